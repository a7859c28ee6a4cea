"""Benchmarks: where a training step's time and memory go, and how far our DeepSpeed step is from
a bare PyTorch loop. Results go to bench/results/<section>.json; bench/RESULTS.md is regenerated
from every JSON there (machine, versions, date, load, then one table per section).

    python bench/bench.py                        # the CPU part, all sections (`make bench`, < 10 min)
    python bench/bench.py --quick                # few repeats: checks the tool, numbers are noise
    python bench/bench.py --sections data        # one section; RESULTS.md keeps the other's JSON
    python bench/bench.py --model PATH           # real Wan2.1 diffusers folder on a GPU: tables 1, 2, 4
                                                 # for that model, gradient checkpointing on
                                                 # (--overhead-rounds 0 if it does not fit twice: the
                                                 # bare loop trains a copy)

What is measured (section numbers as in RESULTS.md)
  1 steps     one training step split into phases (data wait, VAE / text / CLIP encode, forward,
              backward, optimizer, logging) on the tiny preset and a "small" one, online (decode +
              encode every step) and cached (cache.enabled, entries written by tools/precompute.py);
              each with the transformer's FLOPs per step, video tokens/s, TFLOPS and (on a GPU the
              peak table knows) MFU, by e2v/train/flops.py's count (docs/speed.md).
  2 overhead  the train_e2v.py step (the DeepSpeed engine from ds_configs/zero2.json as
              resolve_deepspeed_config fills it, cached tensors, the loop's checks and logging)
              against a bare PyTorch loop doing the same forward / backward / clipping / AdamW on a
              copy of the same model and batches, interleaved in one process; plus ZeRO variants.
              Goal: within 1.10x. A cProfile of both steps names where the difference goes.
  3 data      81 x 480 x 832 samples from 720p clips (decode + resize + element preprocessing in
              E2VDataset.load): decord against OpenCV, the clip resize against PIL per frame, DataLoader
              scaling with 0 / 1 / 2 workers.
  10 compile the compiled block (`speed.compile`) against eager on the CPU presets, two frame buckets:
              step ratio, compile time from an empty inductor cache, graphs, losses compared
              (`--sections compile`; bench/benchlib/compile.py).
  4 memory    peak RSS (and torch.cuda.max_memory_allocated on GPU) per configuration, read in the
              step processes (one fresh process per configuration: ru_maxrss never goes down).

Every configuration runs in a fresh child process (`--child`); the parent only collects JSON.
The step is train_e2v.py's, built and run from the same e2v functions (e2v.models.load.load_parts,
e2v.train.engine, e2v.train.step, e2v.runtime.device.to_device) with a phase timer around each part:
bench/benchlib/step.py. tests/launch/test_bench_step.py checks it against train_e2v.py's own loop (same
losses and gradient norms, fp32 and bf16); tests/launch/test_bench.py checks the phase sums and the bare
loop. Absolute times depend on the machine and its load (the 1-minute load average is recorded
with every result); ratios (online / cached, engine / bare, workers 2 / 1) compare across machines.

The sections live in bench/benchlib/ (its __init__ lists them); this file is the command line and
the parent process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# bench/ is the maintainers' harness, not part of the installed package: `python bench/<script>.py`
# finds its sibling modules (bench.*) from the checkout's root.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.benchlib.common import BENCH_DIR, MODEL_OVERRIDES, PRESETS, TINY_CONFIG, cache_dir, config_sets, load1  # noqa: E402
from bench.benchlib.report import render  # noqa: E402

# --- parent: run the children, write JSON and RESULTS.md ---------------------------------------


def run_child(kind: str, args, **extra) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    for k in ("steps", "warmup", "overhead_rounds", "overhead_steps", "profile_steps", "cache_batches",
              "data_repeats", "loader_samples", "threads"):
        if getattr(args, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.model:
        cmd += ["--model", args.model]
    for s in args.set:
        cmd += ["--set", s]
    load_before = load1()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench child {kind} {extra} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_JSON ")][-1]
    out = json.loads(line[len("BENCH_JSON "):])
    out["load1_before"], out["load1_after"], out["wall_s"] = load_before, load1(), round(time.time() - t0, 1)
    print(f"[bench] {kind} {extra}: {out['wall_s']} s, load {load_before} -> {out['load1_after']}", flush=True)
    return out


def ensure_demo_data(preset: str) -> Path:
    p = PRESETS[preset]
    root = BENCH_DIR / "tmp" / f"demo_{preset}"
    subprocess.run([sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(root), "--num-samples", "8",
                    "--size", str(p["size"]), "--frames", str(p["frames"])], check=True, capture_output=True)
    return root


def machine() -> dict:
    import importlib.metadata as md

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    versions = {}
    for pkg in ("torch", "deepspeed", "diffusers", "transformers", "peft", "decord", "opencv-python-headless"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    gpu = None
    import torch

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "python": platform.python_version(), "versions": versions,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def precompute(args, preset: str, root: Path) -> dict:
    """Fill the cache from scratch with tools/precompute.py (what a user runs once before a cached
    run); its wall time is the encode cost the cached step no longer pays."""
    import shutil

    shutil.rmtree(cache_dir(preset), ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "tools/precompute.py"), "--config", str(TINY_CONFIG)]
    for s in config_sets(preset, root, args.model, args.set, cached=True):
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tools/precompute.py failed for {preset} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    n = len(list(cache_dir(preset).rglob("*.safetensors"))) - 1  # minus _shared
    return {"samples": n, "wall_s": round(time.time() - t0, 1)}


def section_steps(args, presets) -> dict:
    out = {"presets": {}}
    for preset in presets:
        root = Path(args.data_root) if preset == "model" else ensure_demo_data(preset)
        online = run_child("steps", args, preset=preset, mode="online", data_root=root)
        pre = precompute(args, preset, root)
        cached = run_child("steps", args, preset=preset, mode="cached", data_root=root)
        ratio = online["step_ms"]["median"] / cached["step_ms"]["median"]
        out["presets"][preset] = {"online": online, "precompute": pre, "cached": cached,
                                  "online_over_cached": round(ratio, 2)}
    return out


def write_json(section: str, payload: dict, suffix: str = "", results_dir: Path = BENCH_DIR / "results") -> Path:
    path = results_dir / f"{section}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="steps,data", help="comma list of: steps (includes overhead and memory), data, "
                   "compile")
    p.add_argument("--quick", action="store_true", help="few repeats: checks the tool, not the machine")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"for the steps section: {', '.join(PRESETS)}")
    p.add_argument("--model", default=None, help="real Wan2.1 diffusers folder (needs a GPU)")
    p.add_argument("--data-root", default=None, help="dataset for --model (default: the 81-frame bench clips)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # --model on CPU: tests only
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--overhead-rounds", type=int, default=None)
    p.add_argument("--overhead-steps", type=int, default=None)
    p.add_argument("--profile-steps", type=int, default=None)
    p.add_argument("--cache-batches", type=int, default=4)
    p.add_argument("--data-repeats", type=int, default=None)
    p.add_argument("--loader-samples", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads in the step processes (default: torch's)")
    p.add_argument("--no-report", action="store_true", help="write JSON only")
    # child-only arguments
    p.add_argument("--child", choices=["steps", "data", "check", "compile"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-root-2", default=None, help=argparse.SUPPRESS)  # compile: the second bucket's clips
    p.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["online", "cached", "eager", "compiled"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    full = dict(steps=8, overhead_rounds=6, overhead_steps=3, profile_steps=4, data_repeats=2, loader_samples=6)
    quick = dict(steps=3, overhead_rounds=2, overhead_steps=2, profile_steps=2, data_repeats=1, loader_samples=4)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.child:
        import torch

        from e2v.runtime.hostmem import return_freed_memory

        return_freed_memory()  # the step processes run as train_e2v.py's ranks do
        if args.threads:
            torch.set_num_threads(args.threads)
        from bench.benchlib.compile import child_compile
        from bench.benchlib.data import child_data
        from bench.benchlib.steps import child_check, child_steps

        result = {"steps": child_steps, "data": child_data, "check": child_check, "compile": child_compile}[args.child](args)
        result["load1_end"], result["torch_threads"] = load1(), torch.get_num_threads()
        print("BENCH_JSON " + json.dumps(result), flush=True)
        return

    import torch

    if args.model and not (torch.cuda.is_available() or args.allow_cpu):
        raise SystemExit("--model needs a GPU (torch.cuda.is_available() is False here): the real Wan2.1 "
                         "transformer does not train on CPU. Run without --model for the CPU benchmarks.")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"steps", "data", "compile"}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from steps, data, compile")
    (BENCH_DIR / "tmp").mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"[bench] {info['cpu']}, {info['cores']} cores, load {load1()}", flush=True)
    t0 = time.time()
    suffix = "_model" if args.model else ""
    if args.model:
        from bench.benchlib.data import make_data_clips

        args.data_root = args.data_root or str(make_data_clips(BENCH_DIR / "tmp"))
        print(f"[bench] --model: {' '.join(MODEL_OVERRIDES)} (gradient checkpointing on: the step trained "
              f"at this size; --set train.gradient_checkpointing=false to measure without)", flush=True)
    if "data" in sections and not args.model:
        t_section = time.time()
        res = run_child("data", args)
        write_json("data", {"machine": info, "quick": args.quick, **res, "section_wall_s": time.time() - t_section})
    if "steps" in sections:
        t_section = time.time()
        res = section_steps(args, ["model"] if args.model else [x for x in args.presets.split(",") if x])
        res["section_wall_s"] = time.time() - t_section
        # a --model run without CUDA (--allow-cpu) only checks the code path: keep it out of RESULTS.md
        where = BENCH_DIR / "results" if torch.cuda.is_available() or not args.model else BENCH_DIR / "tmp" / "results"
        print(f"[bench] wrote {write_json('steps', {'machine': info, 'quick': args.quick, **res}, suffix, where)}")
    if "compile" in sections and not args.model:
        from bench.benchlib.compile import section_compile

        t_section = time.time()
        res = section_compile(args, run_child, [x for x in args.presets.split(",") if x])
        write_json("compile", {"machine": info, "quick": args.quick, **res, "section_wall_s": time.time() - t_section})
    print(f"[bench] done in {time.time() - t0:.0f} s", flush=True)
    if not args.no_report:
        path = write_report()
        print(f"[bench] wrote {path}")


def write_report() -> Path:
    return render(BENCH_DIR)


if __name__ == "__main__":
    main()
