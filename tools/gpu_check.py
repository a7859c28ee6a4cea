"""The checks a GPU user runs first (`make gpu-check`), written to bench/RESULTS_GPU.md and
bench/results/gpu.json with the GPU's name:

  1 tiny_bf16        the quick demo config (configs/e2v_tiny_lora.yaml) in bf16 on CUDA, a few steps through the launcher
  2 e2v_1.3b_ckpt    the real-shape Wan2.1-T2V-1.3B E2V run (configs/e2v_t2v_1.3b.yaml on the random-weight
    e2v_1.3b_nockpt  folder tools/smoke_real.py builds) at 480 x 832 x 81 under ds_configs/zero2.json, with
                     and without gradient checkpointing: step time and torch.cuda.max_memory_allocated
                     against tools/estimate_memory.py's GPU figure for the same config
  3 overhead         the train_e2v.py step against a bare PyTorch loop on that model (tools/bench.py --model)
  4 attention        which scaled-dot-product-attention kernel the Wan attention actually runs (the
                     torch.backends.cuda.*_sdp_enabled flags, and a profiler probe of one bf16 forward)

    python tools/gpu_check.py [--steps 3] [--skip overhead]

Without CUDA it exits at once (status 2) with one line saying why; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS_MD = ROOT / "bench" / "RESULTS_GPU.md"
RESULTS_JSON = ROOT / "bench" / "results" / "gpu.json"
WORK = ROOT / "smoke_real" / "gpu"
CHECKS = ("tiny_bf16", "e2v_1.3b", "overhead", "attention")
GIB = 2**30

# train_e2v.py through a wrapper that records the rank's peak CUDA allocation at the end of training.
PEAK_WRAPPER = r"""
import json, runpy, sys, torch
sys.path.insert(0, {root!r})
from e2v.train import export

real_export = export.export_lora

def export_after_peak(transformer, out_dir, full_names, rank=0, **options):
    if rank == 0:
        open({out!r}, "w").write(json.dumps({{"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                              "max_memory_reserved": torch.cuda.max_memory_reserved()}}))
    return real_export(transformer, out_dir, full_names, rank=rank, **options)

export.export_lora = export_after_peak
runpy.run_path({train!r}, run_name="__main__")
"""


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU checks, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
                "the GPU checks need one; tools/smoke_real.py is the CPU counterpart")
    return None


def launch(name: str, config: str, sets: list[str], wrapper: Path | None = None) -> dict:
    from tools.smokelib.measure import read_scalars, run_measured, train_command

    r = run_measured(name, train_command(config, *sets, script=wrapper), WORK / "logs", timeout=3600)
    scalars = read_scalars(WORK / "runs" / name)
    r["losses"] = {s: v["train/loss"] for s, v in scalars.items() if "train/loss" in v}
    times = [v["perf/step_time_s"] for s, v in sorted(scalars.items()) if "perf/step_time_s" in v]
    r["step_time_s"] = times
    r["step_time_after_first_s"] = (sum(times[1:]) / len(times[1:])) if len(times) > 1 else None
    r["passed"] = r["rc"] == 0 and bool(r["losses"])
    return r


def check_tiny(steps: int) -> dict:
    data = WORK / "demo_data"
    subprocess.run([sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(data), "--num-samples", "8"],
                   check=True, capture_output=True)
    return launch("tiny_bf16", "configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={data}", f"output_dir={WORK / 'runs'}", "run_id=tiny_bf16",
        "train.mixed_precision=bf16", f"train.max_steps={steps}", "validation.every_n_steps=0",
        "visualization.enabled=false", "train.log_every=1"])


def e2v_sets(folders: dict, data: Path, steps: int, ckpt: bool, run_id: str) -> list[str]:
    return [f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}",
            f"data.datasets.0.data_root={data}", f"output_dir={WORK / 'runs'}", f"run_id={run_id}",
            "deepspeed.config=ds_configs/zero2.json", f"train.gradient_checkpointing={str(ckpt).lower()}",
            f"train.max_steps={steps}", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
            f"train.checkpoint_every={steps}", "train.log_every=1", "validation.every_n_steps=0",
            "visualization.enabled=false"]


def estimate_gpu(sets: list[str], ckpt: bool) -> float:
    from e2v.config.load import load_config
    from tools.estimate_memory import estimate

    cfg = load_config(str(ROOT / "configs/e2v_t2v_1.3b.yaml"), sets, check_paths=False)
    row = next(r for r in estimate(cfg, 1, 80)["rows"] if r["ds_config"] == "zero2.json"
               and r["gradient_checkpointing"] == ckpt and not r["activation_offload"])
    return row["gpu_total_gb"]


def check_e2v(steps: int) -> dict:
    from tools.smokelib.build import build_folders

    folders = build_folders(ROOT / "smoke_real", "full")
    data = WORK / "data_81x832"
    subprocess.run([sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(data), "--num-samples", "2",
                    "--size", "832", "--frames", "81"], check=True, capture_output=True)
    out = {"folder": str(folders["t2v"])}
    for ckpt in (True, False):
        name = f"e2v_1.3b_{'ckpt' if ckpt else 'nockpt'}"
        peak_file = WORK / f"{name}_peak.json"
        peak_file.unlink(missing_ok=True)
        wrapper = WORK / f"{name}_wrapper.py"
        wrapper.write_text(PEAK_WRAPPER.format(root=str(ROOT), out=str(peak_file), train=str(ROOT / "train_e2v.py")))
        sets = e2v_sets(folders, data, steps, ckpt, name)
        r = launch(name, "configs/e2v_t2v_1.3b.yaml", sets, wrapper)
        peak = json.loads(peak_file.read_text()) if peak_file.exists() else {}
        r["max_memory_allocated_gib"] = peak.get("max_memory_allocated", 0) / GIB or None
        r["estimate_gib"] = estimate_gpu(sets, ckpt)  # estimate_memory's GB are 2**30 bytes
        out[name] = r
        print(f"[gpu-check] {name}: {'ok' if r['passed'] else 'FAILED'}, step {r['step_time_after_first_s']} s, "
              f"max allocated {r['max_memory_allocated_gib']} GiB (estimate {r['estimate_gib']:.1f})", flush=True)
    out["passed"] = out["e2v_1.3b_ckpt"]["passed"]  # without checkpointing it may not fit: reported, not required
    return out


def overhead_command(folder: Path, clip: Path, *extra: str) -> list[str]:
    """tools/bench.py's step-against-bare-loop section with --model on the T2V folder, expanded for
    elements with the CLIP folder beside it, as configs/e2v_t2v_1.3b.yaml trains it."""
    return [sys.executable, str(ROOT / "tools/bench.py"), "--model", str(folder), "--sections", "steps", "--quick",
            "--no-report", "--set", "model.base=t2v", "--set", f"model.image_encoder={clip}", *extra]


def read_overhead(path: Path) -> dict:
    """The train_e2v.py step over the bare loop (median, from the cached run) in what that command
    wrote (steps_model.json), and whether it is within the benchmark's goal."""
    overhead = json.loads(path.read_text())["presets"]["model"]["cached"]["overhead"]
    return {"ratio_over_bare": overhead["kinds"]["full"]["ratio_over_bare"]["median"],
            "within_goal": overhead["within_goal"]}


def check_overhead() -> dict:
    cmd = overhead_command(ROOT / "smoke_real" / "Wan2.1-T2V-1.3B-full", ROOT / "smoke_real" / "Wan2.1-CLIP-ViT-H14-full")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = {"command": " ".join(cmd), "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        out.update(read_overhead(ROOT / "bench/results/steps_model.json"))
    except (OSError, KeyError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}; {p.stderr[-1500:]}"
    out["passed"] = p.returncode == 0 and "ratio_over_bare" in out
    return out


def check_attention() -> dict:
    """The SDPA flags, and the kernels one bf16 forward of a Wan transformer with the real head size
    (128) launches, found by name in a profiler trace."""
    import torch
    from diffusers import WanTransformer3DModel
    from torch.profiler import ProfilerActivity, profile

    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "math", "cudnn") if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")}
    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=64, freq_dim=32, ffn_dim=64, num_layers=1, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", eps=1e-6).to("cuda", torch.bfloat16)
    x = torch.randn(1, 16, 5, 32, 32, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 64, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x, timestep=torch.tensor([500.0], device="cuda"), encoder_hidden_states=text)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x, timestep=torch.tensor([500.0], device="cuda"), encoder_hidden_states=text)
            torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()})
    attention = [n for n in names if re.search(r"flash|fmha|efficient_attention|cudnn.*(attn|sdpa)|sdpa", n, re.I)]
    kind = ("flash" if any(re.search("flash", n, re.I) for n in attention) else
            "mem_efficient" if any(re.search("efficient|fmha|cutlass", n, re.I) for n in attention) else
            "cudnn" if any(re.search("cudnn", n, re.I) for n in attention) else "math (no fused attention kernel seen)")
    return {"sdp_flags": flags, "backend": kind, "attention_kernels": attention[:8], "passed": True}


def render(result: dict) -> str:
    """bench/RESULTS_GPU.md from a result dict (the one gpu.json holds)."""
    lines = [f"# GPU check: {result['gpu']}", "",
             f"`python tools/gpu_check.py` on {result['gpu']} ({result.get('gpu_memory_gib', '?')} GiB), torch "
             f"{result.get('torch')}, CUDA {result.get('cuda')}, {result.get('date_utc', '')}. "
             f"Overall: {'PASSED' if result.get('passed') else 'FAILED'}.", ""]
    c = result["checks"]
    if "tiny_bf16" in c:
        t = c["tiny_bf16"]
        lines += ["## 1. Tiny demo config, bf16 on CUDA", "",
                  f"{'ok' if t['passed'] else 'FAILED'} (rc {t['rc']}, {t['wall_s']} s); losses {t['losses']}", ""]
    if "e2v_1.3b" in c:
        lines += ["## 2. Wan2.1-T2V-1.3B expanded for elements, 480 x 832 x 81, ds_configs/zero2.json", "",
                  "Random weights of the released shapes (tools/smoke_real.py's folder; UMT5 with one layer).", "",
                  "| gradient checkpointing | result | step time s (after the first) | max allocated GiB | estimate GiB |",
                  "|---|---|---|---|---|"]
        for name, label in (("e2v_1.3b_ckpt", "on"), ("e2v_1.3b_nockpt", "off")):
            r = c["e2v_1.3b"].get(name)
            if r:
                step = f"{r['step_time_after_first_s']:.2f}" if r.get("step_time_after_first_s") else "-"
                alloc = f"{r['max_memory_allocated_gib']:.1f}" if r.get("max_memory_allocated_gib") else "-"
                lines.append(f"| {label} | {'ok' if r['passed'] else 'FAILED'} | {step} | {alloc} | "
                             f"{r['estimate_gib']:.1f} |")
        lines.append("")
    if "overhead" in c:
        o = c["overhead"]
        lines += ["## 3. Step against a bare PyTorch loop (tools/bench.py --model)", "",
                  (f"engine / bare: {o['ratio_over_bare']:.3f} (goal 1.10: {'met' if o.get('within_goal') else 'missed'})"
                   if "ratio_over_bare" in o else f"FAILED: {o.get('error', 'rc ' + str(o['rc']))}"), ""]
    if "attention" in c:
        a = c["attention"]
        lines += ["## 4. Attention backend", "", f"Kernel used: **{a['backend']}**; SDPA flags: "
                  + ", ".join(f"{k} {v}" for k, v in a["sdp_flags"].items()),
                  "", "Kernels seen: " + (", ".join(f"`{k}`" for k in a["attention_kernels"]) or "none"), ""]
    return "\n".join(lines)


def write_report(result: dict, md: Path = RESULTS_MD, js: Path = RESULTS_JSON) -> tuple[Path, Path]:
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(render(result) + "\n")
    return md, js


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", default="", help=f"comma list of checks to leave out: {', '.join(CHECKS)}")
    args = p.parse_args(argv)
    problem = cuda_problem()
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    import datetime

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    skip = set(filter(None, args.skip.split(",")))
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(props.total_memory / GIB, 1),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "checks": {}}
    steps = {"tiny_bf16": lambda: check_tiny(args.steps), "e2v_1.3b": lambda: check_e2v(args.steps),
             "overhead": check_overhead, "attention": check_attention}
    for name in CHECKS:
        if name in skip:
            continue
        try:
            result["checks"][name] = steps[name]()
        except Exception as e:  # one failed check must not hide the others' figures
            result["checks"][name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        print(f"[gpu-check] {name}: {'ok' if result['checks'][name]['passed'] else 'FAILED'}", flush=True)
        write_report({**result, "passed": all(c["passed"] for c in result["checks"].values())})
    result["passed"] = all(c["passed"] for c in result["checks"].values())
    md, js = write_report(result)
    print(f"[gpu-check] {'PASSED' if result['passed'] else 'FAILED'}: {md}, {js}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
