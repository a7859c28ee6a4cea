"""bench/gpu_check.py without a GPU: the immediate exit without CUDA (one line, nothing written), the
report written from a result dict, the budget that skips what the remaining time cannot finish (and
the report rewritten after every section), the data at the real size (a dry build at 81 x 832 x 832:
480 x 832 after the trainer's crop), and every section's logic at tiny sizes on the CPU (--allow-cpu):
the environment, VAE and attention sections in this process; the step section's bench processes;
the main path, the 24 GB configs, activation offload and Wan2.2 through the (warm) launcher.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_gpu_check_runs.py."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT


def test_without_cuda_it_exits_at_once_with_one_line(tmp_path):
    before = {p: p.stat().st_mtime for p in (ROOT / "bench").rglob("*gpu*")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--allow-cpu" in lines[0], lines
    assert {p: p.stat().st_mtime for p in (ROOT / "bench").rglob("*gpu*")} == before, "nothing written"


def test_an_unknown_section_is_named_with_the_choices(capsys):
    from bench.gpu_check import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--only", "step_13b"])
    err = capsys.readouterr().err
    assert "step_13b" in err and "step_1.3b" in err and "activation_offload" in err


FAKE = {
    "device": "NVIDIA H100 80GB HBM3", "cuda": True, "date_utc": "2026-01-01 00:00 UTC", "argv": "",
    "budget_s": 480, "elapsed_s": 301.0, "finished": False, "passed": False,
    "sections": {
        "environment": {"passed": True, "wall_s": 0.4, "device": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1,
                        "capability": "9.0", "driver": "570.1", "cuda": "12.8", "versions": {"torch": "2.13.0"},
                        "TORCH_CUDA_ARCH_LIST": "9.0a", "arch_list_problem": "letters ...",
                        "optimizer": {"default_gpu": "torch's AdamW fused on the GPU"}},
        "step_1.3b": {"passed": True, "wall_s": 150, "precompute_s": 20.5, "online_over_cached": 2.1,
                      "online": {"step_s": 5.68, "phases_s": {"vae_encode": 2.5, "forward_and_loss": 0.9,
                                                              "backward": 1.8, "optimizer": 0.05},
                                 "max_memory_allocated_gib": 40.2, "estimate_gib": 31.3, "latent_shape": [1, 16, 21, 60, 104]},
                      "cached": {"step_s": 2.7, "phases_s": {"forward_and_loss": 0.9, "backward": 1.8},
                                 "max_memory_allocated_gib": 21.0, "estimate_gib": 17.3, "latent_shape": [1, 16, 21, 60, 104]}},
        "vae_dtype": {"passed": False, "wall_s": 3, "error": "RuntimeError: boom"},
        "main_path": {"skipped": "needs ~110 s, 29 s left"},
    },
}


def test_report_from_a_result_dict(tmp_path):
    from bench.gpu_check import write_report

    md, js = write_report(FAKE, tmp_path)
    text = md.read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "Overall: FAILED (so far)" in text and "301 s of a 480 s budget" in text
    assert "| main_path | skipped: needs ~110 s, 29 s left |" in text
    assert "Not run, so not shown to work: main_path (needs ~110 s, 29 s left)." in text
    assert "| vae_dtype | FAILED | 3 |" in text and "RuntimeError: boom" in text
    assert "| online | 5.68 | 2.50 | - | - | 0.90 | 1.80 | 0.05 |" in text and "| 40.2 | 31.3 |" in text
    assert "9.0a (letters ...)" in text and "driver 570.1" in text
    assert "tiny sizes" not in text  # a GPU's figures are not labelled as the CPU's
    assert json.loads(js.read_text())["sections"]["step_1.3b"]["cached"]["step_s"] == 2.7
    cpu = write_report({**FAKE, "cuda": False}, tmp_path)[0].read_text()
    assert "no figure here is a GPU's" in cpu


def test_the_budget_skips_what_cannot_finish_and_the_report_follows_every_section(tmp_path, monkeypatch):
    import bench.gpu_check as gc

    writes = []
    real_write = gc.write_report
    monkeypatch.setattr(gc, "write_report", lambda r, d: writes.append(json.loads(json.dumps(r, default=str)))
                        or real_write(r, d))
    rc = gc.main(["--allow-cpu", "--budget", "20", "--only", "environment,step_1.3b,wan22",
                  "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert rc == 3, "skipped sections: INCOMPLETE, not PASSED"
    assert [list(w["sections"]) for w in writes[:3]] == [["environment"], ["environment", "step_1.3b"],
                                                          ["environment", "step_1.3b", "wan22"]]
    final = json.loads((tmp_path / "out/results/gpu.json").read_text())
    assert final["finished"] and not writes[0]["finished"]
    assert final["sections"]["environment"]["passed"]
    assert final["sections"]["step_1.3b"]["skipped"].startswith("needs ~170 s")
    assert final["sections"]["wan22"]["skipped"].startswith("needs ~40 s")
    assert final["verdict"] == "INCOMPLETE" and not final["passed"]
    assert "passed" not in final["sections"]["wan22"], "a skipped section is not a passed one"
    assert "Overall: INCOMPLETE." in (tmp_path / "out/RESULTS_GPU.md").read_text()
    assert not (tmp_path / "work" / "data_e2v").exists(), "a skipped section builds nothing"


def test_the_data_at_the_training_shape(tmp_path):
    """The real-size data: the command gpu_check runs asks for 81 x 832 x 832 npz with --real-size;
    its dry build renders frames of that size; without --real-size the tool refuses and names the flag;
    npz clips read back as the trainer reads them, cropped to the config's 480 x 832 ratio."""
    from bench.gpu_check import REAL, TINY, demo_data_command
    from e2v.data.media import load_video, probe_video

    cmd = demo_data_command(tmp_path / "real", REAL)
    assert cmd[cmd.index("--frames") + 1] == "81" and cmd[cmd.index("--size") + 1] == "832"
    assert "--real-size" in cmd and cmd[cmd.index("--video-format") + 1] == "npz"
    dry = subprocess.run(cmd + ["--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "81 x 832 x 832 .npz" in dry.stdout and "(2, 832, 832, 3)" in dry.stdout
    assert not (tmp_path / "real").exists(), "a dry run writes nothing"
    refused = subprocess.run([c for c in cmd if c != "--real-size"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--real-size" in refused.stderr

    small = demo_data_command(tmp_path / "tiny", TINY)
    assert "--real-size" not in small
    subprocess.run(small, cwd=ROOT, check=True, capture_output=True, timeout=120)
    clip = tmp_path / "tiny" / "000.npz"
    info = probe_video(clip)
    assert (info.frames, info.height, info.width) == (17, 64, 64)
    video = load_video(clip, 17, 32, 64)  # the trainer's center_crop to a 1:2 frame
    assert tuple(video.shape) == (3, 17, 32, 64) and str(video.dtype) == "torch.uint8"


def test_environment_vae_and_attention_sections_on_cpu(tmp_path):
    """In this process: versions and the optimizer line; the VAE loaded by model.vae_dtype in both
    dtypes (bf16 weights, a nonzero finite latent error against fp32); the attention probe."""
    import bench.gpu_check as gc

    assert gc.main(["--allow-cpu", "--only", "environment,vae_dtype,attention", "--out", str(tmp_path / "out"),
                    "--work", str(tmp_path / "work")]) == 0
    s = json.loads((tmp_path / "out/results/gpu.json").read_text())["sections"]
    assert s["environment"]["import_problems"] == {} and s["environment"]["installed_from"] is None
    assert s["environment"]["optimizer"]["default_gpu"].startswith("torch's AdamW")
    assert s["environment"]["optimizer"]["default_offload"].startswith("torch's AdamW")
    assert s["environment"]["versions"]["deepspeed"]
    v = s["vae_dtype"]
    assert (v["fp32"]["vae_param_dtype"], v["bf16"]["vae_param_dtype"]) == ("torch.float32", "torch.bfloat16")
    assert 0 < v["relative_latent_error"] < 1 and v["latent_shape"] == [1, 16, 5, 8, 8]
    # this CPU's bf16 SDPA: the flash kernel for CPU, by the op torch dispatched to
    assert s["attention"]["passed"] and s["attention"]["backends"] == ["flash (CPU)"], s["attention"]
    assert s["attention"]["sdpa_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]


def test_verdict_of_a_capped_run():
    """Pass, or by how much: what the allocator held at its peak plus the allocation the cap refused."""
    from bench.gpu_check import verdict_24gb

    assert verdict_24gb({"passed": True, "log_text_tail": ""}) == {"passed": True, "exceeds_by_gib": None}
    oom = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
           "50.2 GiB is free. Of the allocated memory 22.75 GiB is allocated by PyTorch")
    v = verdict_24gb({"passed": False, "oom": oom, "max_memory_allocated_gib": 22.75, "max_memory_reserved_gib": 23.5})
    assert v["oom"] and not v["passed"] and v["exceeds_by_gib"] == pytest.approx(23.5 + 2.5 - 24)
    v = verdict_24gb({"passed": False, "log_text_tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                      "allocate 512.00 MiB."})
    assert v["refused_gib"] == pytest.approx(0.5) and v["exceeds_by_gib"] is None  # no peak read: not a figure


def test_the_24gb_configs_fit_24gb():
    """The shipped 24 GB configs load, are the plans their comments describe, and
    tools/estimate_memory.py says each fits 24 GB (the figures docs/gpu.md quotes)."""
    from e2v.config.load import load_config
    from e2v.train.memory import estimate

    i2v = load_config(str(ROOT / "configs/e2v_24gb.yaml"), [], check_paths=False)
    t2v = load_config(str(ROOT / "configs/e2v_t2v_1.3b_24gb.yaml"), [], check_paths=False)
    for cfg in (i2v, t2v):
        assert cfg.cache.enabled and cfg.train.gradient_checkpointing
        assert (cfg.data.num_frames, cfg.data.resolution) == (81, [480, 832])
    assert i2v.deepspeed.config.endswith("zero3_offload.json") and i2v.train.activation_offload
    assert any(t.startswith("attn2.") for t in i2v.lora.target_modules) and not any("attn2" in t for t in i2v.train.trainable)
    assert t2v.deepspeed.config.endswith("zero2.json") and not t2v.train.activation_offload
    r_i2v, r_t2v = estimate(i2v, 1, 24), estimate(t2v, 1, 24)
    assert r_i2v["configured"]["fits"] and r_t2v["configured"]["fits"]
    assert r_i2v["configured"]["gpu_total_gb"] == pytest.approx(14.5, abs=0.1)
    assert r_t2v["configured"]["gpu_total_gb"] == pytest.approx(17.3, abs=0.1)
    # each is the estimator's first fitting plan (the least offloading): the best under 24 GB
    for r in (r_i2v, r_t2v):
        assert {k: r["best"][k] for k in ("ds_config", "gradient_checkpointing", "activation_offload")} == \
               {k: r["configured"][k] for k in ("ds_config", "gradient_checkpointing", "activation_offload")}
    # the LoRA on attn2 is what brings the CPU side down (full attn2: ~202 GB per node)
    full_attn2 = load_config(str(ROOT / "configs/e2v.yaml"), ["cache.enabled=true", "train.activation_offload=true"],
                             check_paths=False)
    assert r_i2v["configured"]["cpu_per_node_gb"] < estimate(full_attn2, 1, 24)["configured"]["cpu_per_node_gb"] / 2


def test_vae_dtype_is_a_config_key_the_loader_and_the_plan_follow():
    """model.vae_dtype: fp32 by default (A2 encodes in fp32); bf16 loads the VAE in bf16, and the
    plan counts its weights at 2 bytes; it shapes the cache (stale entries are named)."""
    from dataclasses import fields

    import torch

    from e2v.config.load import load_config
    from e2v.config.schema import Model
    from e2v.models.load import load_parts
    from e2v.models.plan import encoder_bytes

    tiny = ROOT / "configs/e2v_tiny_lora.yaml"
    fp32, bf16 = (load_config(str(tiny), [f"model.vae_dtype={d}"], check_paths=False) for d in ("fp32", "bf16"))
    assert load_config(str(tiny), [], check_paths=False).model.vae_dtype == "fp32"
    assert next(f for f in fields(Model) if f.name == "vae_dtype").metadata.get("shapes_cache")
    assert load_parts(bf16, with_transformer=False).vae.dtype == torch.bfloat16
    assert load_parts(fp32, with_transformer=False).vae.dtype == torch.float32
    assert encoder_bytes(bf16)["vae"] * 2 == encoder_bytes(fp32)["vae"]
    assert np.isclose(encoder_bytes(bf16)["text_encoder"], encoder_bytes(fp32)["text_encoder"])


def test_phases_on_cuda_are_read_from_cuda_events(monkeypatch):
    """The step section's phase split on a GPU is the time between two CUDA events recorded around
    each phase (after a synchronisation), not the host's clock: simulated with events whose
    elapsed_time is known."""
    import torch

    from bench.benchlib.common import Phases

    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(recorded)
            recorded.append(self)

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms, like torch.cuda.Event
            return 250.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ph = Phases(cuda=True)
    with ph("forward_and_loss"):
        time.sleep(0.01)
    with ph("forward_and_loss"):
        pass
    assert ph.t == {"forward_and_loss": 0.5}  # two phases of one event interval each: 2 x 250 ms
    cpu = Phases(cuda=False)
    with cpu("backward"):
        time.sleep(0.01)
    assert 0.005 < cpu.t["backward"] < 1 and len(recorded) == 4


# A speed section as an H100 would record it (bench/gpulib/speed_section.py): the figures are
# invented for the renderer, not measured.
SPEED = {
    "passed": False, "wall_s": 148.0, "precompute_s": None, "frames": 81, "resolution": [480, 832],
    "backends": ["native", "flex", "_native_cudnn"],
    "runs": [
        {"backend": "native", "compiled": False, "passed": True, "process_s": 38.2, "step_s": 3.912, "step_tflop": 1127.7,
         "tokens_per_s": 8374.2, "tflops_per_gpu": 288.3, "mfu": 0.2915, "hfu": 0.3887, "peak_tflops": 989.0,
         "peak_source": "H100 SXM (NVIDIA H100 data sheet: BF16 1,979 TFLOPS with sparsity)"},
        {"backend": "native", "compiled": True, "passed": True, "process_s": 84.0, "step_s": 3.5, "step_tflop": 1127.7,
         "tokens_per_s": 9360.0, "tflops_per_gpu": 322.2, "mfu": 0.3258, "hfu": 0.4344, "peak_tflops": 989.0,
         "peak_source": "H100 SXM (NVIDIA H100 data sheet: BF16 1,979 TFLOPS with sparsity)"},
        {"backend": "flex", "compiled": False, "passed": False, "process_s": 20.1,
         "error": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory | tried 30 GiB"},
    ],
    "fastest": {"backend": "native", "compiled": True, "paste": ["speed:", "  attention_backend: native", "  compile: true"]},
    "skipped_checks": ["_native_cudnn eager (needs ~40 s, 12 s left; --only speed gives it the whole budget)"],
}


def test_speed_report_from_a_recorded_result(tmp_path):
    """The speed section's table, its failed row, the peak it divided by, the lines to paste, and
    the combinations time left out, from a recorded result (a JSON file, as gpu.json keeps it)."""
    from bench.gpu_check import write_report

    recorded = tmp_path / "speed.json"
    recorded.write_text(json.dumps({**FAKE, "sections": {"speed": SPEED}}))
    text = write_report(json.loads(recorded.read_text()), tmp_path)[0].read_text()
    assert "## speed: 1.3B cached step per attention backend, eager and compiled" in text
    assert "| native | eager | 3.91 | 8374 | 288.3 | 29.1% | 38.9% | 38.2 |" in text
    assert "| native | compiled | 3.50 | 9360 | 322.2 | 32.6% | 43.4% | 84.0 |" in text
    assert "| flex | eager | FAILED: torch.OutOfMemoryError: CUDA out of memory / tried 30 GiB |" in text
    assert "1127.7 TFLOP per step" in text and "Peak: 989 TFLOPS dense bf16, H100 SXM" in text
    assert "```yaml\nspeed:\n  attention_backend: native\n  compile: true\n```" in text
    assert "- skipped check: _native_cudnn eager (needs ~40 s" in text
    assert "| speed | FAILED | 148 |" in text


def test_speed_section_is_skipped_on_a_cpu_and_orders_its_runs(tmp_path):
    """--allow-cpu: nothing measured, said as a skipped section (INCOMPLETE); on a GPU the runs go
    eager native, compiled native, the other backends eager, then compiled."""
    import bench.gpu_check as gc
    from bench.gpulib.speed_section import order

    assert gc.main(["--allow-cpu", "--only", "speed", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]) == 3
    final = json.loads((tmp_path / "out/results/gpu.json").read_text())
    assert final["verdict"] == "INCOMPLETE" and final["sections"]["speed"]["skipped"].startswith("a GPU's speed")
    assert not (tmp_path / "w" / "data_e2v").exists(), "nothing built for a skipped section"
    assert order(["native", "flex", "flash"]) == [("native", False), ("native", True), ("flex", False),
                                                 ("flash", False), ("flex", True), ("flash", True)]


def test_step_section_reports_the_transformer_mfu():
    """read_bench carries the bench's speed figures (bench/benchlib/steps.py) into the step table."""
    from bench.gpulib.report import _render_step

    speed = {"tokens_per_s": 5767.6, "tflops_per_gpu": 198.5, "mfu": 0.2007, "hfu": 0.27}
    r = json.loads(json.dumps(FAKE["sections"]["step_1.3b"]))
    r["online"]["speed"], r["cached"]["speed"] = {**speed, "mfu": None}, speed
    text = "\n".join(_render_step(r))
    assert ("Speed (transformer FLOPs over the whole step): online 5768 video tokens/s, 198.5 TFLOPS; "
            "cached 5768 video tokens/s, 198.5 TFLOPS, MFU 20.1%.") in text
