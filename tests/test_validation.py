"""Validation: logged by the real run at steps 0, n, 2n; identical when run twice on the same
weights (and the same as the engine's numbers, recomputed from the exported LoRA); leaves the
training RNG alone; the reference gaps are exactly 0 for a model that ignores its references."""

from __future__ import annotations

import random

import pytest
import torch



def read_scalars(run_dir) -> dict[int, dict]:
    """Every logged value by step, from scalars.jsonl (step 0 holds only the validation baseline)."""
    import json

    steps: dict[int, dict] = {}
    for d in map(json.loads, (run_dir / "scalars.jsonl").read_text().splitlines()):
        steps.setdefault(d["step"], {}).update(d)
    return steps


def test_logged_at_steps_and_videos_written(viz_run):
    scalars = read_scalars(viz_run)
    val_steps = [s for s, d in sorted(scalars.items()) if "val/loss" in d]
    assert val_steps == [0, 2, 4]
    for s in val_steps:
        d = scalars[s]
        for tag in ("val/reference_gap_shuffle", "val/reference_gap_drop", "val/loss_at_sigma_0.9",
                    "val/reference_gap_shuffle_at_sigma_0.9", "val/loss_shuffled_refs", "val/loss_dropped_refs"):
            assert torch.isfinite(torch.tensor(d[tag])), tag
        assert d["val/reference_gap_shuffle"] == pytest.approx(
            (d["val/loss_shuffled_refs"] - d["val/loss"]) / d["val/loss"], rel=1e-6)  # relative gap
    import imageio.v3 as iio

    for s in val_steps:
        for k in ("00", "01"):  # validation.num_videos 2, from held-out references
            assert iio.imread(viz_run / f"samples/step_{s:06d}/{k}.mp4").shape == (17, 64, 64, 3)


@pytest.fixture(scope="module")
def trained_validator(viz_run, tiny_parts):
    from dataclasses import replace

    from e2v.config import load_config
    from e2v.data import index_samples
    from e2v.models import build_tiny_parts
    from e2v.sampling import load_trained
    from e2v.validation import Validator, split_held_out

    cfg = load_config(viz_run / "config.yaml")
    assert cfg.model.preset == "tiny" and cfg.model.tiny_seed == 0  # tiny_parts are the run's frozen parts
    fresh = build_tiny_parts(seed=0, with_encoders=False).transformer
    parts = replace(tiny_parts, transformer=load_trained(fresh, viz_run / "lora"))
    _, held_out = split_held_out(index_samples(cfg, verbose=False), cfg)
    return Validator(cfg, held_out, parts, viz_run, rank=0, device="cpu", dtype=torch.float32), parts


def test_identical_twice_and_equal_to_the_run(viz_run, trained_validator):
    validator, parts = trained_validator
    torch.manual_seed(7)
    rng_before = torch.get_rng_state()
    py_before = random.getstate()
    first = validator.losses(parts.transformer)
    second = validator.losses(parts.transformer)
    assert first == second  # bit-identical, every tag
    assert torch.equal(torch.get_rng_state(), rng_before) and random.getstate() == py_before
    logged = read_scalars(viz_run)[4]
    for tag in ("val/loss", "val/loss_shuffled_refs", "val/loss_dropped_refs"):
        assert first[tag] == pytest.approx(logged[tag], abs=1e-5), tag  # engine at step 4 vs exported LoRA


def test_gaps_are_zero_for_a_model_that_ignores_references(viz_run, trained_validator):
    validator, parts = trained_validator

    class Blind(torch.nn.Module):
        """The trained transformer with its condition channels and image tokens zeroed."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, encoder_hidden_states_image=None, **kw):
            hidden_states = torch.cat([hidden_states[:, :16], torch.zeros_like(hidden_states[:, 16:])], 1)
            return self.inner(hidden_states, encoder_hidden_states_image=torch.zeros_like(encoder_hidden_states_image), **kw)

    out = validator.losses(Blind(parts.transformer))
    assert out["val/reference_gap_shuffle"] == 0.0 and out["val/reference_gap_drop"] == 0.0
    logged = read_scalars(viz_run)[4]
    assert logged["val/loss_shuffled_refs"] != logged["val/loss"]  # while the unblinded model does read them


def test_held_out_split():
    from types import SimpleNamespace

    from e2v.elements import Sample
    from e2v.validation import split_held_out

    samples = [Sample(f"{i:02d}", None, "p", dataset=d) for d in (0, 1) for i in range(5)] * 2  # repeat 2
    cfg = SimpleNamespace(validation=SimpleNamespace(every_n_steps=10, num_samples=3, seed=1))
    train, val = split_held_out(samples, cfg)
    held = {(s.dataset, s.id) for s in val}
    assert len(val) == 3 == len(held)
    assert not held & {(s.dataset, s.id) for s in train} and len(train) == 2 * (10 - 3)
    assert [(s.dataset, s.id) for s in split_held_out(samples, cfg)[1]] == [(s.dataset, s.id) for s in val]
    cfg.validation.every_n_steps = 0
    assert split_held_out(samples, cfg) == (samples, [])
    cfg.validation.every_n_steps, cfg.validation.num_samples = 10, 10
    with pytest.raises(ValueError, match="num_samples"):
        split_held_out(samples, cfg)
