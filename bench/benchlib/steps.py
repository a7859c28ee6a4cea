"""Sections 1 and 2 in their child processes: the step breakdown of one configuration (online or
cached), and the overhead of the train_e2v.py step against a bare PyTorch loop, interleaved, with
a cProfile of where the difference goes. The step itself is bench/benchlib/step.py."""

from __future__ import annotations

import copy
import pstats
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.benchlib.common import BENCH_DIR, GOAL_RATIO, ROOT, Phases, make_config, stats, summarise_phases
from bench.benchlib.memory import current_rss_mb, reading
from bench.benchlib.step import BareLoop, StepRunner, build_parts, init_single_rank, make_engine
from e2v.data.dataset import index_samples, make_loader
from e2v.train.ds_config import resolve_deepspeed_config
from e2v.train.flops import config_flops, device_peak_tflops, perf_scalars

# DeepSpeed configurations measured beside the shipped one: what the ZeRO-2 machinery costs on one
# rank, to say what a user with one GPU (or a small trainable set) could switch off.
DS_VARIANTS = {
    "zero2_no_overlap": lambda ds: ds["zero_optimization"].update(overlap_comm=False),
    "zero1": lambda ds: ds["zero_optimization"].update(stage=1),
    "zero0": lambda ds: ds["zero_optimization"].update(stage=0),
}


def setup(preset: str, cfg, cuda: bool, log_dir: Path | None, keep_initial: bool = False):
    """Parts, runner, engine and loader of one configuration, as train_e2v.py builds them for rank
    0 of one. `keep_initial`: also a copy of the transformer before deepspeed.initialize (the
    bare loop and the engine variants start from it). -> (parts, runner, engine, scheduler,
    batches, initial transformer or None)"""
    device = "cuda" if cuda else "cpu"
    ds_config = resolve_deepspeed_config(cfg, 1, cuda)
    parts = build_parts(preset, cfg, with_encoders=not cfg.cache.enabled, device=device, ds_config=ds_config)
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)  # Log appends: one run per folder
    runner = StepRunner(cfg, parts, device, cuda, log_dir)
    initial = copy.deepcopy(parts.transformer) if keep_initial else None
    engine, scheduler = make_engine(parts, cfg, cuda, ds_config)
    batches = iter(make_loader(cfg, index_samples(cfg, verbose=False), rank=0, world=1))
    return parts, runner, engine, scheduler, batches, initial


def child_steps(a) -> dict:
    """One configuration in this fresh process: `online` decodes and encodes every step; `cached`
    builds the transformer only and reads the entries tools/precompute.py wrote (e2v/data/store.py),
    then runs the overhead comparison on those tensors."""
    cuda = torch.cuda.is_available()
    rss_start = current_rss_mb()
    init_single_rank()
    cached = a.mode == "cached"
    cfg = make_config(a.preset, Path(a.data_root), a.model, a.set, cached=cached)
    parts, runner, engine, scheduler, batches, initial = setup(
        a.preset, cfg, cuda, BENCH_DIR / "tmp" / f"log_{a.preset}_{a.mode}", keep_initial=cached and a.overhead_rounds)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps, kept, losses = [], [], []
    for i in range(a.warmup + a.steps):
        ph = Phases(cuda)
        c, loss = runner.train_step(engine, batches, ph, scheduler)
        losses.append(loss)  # every step's, the untimed first ones too (bench/gpu_check.py: the loss falls)
        if i >= a.warmup:
            steps.append(ph.t)
        if len(kept) < a.cache_batches:
            kept.append(c)

    out = {"preset": a.preset, "mode": a.mode, "device": "cuda" if cuda else "cpu", "batch": cfg.train.micro_batch_size,
           "frames": cfg.data.num_frames, "resolution": list(cfg.data.resolution),
           "latent_shape": list(kept[0].latents_BCTHW.shape),
           "mixed_precision": cfg.train.mixed_precision, "gradient_checkpointing": cfg.train.gradient_checkpointing,
           "transformer_params_M": round(sum(p.numel() for p in parts.transformer.parameters()) / 1e6, 3),
           "trainable_params_M": round(sum(p.numel() for p in parts.transformer.parameters() if p.requires_grad) / 1e6, 3),
           "phases_ms": summarise_phases(steps),
           "step_ms": stats([1e3 * sum(v for k, v in s.items() if "/" not in k) for s in steps]),
           "memory": reading(rss_start, cuda), "losses": losses}
    out["speed"] = speed(cfg, parts.transformer, out["step_ms"]["median"] / 1e3)
    if cached and a.overhead_rounds:
        out["overhead"] = overhead(cfg, runner, engine, scheduler, initial, kept, cuda, a)
    runner.close()
    return out


def speed(cfg, transformer, step_s: float) -> dict:
    """The step's transformer FLOPs (e2v/train/flops.py, the count training logs) over its median
    time: TFLOP per step (model: forward + backward; hardware: with the recomputed forward), video
    tokens per second, TFLOPS per GPU, and MFU / HFU where the GPU's peak is known. The encoders of
    an online step are not counted, their time is: its MFU is the transformer's share of the step."""
    flops = config_flops(cfg, transformer)
    peak, source = device_peak_tflops(cfg.train.peak_tflops)
    perf = {k.removeprefix("perf/"): v for k, v in perf_scalars(flops, step_s, 1, peak).items()}
    return {"step_tflop": flops.model / 1e12, "hardware_tflop": flops.hardware / 1e12, "peak_tflops": peak,
            "peak_source": source, **perf}


def child_check(a) -> dict:
    """The tool's own claims, fast (tests/launch/test_bench.py): the phases of one online tiny step add
    up to its wall time, and the engine step and the bare loop do the same work."""
    init_single_rank()
    cfg = make_config("tiny", Path(a.data_root), None, a.set)
    parts, runner, engine, scheduler, batches, initial = setup("tiny", cfg, False, BENCH_DIR / "tmp" / "tb_check",
                                                               keep_initial=True)
    walls, steps, cache = [], [], []
    for _ in range(2):  # the second step is the measured one (the first allocates)
        ph = Phases(False)
        t0 = time.perf_counter()
        c, _ = runner.train_step(engine, batches, ph, scheduler)
        walls.append(time.perf_counter() - t0)
        steps.append(ph.t)
        cache.append(c)
    runner.close()
    return {"phases_s": steps[-1], "wall_s": walls[-1],
            "equivalence": equivalence(cfg, parts, initial, cache, False)}


# --- overhead: DeepSpeed step vs bare loop, interleaved -----------------------------------------


def equivalence(cfg, parts, initial, cache, cuda, steps: int = 3) -> dict:
    """Same work, checked: from the same initial weights, batch, sigmas and noise, the engine step
    and the bare loop must give the same losses (fp32) for `steps` optimizer steps."""
    device = "cuda" if cuda else "cpu"
    losses = {}
    for kind in ("engine", "bare"):
        model = copy.deepcopy(initial)
        runner = StepRunner(cfg, parts, device, cuda, None)  # fresh generators: the same draws for both
        stepper = make_engine(parts, cfg, cuda, transformer=model)[0] if kind == "engine" else BareLoop(model, cfg, device)
        losses[kind] = [runner.step(stepper, cache[i % len(cache)], Phases(cuda)) for i in range(steps)]
    diff = max(abs(x - y) for x, y in zip(losses["engine"], losses["bare"]))
    return {"steps": steps, "losses_engine": losses["engine"], "losses_bare": losses["bare"], "max_abs_diff": diff}


def overhead(cfg, runner, engine, scheduler, initial, cache, cuda, a) -> dict:
    """Rounds of k steps of each kind (the loop's full step, the bare engine step, the engine under
    DS_VARIANTS, the bare PyTorch loop), the order reversed every other round, so load changes on
    a shared machine hit every kind alike. Per round: each kind's median step; ratios per round."""
    device = "cuda" if cuda else "cpu"
    parts = runner.parts
    # two more copies of the model: skipped for a real model, whose GPU holds two at most
    check = equivalence(cfg, parts, initial, cache, cuda) if a.preset != "model" else None
    steppers = {"engine": engine, "bare": BareLoop(copy.deepcopy(initial), cfg, device)}
    # Variants on the tiny preset only: that is where fixed per-step costs show (and a real model
    # fits twice at most).
    for name, edit in (DS_VARIANTS.items() if a.preset == "tiny" else ()):
        ds = resolve_deepspeed_config(cfg, 1, cuda)
        edit(ds)
        steppers[name] = make_engine(parts, cfg, cuda, ds, transformer=copy.deepcopy(initial))[0]
    quiet = StepRunner(cfg, parts, device, cuda, None)  # the same step without the logging

    def one(kind, i, ph):
        if kind == "full":
            runner.step(engine, cache[i % len(cache)], ph, scheduler)
        else:
            quiet.step(steppers[kind], cache[i % len(cache)], ph)

    kinds = ["full"] + list(steppers)
    for kind in kinds:  # first steps of a fresh engine allocate buffers: not what we measure
        for i in range(a.warmup):
            one(kind, i, Phases(cuda))
    rounds, phases = [], {k: [] for k in kinds}
    for r in range(a.overhead_rounds):
        times = {}
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            ts = []
            for i in range(a.overhead_steps):
                ph = Phases(cuda)
                t0 = time.perf_counter()
                one(kind, i, ph)
                ts.append(time.perf_counter() - t0)
                phases[kind].append(ph.t)
            times[kind] = 1e3 * statistics.median(ts)
        rounds.append(times)
    kinds_out = {kind: {"step_ms": stats([x[kind] for x in rounds]),
                        "ratio_over_bare": stats([x[kind] / x["bare"] for x in rounds]),
                        "phases_ms": summarise_phases(phases[kind])} for kind in kinds}
    ratio = kinds_out["full"]["ratio_over_bare"]["median"]
    return {"rounds": a.overhead_rounds, "steps_per_round": a.overhead_steps, "kinds": kinds_out,
            "equivalence": check, "goal": GOAL_RATIO, "within_goal": ratio <= GOAL_RATIO,
            "profile": profile_steps(one, cache, a.profile_steps)}


def profile_steps(one, cache, n: int) -> dict:
    """cProfile of n full steps and n bare steps (`one(kind, i, phases)` runs one). The own time
    (tottime) that grows from bare to full, per function and per source file, is where the
    overhead goes. cProfile inflates Python-heavy code, so read these as a ranking, not as
    milliseconds to subtract."""
    import cProfile

    own = {}
    for kind in ("full", "bare"):
        prof = cProfile.Profile()
        prof.enable()
        for i in range(n):
            one(kind, i, Phases(False))
        prof.disable()
        own[kind] = {(f, line, fn): (v[2], v[1]) for (f, line, fn), v in pstats.Stats(prof).stats.items()}
    keys = set(own["full"]) | set(own["bare"])
    extra = {k: own["full"].get(k, (0, 0))[0] - own["bare"].get(k, (0, 0))[0] for k in keys}
    # Builtins (torch kernels, run_backward) do the same work in both; their difference is noise.
    python_keys = [k for k in keys if k[0] != "~"]
    by_file = {}
    for k in python_keys:
        by_file[_short_path(k[0])] = by_file.get(_short_path(k[0]), 0.0) + extra[k]
    calls = {kind: sum(v[1] for k, v in own[kind].items() if k[0] != "~") / n for kind in own}
    top = sorted(python_keys, key=lambda k: -extra[k])[:10]
    return {"steps": n,
            "total_own_ms_per_step": {k: round(1e3 * sum(v[0] for v in own[k].values()) / n, 2) for k in own},
            "python_calls_per_step": {k: round(v) for k, v in calls.items()},
            "top_files": [{"file": f, "extra_ms": round(1e3 * d / n, 2)}
                          for f, d in sorted(by_file.items(), key=lambda kv: -kv[1])[:8]],
            "top_functions": [{"function": f"{_short_path(k[0])}:{k[1]}({k[2]})", "extra_ms": round(1e3 * extra[k] / n, 2),
                               "calls_per_step": round(own["full"].get(k, (0, 0))[1] / n, 1)} for k in top]}


def _short_path(f: str) -> str:
    """site-packages/deepspeed/runtime/engine.py -> deepspeed/runtime/engine.py; this repository's
    files relative to its root."""
    p = Path(f)
    if "site-packages" in p.parts:
        return "/".join(p.parts[p.parts.index("site-packages") + 1:])
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return p.name
