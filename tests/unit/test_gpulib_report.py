"""The GPU check's report for the sections that had none (bench/gpulib/report.py): validation_24gb
and fp8_14b, from a hand-written result dict; and the fp8 section's estimate, assembled from
e2v.train.memory's parts, against the row tools/estimate_memory.py prints for the same counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import gpu_report

VALIDATION = {"passed": True, "wall_s": 80, "limit_gib": 24.0, "precompute": {"rc": 0},
              "estimate": {"gpu_total_gib": 15.81, "validation_gib": 17.2, "fits": True},
              "run": {"passed": True, "rc": 0, "losses": {"1": 0.51, "2": 0.49}, "val_loss": {"0": 0.6, "2": 0.55},
                      "step_time_after_first_s": 3.25, "max_memory_allocated_gib": 16.02, "max_memory_reserved_gib": 17.5},
              "exceeds_by_gib": None, "validated_steps": [0, 2], "video_written": True, "frames": 81,
              "resolution": [480, 832], "real_size": True}
FP8 = {"passed": False, "wall_s": 60, "layers": 4, "fp8_on_host_gib": 1.25, "build_s": 12.3,
       "estimate_train_gib": 10.0, "estimate_validation_gib": 8.0, "loss": 0.12345, "peak_train_gib": 10.5,
       "peak_validation_gib": 9.6, "measured_to_estimate": {"train": 1.05, "validation": 1.2}}


def test_validation_24gb_has_its_run_its_validations_and_its_estimate():
    text = gpu_report({"validation_24gb": VALIDATION})
    assert "## validation_24gb: Validation of a 24 GB config under a 24 GiB cap" in text
    assert "| validation_24gb | ok | 0 | {'1': 0.51, '2': 0.49} | 3.25 | 16.02 |" in text
    assert ("Validated at steps [0, 2] (losses {'0': 0.6, '2': 0.55}); video written: yes; 81 frames at 480 x 832. "
            "Estimate 15.8 GiB training, 17.2 GiB the validation phase; max reserved 17.50 GiB; exceeds by - GiB; "
            "under torch.cuda.set_per_process_memory_fraction = 24.0 GiB.") in text
    failed = gpu_report({"validation_24gb": {**VALIDATION, "passed": False, "video_written": False, "real_size": False,
                                          "frames": 9, "resolution": [64, 64], "exceeds_by_gib": 1.5, "oom": True,
                                          "refused_gib": 2.0}})
    assert "| validation_24gb | FAILED |" in failed
    assert "video written: NO; 9 frames at 64 x 64 (tiny sizes, not the training shape)" in failed
    assert "exceeds by 1.50 (refused 2.00) GiB" in failed
    no_precompute = gpu_report({"validation_24gb": {"passed": False, "limit_gib": 24.0, "precompute": {"rc": 1},
                                                 "estimate": VALIDATION["estimate"]}})
    assert "The precompute failed (rc 1): nothing was trained." in no_precompute


def test_fp8_14b_has_peaks_against_estimates():
    text = gpu_report({"fp8_14b": FP8})
    assert "## fp8_14b: fp8 base at the I2V-14B widths under a 24 GiB cap" in text
    assert "| train | 10.50 | 10.00 | 1.050 |" in text and "| validation | 9.60 | 8.00 | 1.200 |" in text
    assert ("4 blocks at the I2V-14B widths, their fp8 weights on the host (1.25 GiB), built in 12.3 s; loss 0.1235. "
            "Passed when each peak is within 15% of e2v.train.memory's estimate.") in text
    assert "| fp8_14b | FAILED | 60 |" in text
    cpu = gpu_report({"fp8_14b": {**{k: v for k, v in FP8.items() if not k.startswith("peak")},
                               "measured_to_estimate": {}, "peaks": "not measured without CUDA", "passed": True}},
                  cuda=False)
    assert "| train | - | 10.00 | - |" in cpu and "Peaks: not measured without CUDA." in cpu
    oom = gpu_report({"fp8_14b": {**FP8, "oom": "CUDA out of memory. Tried to allocate 2.00 GiB"}})
    assert "Out of memory under the cap: CUDA out of memory. Tried to allocate 2.00 GiB" in oom


def test_fp8_estimate_is_the_memory_models_row_for_the_same_counts():
    """The section's train estimate (model states with every block on the host, the dequantised
    layer, checkpointed and offloaded activations) equals tools/estimate_memory.py's zero2.json row
    (checkpointing, offload) for the same counts, less what an in-process run has not: the buckets,
    the context exchange and the CUDA-context allowance."""
    import dataclasses

    from bench.gpulib.fp8_section import CONFIG, _estimate, _model
    from e2v.config.load import load_config
    from e2v.models.plan import tokens
    from e2v.train.memory import GB, OVERHEAD_GB, counts_of, dequant_bytes, estimate

    root = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
    cfg = load_config(root / CONFIG, check_paths=False)
    model, _ = _model(cfg, real=False)  # the tiny widths --allow-cpu runs
    c = counts_of(model)
    assert c.fp8 > 0 and c.fp8_largest > 0 and c.trainable > 0
    s, ctx = tokens(cfg)
    every_block = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_blocks_on_host=c.layers))
    rows = estimate(every_block, 1, 24, counts=c)["rows"]
    row = next(r for r in rows if r["ds_config"] == "zero2.json" and r["gradient_checkpointing"] and r["activation_offload"])
    ours = _estimate(model, cfg, s, ctx)
    buffers_not_in_process = row["buffers_gb"] * GB - dequant_bytes(c, 2)
    resident_and_activations = (row["gpu_total_gb"] - row["encoders_gb"] - OVERHEAD_GB) * GB - buffers_not_in_process
    assert ours["train"] == pytest.approx(resident_and_activations, rel=1e-9)
