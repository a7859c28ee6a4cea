"""Validation: logged by the real run at steps 0, n, 2n; identical when run twice on the same
weights (and the same as the engine's numbers, recomputed from the exported LoRA); leaves the
training RNG alone (losses and videos); the reference gaps are exactly 0 for a model that ignores
its references; `validation.sets` alone (no held-out samples) still generates videos.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_validation_runs.py."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT


def test_held_out_split():
    from types import SimpleNamespace

    from e2v.data.sample import Sample
    from e2v.eval.validation import split_held_out

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


def test_console_line_shows_difference_and_percent():
    from e2v.eval.validation import summary

    scalars = {"val/loss": 1.04, "val/reference_gap_shuffle": 0.177, "val/reference_gap_shuffle_rel": 0.170,
               "val/reference_gap_drop": -0.02, "val/reference_gap_drop_rel": -0.0192}
    assert summary(scalars, 2) == "loss 1.0400, shuffle gap +0.177 (+17.0%), drop gap -0.020 (-1.9%), 2 video(s)"
    assert summary({}, 1) == "1 video(s)"
    followed = {"val/sample_reference_match": 5 / 6, "val/sample_reference_swap": 1.0, "val/element_similarity": 0.9512,
                "val/element_similarity_gap": 0.0123}
    assert summary(followed, 6) == ("subject colour follows the references: match 0.83, swap 1.00, CLIP element "
                                    "similarity 0.951 (gap +0.012), 6 video(s)")


def test_sets_alone_validate_with_videos_only(tiny_parts, demo_data, tmp_path):
    """validation.sets without held-out samples: videos at every_n_steps (and the last step), no
    losses; the config accepts it, and still rejects validation with nothing to do."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError
    from e2v.data.dataset import index_samples
    from e2v.eval.validation import Validator, split_held_out

    base = [f"data.datasets.0.data_root={demo_data}", "validation.every_n_steps=3", "train.max_steps=4",
            "validation.num_inference_steps=1"]
    with pytest.raises(ConfigError, match="nothing to validate"):
        load_config(ROOT / "configs/e2v_tiny_lora.yaml", base + ["validation.num_samples=0"])
    with pytest.raises(ConfigError, match=r"num_samples must be >= 2 \(or 0"):
        load_config(ROOT / "configs/e2v_tiny_lora.yaml", base + ["validation.num_samples=1"])
    sets = ('validation.sets=[{prompt: "a shape moves", elements: {person: "%s", background: "%s"}}]'
            % (demo_data / "000_person.png", demo_data / "000_background.png"))
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", base + ["validation.num_samples=0", sets])
    samples = index_samples(cfg, verbose=False)
    train, held_out = split_held_out(samples, cfg)
    assert held_out == [] and train == samples

    validator = Validator(cfg, held_out, tiny_parts, tmp_path, rank=0, device="cpu", dtype=torch.float32)
    assert [s for s in range(5) if validator.due(s)] == [0, 3, 4]
    assert validator.maybe_run(tiny_parts.transformer, 3) == {}
    assert sorted(p.name for p in (tmp_path / "samples/step_000003").iterdir()) == ["00.mp4", "00.txt"]
    assert (tmp_path / "samples/step_000003/00.txt").read_text() == "a shape moves\n"
