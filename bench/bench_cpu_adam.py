"""The optimizer step of optimizer offload, measured on CPU: torch's AdamW (fused CPU kernel, and its
default foreach implementation) against DeepSpeed's CPU Adam, on one flat fp32 partition as ZeRO
hands it to the optimizer.

    python bench/bench_cpu_adam.py [--numel 50000000] [--repeats 7]   # -> bench/results/cpu_adam.json

DeepSpeed's CPU Adam is JIT-compiled at its first use here (unless prebuilt with DS_BUILD_CPU_ADAM=1),
which takes a minute or more and is not timed. Each optimizer gets the same parameters and gradients;
each timed step is one `optimizer.step()`; the repeats are interleaved (A B C A B C ...) so that the
load of a shared machine falls on all alike. The first step of each (state allocation) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def optimizers(numel: int) -> dict:
    """name -> (optimizer, its parameter), every parameter a copy of the same values."""
    g = torch.Generator().manual_seed(0)
    base, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    out = {}

    def param():
        p = torch.nn.Parameter(base.clone())
        p.grad = grad.clone()
        return p

    p = param()
    out["torch_adamw_fused"] = (torch.optim.AdamW([p], fused=True, **HYPER), p)
    p = param()
    out["torch_adamw_foreach"] = (torch.optim.AdamW([p], foreach=True, **HYPER), p)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = param()
        out["deepspeed_cpu_adam"] = (DeepSpeedCPUAdam([p], adamw_mode=True, **HYPER), p)  # builds (JIT) here
    except Exception as e:  # no compiler here: say so in the results
        out["_deepspeed_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000, help="fp32 elements in the partition (50 M: 200 MB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_adam.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    opts = optimizers(args.numel)
    setup_s = time.perf_counter() - t0  # DeepSpeed's JIT build, when it runs
    timed = {k: v for k, v in opts.items() if not k.startswith("_")}
    first_step_ms = {}
    for name, (opt, _) in timed.items():
        t0 = time.perf_counter()
        opt.step()  # state allocation: not timed with the rest
        first_step_ms[name] = (time.perf_counter() - t0) * 1e3
    times = {k: [] for k in timed}
    for _ in range(args.repeats):
        for name, (opt, _) in timed.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append((time.perf_counter() - t0) * 1e3)
    params = {k: p for k, (_, p) in timed.items()}
    ref = params["torch_adamw_foreach"]
    result = {
        "what": "one optimizer.step() on a flat fp32 partition on CPU (the optimizer-offload step), ms",
        "numel": args.numel, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_1min": os.getloadavg()[0],
        "versions": {"torch": torch.__version__},
        "setup_s (DeepSpeed's build when it ran)": setup_s, "first_step_ms": first_step_ms,
        "ms": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()},
        # the same update: the largest difference from torch's foreach AdamW after every step
        "max_abs_diff_vs_foreach": {k: float((p.detach() - ref.detach()).abs().max()) for k, p in params.items()},
    }
    try:
        import deepspeed

        result["versions"]["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    if "_deepspeed_error" in opts:
        result["deepspeed_error"] = opts["_deepspeed_error"]
    med = {k: v["median"] for k, v in result["ms"].items()}
    result["fastest"] = min(med, key=med.get)
    if "deepspeed_cpu_adam" in med:
        result["deepspeed_cpu_adam_over_torch_fused"] = med["deepspeed_cpu_adam"] / med["torch_adamw_fused"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k, v in result["ms"].items():
        print(f"{k:24s} {v['median']:9.1f} ms  ({v['min']:.1f}-{v['max']:.1f})")
    print(f"fastest: {result['fastest']}; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
