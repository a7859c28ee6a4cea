"""tools/gpu_check.py's logic that runs without a GPU: the immediate exit without CUDA (one line,
nothing written), the report written from a result dict, and the overhead check's command and
reader on tiny folders."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, save_t2v_and_clip_folders


def test_without_cuda_it_exits_at_once_with_one_line(tmp_path):
    before = {p: p.stat().st_mtime for p in (ROOT / "bench").rglob("*gpu*")}
    proc = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert {p: p.stat().st_mtime for p in (ROOT / "bench").rglob("*gpu*")} == before, "nothing written"


FAKE = {
    "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1, "torch": "2.13.0", "cuda": "12.8",
    "date_utc": "2026-01-01 00:00 UTC", "passed": False,
    "checks": {
        "tiny_bf16": {"passed": True, "rc": 0, "wall_s": 20.0, "losses": {1: 1.1, 2: 1.0}},
        "e2v_1.3b": {"passed": True,
                     "e2v_1.3b_ckpt": {"passed": True, "step_time_after_first_s": 4.25,
                                       "max_memory_allocated_gib": 21.5, "estimate_gib": 24.0},
                     "e2v_1.3b_nockpt": {"passed": False, "step_time_after_first_s": None,
                                         "max_memory_allocated_gib": None, "estimate_gib": 95.0}},
        "overhead": {"passed": False, "rc": 1, "error": "KeyError: 'overhead'"},
        "attention": {"passed": True, "backend": "flash", "sdp_flags": {"flash": True, "math": True},
                      "attention_kernels": ["pytorch_flash::flash_fwd_kernel"]},
    },
}


def test_report_from_a_result_dict(tmp_path):
    from tools.gpu_check import write_report

    md, js = write_report(FAKE, tmp_path / "RESULTS_GPU.md", tmp_path / "results" / "gpu.json")
    text = md.read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "Overall: FAILED" in text
    assert "| on | ok | 4.25 | 21.5 | 24.0 |" in text
    assert "| off | FAILED | - | - | 95.0 |" in text
    assert "FAILED: KeyError: 'overhead'" in text
    assert "Kernel used: **flash**" in text and "`pytorch_flash::flash_fwd_kernel`" in text
    assert json.loads(js.read_text())["gpu"] == FAKE["gpu"]


@pytest.mark.train  # the benchmark's step processes run DeepSpeed steps
def test_overhead_check_reads_what_bench_model_writes(tmp_path, demo_data):
    """The overhead check is `tools/bench.py --model` on the T2V folder with a CLIP folder beside it.
    The same command on tiny folders of that layout runs on CPU (--allow-cpu, which writes under
    bench/tmp/), and the check's reader finds the ratio in what it wrote."""
    from tools.gpu_check import overhead_command, read_overhead

    t2v, clip, _ = save_t2v_and_clip_folders(tmp_path)
    written = ROOT / "bench/tmp/results/steps_model.json"
    written.unlink(missing_ok=True)
    cmd = overhead_command(t2v, clip, "--allow-cpu", "--data-root", str(demo_data),
                           "--set", "data.num_frames=17", "--set", "data.resolution=[64,64]")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = json.loads(written.read_text())["presets"]["model"]
    assert (runs["online"]["mode"], runs["cached"]["mode"]) == ("online", "cached")
    result = runs["cached"]
    overhead = read_overhead(written)
    assert overhead["ratio_over_bare"] > 0
    assert overhead["within_goal"] == (overhead["ratio_over_bare"] <= result["overhead"]["goal"])


def test_the_real_shape_runs_settings_load_and_have_a_gpu_estimate(tmp_path):
    """The 1.3B runs' --set list is a valid config of configs/e2v_t2v_1.3b.yaml, and estimate_memory
    gives each a GPU figure (checkpointing the smaller): a typo here would only show on a GPU."""
    from e2v.config.load import load_config
    from tools.gpu_check import e2v_sets, estimate_gpu
    from tools.smokelib.build import transformer_config

    folders = {"t2v": tmp_path / "t2v", "clip": tmp_path / "clip"}  # the 1.3B transformer's config, as built
    (folders["t2v"] / "transformer").mkdir(parents=True)
    (folders["t2v"] / "transformer/config.json").write_text(json.dumps(transformer_config("full")))
    with_ckpt, without = (e2v_sets(folders, tmp_path / "data", 3, ckpt, "x") for ckpt in (True, False))
    cfg = load_config(str(ROOT / "configs/e2v_t2v_1.3b.yaml"), with_ckpt, check_paths=False)
    assert cfg.train.gradient_checkpointing and cfg.train.max_steps == 3
    assert cfg.deepspeed.config.endswith("zero2.json") and (cfg.data.num_frames, cfg.data.resolution) == (81, [480, 832])
    assert 0 < estimate_gpu(with_ckpt, True) < estimate_gpu(without, False)
