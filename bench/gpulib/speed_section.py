"""The GPU check's speed section: Wan2.1-T2V-1.3B expanded for elements, its cached training step at
81 x 480 x 832 (the cache the step_1.3b section filled, else filled here), once per attention
backend that trains on this machine (e2v/models/speed.py's BACKENDS: a backward, and nothing
missing) and per mode, eager and compiled (speed.attention_backend, speed.compile), each in a fresh
bench/bench.py step process (the step is train_e2v.py's). Per run: the median step, video tokens
per second, TFLOPS per GPU and MFU / HFU by e2v/train/flops.py's count (the figures training logs);
the fastest run's keys, as YAML lines to paste into a config.

Runs in order of value (eager native, compiled native, then the other backends eager, then
compiled) while its time lasts: its budget in a default call, all the time left with
`--only speed`; what did not fit is a skipped check (INCOMPLETE). Without CUDA (--allow-cpu) the
section is skipped: a CPU's MFU means nothing.

Registered in bench/gpulib/sections.py's SECTIONS as
    Section("speed", SPEED_BUDGET_S, section_speed, ...)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench.gpulib.common import ROOT, Ctx, dataset, model_folders

SPEED_BUDGET_S = 150  # eager native and compiled native at least, on an H100 / H200
# Guesses for one run's process on an H100 / H200 (model load from the folder, the warm-up steps,
# the compile of the block, 2 timed steps); the report records each run's real wall time.
RUN_S = {False: 40.0, True: 90.0}
TIMED_STEPS = 2
WARMUP = {False: 1, True: 2}  # compiled: the first step compiles the block, the second checks no recompile


def training_backends(cuda: bool) -> list[str]:
    """The attention backends a training step can use here: a backward, their package importable,
    this GPU's compute capability and the 1.3B head size (128) allowed; native first."""
    import torch

    from e2v.models.speed import BACKENDS, backend_problem

    capability = torch.cuda.get_device_capability() if cuda else None
    cudnn = torch.backends.cudnn.version() if cuda else None
    return [name for name, b in BACKENDS.items()
            if b.backward and backend_problem(name, cuda, capability, head_dim=128, cudnn_version=cudnn) is None]


def order(backends: list[str]) -> list[tuple[str, bool]]:
    """(backend, compiled) in order of value: eager native, compiled native, the others eager, then compiled."""
    first = [("native", False), ("native", True)] if "native" in backends else []
    others = [b for b in backends if b != "native"]
    return first + [(b, False) for b in others] + [(b, True) for b in others]


def step_sets(folders: dict, ctx: Ctx) -> list[str]:
    """The step section's --set list (bench_command's), so the cached entries it wrote match."""
    from bench.gpulib.sections import bench_command

    cmd = bench_command(folders, dataset(ctx, "data_e2v"), ctx)
    return [s for i, s in enumerate(cmd) if i and cmd[i - 1] == "--set"]


def ensure_cache(folders: dict, data: Path, sets: list[str]) -> float | None:
    """tools/precompute.py into bench/'s model cache unless it holds entries (the step section's
    run leaves them); its wall time, None when there was nothing to do."""
    from bench.benchlib.common import cache_dir

    if list(cache_dir("model").rglob("*.safetensors")):
        return None
    from bench.bench import precompute

    return precompute(SimpleNamespace(model=str(folders["t2v"]), set=sets), "model", data)["wall_s"]


def run_step(folders: dict, data: Path, sets: list[str], backend: str, compiled: bool, timeout: float) -> dict:
    """One cached-step process of bench/bench.py with this backend and mode: its figures or its error."""
    cmd = [sys.executable, str(ROOT / "bench/bench.py"), "--child", "steps", "--preset", "model", "--mode", "cached",
           "--data-root", str(data), "--model", str(folders["t2v"]), "--steps", str(TIMED_STEPS),
           "--warmup", str(WARMUP[compiled]), "--overhead-rounds", "0", "--cache-batches", "1"]
    for s in [*sets, f"speed.attention_backend={backend}", f"speed.compile={str(compiled).lower()}"]:
        cmd += ["--set", s]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "compiled": compiled, "passed": False, "error": f"timed out after {timeout:.0f} s"}
    out = {"backend": backend, "compiled": compiled, "process_s": round(time.monotonic() - t0, 1)}
    lines = [x for x in p.stdout.splitlines() if x.startswith("BENCH_JSON ")]
    if p.returncode != 0 or not lines:
        return {**out, "passed": False, "error": (p.stdout[-800:] + p.stderr[-2500:])}
    r = json.loads(lines[-1][len("BENCH_JSON "):])
    s = r["speed"]
    return {**out, "passed": True, "step_s": round(r["step_ms"]["median"] / 1e3, 3), "step_tflop": s["step_tflop"],
            "tokens_per_s": s["tokens_per_s"], "tflops_per_gpu": s["tflops_per_gpu"], "mfu": s.get("mfu"),
            "hfu": s.get("hfu"), "peak_tflops": s["peak_tflops"], "peak_source": s["peak_source"],
            "losses": r.get("losses")}


def paste_lines(run: dict) -> list[str]:
    """The config lines that select a run's backend and mode."""
    return ["speed:", f"  attention_backend: {run['backend']}", f"  compile: {str(run['compiled']).lower()}"]


def section_speed(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return {"skipped": "a GPU's speed: not measured with --allow-cpu"}
    t0 = time.monotonic()
    cap = ctx.left() if ctx.only == ["speed"] else SPEED_BUDGET_S
    folders = model_folders(ctx, "1.3b")
    data = dataset(ctx, "data_e2v")
    sets = step_sets(folders, ctx)
    out = {"precompute_s": ensure_cache(folders, data, sets), "frames": ctx.sizes.frames,
           "resolution": list(ctx.sizes.resolution), "backends": training_backends(ctx.cuda), "runs": []}
    skipped = []
    for backend, compiled in order(out["backends"]):
        left = min(ctx.left(), cap - (time.monotonic() - t0))
        if RUN_S[compiled] > left:
            skipped.append(f"{backend} {'compiled' if compiled else 'eager'} (needs ~{RUN_S[compiled]:.0f} s, "
                           f"{max(left, 0):.0f} s left; --only speed gives it the whole budget)")
            continue
        out["runs"].append(run_step(folders, data, sets, backend, compiled, timeout=max(left, 30)))
    ok = [r for r in out["runs"] if r["passed"]]
    if ok:
        best = min(ok, key=lambda r: r["step_s"])
        out["fastest"] = {"backend": best["backend"], "compiled": best["compiled"], "paste": paste_lines(best)}
    if skipped:
        out["skipped_checks"] = skipped
    # a backend e2v says trains here and that fails is a finding: the section fails with it
    out["passed"] = bool(ok) and len(ok) == len(out["runs"])
    return out


def render_speed(r: dict) -> list[str]:
    """The speed section's table and the lines to paste (bench/RESULTS_GPU.md)."""
    if "runs" not in r:
        return []
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    out = ["| attention backend | mode | step s | video tokens/s | TFLOPS per GPU | MFU | HFU | process s |",
           "|---|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        mode = "compiled" if x["compiled"] else "eager"
        if not x["passed"]:
            last = (str(x.get("error", "")).strip().splitlines() or [""])[-1].replace("|", "/")[:160]
            out.append(f"| {x['backend']} | {mode} | FAILED: {last} | | | | | {x.get('process_s', '-')} |")
            continue
        out.append(f"| {x['backend']} | {mode} | {x['step_s']:.2f} | {x['tokens_per_s']:.0f} | "
                   f"{x['tflops_per_gpu']:.1f} | {pct(x['mfu'])} | {pct(x['hfu'])} | {x['process_s']} |")
    ran = [x for x in r["runs"] if x["passed"]]
    peak = (f"{ran[0]['peak_tflops']:g} TFLOPS dense bf16, {ran[0]['peak_source']}" if ran and ran[0]["peak_tflops"]
            else (ran[0]["peak_source"] if ran else "-"))
    out += ["", f"Wan2.1-T2V-1.3B expanded for elements, cached step at {r['frames']} x "
                f"{' x '.join(map(str, r['resolution']))}, ZeRO-2, gradient checkpointing; "
                f"{ran[0]['step_tflop']:.1f} TFLOP per step (forward + backward, e2v/train/flops.py)" if ran else "",
            f"Peak: {peak}. Backends that train here: {', '.join(r.get('backends', [])) or 'none'}."]
    if "fastest" in r:
        out += ["", "Fastest: paste into the config", "", "```yaml", *r["fastest"]["paste"], "```"]
    return out
