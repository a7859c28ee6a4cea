"""The sequence layout (SkyReels-V3 R2V / Phantom) in training, against an oracle written from
SkyReels-V3's own inference code (`skyreels_v3/pipelines/reference_to_video_pipeline.py`: its
`resize_ref_images`, `prepare_latents` and the denoising step's transformer call) and ComfyUI's
`WanPhantomSubjectToVideo` (its `common_upscale(..., "bilinear", "center")`), never from the
project's helpers: the condition (reference slots), the model input, the timestep per token, the
sliced prediction and the loss, exact on tiny random models for 1..4 references, both slot
policies (V3's fixed 4, Phantom's as many as references) and both preprocessings (V3's white
letterbox, ComfyUI's centre crop). Then the options (before / after, loss on the slots, dropout),
the cache, and the config errors."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_r2v import (
    R2V_TINY,
    SIZES,
    H,
    Recorder,
    W,
    _batch,
    _cfg,
    _image,
    comfy_center_crop_bilinear,
    v3_prompt_embeds,
    v3_ref_latents,
    v3_resize_ref,
    v3_step,
    v3_target,
    v3_to_tensor,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def t2v_parts():
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0, base="t2v")


# --- exact against the oracle ---------------------------------------------------------------------


@pytest.mark.parametrize("preprocess", ["fit_pad_white", "crop_bilinear"])
@pytest.mark.parametrize("slots", [4, None], ids=["v3_slots4", "phantom_as_many"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_r2v_training_step_equals_the_v3_oracle(t2v_parts, n, slots, preprocess):
    """One training step's tensors, each exactly (torch.equal) what V3's inference code builds for
    the same references, noise and t: the slots, the model input, one timestep per sample (so every
    token gets the sample's t), the prediction sliced to the video, the loss on the video only."""
    from e2v.conditioning.layout import batch_conditions
    from e2v.train.step import draw_flow, forward_loss

    cfg = _cfg(4, f"processors.vae.default_preprocess={preprocess}",
               f"conditioning.sequence.slots={'null' if slots is None else slots}")
    images = {f"e{k}": _image(10 * n + k, SIZES[k]) for k in range(n)}
    batch = _batch(cfg, [images], seed=n)
    rec = Recorder(t2v_parts.transformer)

    with torch.no_grad():
        c = batch_conditions(batch, t2v_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(5))
        sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(6))
        loss, per_sample, pred, target = forward_loss(rec, c, sigma, noise, noisy, cfg, torch.float32)
    call = rec.calls[-1]

    vae = t2v_parts.vae
    with torch.no_grad():
        pixels = [v3_to_tensor(v3_resize_ref(images[f"e{k}"], W, H)) if preprocess == "fit_pad_white"
                  else comfy_center_crop_bilinear(images[f"e{k}"], W, H) for k in range(n)]
        refs = v3_ref_latents(pixels, vae, torch.Generator().manual_seed(5), "sample", slots)
        x0 = v3_target(batch["video"][0], vae)
        text = v3_prompt_embeds(batch["prompt"][0], t2v_parts.tokenizer, t2v_parts.text_encoder)
        x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        hidden, timestep, v3_pred = v3_step(t2v_parts.transformer, x_t, refs, 1000 * sigma, text)
        v3_loss = ((v3_pred.float() - (noise - x0)) ** 2).mean()

    assert refs.shape[2] == (4 if slots else n)
    assert torch.equal(c.ref_latents_BCNhw, refs), "the reference slots"
    assert torch.equal(c.latents_BCTHW, x0) and torch.equal(c.text_BLD, text)
    assert torch.equal(call["hidden_states"], hidden), "the model input"
    assert call["timestep"].shape == (1,) and torch.equal(call["timestep"], timestep), "one t per sample"
    assert torch.equal(pred, v3_pred) and pred.shape == x0.shape, "the prediction, sliced to the video"
    assert torch.equal(loss, v3_loss), "the loss, on the video's frames only"


def test_r2v_one_timestep_reaches_every_token(t2v_parts):
    """A [B] timestep is V3's input: the transformer gives every token of the sample, reference slots
    included, the same time embedding; per-token timesteps all equal to t compute the same output."""
    from e2v.conditioning.layout import batch_conditions, place_references
    from e2v.train.step import model_input

    cfg = _cfg(2)
    batch = _batch(cfg, [{"e0": _image(1, SIZES[0]), "e1": _image(2, SIZES[1])}])
    with torch.no_grad():
        c = batch_conditions(batch, t2v_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
        noisy = torch.randn_like(c.latents_BCTHW)
        t = torch.tensor([640.0])
        x, timestep, n_ref = place_references(c, model_input(noisy, c.cond_BCTHW), t)
        per_token = t[:, None].expand(1, x.shape[2] * (H // 16) * (W // 16))
        m = t2v_parts.transformer
        kw = dict(encoder_hidden_states=c.text_BLD, return_dict=False)
        assert n_ref == 4 and torch.equal(timestep, t)
        torch.testing.assert_close(m(x, timestep=timestep, **kw)[0], m(x, timestep=per_token, **kw)[0], rtol=0, atol=1e-6)


def test_r2v_batch_of_mixed_counts_pads_each_sample_as_v3_alone(t2v_parts):
    """Two samples (3 and 1 references) in one batch: each sample's slots are what V3 builds for it
    alone (the generator drawn sample after sample); Phantom's policy pads the shorter with zero
    slots after its references, on the far side from the video."""
    from e2v.conditioning.layout import batch_conditions

    imgs = [{f"e{k}": _image(40 + k, SIZES[k]) for k in range(3)}, {"e0": _image(50, SIZES[3])}]
    vae = t2v_parts.vae
    for slots in (4, None):
        cfg = _cfg(3, f"conditioning.sequence.slots={'null' if slots is None else slots}")
        with torch.no_grad():
            c = batch_conditions(_batch(cfg, imgs), t2v_parts, cfg, rng=random.Random(0),
                                 generator=torch.Generator().manual_seed(3))
            g = torch.Generator().manual_seed(3)
            refs = [v3_ref_latents([v3_to_tensor(v3_resize_ref(im[k], W, H)) for k in im], vae, g, "sample", slots)
                    for im in imgs]
        if slots is None:
            refs[1] = torch.cat([refs[1], torch.zeros_like(refs[0][:, :, :2])], 2)
        assert torch.equal(c.ref_latents_BCNhw, torch.cat(refs))


# --- the options ------------------------------------------------------------------------------------


def test_r2v_before_mirrors_the_slots_and_loss_on_references_adds_their_outputs(t2v_parts):
    """place: before puts the slots (zero slots first, then the references) in front of the video and
    drops the first S outputs; loss_on_references adds the slots' outputs with target 0."""
    from e2v.conditioning.layout import batch_conditions
    from e2v.train.flow import per_sample_mse
    from e2v.train.step import draw_flow, forward_loss

    images = {"e0": _image(1, SIZES[0]), "e1": _image(2, SIZES[1])}
    after, before, on_refs = (_cfg(2, *s) for s in ([], ["conditioning.sequence.place=before"],
                                                     ["conditioning.sequence.loss_on_references=true"]))
    out = {}
    for name, cfg in (("after", after), ("before", before), ("on_refs", on_refs)):
        rec = Recorder(t2v_parts.transformer)
        with torch.no_grad():
            c = batch_conditions(_batch(cfg, [images]), t2v_parts, cfg, rng=random.Random(0),
                                 generator=torch.Generator().manual_seed(1))
            sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(2))
            loss, _, pred, target = forward_loss(rec, c, sigma, noise, noisy, cfg, torch.float32)
        out[name] = (c, rec.calls[-1]["hidden_states"], loss, pred, target)
    c_a, x_a, loss_a, _, target_a = out["after"]
    c_b, x_b, _, pred_b, _ = out["before"]
    assert torch.equal(c_b.ref_latents_BCNhw[:, :, 2:], c_a.ref_latents_BCNhw[:, :, :2])
    assert c_b.ref_latents_BCNhw[:, :, :2].eq(0).all()
    assert torch.equal(x_b[:, :, :4], c_b.ref_latents_BCNhw) and torch.equal(x_b[:, :, 4:], x_a[:, :, :3])
    with torch.no_grad():
        full = t2v_parts.transformer(x_b, timestep=1000 * sigma, encoder_hidden_states=c_b.text_BLD, return_dict=False)[0]
        assert torch.equal(pred_b, full[:, :, 4:])
        full_a = t2v_parts.transformer(x_a, timestep=1000 * sigma, encoder_hidden_states=c_a.text_BLD,
                                       return_dict=False)[0]
    expected = per_sample_mse(full_a, torch.cat([target_a, torch.zeros_like(full_a[:, :, 3:])], 2)).mean()
    torch.testing.assert_close(out["on_refs"][2], expected, rtol=0, atol=0)
    assert not torch.equal(out["on_refs"][2], loss_a)


def test_r2v_reference_dropout_gives_all_zero_slots(t2v_parts):
    """Dropout's input is V3's "no reference" input (its image-free guidance branch): every slot zero."""
    from e2v.conditioning.layout import batch_conditions

    cfg = _cfg(2, "conditioning.reference_dropout=1.0")
    batch = _batch(cfg, [{"e0": _image(1, SIZES[0]), "e1": _image(2, SIZES[1])}])
    c = batch_conditions(batch, t2v_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
    assert c.ref_dropped == [True] and c.ref_latents_BCNhw.shape[2] == 4 and c.ref_latents_BCNhw.eq(0).all()


def test_r2v_cached_conditions_equal_the_encoded_ones(t2v_parts):
    """The cache stores each reference's one-frame posterior; the one layout rule turns it into the
    slots an encoding run builds, with the same draws (posterior samples included)."""
    from e2v.conditioning.cached import compute_entry, shared_entry
    from e2v.conditioning.layout import batch_conditions
    from e2v.data.dataset import element_inputs

    cfg = _cfg(3)
    imgs = [{f"e{k}": _image(60 + k, SIZES[k]) for k in range(3)}, {"e0": _image(70, SIZES[3])}]
    batch = _batch(cfg, imgs)
    empty, clip_shape = shared_entry(t2v_parts)
    entries = []
    for i, im in enumerate(imgs):
        item = {"video": batch["video"][i], "prompt": batch["prompt"][i], **element_inputs(cfg, im, H, W)}
        entries.append(compute_entry(item, t2v_parts, cfg))
    cached = {"id": batch["id"], "prompt": batch["prompt"], "element_names": batch["element_names"],
              "cached": entries, "shared": [{"empty_text": empty, "clip_shape": clip_shape}] * 2, "skipped": []}
    assert entries[0]["vae.e0.mean"].shape[1] == 1, "one latent frame per reference"
    with torch.no_grad():
        a = batch_conditions(batch, t2v_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(4))
        b = batch_conditions(cached, t2v_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(4))
    # Not bit-equal: the cache encodes each clip and reference alone, training the batch, and the CPU's
    # conv kernels sum a batch in another order. fp32 through the tiny VAE encoder's convolutions on
    # latents of magnitude ~1: 2e-5 (measured 7e-6); a wrong frame or a missing term moves them by ~0.1.
    torch.testing.assert_close(b.ref_latents_BCNhw, a.ref_latents_BCNhw, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(b.latents_BCTHW, a.latents_BCTHW, rtol=1e-5, atol=2e-5)
    assert b.ref_layout == a.ref_layout == "after"


# --- bad input, named before any weight loads ------------------------------------------------------


@pytest.mark.parametrize("sets, words", [
    (["e2v_type=dual"], ["e2v_type: vae"]),
    (["conditioning.sequence.slots=2"], ["conditioning.sequence.slots", "slots: 3"]),
    (["conditioning.sequence.loss_on_references=true", "flow.objective=x0"], ["loss_on_references"]),
    (["parallel.ulysses_degree=2", "conditioning.sequence.slots=null"], ["conditioning.sequence.slots"]),
])
def test_r2v_bad_combinations_name_the_key_and_the_fix(sets, words):
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(R2V_TINY, sets, check_paths=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


HUB_TINY_OFF = ["model.preset=null", "model.tiny.layers=2", "model.tiny.heads=2", "model.tiny.head_dim=12",
                "model.tiny.ffn_dim=32"]


@pytest.mark.parametrize("sets, words", [
    (["model.base=auto"], ["conditioning.target_layout: sequence", "model.base: t2v"]),  # the tiny I2V shape
    ([*HUB_TINY_OFF, "model.base=auto", "model.pretrained=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"],
     ["conditioning.target_layout: sequence", "T2V base"]),
    ([*HUB_TINY_OFF, "model.base=auto", "model.pretrained=Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
      "conditioning.target_layout=overlay"], ["target_layout: sequence", "model.base: t2v"]),
], ids=["tiny_i2v", "i2v_14b", "t2v_with_channel_layout"])
def test_r2v_base_and_layout_mismatch_is_named_on_the_meta_device(sets, words):
    """A base with condition channels given this layout, and a latents-only base given the
    condition-channel layout: one line from the meta-device preflight, before any weight loads."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError
    from e2v.models.plan import preflight

    with pytest.raises((ConfigError, ValueError)) as e:
        preflight(load_config(R2V_TINY, sets, check_paths=False))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_r2v_more_references_than_slots_is_named():
    from e2v.conditioning.sequence import fill_slots

    chunks = [[torch.zeros(1, 16, 1, 8, 8)] * 5]
    with pytest.raises(ValueError, match="conditioning.sequence.slots is 4"):
        fill_slots(chunks, [False], torch.zeros(1, 16, 3, 8, 8), slots=4)


def test_r2v_sampling_without_a_required_reference_is_named(tmp_path):
    """tools/sample.py stops in one line, before any weight loads, when a required element is not given."""
    import numpy as np
    from PIL import Image

    import e2v.eval.sample_cli as sample

    path = tmp_path / "object.png"
    Image.fromarray(np.full((32, 32, 3), 200, dtype=np.uint8)).save(path)
    with pytest.raises(SystemExit) as e:
        sample.main(["--config", R2V_TINY, "--prompt", "x", "--element", f"object={path}", "--out", str(tmp_path / "v.mp4")])
    assert "--element person=IMAGE is missing" in str(e.value)
