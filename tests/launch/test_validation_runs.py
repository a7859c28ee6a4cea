"""Validation: logged by the real run at steps 0, n, 2n; identical when run twice on the same
weights (and the same as the engine's numbers, recomputed from the exported LoRA); leaves the
training RNG alone (losses and videos); the reference gaps are exactly 0 for a model that ignores
its references; `validation.sets` alone (no held-out samples) still generates videos.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_validation.py."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)


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
                    "val/reference_gap_shuffle_at_sigma_0.9", "val/loss_shuffled_refs", "val/loss_dropped_refs",
                    "val/reference_gap_shuffle_rel", "val/reference_gap_drop_rel",
                    "val/reference_gap_shuffle_rel_at_sigma_0.9", "val/reference_gap_drop_rel_at_sigma_0.3"):
            assert torch.isfinite(torch.tensor(d[tag])), tag
        for name, tag in (("shuffled", "shuffle"), ("dropped", "drop")):  # the gap is a plain difference
            gap = d[f"val/loss_{name}_refs"] - d["val/loss"]
            assert d[f"val/reference_gap_{tag}"] == pytest.approx(gap, rel=1e-6, abs=1e-12)
            assert d[f"val/reference_gap_{tag}_rel"] == pytest.approx(gap / d["val/loss"], rel=1e-6, abs=1e-12)
        # the held-out videos against their references (e2v/eval/fidelity.py; tests/unit/test_fidelity.py checks the values)
        assert 0 <= d["val/sample_reference_match"] <= 1 and 0 <= d["val/sample_reference_swap"] <= 1
        for tag in ("val/element_similarity", "val/element_similarity_gap", "val/element_similarity_person",
                    "val/element_similarity_gap_background"):
            assert torch.isfinite(torch.tensor(d[tag])), tag
    import imageio.v3 as iio

    for s in val_steps:
        for k in ("00", "01"):  # validation.num_videos 2, from held-out references
            assert iio.imread(viz_run / f"samples/step_{s:06d}/{k}.mp4").shape == (17, 64, 64, 3)
        # 2 rows, each under two label lines: 3 references and 5 frames, a spacer, the partner's 3
        # references and the 5 frames made with them; 64 px tiles, 2 px gaps, a 6 px spacer
        from e2v.eval.viz import LABEL_BAND

        strip = 8 * 64 + 7 * 2
        assert iio.imread(viz_run / f"samples/step_{s:06d}/sheet.png").shape == (
            2 * (2 * LABEL_BAND + 64) + 2, 2 * strip + 6 + 2 * 2, 3)


@pytest.fixture(scope="module")
def trained_validator(viz_run, tiny_parts):
    from dataclasses import replace

    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples
    from e2v.eval.sampling import load_trained
    from e2v.eval.validation import Validator, split_held_out
    from e2v.models.tiny import build_tiny_parts

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

    from helpers import blind

    out = validator.losses(blind(parts.transformer))
    gaps = [k for k in out if k.startswith("val/reference_gap_")]
    assert len(gaps) == 2 * 2 * (1 + 2)  # shuffle/drop x plain/rel x (mean + 2 sigmas)
    assert all(out[k] == 0.0 for k in gaps), {k: out[k] for k in gaps}
    logged = read_scalars(viz_run)[4]
    assert logged["val/loss_shuffled_refs"] != logged["val/loss"]  # while the unblinded model does read them


def test_videos_leave_the_training_rngs_alone(trained_validator, tmp_path):
    """Generating draws its noise from a generator seeded by validation.seed: the global torch,
    numpy and Python RNGs and a training generator are where they were."""
    import numpy as np

    validator, parts = trained_validator
    validator.out = tmp_path  # the fixture run's samples/ stay as the run wrote them
    torch.manual_seed(11)
    np.random.seed(11)
    train_gen = torch.Generator().manual_seed(5)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), train_gen.get_state())
    assert validator.videos(parts.transformer, 9)[0] == 2
    assert (tmp_path / "step_000009/01.mp4").exists()
    assert torch.equal(torch.get_rng_state(), states[0]) and np.array_equal(np.random.get_state()[1], states[1])
    assert random.getstate() == states[2] and torch.equal(train_gen.get_state(), states[3])
