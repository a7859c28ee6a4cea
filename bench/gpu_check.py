"""`make gpu-check`: what a user decides by, measured on one CUDA GPU in one call of at most 8
minutes (`--budget`, default 480 s). Sections run in order of value, each with its own time budget;
a section the remaining time cannot finish is skipped and says so (the budgets add up to more than
480 s: the last sections of a default call may be skipped; `--only` runs them in another). bench/RESULTS_GPU.md and
bench/results/gpu.json are rewritten after EVERY section, so a call cut short keeps what it measured.

  environment         every package the check needs, imported (bench/gpulib/packages.py: what fails to
                      import is installed first, from --wheels only, or nothing with --no-install); GPU,
                      driver, versions, TORCH_CUDA_ARCH_LIST, the optimizer the plan picks and why (this
                      check sets torch's AdamW explicitly: deepspeed.optimizer=torch_adamw, nothing JIT-built)
  step_1.3b           Wan2.1-T2V-1.3B expanded for elements, real shapes with random weights
                      (bench/smokelib/build.py), 81 x 480 x 832, ZeRO-2, checkpointing: the online step
                      and, after tools/precompute.py on the GPU, the cached step, split into phases
                      (VAE encodes, CLIP, text, forward, backward, optimizer) timed with CUDA events
                      (bench/bench.py --model: the step is train_e2v.py's), torch.cuda.max_memory_allocated
                      against tools/estimate_memory.py; the loss must fall from the first step to the last
                      (lr warmed up, one fixed timestep)
  speed               the 1.3B cached step at 81 x 480 x 832 with each attention backend that trains here,
                      eager and compiled (speed.attention_backend, speed.compile): step time, video tokens/s,
                      TFLOPS and MFU by e2v/train/flops.py's count, the fastest as config lines to paste
                      (bench/gpulib/speed_section.py); skipped with --allow-cpu
  vae_dtype           model.vae_dtype bf16 against fp32 (the default, as A2 encodes): encode time of one
                      81 x 480 x 832 clip and the relative error of its latents
  main_path           configs/e2v.yaml's path at the I2V-14B widths with 2 layers: zero3_offload with the
                      transformer partitioned at load, 3 steps, `--resume latest` for a 4th, the export,
                      and tools/sample.py on it in bf16 (not constant, and within 25 dB PSNR of the
                      same sample with the transformer in fp32, the reference)
  gpu_24gb            configs/e2v_t2v_1.3b_24gb.yaml (real 1.3B shapes) and configs/e2v_24gb.yaml (the
                      I2V-14B widths, 2 layers: under zero3_offload with activation offload a GPU holds
                      one working layer, so its peak does not grow with depth) under
                      torch.cuda.set_per_process_memory_fraction = 24 GiB: pass, or by how much they exceed
  validation_24gb     configs/e2v_t2v_1.3b_24gb.yaml from its cache WITH validation on, under the same cap
                      (bench/gpulib/validation_section.py): the VAE and the CLIP visit the device in turn
  activation_offload  train.activation_offload off and on at 33 x 480 x 832 (1.3B): equal losses, step
                      time, and the peak memory must drop
  offload_adam        torch's AdamW fused on ZeRO's offloaded CPU partition (the default of e2v.yaml, the
                      24 GB config and A14B), as training builds it: fused (pinned: reported), equal to torch's
                      reference AdamW step for step (bench/gpulib/offload_adam.py)
  wan22               the tiny Wan2.2 TI2V and two-expert presets through training and validation
  r2v                 the sequence layout (SkyReels-V3 R2V's 4 slots, Phantom's as many) on the tiny T2V,
                      through training and validation
  attention           which SDPA backend a bf16 Wan forward dispatches to (flash / efficient / cuDNN /
                      math, by the aten op that ran); math fails on a GPU
  fp8_14b             the fp8 base at the I2V-14B widths (4 blocks) under the 24 GiB cap: peaks against
                      e2v/train/memory.py (bench/gpulib/fp8_section.py)
  causal_step         the causal task's step (block-causal, per-block timesteps) against the bidirectional
                      one, Wan2.1-T2V-1.3B at 480 x 832 x 81 with blocks of 3, random weights: time and peak
                      memory of each, flex and per-block attention, whose losses must agree
                      (bench/gpulib/causal_section.py)

The verdict: FAILED when a section that ran failed, INCOMPLETE when none failed but a section or a
check inside one was skipped (a budget too short, --allow-cpu's CPU-only limits), PASSED only when
everything asked for ran and passed. Exit status 0 / 1 / 3 for them.

    python bench/gpu_check.py                       # everything, 480 s
    python bench/gpu_check.py --only step_1.3b      # one section (comma list for several)
    python bench/gpu_check.py --budget 240          # a shorter slot: the later sections are skipped
    python bench/gpu_check.py --allow-cpu           # every section at tiny sizes on the CPU (tests);
                                                    # writes under bench/tmp/ unless --out

Without CUDA (and without --allow-cpu) it exits at once (status 2) with one line; nothing is written.

Running it on a fresh GPU machine (docs/gpu.md): it has a CUDA torch, transformers and peft, no
network. Before the slot, where there is network, build the wheel folder for that machine's Python
and torch (`make gpu-wheels`: bench/gpulib/packages.py wheels) and carry it; there,
`make gpu-check WHEELS=wheels` (or `python bench/gpu_check.py --wheels wheels`) installs what does not
import from that folder with pip --no-index, with the interpreter it is run with.
Leave TORCH_CUDA_ARCH_LIST unset, or give plain numbers (e.g. "9.0"): DeepSpeed 0.19.8's op builder
fails on "9.0a" (int('0a')) when anything JIT-builds an op; the environment section records it.
The data is generated here without ffmpeg (tools/make_demo_dataset.py --real-size --video-format
npz: 81 x 832 x 832 uint8 frames; the trainer center-crops 480 x 832), and so are the random-weight
model folders (smoke_real/, ~1 min on 16 cores; kept for a second call on the same machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

# The GPU check runs with the machine's own interpreter, e2v not installed in it (`make gpu-check`
# installs no package: docs/gpu.md): e2v and bench are found from the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpulib.common import REAL, ROOT, TINY, Ctx, demo_data_command, verdict_24gb  # noqa: F401
from bench.gpulib.report import _ok, write_report
from bench.gpulib.sections import CONFIGS_24GB, NAMES, SECTIONS, WAN22_RUNS  # noqa: F401

# --- the call -----------------------------------------------------------------------------------


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU checks, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
                "the GPU checks need one (--allow-cpu runs them at tiny sizes, to check the tool)")
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole call (default 480)")
    p.add_argument("--only", default="", help=f"comma list of sections: {', '.join(NAMES)}")
    p.add_argument("--allow-cpu", action="store_true", help="no CUDA: every section at tiny sizes on the CPU")
    p.add_argument("--out", type=Path, default=None, help="report folder (default bench/, with --allow-cpu bench/tmp/)")
    p.add_argument("--work", type=Path, default=None, help="data, runs and logs (default smoke_real/gpu[_cpu])")
    p.add_argument("--wheels", type=Path, default=None,
                   help="install what does not import from this folder only (pip --no-index; bench/gpulib/packages.py)")
    p.add_argument("--no-install", action="store_true", help="install nothing: report what does not import")
    args = p.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        p.error(f"--only: unknown {unknown}; choose from {', '.join(NAMES)}")
    args.only = only
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem and not args.allow_cpu:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # the scripts it starts (tools/*.py, bench/bench.py) import e2v from this checkout, installed or not
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    packages = prepare_packages(args.wheels, args.no_install)
    cuda = problem is None
    out_dir = args.out or (ROOT / "bench" if cuda else ROOT / "bench" / "tmp")
    work = args.work or ROOT / "smoke_real" / ("gpu" if cuda else "gpu_cpu")
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    ctx = Ctx(cuda=cuda, sizes=REAL if cuda else TINY, work=work, deadline=t_start + args.budget, packages=packages,
              only=args.only)
    result = {"device": torch.cuda.get_device_name(0) if cuda else "CPU (--allow-cpu, tiny sizes)", "cuda": cuda,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "argv": "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
              "budget_s": args.budget, "elapsed_s": 0.0, "sections": {}, "finished": False}
    for s in SECTIONS:
        if args.only and s.name not in args.only:
            continue
        left = ctx.left()
        if s.name != "environment" and packages["problems"]:  # each would fail on an import
            r = {"skipped": "packages do not import (environment)"}
        elif s.budget_s > left:  # on a GPU; at tiny sizes on a CPU the budgets are not the times
            r = {"skipped": f"needs ~{s.budget_s:.0f} s, {max(left, 0):.0f} s left"}
        else:
            print(f"[gpu-check] {s.name} (budget {s.budget_s:.0f} s, {left:.0f} s left) ...", flush=True)
            t0 = time.monotonic()
            try:
                r = s.run(ctx)
            except Exception as e:  # one failed section must not hide the others' figures
                r = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            r["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"[gpu-check] {s.name}: {_ok(r)} in {r['wall_s']:.0f} s", flush=True)
        result["sections"][s.name] = r
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        result["verdict"] = verdict(result["sections"])
        result["passed"] = result["verdict"] == "PASSED"
        write_report(result, out_dir)
    result["finished"] = True
    md, js = write_report(result, out_dir)
    print(f"[gpu-check] {result['verdict']} in {result['elapsed_s']:.0f} s: {md}, {js}")
    return EXIT[result["verdict"]]


EXIT = {"PASSED": 0, "FAILED": 1, "INCOMPLETE": 3}


def verdict(sections: dict) -> str:
    """FAILED when a section that ran failed; INCOMPLETE when none failed but a section, or a check
    inside one (`skipped_checks`), was skipped; PASSED only when everything asked for ran and passed."""
    if any("skipped" not in r and not r.get("passed") for r in sections.values()):
        return "FAILED"
    if any("skipped" in r or r.get("skipped_checks") for r in sections.values()):
        return "INCOMPLETE"
    return "PASSED"


def prepare_packages(wheels: Path | None, no_install: bool) -> dict:
    """Everything the check imports, importable before the first section: checked by importing it
    (bench/gpulib/packages.py); what fails is installed from `wheels` only (no index), from the
    index without it, or not at all with `no_install`. -> {"installed_from", "problems", "pip"}"""
    import importlib

    from bench.gpulib.packages import import_problems, install

    problems = import_problems()
    if problems and not no_install:
        print(f"[gpu-check] cannot import {', '.join(problems)}: installing "
              f"{'from ' + str(wheels) + ' (no index)' if wheels else 'from the package index'}", flush=True)
        out = install(sys.executable, wheels, no_install, problems)
        importlib.invalidate_caches()
        return out
    return {"installed_from": None, "problems": problems}


if __name__ == "__main__":
    sys.exit(main())
