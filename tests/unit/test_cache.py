"""The conditioning cache against a second code path: batch_conditions on the same raw batch with the
same RNG states must give what it assembles from the cached entries (every
cacheable mode, dropouts, posterior samples). Then the real tools: precompute, stale and missing
entries, and a cached training run against an encoding one (mixed sizes, 2 processes, batch 2).

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_cache_runs.py."""

import dataclasses
import os
import random

import numpy as np
import pytest
import torch
from helpers import ROOT

from e2v.conditioning.cached import compute_entry, shared_entry
from e2v.conditioning.layout import batch_conditions
from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.data.dataset import E2VDataset, collate, index_samples
from e2v.data.store import CacheError, CacheStore


def _cfg(data, cache_dir, *sets):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={data}", f"cache.dir={cache_dir}", "validation.every_n_steps=0",
        "visualization.enabled=false", *sets])


def _fill(cfg, parts, samples):
    store = CacheStore(cfg)
    ds = E2VDataset(cfg, samples)
    for s in samples:
        item = ds.load(s)
        store.write(s, compute_entry(item, parts, cfg), item["element_names"])
    store.write_shared(*shared_entry(parts))
    return store


def _both(cfg, parts, samples, store, seed=3):
    raw = collate([E2VDataset(cfg, samples)[i] for i in range(len(samples))])
    cached = collate([{**store.load(s), "skipped": []} for s in samples])
    out = []
    for batch in (raw, cached):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        with torch.no_grad():
            out.append((batch_conditions(batch, parts, cfg, rng=rng, generator=gen), rng.random(),
                        torch.rand(1, generator=gen).item()))
    return out


MODES = {  # name -> overrides; each a cacheable layout
    "full_before_argmax": (),
    "index_before_sample_dropouts": ("processors.vae.frame_conditioning=index", "processors.vae.frame_index=1",
                                     "processors.vae.sample_mode=sample", "conditioning.target_sample_mode=sample",
                                     "conditioning.reference_dropout=0.5", "conditioning.caption_dropout=0.5"),
    "random_after": ("processors.vae.combine=after", "processors.vae.frame_conditioning=random",
                     "processors.vae.sample_mode=sample", "conditioning.reference_dropout=0.3"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_cached_conditions_equal_encoded(mode, demo_data, tiny_parts, tmp_path):
    cfg = _cfg(demo_data, tmp_path / "cache", *MODES[mode])
    samples = index_samples(cfg, verbose=False)[:3]
    store = _fill(cfg, tiny_parts, samples)
    (enc, enc_rng, enc_gen), (cac, cac_rng, cac_gen) = _both(cfg, tiny_parts, samples, store)
    assert (enc_rng, enc_gen) == (cac_rng, cac_gen), "the cached path must consume rng and generator identically"
    assert enc.kept == cac.kept and enc.ref_dropped == cac.ref_dropped and enc.caption_dropped == cac.caption_dropped
    for f in ("latents_BCTHW", "cond_BCTHW", "clip_BLD", "text_BLD"):
        a, b = getattr(enc, f), getattr(cac, f)
        assert a.shape == b.shape, f
        # batch-of-4 vs batch-of-1 encodes differ only by summation order
        torch.testing.assert_close(b, a, atol=5e-5, rtol=1e-5, msg=f"{mode}: {f}")
    if mode == "full_before_argmax":
        assert torch.count_nonzero(cac.cond_BCTHW[:, :4]) > 0 and torch.count_nonzero(cac.clip_BLD) > 0


def test_stale_and_missing_entries_name_sample_and_field(demo_data, tiny_parts, tmp_path):
    cfg = _cfg(demo_data, tmp_path / "cache")
    samples = index_samples(cfg, verbose=False)[:2]
    store = _fill(cfg, tiny_parts, samples)
    store.verify_all(samples)  # fresh: no error
    changed = dataclasses.replace(samples[0], prompt="a different caption")
    with pytest.raises(CacheError, match=f"sample {samples[0].id}: .*'prompt' changed"):
        store.verify_all([changed, samples[1]])
    os.utime(samples[1].elements["person"], ns=(1, 1))  # touched element image: mtime differs
    assert "'element.person' changed" in store.problem(samples[1])
    other = dataclasses.replace(samples[0], id="not_cached")
    with pytest.raises(CacheError, match="sample not_cached: no cache entry"):
        store.verify_all([other])
    res = _cfg(demo_data, tmp_path / "cache", "model.tiny_seed=1")
    assert "'model.tiny_seed' changed" in CacheStore(res).problem(samples[0])


def test_uncacheable_modes_are_refused(demo_data, tmp_path):
    with pytest.raises(ConfigError, match="combine: after"):
        _cfg(demo_data, tmp_path, "cache.enabled=true", "processors.vae.frame_conditioning=prefix")
    with pytest.raises(ConfigError, match="prepend"):
        _cfg(demo_data, tmp_path, "cache.enabled=true", "conditioning.target_layout=prepend")


def test_a_cached_run_validates_and_visualizes_with_encoders_loaded_on_demand(demo_data, tiny_parts, tmp_path):
    """With cache.enabled the encoders are not resident: validation that needs them (here a
    negative prompt the cache does not hold; tests/unit/test_hw_validation.py covers validation from
    the cache) loads them for the time it runs, visualization loads the VAE for each dump. Oracle: the same Validator / Visualizer given
    the resident encoders; the numbers and the contact sheet must be identical."""
    from PIL import Image

    from e2v.eval.validation import Validator, split_held_out
    from e2v.eval.viz import Visualizer
    from e2v.models.parts import Parts
    from e2v.train.step import draw_flow

    cfg = _cfg(demo_data, tmp_path / "cache", "cache.enabled=true", "validation.every_n_steps=2",
               "validation.num_samples=3", "validation.num_videos=1", "validation.num_inference_steps=2",
               "validation.guidance_scale=2", "validation.negative_prompt=blurry",
               "visualization.enabled=true", "visualization.frequency=1")
    _, held = split_held_out(index_samples(cfg, verbose=False), cfg)
    model = tiny_parts.transformer
    resident = Validator(cfg, held, tiny_parts, tmp_path / "resident", rank=0, device="cpu", dtype=torch.float32)
    on_demand = Validator(cfg, held, Parts(model), tmp_path / "on_demand", rank=0, device="cpu", dtype=torch.float32)
    want, got = resident.maybe_run(model, 0), on_demand.maybe_run(model, 0)
    assert "val/reference_gap_shuffle" in got and got == want
    assert (tmp_path / "on_demand/samples/step_000000/00.mp4").exists()

    batch = collate([E2VDataset(cfg, held)[i] for i in range(2)])
    with torch.no_grad():
        c = batch_conditions(batch, tiny_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
        sigma, _, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(0))
        pred = model(torch.cat([noisy, c.cond_BCTHW], 1), timestep=1000 * sigma, encoder_hidden_states=c.text_BLD,
                     encoder_hidden_states_image=c.clip_BLD, return_dict=False)[0]
    sheets = []
    for name, vae in (("resident", tiny_parts.vae), ("on_demand", None)):
        vis = Visualizer(cfg, tmp_path / name, vae, rank=0, device="cpu")
        vis.maybe_dump(1, batch, c, noisy, pred, sigma)
        vis.close()
        assert vis.vae is vae  # the loaded VAE is released after the dump
        sheets.append(np.asarray(Image.open(tmp_path / name / "visualizations/step_000001/contact_sheet.png")))
    assert np.array_equal(sheets[0], sheets[1])

    # A batch read from the cache holds no pixels: the sheet's references are read from the element
    # files again, the same tiles as the raw batch's (this crashed a cached demo at its first dump).
    store = _fill(cfg, tiny_parts, held[:2])
    from_cache = collate([E2VDataset(cfg, held[:2], store)[i] for i in range(2)])
    assert "vae_refs" not in from_cache
    vis = Visualizer(cfg, tmp_path / "from_cache", tiny_parts.vae, rank=0, device="cpu")
    vis.maybe_dump(1, from_cache, c, noisy, pred, sigma)
    vis.close()
    assert np.array_equal(np.asarray(Image.open(tmp_path / "from_cache/visualizations/step_000001/contact_sheet.png")),
                          sheets[0])
