"""Validation with held-out samples of several frame buckets (data.auto_frame_buckets): micro-batches
hold one latent shape, the per-sample losses are each sample's own (computed alone here), the
references are shuffled only within a shape, and a sample alone in its shape is left out of the
shuffle gap (said once in the log)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only waits

FRAMES = [17, 9, 17, 9, 13]  # held-out sample k's bucket: 17 and 9 twice each, 13 alone


@pytest.fixture
def bucketed(tiny_parts, demo_data, tmp_path):
    return make_bucketed(tiny_parts, demo_data, tmp_path)


def make_bucketed(tiny_parts, demo_data, tmp_path, *sets):
    """A Validator on 5 held-out demo samples put in the buckets of FRAMES."""
    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples
    from e2v.eval.validation import Validator, split_held_out

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={demo_data}", "data.auto_frame_buckets=true", "data.frame_buckets=[9,13,17]",
        "validation.every_n_steps=1", "validation.num_samples=5", "validation.sigmas=[0.9]",
        "validation.num_videos=5", "validation.num_inference_steps=1", "train.micro_batch_size=2",
        "validation.subject_colour={subject: person, background: background, distractors: [object]}", *sets])
    _, held_out = split_held_out(index_samples(cfg, verbose=False), cfg)
    h, w = cfg.data.resolution
    held_out = [replace(s, bucket=(f, h, w)) for s, f in zip(held_out, FRAMES, strict=True)]
    return Validator(cfg, held_out, tiny_parts, tmp_path, rank=0, device="cpu", dtype=torch.float32)


def alone(validator, model, conds, i: int, refs: int | None, sigma: float, seed: int) -> float:
    """Sample i's loss computed by itself (B=1) with the references of sample `refs` (None:
    dropped), its noise the i-th draw of the seeded generator (the documented noise rule)."""
    from e2v.conditioning.layout import with_references
    from e2v.train.flow import add_noise, per_sample_mse
    from e2v.train.step import predict, prediction_and_target

    gen = torch.Generator().manual_seed(seed)
    noise = [torch.randn(c.latents_BCTHW.shape, generator=gen) for c in conds][i]
    c = conds[i]
    sigma_B = torch.full((1,), sigma)
    noisy = add_noise(c.latents_BCTHW, noise, sigma_B)
    c = with_references(c, None if refs is None else conds[refs])
    pred = predict(model, noisy, 1000 * sigma_B, c, c.text_BLD, torch.float32)
    pred, target = prediction_and_target(validator.cfg.flow, pred, noisy, sigma_B, c.latents_BCTHW, noise)
    return per_sample_mse(pred, target).item()


def test_two_frame_buckets_validate(bucketed, tiny_parts, capsys):
    """Three latent shapes held out, micro-batch 2: per-sample losses equal each sample's alone (in
    sample order), shuffle partners within a shape, the scalars over the right samples, videos made."""
    v, model = bucketed, tiny_parts.transformer.eval()
    conds = v.encode()
    assert sorted({c.latents_BCTHW.shape[2] for c in conds}) == [3, 4, 5]  # three latent shapes were held out

    partners = [v.partner(k) for k in range(len(conds))]
    assert partners == [2, 3, 0, 1, None]  # the next of its own shape, cyclic; the lone 13-frame one has none
    for k, p in enumerate(partners):
        assert p is None or conds[p].latents_BCTHW.shape == conds[k].latents_BCTHW.shape

    sigma, seed = 0.9, v.cfg.validation.seed * 1000  # validation.sigmas[0]'s noise seed, as losses() draws it
    variants = {"true": list(range(5)), "shuffled": [2, 3, 0, 1, 4], "dropped": [None] * 5}
    got = v.per_sample_losses(model, conds, variants, sigma, seed=seed)
    want = {name: [alone(v, model, conds, i, src[i], sigma, seed) for i in range(5)] for name, src in variants.items()}
    for name in variants:
        # fp32, batched vs alone: only the reduction order differs (measured: at most 1.2e-7 relative)
        torch.testing.assert_close(got[name], torch.tensor(want[name]), rtol=1e-5, atol=1e-6, msg=name)

    capsys.readouterr()
    scalars = v.losses(model)
    v.losses(model)
    said = [line for line in capsys.readouterr().out.splitlines() if "alone in their frame/resolution bucket" in line]
    assert len(said) == 1 and "1 of 5" in said[0], said  # said once, naming what was left out
    # val/loss and the drop gap over all 5; the shuffle gap over the 4 with a partner, against their true loss
    true, shuffled, dropped = want["true"], want["shuffled"][:4], want["dropped"]
    assert scalars["val/loss"] == pytest.approx(sum(true) / 5, rel=1e-5)
    assert scalars["val/reference_gap_drop"] == pytest.approx(sum(dropped) / 5 - sum(true) / 5, rel=1e-4, abs=1e-6)
    assert scalars["val/reference_gap_shuffle"] == pytest.approx(sum(shuffled) / 4 - sum(true[:4]) / 4, rel=1e-4,
                                                                 abs=1e-6)

    # The generated videos (all at the config's size), swapped with each partner's references; the lone one unswapped
    count, video_scalars = v.videos(model, 1)
    assert count == 5 and {"val/sample_reference_match", "val/sample_reference_swap"} <= set(video_scalars)
    assert (v.out / "step_000001/sheet.png").exists()


def test_no_shared_shape_logs_no_shuffle_gap(bucketed, tiny_parts, capsys):
    from e2v.eval.validation import Validator

    lone = Validator(bucketed.cfg, [bucketed.samples[i] for i in (0, 1, 4)], tiny_parts, bucketed.out.parent,
                     rank=0, device="cpu", dtype=torch.float32)
    capsys.readouterr()
    scalars = lone.losses(tiny_parts.transformer.eval())
    assert not [k for k in scalars if "shuffle" in k] and "val/reference_gap_drop" in scalars
    assert capsys.readouterr().out.count("shuffle gap is not logged") == 1


def test_from_the_cache_one_batch_per_bucket(bucketed, tiny_parts, demo_data, tmp_path):
    """A run from the cache holds each held-out sample's conditions at its bucket's latent shape:
    its losses are the encoding validation's (the oracle) and its videos come one batch per bucket,
    each at its sample's shape, in sample order, swapped within the bucket."""
    from e2v.conditioning.cached import compute_entry, shared_entry
    from e2v.data.dataset import E2VDataset
    from e2v.data.store import CacheStore
    from e2v.eval.validation import reads_cache

    cached = make_bucketed(tiny_parts, demo_data, tmp_path / "cached", "cache.enabled=true",
                           f"cache.dir={tmp_path / 'cache'}")
    assert reads_cache(cached.cfg)
    store, ds = CacheStore(cached.cfg), E2VDataset(cached.cfg, cached.samples)
    for s in cached.samples:
        item = ds.load(s)
        store.write(s, compute_entry(item, tiny_parts, cached.cfg), item["element_names"])
    store.write_shared(*shared_entry(tiny_parts))

    model = tiny_parts.transformer.eval()
    want, got = bucketed.losses(model), cached.losses(model, tiny_parts)
    assert got.keys() == want.keys() and "val/reference_gap_shuffle" in got
    for k in want:  # the same conditions, assembled from the cache: rounding apart, the same numbers
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k

    groups = cached.cached_video_groups()
    assert groups == [[0, 2], [1, 3], [4]]
    latents, swapped = cached.generate_from_cache(model, tiny_parts, partners=True)
    conds = cached.encode()
    for group, lat, swap in zip(groups, latents, swapped, strict=True):
        assert lat.shape == swap.shape == (len(group), *conds[group[0]].latents_BCTHW.shape[1:])
    videos = cached.decode(groups, latents, tiny_parts.vae)
    assert [len(video) for video in videos] == FRAMES  # each video in its sample's place, its own frame count
