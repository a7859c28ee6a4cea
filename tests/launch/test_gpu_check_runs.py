"""bench/gpu_check.py without a GPU: the immediate exit without CUDA (one line, nothing written), the
report written from a result dict, the budget that skips what the remaining time cannot finish (and
the report rewritten after every section), the data at the real size (a dry build at 81 x 832 x 832:
480 x 832 after the trainer's crop), and every section's logic at tiny sizes on the CPU (--allow-cpu):
the environment, VAE and attention sections in this process; the step section's bench processes;
the main path, the 24 GB configs, activation offload and Wan2.2 through the (warm) launcher.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_gpu_check.py."""

import json
import time

import pytest
from helpers_launch import launch_train


@pytest.mark.slow
def test_step_section_on_tiny_folders(tmp_path):
    """bench/bench.py --model on the tiny T2V + CLIP folders (the 1.3B layout): online, precompute,
    cached; the phases the section reports are where the encoders run (online only)."""
    import bench.gpu_check as gc

    assert gc.main(["--allow-cpu", "--only", "step_1.3b", "--out", str(tmp_path / "out"),
                    "--work", str(tmp_path / "work")]) == 0
    r = json.loads((tmp_path / "out/results/gpu.json").read_text())["sections"]["step_1.3b"]
    on, cached = r["online"], r["cached"]
    assert on["phases_s"]["vae_encode"] > 0 and on["phases_s"]["text_encode"] > 0
    assert "vae_encode" not in cached["phases_s"] and "cache_assembly" in cached["phases_s"]
    assert on["latent_shape"] == cached["latent_shape"] == [1, 16, 5, 8, 8]
    assert 0 < cached["estimate_gib"] <= on["estimate_gib"]  # no encoders resident (bytes, for the tiny ones)
    assert sum(on["phases_s"].values()) <= on["step_s"] * 1.05  # medians of parts within the step
    assert r["precompute_s"] > 0 and "--set deepspeed.optimizer=torch_adamw" in r["command"]
    for mode in (on, cached):  # warmed-up lr, one timestep: the loss falls over the steps
        losses = mode["loss_falls"]["losses"]
        assert mode["loss_falls"]["passed"] and len(losses) == 3 and losses[-1] < losses[0], losses


def warm_start_training(name, config, sets, script, extra, log_dir, timeout):
    """bench/gpulib/common.start_training through the suite's warm launcher (same command, same wrapper)."""
    t0 = time.perf_counter()
    done = launch_train(config, *sets, script=script, extra=tuple(extra)).wait(int(timeout), check=False)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    log.write_text(done.stdout + done.stderr)
    return {"name": name, "rc": done.returncode, "wall_s": round(time.perf_counter() - t0, 1), "log": str(log)}


@pytest.mark.slow
def test_launching_sections_on_cpu(tmp_path, monkeypatch):
    """main_path, gpu_24gb, activation_offload and wan22 at tiny sizes, each launch through the
    launcher with gpu_check's peak/cap wrapper: what each section claims, read from its result."""
    import bench.gpu_check as gc
    from bench.gpulib import common

    monkeypatch.setattr(common, "start_training", warm_start_training)  # train() looks it up there
    gc.main(["--allow-cpu", "--budget", "3000", "--only", "main_path,gpu_24gb,activation_offload,wan22,offload_adam",
             "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    s = json.loads((tmp_path / "out/results/gpu.json").read_text())["sections"]
    failed = {k: v for k, v in s.items() if not v.get("passed")}
    assert not failed, json.dumps(failed, indent=1, default=str)[-6000:]

    m = s["main_path"]
    assert m["partitioned_load"] and m["resumed"]["from_step"] == 2 and list(m["resumed"]["losses"]) == ["3"]
    assert "pytorch_lora_weights.safetensors" in m["export_files"]
    assert m["sample"]["shape"] == [9, 64, 64, 3] and m["sample"]["pixel_std"] > 1
    assert m["sample"]["psnr_db_vs_fp32"] >= 25  # bf16 against the fp32 reference

    g = s["gpu_24gb"]
    for name in gc.CONFIGS_24GB:
        assert g[name]["run"]["rc"] == 0 and g[name]["exceeds_by_gib"] is None and g[name]["precompute"]["rc"] == 0
    assert g["e2v_24gb"]["estimate_40_layers"]["fits"] and g["e2v_24gb"]["estimate_40_layers"]["gpu_total_gib"] < 24

    a = s["activation_offload"]
    assert a["losses"]["passed"] and len(a["losses"]["steps"]) == 3
    assert all(x["rel_diff"] == 0 for x in a["losses"]["steps"].values())  # a no-op without CUDA: identical
    assert a["skipped_checks"] and "peak_saved_gib" not in a  # no peak to compare on a CPU: said, not passed over
    final = json.loads((tmp_path / "out/results/gpu.json").read_text())
    assert final["verdict"] == "INCOMPLETE"  # every section ran and passed, but a check inside one could not

    for name in gc.WAN22_RUNS:
        assert s["wan22"][name]["val_loss"] and len(s["wan22"][name]["losses"]) == 2

    o = s["offload_adam"]  # training's optimizer on the offloaded partition, against torch's reference AdamW
    assert o["optimizer"] == "torch.optim.adamw.AdamW" and o["partition_device"] == "cpu" and o["matches_reference"]
    assert len(o["max_abs_diff"]) == 3 and o["losses"][-1] < o["losses"][0]
    assert o["skipped_checks"]  # not fused without CUDA: said
