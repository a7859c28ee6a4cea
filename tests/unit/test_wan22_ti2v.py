"""Wan2.2 TI2V-5B: the tiny Wan2.2 VAE keeps the video; the clean_prefix layout (references as clean
latent frames before the clip, per-token timestep 0, loss on the clip's frames) equals diffusers'
`WanImageToVideoPipeline(expand_timesteps=True)` for one reference at every step and extends over N
references as written out by hand; plain text-to-video on TI2V equals `WanPipeline(expand_timesteps=
True)`; the cache, the devices, the config checks, the real model's plan; and one tiny run through
the deepspeed launcher whose export loads into the diffusers pipeline and changes its output.
Every test name has `wan22` in it (`pytest -k wan22`).

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_wan22_ti2v_runs.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import ROOT
from helpers_wan22 import S, _image

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_TI2V = str(ROOT / "configs/e2v_wan22_ti2v_tiny.yaml")


def _cfg(*sets):
    from e2v.config.load import load_config

    return load_config(TINY_TI2V, [f"data.resolution=[{S},{S}]", *sets], check_paths=False)


def _normalised(vae, pixels_BCFHW: torch.Tensor) -> torch.Tensor:
    """The oracle's latents: vae.encode(...).mode() normalised by hand (diffusers' arithmetic)."""
    z = vae.encode(pixels_BCFHW).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    return (z - mean) * (1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1))


def test_wan22_tiny_vae_is_the_wan22_structure_and_keeps_the_video(ti2v_parts):
    """Real Wan2.2 code path (residual down / up blocks, 2x2 patchify, 48 channels, 16x space), and
    latents that carry the 16 x 16-pooled colour of each latent frame (a linear probe from the
    normalised latent reads it back on held-out clips: R^2 > 0.999) and its half-group change
    (the decoded video against the half-group means: > 60 dB). Deterministic in the seed."""
    import torch.nn.functional as F

    from e2v.models.tiny_vae import synthetic_videos
    from e2v.models.tiny_vae22 import build_tiny_vae22

    vae = ti2v_parts.vae
    assert vae.config.is_residual and vae.config.patch_size == 2 and vae.config.z_dim == 48
    g = torch.Generator().manual_seed(1)
    fit, held = synthetic_videos(6, g, 9, 64), synthetic_videos(2, g, 9, 64)

    def pooled(v):  # frame 0 alone, then groups of 4; 16 x 16 means
        b, c, f, h, w = v.shape
        groups = torch.cat([v[:, :, :1], v[:, :, 1:].reshape(b, c, (f - 1) // 4, 4, h, w).mean(3)], 2)
        return F.avg_pool3d(groups, (1, 16, 16))

    def rows(x):
        return x.permute(0, 2, 3, 4, 1).reshape(-1, x.shape[1]).double()

    with torch.no_grad():
        x_fit, x_held = (rows(_normalised(vae, c)) for c in (fit, held))
        z = vae.encode(held).latent_dist.mode()
        decoded = vae.decode(z).sample
    assert z.shape == (2, 48, 3, 4, 4) and decoded.shape == (2, 3, 9, 64, 64)
    ones = torch.ones(len(x_fit), 1, dtype=torch.float64)
    w = torch.linalg.lstsq(torch.cat([x_fit, ones], 1), rows(pooled(fit))).solution
    y = rows(pooled(held))
    r2 = 1 - ((torch.cat([x_held, ones[:len(x_held)]], 1) @ w - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    assert r2 > 0.999, r2
    b, c, f, h, w_ = held.shape
    halves = held[:, :, 1:].reshape(b, c, 2, 2, 2, h, w_).mean(4).repeat_interleave(2, 3).reshape(b, c, 8, h, w_)
    target = F.avg_pool3d(torch.cat([held[:, :, :1], halves], 2), (1, 16, 16))
    target = target.repeat_interleave(16, 3).repeat_interleave(16, 4)
    psnr = 10 * torch.log10(4 / ((decoded - target) ** 2).mean())
    assert psnr > 60, psnr
    assert build_tiny_vae22(0).config.latents_mean == vae.config.latents_mean


def test_wan22_ti2v_one_reference_equals_the_pipeline_at_every_step(ti2v_parts):
    """One reference: at every step (3 steps x cond / uncond) the transformer gets exactly the
    input and per-token timesteps of WanImageToVideoPipeline(expand_timesteps=True) (the
    reference's latent in place of frame 0, timestep 0 on its tokens, t on the rest), and the
    sampled clip equals the pipeline's frames 1.. (its frame 0 is the reference's latent)."""
    from diffusers import WanImageToVideoPipeline

    from e2v.eval.sampling import generate, latent_shape, make_scheduler
    from e2v.runtime.device import randn

    p, cfg, image = ti2v_parts, _cfg(), _image(1)
    calls = []

    def record(module, args, kwargs):
        calls.append({"hidden_states": args[0] if args else kwargs["hidden_states"], **kwargs})

    hook = p.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = generate(p.transformer, p, cfg, ["a shape moves"], [{"person": image}], seed=5, num_steps=3,
                       guidance_scale=2.5, shift=3.0, negative_prompt="static")
        ours, calls = calls, []
        noise = randn(latent_shape(cfg, p.vae), torch.Generator().manual_seed(5), "cpu")  # what generate drew
        pipe = WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                                       transformer=p.transformer, scheduler=make_scheduler(3.0), expand_timesteps=True)
        frame0 = torch.randn(1, 48, 1, S // 16, S // 16)  # replaced by the reference's latent in every input
        ref = pipe(image=image, prompt="a shape moves", negative_prompt="static", height=S, width=S, num_frames=21,
                   num_inference_steps=3, guidance_scale=2.5, output_type="latent",
                   latents=torch.cat([frame0, noise], 2)).frames
        theirs = calls
    finally:
        hook.remove()
    assert len(ours) == len(theirs) == 6
    per_frame = (S // 32) ** 2
    for mine, want in zip(ours, theirs):
        torch.testing.assert_close(mine["hidden_states"], want["hidden_states"], atol=1e-6, rtol=0)
        assert mine["timestep"].shape == want["timestep"].shape == (1, 6 * per_frame)
        torch.testing.assert_close(mine["timestep"], want["timestep"].float(), atol=0, rtol=0)
        assert (mine["timestep"][0, :per_frame] == 0).all() and (mine["timestep"][0, per_frame:] > 0).all()
        torch.testing.assert_close(mine["encoder_hidden_states"], want["encoder_hidden_states"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out, ref[:, :, 1:], atol=2e-5, rtol=0)
    with torch.no_grad():
        pixels = pipe.video_processor.preprocess(image, height=S, width=S).float().unsqueeze(2)
        torch.testing.assert_close(ref[:, :, :1], _normalised(p.vae, pixels), atol=1e-5, rtol=0)


NAMES = ["person", "object", "background"]  # the tiny TI2V config's elements, in position order


def _batch(counts: list[int], seed: int = 0) -> dict:
    """A raw batch as data.collate builds it: sample i has the first counts[i] elements."""
    g = torch.Generator().manual_seed(seed)
    b = len(counts)
    batch = {"id": [f"s{i}" for i in range(b)], "video": torch.rand(b, 3, 17, S, S, generator=g) * 2 - 1,
             "prompt": ["a shape moves"] * b, "element_names": [], "vae_refs": [], "vae_repeats": [],
             "clip_refs": [], "skipped": []}
    for n in counts:
        batch["element_names"].append(NAMES[:n])
        batch["vae_refs"].append({k: torch.rand(3, S, S, generator=g) * 2 - 1 for k in NAMES[:n]})
        batch["vae_repeats"].append({k: 1 for k in NAMES[:n]})
        batch["clip_refs"].append({})
    return batch


def _encode(batch, parts, cfg, train=False, seed=0):
    from e2v.conditioning.layout import batch_conditions

    with torch.no_grad():
        return batch_conditions(batch, parts, cfg, rng=random.Random(seed), generator=torch.Generator().manual_seed(seed),
                            train=train)


def test_wan22_ti2v_n_references_extend_the_layout_over_n_frames(ti2v_parts):
    """N references: N clean latent frames (each reference encoded alone) before the clip's, zero
    frames in front of a sample with fewer; the transformer gets cat([refs, x_t]) and timestep 0 on
    the N (h/2)(w/2) reference tokens; the loss is the MSE of its prediction for the clip's frames
    only (a hand-made transformer call, sliced); reference dropout gives zero frames."""
    from e2v.train.step import draw_flow, forward_loss

    p, cfg = ti2v_parts, _cfg()
    batch = _batch([3, 1])
    c = _encode(batch, p, cfg)
    with torch.no_grad():
        refs = [[_normalised(p.vae, batch["vae_refs"][i][k][None, :, None]) for k in batch["element_names"][i]]
                for i in range(2)]
        clip = _normalised(p.vae, batch["video"])
    assert c.ref_latents_BCNhw.shape == (2, 48, 3, 4, 4) and c.cond_BCTHW is None and c.clip_BLD is None
    torch.testing.assert_close(c.ref_latents_BCNhw[0:1], torch.cat(refs[0], 2), atol=1e-5, rtol=0)
    assert (c.ref_latents_BCNhw[1, :, :2] == 0).all()  # padded in front: its reference stays next to its clip
    torch.testing.assert_close(c.ref_latents_BCNhw[1:, :, 2:], refs[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.latents_BCTHW, clip, atol=1e-5, rtol=0)  # the clip alone: no frame dropped
    assert cfg.reference_frames() == 0  # the references take none of the clip's frames

    calls = []
    hook = p.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    try:
        sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(3))
        with torch.no_grad():
            loss, per_sample, pred, target = forward_loss(p.transformer, c, sigma, noise, noisy, cfg, torch.float32)
    finally:
        hook.remove()
    per_frame = 2 * 2  # (h/2)(w/2) tokens a latent frame
    timestep = calls[0]["timestep"]
    assert timestep.shape == (2, 8 * per_frame)
    assert (timestep[:, :3 * per_frame] == 0).all()
    torch.testing.assert_close(timestep[:, 3 * per_frame:], (1000 * sigma)[:, None].expand(2, 5 * per_frame))
    with torch.no_grad():
        full = p.transformer(torch.cat([c.ref_latents_BCNhw, noisy], 2), timestep=timestep,
                             encoder_hidden_states=c.text_BLD, return_dict=False)[0]
    assert full.shape[2] == 8 and pred.shape == noisy.shape == (2, 48, 5, 4, 4)
    torch.testing.assert_close(pred, full[:, :, 3:], atol=1e-6, rtol=0)
    torch.testing.assert_close(per_sample, ((full[:, :, 3:] - (noise - c.latents_BCTHW)) ** 2).mean((1, 2, 3, 4)),
                               atol=1e-6, rtol=0)

    dropped = _encode(batch, p, _cfg("conditioning.reference_dropout=1.0"), train=True)
    assert dropped.ref_latents_BCNhw.shape == (2, 48, 3, 4, 4) and (dropped.ref_latents_BCNhw == 0).all()
    assert _encode(_batch([0, 0]), p, cfg).ref_latents_BCNhw is None  # no reference: plain TI2V text-to-video


def test_wan22_ti2v_cached_conditions_equal_the_encoded_ones(ti2v_parts):
    """tools/precompute.py's entries (each reference on its own: the combine-after format the
    layout implies) give the encoded tensors, posterior samples drawn in the same order."""
    from e2v.conditioning.cached import compute_entry
    from e2v.conditioning.encode import encode_text
    from e2v.conditioning.layout import batch_conditions

    p = ti2v_parts
    cfg = _cfg("processors.vae.sample_mode=sample", "conditioning.target_sample_mode=sample",
               "processors.vae.combine=before")
    assert cfg.processors.vae.combine == "after"  # implied by clean_prefix (config.normalise)
    raw = _batch([3, 1], seed=4)
    items = [{k: v[i] for k, v in raw.items() if k not in ("id", "skipped")} for i in range(2)]
    entries = [compute_entry(it, p, cfg) for it in items]
    shared = {"empty_text": encode_text([""], p.tokenizer, p.text_encoder)[0, :1], "clip_shape": (0, 0)}
    batch = {"id": raw["id"], "prompt": raw["prompt"], "element_names": raw["element_names"], "cached": entries,
             "shared": [shared, shared], "skipped": []}
    with torch.no_grad():
        cached = batch_conditions(batch, p, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
    encoded = _encode(raw, p, cfg, train=True)
    torch.testing.assert_close(cached.ref_latents_BCNhw, encoded.ref_latents_BCNhw, atol=1e-5, rtol=0)
    # the clips: encoded one by one for the cache, as a batch online (conv summation order only)
    torch.testing.assert_close(cached.latents_BCTHW, encoded.latents_BCTHW, atol=1e-4, rtol=0)
    assert (cached.ref_latents_BCNhw[1, :, :2] == 0).all() and cached.ref_latents_BCNhw[1, :, 2].abs().sum() > 0


def test_wan22_ti2v_text_to_video_equals_wanpipeline_and_its_lora_loads(ti2v_parts, tmp_path):
    """Plain text-to-video on TI2V (e2v_type: none): the sampler equals WanPipeline(expand_timesteps=
    True) (per-token timesteps, all t: the same numbers as one per sample); a LoRA trained by the
    training step (forward_loss, backward, two steps) and exported loads into that pipeline and
    changes its output, to what tools/sample.py's loader gives."""
    from diffusers import WanPipeline

    from e2v.eval.sampling import generate, load_trained, make_scheduler
    from e2v.models.tiny import build_tiny_parts
    from e2v.train.engine import prepare_for_training
    from e2v.train.export import export_lora
    from e2v.train.step import draw_flow, forward_loss

    p = ti2v_parts
    cfg = _cfg("e2v_type=none", "conditioning.target_layout=overlay", "train.trainable=[]")
    opts = dict(height=S, width=S, num_frames=17, num_inference_steps=3, guidance_scale=3.0, output_type="latent")

    def pipe_latents(transformer):
        pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=transformer,
                           scheduler=make_scheduler(5.0), expand_timesteps=True)
        return pipe(prompt="a person walking", negative_prompt="", generator=torch.Generator().manual_seed(2),
                    **opts).frames

    base = pipe_latents(p.transformer)
    ours = generate(p.transformer, p, cfg, ["a person walking"], seed=2, num_steps=3, guidance_scale=3.0, shift=5.0)
    torch.testing.assert_close(ours, base, atol=1e-5, rtol=0)

    trained = copy.copy(p)
    trained.transformer = build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer
    full_names = prepare_for_training(trained, cfg)
    lora = [t for t in trained.transformer.parameters() if t.requires_grad]
    opt = torch.optim.SGD(lora, lr=1.0)
    c = _encode(_batch([0, 0]), trained, cfg, train=True)
    for step in range(2):
        sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(step))
        loss, *_ = forward_loss(trained.transformer, c, sigma, noise, noisy, cfg, torch.float32)
        loss.backward()
        opt.step(), opt.zero_grad()
    export_lora(trained.transformer, tmp_path / "lora", full_names)

    fresh = build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=fresh,
                       scheduler=make_scheduler(5.0), expand_timesteps=True)
    pipe.load_lora_weights(tmp_path / "lora")
    with_lora = pipe(prompt="a person walking", negative_prompt="", generator=torch.Generator().manual_seed(2),
                     **opts).frames
    assert (with_lora - base).abs().max() > 1e-3
    loaded = load_trained(build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer, tmp_path / "lora")
    torch.testing.assert_close(generate(loaded, p, cfg, ["a person walking"], seed=2, num_steps=3, guidance_scale=3.0,
                                        shift=5.0), with_lora, atol=1e-5, rtol=0)


def test_wan22_ti2v_layout_stays_on_the_models_device(ti2v_parts):
    """The meta device standing in for CUDA (tests/unit/test_devices.py): reference frames, their zero
    padding, the per-token timesteps, the step's loss and the sampler all stay on the models'
    device, online and from the cache."""
    import transformers.masking_utils as masking

    from e2v.conditioning.cached import compute_entry
    from e2v.conditioning.encode import encode_text
    from e2v.conditioning.layout import batch_conditions
    from e2v.eval.sampling import generate
    from e2v.models.parts import place_encoders
    from e2v.runtime.device import to_device
    from e2v.train.step import draw_flow, forward_loss

    meta, cfg = torch.device("meta"), _cfg()
    entries = [compute_entry({k: v[i] for k, v in _batch([3, 1]).items() if k not in ("id", "skipped")}, ti2v_parts,
                             cfg) for i in range(2)]
    shared = {"empty_text": encode_text([""], ti2v_parts.tokenizer, ti2v_parts.text_encoder)[0, :1],
              "clip_shape": (0, 0)}
    peek = masking._ignore_bidirectional_mask_sdpa  # as test_devices.meta_parts: UMT5 peeks at mask values
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masking, "_ignore_bidirectional_mask_sdpa",
                   lambda mask, *a, **kw: False if mask is not None and mask.is_meta else peek(mask, *a, **kw))
        parts = copy.deepcopy(ti2v_parts)
        parts.transformer.to(meta)
        place_encoders(parts, meta)
        c = _encode(to_device(_batch([3, 1]), meta), parts, cfg)
        sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(0))
        loss, per_sample, pred, target = forward_loss(parts.transformer, c, sigma, noise, noisy, cfg, torch.float32)
        cached = batch_conditions(to_device({"id": ["a", "b"], "prompt": ["x", "y"], "cached": entries,
                                                  "element_names": [NAMES, NAMES[:1]], "shared": [shared] * 2,
                                                  "skipped": []}, meta),
                                       parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
        latents = generate(parts.transformer, parts, cfg, ["a shape moves"], [{"person": _image(0)}], seed=1,
                           num_steps=2, guidance_scale=3.0, shift=3.0, device=meta)
    for name, t in dict(refs=c.ref_latents_BCNhw, loss=loss, pred=pred, cached=cached.ref_latents_BCNhw,
                        latents=latents).items():
        assert t.device == meta, name
    assert c.ref_latents_BCNhw.shape == cached.ref_latents_BCNhw.shape == (2, 48, 3, 4, 4)
    assert pred.shape == (2, 48, 5, 4, 4) and latents.shape == (1, 48, 5, 4, 4)


def test_wan22_ti2v_config_checks_name_the_key_and_the_fix():
    """What the model's shape allows, checked on the meta device before any weight loads."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError
    from e2v.models.plan import preflight

    preflight(_cfg())
    preflight(_cfg("e2v_type=none", "conditioning.target_layout=overlay"))  # plain TI2V text-to-video
    cases = [
        (_cfg("conditioning.target_layout=overlay"), r"target_layout: clean_prefix"),
        (_cfg("e2v_type=dual"), r"no image attention .* use e2v_type: vae"),
        (_cfg("data.resolution=[48,64]"), r"multiples of 32"),
        (load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["conditioning.target_layout=clean_prefix"], check_paths=False),
         r"clean_prefix needs a model whose input is its latents alone"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            preflight(cfg)
    with pytest.raises(ConfigError, match=r"target_layout: clean_prefix .* e2v_type=none has no VAE condition"):
        _cfg("e2v_type=none")


def test_wan22_ti2v_5b_yaml_plans_the_published_model(demo_data, capsys, monkeypatch):
    """configs/e2v_wan22_ti2v_5b.yaml dry-runs the published TI2V-5B on the meta device (its
    conversion config: 30 layers x 24 heads x 128, 48 channels, 5.00 B parameters; the Wan2.2 VAE
    counted among the resident encoders), and tools/estimate_memory.py plans it (README rows)."""
    import sys

    import train_e2v
    from e2v.config.bases import vae_config
    from e2v.config.load import load_config
    from e2v.models.plan import build_meta_transformer, count_params, encoder_bytes, tokens
    from e2v.train import memory as em

    cfg = load_config(ROOT / "configs/e2v_wan22_ti2v_5b.yaml", check_paths=False)
    assert cfg.model.pretrained == "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    assert count_params(build_meta_transformer(cfg)) == 4_999_787_712
    assert vae_config(cfg)["z_dim"] == 48 and round(encoder_bytes(cfg)["vae"] / 4 / 1e9, 2) == 0.70
    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", "configs/e2v_wan22_ti2v_5b.yaml", "--dry_run",
                                      "--set", f"data.datasets.0.data_root={demo_data}"])
    train_e2v.main()
    out = capsys.readouterr().out
    assert "30 layers x 24 heads x 128, in_channels 48, image attention no" in out and "params 5.161 B" in out
    # 704 x 1280 x 121: 31 clip + 3 reference latent frames of 22 x 40 tokens
    assert tokens(cfg) == ((31 + 3) * 22 * 40, 512)
    rows = em.estimate(cfg, 1, 80)["rows"]  # per GPU: the same terms at any GPU size; cached: less the encoders
    assert rows[0]["encoders_gb"] == pytest.approx(sum(encoder_bytes(cfg).values()) / 2**30)

    def first_fit(gb, cached=False):  # the estimate's own order: least offloading first
        return next(((r["ds_config"], r["gradient_checkpointing"], r["activation_offload"]) for r in rows
                     if r["gpu_total_gb"] - cached * r["encoders_gb"] <= gb), None)

    assert first_fit(24) is None  # online, the 13.2 GB of resident encoders leave no room
    assert first_fit(24, cached=True) == ("zero2_offload.json", True, True)
    assert first_fit(80) == first_fit(48) == ("zero2.json", True, False)


@pytest.mark.parametrize("heads,head_dim,ffn,layers,frames,size", [(2, 12, 32, 2, 5, 16), (4, 32, 256, 2, 5, 32)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_wan22_per_token_timesteps_activation_formula(heads, head_dim, ffn, layers, frames, size, checkpointing):
    """tools/estimate_memory.py's per-token timestep terms against the bytes autograd saves for a
    48-channel Wan transformer given one timestep per token (tests/unit/test_estimate_memory.py's
    measurement), within 20%."""
    from diffusers import WanTransformer3DModel
    from helpers_memory import _saved_bytes

    from e2v.models.plan import activation_terms
    from e2v.train import memory as em

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=48, out_channels=48,
        text_dim=32, freq_dim=32, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32).requires_grad_(True)
    s = frames * size * size // 4
    inputs = dict(hidden_states=torch.randn(1, 48, frames, size, size), timestep=torch.full((1, s), 500.0),
                  encoder_hidden_states=torch.randn(1, 512, 32), return_dict=False)
    measured = _saved_bytes(model, inputs, checkpointing)
    c = em.ModelCounts(0, 0, 0, heads * head_dim, ffn, layers)
    block, outside = activation_terms(s, 512, c, per_token_time=True)
    predicted = 4 * (layers * s * c.width + outside if checkpointing else layers * block + outside)
    assert predicted == pytest.approx(measured, rel=0.2)
    scalar_block, scalar_outside = activation_terms(s, 512, c)
    assert scalar_outside < outside and scalar_block < block
