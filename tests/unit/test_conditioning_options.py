"""Every element and conditioning option of the E2V config, against independent oracles: A2's
arithmetic computed by hand, a second code path (hand-built condition videos through one VAE
encode, per-element encodes), diffusers' I2V pipeline patched the way A2's fork samples the
posterior, and the tiny VAE's known structure (latent frame k = pixel group k).

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_conditioning_options_runs.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers_conditioning import NAMES, REPEATS, F, S, make_batch, make_cfg
from PIL import Image

from e2v.conditioning.encode import (
    build_vae_condition,
    condition_mask,
    condition_video,
    encode_clip_images,
    encode_text,
    encode_video,
    select_elements,
)
from e2v.conditioning.layout import batch_conditions
from e2v.config.load import load_config
from e2v.data.media import center_crop, letterbox, load_image, pad_white


def encode(batch, parts, cfg, seed=0, train=True):
    with torch.no_grad():
        return batch_conditions(batch, parts, cfg, rng=random.Random(seed), generator=torch.Generator().manual_seed(seed),
                            train=train)


def hand_condition(refs_N3HW: list[torch.Tensor], repeats: list[int]) -> torch.Tensor:
    """The pixel condition video written out frame by frame: [r0 x rep0, r1 x rep1, ..., zeros]."""
    frames = [r for r, n in zip(refs_N3HW, repeats) for _ in range(n)]
    frames += [torch.zeros(3, S, S)] * (F - len(frames))
    return torch.stack(frames, dim=1).unsqueeze(0)  # [1,3,F,H,W]


def _image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("w,h,rows,cols", [
    (50, 37, 0, 5),    # too tall for 80x48: int((80/48*37 - 50)/2) = int(5.83) = 5 columns each side
    (101, 20, 20, 0),  # too wide: int((48/80*101 - 20)/2) = int(20.3) = 20 rows each side
    (30, 18, 0, 0),    # exactly the aspect (80/48): nothing to pad
])
def test_pad_white_and_letterbox_are_a2_arithmetic(w, h, rows, cols):
    img = _image(w, h)
    arr = np.asarray(img)
    for fn, fill in ((pad_white, 255), (letterbox, 0)):
        padded = np.pad(arr, ((rows, rows), (cols, cols), (0, 0)), constant_values=fill)
        expected = Image.fromarray(padded).resize((80, 48), Image.BICUBIC)
        out = fn(img, 48, 80)
        assert out.size == (80, 48)
        assert np.array_equal(np.asarray(out), np.asarray(expected)), fn.__name__


@pytest.mark.parametrize("w,h,box", [
    (101, 90, (0, 15, 101, 75)),    # too tall: crop height int(101/80*48) = 60, top (90-60)//2 = 15
    (300, 50, (108, 0, 191, 50)),   # too wide: crop width int(50/48*80) = 83, left (300-83)//2 = 108
])
def test_center_crop_is_a2_arithmetic(w, h, box):
    img = _image(w, h, seed=1)
    expected = img.crop(box).resize((80, 48), Image.BICUBIC)
    assert np.array_equal(np.asarray(center_crop(img, 48, 80)), np.asarray(expected))


def test_rgba_is_composited_on_white(tmp_path):
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., :3] = (10, 200, 30)
    rgba[0, 0, 3], rgba[0, 1, 3], rgba[0, 2, 3] = 0, 255, 128
    Image.fromarray(rgba, "RGBA").save(tmp_path / "x.png")
    out = np.asarray(load_image(tmp_path / "x.png")).astype(int)
    assert out[0, 0].tolist() == [255, 255, 255]  # transparent -> white
    assert out[0, 1].tolist() == [10, 200, 30]     # opaque -> the colour
    expected = [round(c * 128 / 255 + 255 * (1 - 128 / 255)) for c in (10, 200, 30)]
    assert np.abs(out[0, 2] - expected).max() <= 1  # half alpha -> blended with white


def test_default_preprocess_and_per_element_overrides(demo_data):
    """data.py applies `<element>.vae.preprocess or processors.vae.default_preprocess` (and the
    same for CLIP): checked image by image against the media functions."""
    from e2v.data.dataset import E2VDataset, index_samples
    from e2v.data.media import image_to_tensor, preprocess_image

    cfg = load_config("configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={demo_data}", "processors.vae.default_preprocess=letterbox",
        "data.elements.1.vae.preprocess=null", "processors.clip.default_preprocess=resize",
        "data.elements.0.clip.preprocess=center_crop", "processors.clip.resolution=[40,40]"])
    s = index_samples(cfg)[0]
    item = E2VDataset(cfg, [s]).load(s)
    expected_vae = {"person": "pad_white", "object": "letterbox", "background": "center_crop"}
    expected_clip = {"person": "center_crop", "object": "resize", "background": "resize"}
    for name, mode in expected_vae.items():
        img = load_image(s.elements[name])
        torch.testing.assert_close(item["vae_refs"][name], image_to_tensor(preprocess_image(img, 64, 64, mode)),
                                   atol=0, rtol=0)
        assert np.array_equal(item["clip_refs"][name], np.asarray(preprocess_image(img, 40, 40, expected_clip[name])))


def test_sample_mode_consumes_the_generator_as_a2_after_the_noise_draw(tiny_parts, monkeypatch):
    """A2's fork of the I2V pipeline draws the noise, then samples the condition posterior with the
    same generator. Oracle 1: diffusers' prepare_latents with retrieve_latents patched to do that.
    Oracle 2: the hand-built multi-reference path, vae.encode(video).latent_dist.sample(g)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan_i2v

    p = tiny_parts
    pipe = WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(), image_processor=p.image_processor,
                                   image_encoder=p.image_encoder, transformer=p.transformer)
    image = torch.rand(1, 3, S, S, generator=torch.Generator().manual_seed(3)) * 2 - 1
    g_pipe = torch.Generator().manual_seed(7)
    monkeypatch.setattr(pipeline_wan_i2v, "retrieve_latents", lambda enc, **_: enc.latent_dist.sample(g_pipe))
    with torch.no_grad():
        noise_a2, cond_a2 = pipe.prepare_latents(image, 1, 16, S, S, F, torch.float32, torch.device("cpu"),
                                                 generator=g_pipe)
        g = torch.Generator().manual_seed(7)
        noise = torch.randn(1, 16, 5, 4, 4, generator=g)
        ours = build_vae_condition([image.unsqueeze(2)], [1], F, p.vae, sample_mode="sample", generator=g)
        mean = build_vae_condition([image.unsqueeze(2)], [1], F, p.vae)
    assert torch.equal(noise, noise_a2)
    torch.testing.assert_close(ours, cond_a2, atol=0, rtol=0)
    assert (ours - mean).abs().max() > 1e-3, "sample and argmax must differ (else this test proves nothing)"

    refs = [torch.rand(1, 3, 1, S, S, generator=torch.Generator().manual_seed(k)) * 2 - 1 for k in range(3)]
    video = hand_condition([r[0, :, 0] for r in refs], [1, 4, 4])
    vae_stats = (torch.tensor(p.vae.config.latents_mean).view(1, 16, 1, 1, 1),
                 1.0 / torch.tensor(p.vae.config.latents_std).view(1, 16, 1, 1, 1))
    with torch.no_grad():
        g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        torch.randn(1, 16, 5, 4, 4, generator=g1), torch.randn(1, 16, 5, 4, 4, generator=g2)
        hand = (p.vae.encode(video).latent_dist.sample(g1) - vae_stats[0]) * vae_stats[1]
        ours = build_vae_condition(refs, [1, 4, 4], F, p.vae, sample_mode="sample", generator=g2)
    torch.testing.assert_close(ours[:, 4:], hand, atol=0, rtol=0)
    assert torch.equal(g1.get_state(), g2.get_state()), "the generator must be consumed exactly as A2 does"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_n_elements_layout_mask_and_one_encode(tiny_parts, n):
    """N = 1..4 through batch_conditions: the condition equals a hand-built condition video through ONE
    VAE encode, the mask covers exactly 1 + 4 (N-1) pixel frames = latent frames 0..N-1, and (the
    tiny VAE maps pixel group k to latent frame k) latent frame k is reference k's own latent."""
    cfg = make_cfg()
    batch = make_batch([n], seed=n)
    c = encode(batch, tiny_parts, cfg, train=False)
    refs = [batch["vae_refs"][0][k] for k in NAMES[:n]]
    video = hand_condition(refs, [REPEATS[k] for k in NAMES[:n]])
    with torch.no_grad():
        expected = encode_video(video, tiny_parts.vae)
    assert c.kept == [NAMES[:n]]
    assert c.cond_BCTHW.shape == (1, 20, 5, 4, 4)
    mask = c.cond_BCTHW[:, :4]
    assert (mask[:, :, :n] == 1).all() and (mask[:, :, n:] == 0).all()
    torch.testing.assert_close(mask, condition_mask([1 + 4 * (n - 1)], F, 4, 4), atol=0, rtol=0)
    torch.testing.assert_close(c.cond_BCTHW[:, 4:], expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        for k, r in enumerate(refs):  # reference k alone, as a one-frame video
            alone = encode_video(r.view(1, 3, 1, S, S), tiny_parts.vae)
            torch.testing.assert_close(c.cond_BCTHW[:, 4:, k], alone[:, :, 0], atol=2e-4, rtol=0)


def test_combine_after_equals_per_element_encodes_concatenated(tiny_parts):
    cfg = make_cfg(processors__vae={"combine": "after"})
    batch = make_batch([3, 2], seed=5)
    c = encode(batch, tiny_parts, cfg, train=False)
    with torch.no_grad():
        for i, n in enumerate([3, 2]):
            chunks = [encode_video(batch["vae_refs"][i][k].view(1, 3, 1, S, S), tiny_parts.vae) for k in NAMES[:n]]
            lat = torch.cat(chunks + [torch.zeros(1, 16, 5 - n, 4, 4)], dim=2)
            torch.testing.assert_close(c.cond_BCTHW[i:i + 1, 4:], lat, atol=0, rtol=0)
            assert (c.cond_BCTHW[i, :4, :n] == 1).all() and (c.cond_BCTHW[i, :4, n:] == 0).all()
    # Why A2 found "before" better: through a causal VAE that mixes frames (a random-weight one;
    # the informative tiny VAE keeps frame groups apart) the padding latents depend on the references.
    import dataclasses

    from e2v.models.tiny_vae import build_tiny_vae

    mixing = dataclasses.replace(tiny_parts, vae=build_tiny_vae(0, informative=False))
    before = encode(batch, mixing, make_cfg(), train=False)
    after = encode(batch, mixing, cfg, train=False)
    assert (after.cond_BCTHW[:, 4:, 3:] == 0).all()
    assert (before.cond_BCTHW[:, 4:, 3:] - before.cond_BCTHW[:1, 4:, 3:]).abs().max() > 1e-3


def test_combine_after_without_repeats_marks_one_latent_frame_per_reference(tiny_parts):
    cfg = make_cfg(processors__vae={"combine": "after"},
                   data__elements=[{"name": n, "suffixes": [f"_{n}.png"], "vae": {"repeat": 1, "position": i}}
                                   for i, n in enumerate(NAMES[:3])])
    batch = make_batch([3], seed=6)
    batch["vae_repeats"] = [{k: 1 for k in NAMES[:3]}]
    c = encode(batch, tiny_parts, cfg, train=False)
    assert (c.cond_BCTHW[0, :4, :3] == 1).all() and (c.cond_BCTHW[0, :4, 3:] == 0).all()


ALLOWED = {
    "full": {(0, 1, 2, 3)},
    "index": {(2,)},
    "prefix": {(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3)},
    "random": {tuple(i for i in range(4) if m >> i & 1) for m in range(1, 16)},
    "first_and_last": {(0, 3)},
}


@pytest.mark.parametrize("mode", sorted(ALLOWED))
def test_frame_conditioning_modes_keep_only_allowed_subsets(mode):
    seen = {tuple(select_elements(4, mode, random.Random(seed), frame_index=2)) for seed in range(400)}
    assert seen == ALLOWED[mode], f"{mode}: {seen ^ ALLOWED[mode]}"
    for n in (1, 2, 3):  # fewer elements present: the same rules, compacted
        kept = {tuple(select_elements(n, mode, random.Random(seed), frame_index=0)) for seed in range(100)}
        assert all(k and list(k) == sorted(set(k)) and max(k) < n for k in kept)


def test_frame_conditioning_dropped_elements_are_absent_and_compacted(tiny_parts):
    """`index` 1 keeps only the object: it moves to position 0 and repeat 4 (its own), exactly the
    layout inference with the object alone produces."""
    cfg = make_cfg(processors__vae={"frame_conditioning": "index", "frame_index": 1})
    batch = make_batch([3], seed=8)
    c = encode(batch, tiny_parts, cfg, train=False)
    assert c.kept == [["object"]]
    with torch.no_grad():
        expected = build_vae_condition([batch["vae_refs"][0]["object"].view(1, 3, 1, S, S)], [4], F, tiny_parts.vae)
        tokens = encode_clip_images([batch["clip_refs"][0]["object"]], tiny_parts.image_encoder,
                                    tiny_parts.image_processor)
    torch.testing.assert_close(c.cond_BCTHW, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(c.clip_BLD, tokens.reshape(1, -1, 32), atol=0, rtol=0)


def test_clip_false_removes_exactly_that_elements_token_block(tiny_parts):
    """The object is in the VAE stream but not the CLIP stream: the tokens are subject | background,
    each the element's own 17-token block (257 with ViT-H/14), in position order."""
    cfg = make_cfg()
    cfg_noclip = make_cfg(data__elements=[
        {"name": n, "suffixes": [f"_{n}.png"], "vae": {"repeat": REPEATS[n], "position": i},
         **({"clip": False} if n == "object" else {})} for i, n in enumerate(NAMES[:3])])
    assert [e.name for e in cfg_noclip.clip_elements] == ["subject", "background"]
    full = encode(make_batch([3], seed=9), tiny_parts, cfg, train=False)
    batch = make_batch([3], seed=9, clip_names={"subject", "background"})
    c = encode(batch, tiny_parts, cfg_noclip, train=False)
    assert full.clip_BLD.shape == (1, 3 * 17, 32) and c.clip_BLD.shape == (1, 2 * 17, 32)
    torch.testing.assert_close(c.clip_BLD[:, :17], full.clip_BLD[:, :17], atol=0, rtol=0)
    torch.testing.assert_close(c.clip_BLD[:, 17:], full.clip_BLD[:, 34:], atol=0, rtol=0)
    torch.testing.assert_close(c.cond_BCTHW, full.cond_BCTHW, atol=0, rtol=0)  # the VAE stream keeps it


def test_mixed_element_counts_pad_clip_tokens_with_zeros(tiny_parts):
    """One batch with 3, 1 and 2 elements: CLIP tokens are zero-padded to the largest count (the
    decision documented in conditioning._encode_clip_batch); each sample's own blocks and its VAE
    condition equal the sample encoded alone."""
    cfg = make_cfg()
    batch = make_batch([3, 1, 2], seed=10)
    c = encode(batch, tiny_parts, cfg, train=False)
    assert c.clip_BLD.shape == (3, 3 * 17, 32)
    for i, n in enumerate([3, 1, 2]):
        solo = {k: (v[i:i + 1] if k == "video" else [v[i]]) for k, v in batch.items() if k != "skipped"}
        alone = encode(solo, tiny_parts, cfg, train=False)
        torch.testing.assert_close(c.clip_BLD[i, : 17 * n], alone.clip_BLD[0], atol=1e-5, rtol=0)
        assert (c.clip_BLD[i, 17 * n:] == 0).all()
        torch.testing.assert_close(c.cond_BCTHW[i], alone.cond_BCTHW[0], atol=3e-5, rtol=0)


def test_reference_dropout_zeroes_condition_mask_and_clip_tokens(tiny_parts):
    cfg = make_cfg(conditioning={"reference_dropout": 0.5})
    batch = make_batch([3] * 8, seed=12)
    c = encode(batch, tiny_parts, cfg, seed=3)
    plain = encode(batch, tiny_parts, make_cfg(), seed=3, train=False)
    assert 0 < sum(c.ref_dropped) < 8, "seed 3 must drop some and keep some samples"
    for i, dropped in enumerate(c.ref_dropped):
        if dropped:
            assert (c.cond_BCTHW[i] == 0).all() and (c.clip_BLD[i] == 0).all()
        else:
            torch.testing.assert_close(c.cond_BCTHW[i], plain.cond_BCTHW[i], atol=0, rtol=0)
            torch.testing.assert_close(c.clip_BLD[i], plain.clip_BLD[i], atol=0, rtol=0)
    off = encode(batch, tiny_parts, cfg, seed=3, train=False)  # validation never drops
    assert not any(off.ref_dropped)


def test_caption_dropout_uses_the_empty_prompt_embedding(tiny_parts):
    cfg = make_cfg(conditioning={"caption_dropout": 0.5})
    batch = make_batch([1] * 8, seed=13)
    batch["prompt"] = ["a dog moves slowly"] * 8
    c = encode(batch, tiny_parts, cfg, seed=4)
    with torch.no_grad():
        empty, prompt = encode_text(["", "a dog moves slowly"], tiny_parts.tokenizer, tiny_parts.text_encoder)
    assert 0 < sum(c.caption_dropped) < 8
    for i, dropped in enumerate(c.caption_dropped):
        torch.testing.assert_close(c.text_BLD[i], empty if dropped else prompt, atol=1e-6, rtol=0)


def test_target_layout_prepend_puts_reference_frames_before_the_clip(tiny_parts):
    cfg = make_cfg(conditioning={"target_layout": "prepend"})
    batch = make_batch([3, 1], seed=14)
    c = encode(batch, tiny_parts, cfg, train=False)
    with torch.no_grad():
        for i, n in enumerate([3, 1]):
            refs = [batch["vae_refs"][i][k] for k in NAMES[:n]]
            frames = [r for r, k in zip(refs, NAMES) for _ in range(REPEATS[k])]
            n_ref = len(frames)
            video = torch.cat([torch.stack(frames, dim=1).unsqueeze(0), batch["video"][i:i + 1, :, : F - n_ref]], 2)
            torch.testing.assert_close(c.latents_BCTHW[i:i + 1], encode_video(video, tiny_parts.vae), atol=1e-4, rtol=0)
    overlay = encode(batch, tiny_parts, make_cfg(), train=False)
    with torch.no_grad():
        torch.testing.assert_close(overlay.latents_BCTHW, encode_video(batch["video"], tiny_parts.vae), atol=0, rtol=0)


def test_e2v_type_selects_the_pathways(tiny_parts):
    """On the I2V base: `vae` keeps the condition and feeds zero CLIP blocks; `clip` keeps the CLIP
    tokens and feeds a zero condition (the model has 36 input channels either way)."""
    batch = make_batch([3], seed=15)
    dual = encode(batch, tiny_parts, make_cfg(), train=False)
    vae = encode(batch, tiny_parts, make_cfg(e2v_type="vae"), train=False)
    clip = encode(batch, tiny_parts, make_cfg(e2v_type="clip"), train=False)
    torch.testing.assert_close(vae.cond_BCTHW, dual.cond_BCTHW, atol=0, rtol=0)
    assert (vae.clip_BLD == 0).all()
    torch.testing.assert_close(clip.clip_BLD, dual.clip_BLD, atol=0, rtol=0)
    assert clip.cond_BCTHW.shape == (1, 20, 5, 4, 4) and (clip.cond_BCTHW == 0).all()


def test_concatenate_mask_false_drops_exactly_the_4_mask_channels(tiny_parts):
    """For a T2V base expanded to 32 input channels: the condition is the 16 latent channels alone."""
    batch = make_batch([2], seed=16)
    with_mask = encode(batch, tiny_parts, make_cfg(), train=False)
    no_mask = encode(batch, tiny_parts, make_cfg(model={"preset": "tiny", "base": "t2v"},
                                                 processors__vae={"concatenate_mask": False}), train=False)
    assert no_mask.cond_BCTHW.shape == (1, 16, 5, 4, 4)
    torch.testing.assert_close(no_mask.cond_BCTHW, with_mask.cond_BCTHW[:, 4:], atol=0, rtol=0)


def test_condition_video_rejects_too_many_reference_frames():
    with pytest.raises(ValueError, match="references take 13 frames but the video has only 9"):
        condition_video([torch.zeros(1, 3, 1, 8, 8)] * 4, [1, 4, 4, 4], 9)


def test_shipped_e2v_yaml_is_the_a2_recipe_and_dry_runs(demo_data, capsys, monkeypatch):
    """configs/e2v.yaml: A2's values, and `train_e2v.py --config configs/e2v.yaml --dry_run`
    validates, indexes the data and plans the 14B model on the meta device (no weights read)."""
    import sys

    import train_e2v

    cfg = load_config("configs/e2v.yaml", check_paths=False)
    assert cfg.model.pretrained == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers" and cfg.model.base == "i2v"
    assert [(e.name, e.vae.repeat, e.vae.position, e.vae.preprocess) for e in cfg.vae_elements] == [
        ("subject", 1, 0, "pad_white"), ("object", 4, 1, "pad_white"), ("background", 4, 2, "center_crop")]
    assert all(e.clip.preprocess == "pad_white" for e in cfg.clip_elements) and cfg.processors.clip.resolution == [512, 512]
    assert (cfg.conditioning.reference_dropout, cfg.conditioning.caption_dropout) == (0.1, 0.3)
    assert (cfg.train.lr, cfg.data.num_frames, cfg.data.resolution, cfg.flow.shift) == (1e-5, 81, [480, 832], 8.0)
    assert cfg.processors.vae.combine == "before" and cfg.e2v_type == "dual"
    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", "configs/e2v.yaml", "--dry_run",
                                      "--set", f"data.datasets.0.data_root={demo_data}"])
    train_e2v.main()
    out = capsys.readouterr().out
    # the demo's 17-frame clips are all too short for configs/e2v.yaml's 81 frames: said, not "8 samples"
    assert "config OK; 0 usable samples" in out and "8 unusable (listed above): training stops at start" in out
    assert "40 layers x 40 heads x 128, in_channels 36, image attention yes" in out and "expanded" not in out
    # trained in full: every attn2 tensor (40 blocks x 15: q, k, v, out, add_k, add_v with biases,
    # norm_q, norm_k, norm_added_k) + patch embedding (2) + image embedder (8)
    assert "(610 tensors in full beside the LoRA)" in out
    assert "ZeRO-3, optimizer and param offloaded to CPU" in out


def test_clip_only_elements_give_the_exact_zero_condition(tiny_parts):
    """A sample whose kept elements are all CLIP-only has no reference frame: its condition is the
    exact zeros of an absent or dropped reference, not the VAE encode of a grey video."""
    cfg = make_cfg()
    batch = make_batch([2, 2], seed=13)
    batch["vae_refs"][1], batch["vae_repeats"][1] = {}, {}  # sample 1: both elements CLIP-only
    c = encode(batch, tiny_parts, cfg, train=False)
    assert c.kept == [["subject", "object"], ["subject", "object"]]
    assert (c.cond_BCTHW[1] == 0).all()
    assert c.cond_BCTHW[0, :4, :2].eq(1).all() and c.cond_BCTHW[0, 4:].abs().sum() > 0
    assert c.clip_BLD[1].abs().sum() > 0  # the CLIP stream still carries them


def test_index_mode_keeps_the_last_present_element_when_a_sample_has_fewer():
    assert select_elements(2, "index", random.Random(0), frame_index=2) == [1]
    assert select_elements(3, "index", random.Random(0), frame_index=2) == [2]


def test_shipped_e2v_yaml_dry_runs_before_the_data_exists(capsys, monkeypatch):
    """The command in configs/e2v.yaml's header, on a fresh clone: the missing data folder is
    reported, the model and memory plan still printed."""
    import sys

    import train_e2v

    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", "configs/e2v.yaml", "--dry_run"])
    train_e2v.main()
    out = capsys.readouterr().out
    assert "WARNING: data_root data/e2v does not exist: not indexed" in out
    assert "config OK; 0 usable samples" in out and "in_channels 36, image attention yes" in out
    # 6.41 B trained: 12 B of optimizer state each (ZeRO-3 keeps no module copy); 10.09 B frozen bf16 not saved
    assert ("checkpoint per save (estimate): 71.61 GiB (trained weights + optimizer state, 3 kept); the frozen "
            "18.80 GiB stay in the model folder (saving them too: 90.40 GiB)") in out


def test_clip_false_through_the_data_path(tiny_parts):
    """The same as above, but the per-sample inputs come from data.element_inputs (what the
    DataLoader builds from the images), not by hand: `clip: false` leaves the object's VAE frames
    in place and takes exactly its token block out."""
    from e2v.data.dataset import element_inputs

    cfg = make_cfg()
    cfg_noclip = make_cfg(data__elements=[
        {"name": n, "suffixes": [f"_{n}.png"], "vae": {"repeat": REPEATS[n], "position": i},
         **({"clip": False} if n == "object" else {})} for i, n in enumerate(NAMES[:3])])
    rng = np.random.default_rng(5)
    images = {n: Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)) for n in NAMES[:3]}
    video = torch.rand(1, 3, F, S, S, generator=torch.Generator().manual_seed(5)) * 2 - 1

    def batch_for(c):
        x = element_inputs(c, images, S, S)
        return {"id": ["s0"], "video": video, "prompt": ["a shape moves"], "skipped": [],
                **{k: [v] for k, v in x.items()}}

    full_b, noclip_b = batch_for(cfg), batch_for(cfg_noclip)
    assert noclip_b["element_names"] == full_b["element_names"] == [["subject", "object", "background"]]
    assert sorted(noclip_b["clip_refs"][0]) == ["background", "subject"]
    full, c = encode(full_b, tiny_parts, cfg, train=False), encode(noclip_b, tiny_parts, cfg_noclip, train=False)
    assert full.clip_BLD.shape == (1, 3 * 17, 32) and c.clip_BLD.shape == (1, 2 * 17, 32)
    torch.testing.assert_close(c.clip_BLD, torch.cat([full.clip_BLD[:, :17], full.clip_BLD[:, 34:]], 1), atol=0, rtol=0)
    torch.testing.assert_close(c.cond_BCTHW, full.cond_BCTHW, atol=0, rtol=0)
