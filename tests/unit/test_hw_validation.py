"""Validation that fits where training fits (e2v/eval/validation.py): a run from the cache
validates from its cached conditions with no text encoder and nothing encoded, the VAE and then
the CLIP visiting the device one at a time for their parts, and gives what the encoding
validation gives; the decode is tiled, and the
tiles' seams are measured against an untiled decode of the tiny VAE."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from e2v.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


def _sets(data: Path, cache: Path, *more: str) -> list[str]:
    return [f"data.datasets.0.data_root={data}", f"cache.dir={cache}", "validation.every_n_steps=2",
            "validation.num_samples=3", "validation.num_videos=2", "validation.num_inference_steps=2",
            "validation.sigmas=[0.3,0.9]", *more]


@pytest.fixture(scope="module")
def cached_setup(demo_data, tmp_path_factory):
    """The demo data's conditions precomputed (tools/precompute.py), the tiny parts and both configs."""
    from e2v.models.load import load_parts
    from tools.precompute import main as precompute

    cache = tmp_path_factory.mktemp("hw_cache") / "cache"
    sets = _sets(demo_data, cache)
    with contextlib.redirect_stdout(io.StringIO()):
        assert precompute(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                           *[a for s in sets for a in ("--set", s)]]) == 0
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", sets + ["cache.enabled=true"])
    return cfg, load_parts(cfg, with_encoders=True)


def _held_out(cfg):
    from e2v.data.dataset import index_samples
    from e2v.eval.validation import split_held_out

    return split_held_out(index_samples(cfg, verbose=False), cfg)[1]


def test_from_the_cache_no_encoder_and_the_same_numbers(cached_setup, tmp_path, monkeypatch):
    """The oracle is the encoding validation of the same held-out samples (argmax posteriors:
    both paths give the same conditions). The cached one never encodes text, images or video
    (those functions are made to raise), decodes inside the VAE's visit to the device, and runs
    the CLIP (element similarity) in its own visit after the VAE went home."""
    import e2v.conditioning.encode as encode
    import e2v.eval.validation as validation
    from e2v.eval.validation import Validator
    from e2v.models.parts import Parts

    cfg, parts = cached_setup
    online_cfg = replace(cfg, cache=replace(cfg.cache, enabled=False))
    held_out = _held_out(cfg)
    model = parts.transformer.eval()
    online = Validator(online_cfg, held_out, parts, tmp_path / "online", rank=0, device="cpu", dtype=torch.float32)
    want = online.losses(model)
    want_latents = online.generate(model, parts, online.video_inputs())

    def refuse(*a, **kw):
        raise AssertionError("an encoder ran in a validation from the cache")

    for name in ("encode_text", "encode_clip_images", "encode_video", "encode_video_stats"):
        monkeypatch.setattr(encode, name, refuse)
    monkeypatch.setattr(validation, "with_encoders", refuse)
    events = []
    real_visiting = validation.visiting

    @contextlib.contextmanager
    def recorded(module, device):
        events.append(("visit", type(module).__name__))
        with real_visiting(module, device):
            yield module
        events.append(("home", type(module).__name__))

    monkeypatch.setattr(validation, "visiting", recorded)
    run_parts = Parts(transformer=model)  # a run from the cache holds no encoder
    cached = Validator(cfg, held_out, run_parts, tmp_path / "cached", rank=0, device="cpu", dtype=torch.float32)
    with cached.frozen_parts() as vparts:
        assert vparts.text_encoder is None and vparts.image_encoder is None and vparts.vae is not None
        vae = vparts.vae
        vae.decoder.register_forward_pre_hook(lambda *_: events.append(("decode", "AutoencoderKLWan")))
        vae.encoder.register_forward_pre_hook(lambda *_: events.append(("encode", "AutoencoderKLWan")))
        got = cached.losses(model, vparts)
        got_latents, _ = cached.generate_from_cache(model, vparts, partners=False)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    torch.testing.assert_close(torch.cat(got_latents), want_latents, rtol=1e-4, atol=1e-5)  # one bucket: one group
    assert events == []  # nothing decoded or encoded yet, nothing brought to the device

    scalars = cached.maybe_run(model, 2)  # the whole validation: losses, videos, files, element similarity
    assert scalars["val/loss"] == pytest.approx(want["val/loss"], rel=1e-4)
    assert "val/element_similarity" in scalars  # the CLIP came for its part
    decodes = [i for i, e in enumerate(events) if e[0] == "decode"]
    assert decodes and ("encode", "AutoencoderKLWan") not in events
    # one at a time: each visit ends before the next begins; the VAE's holds every decode, then the CLIP's
    assert [e for e in events if e[0] in ("visit", "home")] == [
        ("visit", "AutoencoderKLWan"), ("home", "AutoencoderKLWan"), ("visit", "CLIPVisionModel"),
        ("home", "CLIPVisionModel")], events
    vae_visit = (events.index(("visit", "AutoencoderKLWan")), events.index(("home", "AutoencoderKLWan")))
    assert all(vae_visit[0] < d < vae_visit[1] for d in decodes), events
    assert sorted(p.name for p in (tmp_path / "cached/samples/step_000002").iterdir())[:2] == ["00.mp4", "00.txt"]

    # Another rank runs the same collectives (losses, generation) but decodes nothing: no VAE on its host.
    other = Validator(cfg, held_out, run_parts, tmp_path / "rank1", rank=1, device="cpu", dtype=torch.float32)
    assert other.maybe_run(model, 2) == {k: v for k, v in scalars.items() if k in want}
    assert "vae" not in other.host and not (tmp_path / "rank1/samples").exists()


def test_reads_cache_rule():
    from e2v.eval.validation import reads_cache

    base = load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["cache.enabled=true"], check_paths=False)
    assert reads_cache(base)
    assert not reads_cache(replace(base, cache=replace(base.cache, enabled=False)))
    v = base.validation
    assert not reads_cache(replace(base, validation=replace(v, guidance_scale=5.0, negative_prompt="blurry")))
    assert reads_cache(replace(base, validation=replace(v, guidance_scale=5.0, negative_prompt="")))


@pytest.mark.parametrize("informative", [True, False])
def test_tiled_decode_matches_untiled(informative, monkeypatch):
    """diffusers' AutoencoderKLWan tiling on the tiny VAEs (the informative one, whose decode is
    local, and a random one whose convolutions see across the seams), frames of 96 x 128 px in
    64 px tiles with a 48 px stride (each seam blended over 16 px), against the untiled decode
    (pixels in [-1, 1]). Measured: the informative VAE's tiles are exact; the random one's differ
    by 0.0011 on average (0.14 of 255 levels) and up to 0.029 at a seam, where its receptive
    field is wider than the 16 px blend (Wan's VAE tiles 256 px with 64 px blends). The VAE's own
    setting is restored."""
    from e2v.eval.validation import tiled
    from e2v.models.tiny_vae import build_tiny_vae

    vae = build_tiny_vae(0, informative=informative).eval()
    calls = []
    real = vae.tiled_decode
    monkeypatch.setattr(vae, "tiled_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    r = vae.spatial_compression_ratio
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, vae.config.z_dim, 1, 96 // r, 128 // r, generator=g)  # one frame: the seams are spatial
    with torch.no_grad():
        whole = vae.decode(z, return_dict=False)[0]
        assert not vae.use_tiling and not calls
        vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                          tile_sample_stride_width=48)
        vae.use_tiling = False
        with tiled(vae):
            assert vae.use_tiling
            tiles = vae.decode(z, return_dict=False)[0]
    assert calls and not vae.use_tiling  # it tiled, and the setting is back
    assert tiles.shape == whole.shape == (1, 3, 1, 96, 128)
    diff = (tiles - whole).abs()
    print(f"tiled vs untiled decode ({'informative' if informative else 'random'} tiny VAE): mean |diff| "
          f"{diff.mean():.5f}, max {diff.max():.5f}, output std {whole.std():.4f}")
    assert diff.mean() < 0.005 and diff.max() < (1e-6 if informative else 0.1)
