"""Benchmarks: where a training step's time and memory go, and how far our DeepSpeed step is from
a bare PyTorch loop. Results go to bench/results/<section>.json; bench/RESULTS.md is regenerated
from every JSON there (machine, versions, date, load, then one table per section).

    python tools/bench.py                        # the CPU part, all sections (`make bench`, < 10 min)
    python tools/bench.py --quick                # few repeats: checks the tool, numbers are noise
    python tools/bench.py --sections data        # one section; RESULTS.md keeps the other's JSON
    python tools/bench.py --model PATH           # real Wan2.1 diffusers folder on a GPU: tables 1, 2, 4
                                                 # for that model (--overhead-rounds 0 if it does not
                                                 # fit twice: the bare loop trains a copy)

What is measured (section numbers as in RESULTS.md)
  1 steps     one training step split into phases (data wait, VAE / text / CLIP encode, forward,
              backward, optimizer, logging) on the tiny preset and a "small" one, online (decode +
              encode every step) and cached (cache.enabled, entries written by tools/precompute.py).
  2 overhead  the train_e2v.py step (the DeepSpeed engine from ds_configs/zero2.json as
              resolve_deepspeed_config fills it, cached tensors, the loop's checks and logging)
              against a bare PyTorch loop doing the same forward / backward / clipping / AdamW on a
              copy of the same model and batches, interleaved in one process; plus ZeRO variants.
              Goal: within 1.10x. A cProfile of both steps names where the difference goes.
  3 data      81 x 480 x 832 samples from 720p clips (decode + resize + element preprocessing in
              E2VDataset.load): decord against OpenCV, the clip resize against PIL per frame, DataLoader
              scaling with 0 / 1 / 2 workers.
  4 memory    peak RSS (and torch.cuda.max_memory_allocated on GPU) per configuration, read in the
              step processes (one fresh process per configuration: ru_maxrss never goes down).

Every configuration runs in a fresh child process (`--child`); the parent only collects JSON.
The step is train_e2v.py's loop body re-stated with the same e2v functions (the loop is inline in
main(); tests/test_bench.py checks the re-statement against the bare loop and the phase sums).
Absolute times depend on the machine and its load (the 1-minute load average is recorded with
every result); ratios (online / cached, engine / bare, workers 2 / 1) compare across machines.

Legend: B batch, C channels, T latent frames, h/w latent size, L tokens, D width, F frames.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import io
import json
import os
import platform
import pstats
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BENCH_DIR = ROOT / "bench"
TINY_CONFIG = ROOT / "configs" / "e2v_tiny.yaml"
GOAL_RATIO = 1.10  # the overhead goal: DeepSpeed step within 1.10x of the bare loop

# The presets. "small" is the tiny preset's encoders with a bigger transformer (2 heads x 128 =
# Wan's head width, 4 layers) at 33 x 128 x 128: 576 video tokens, enough compute that framework
# overhead shows as a fraction and not as the whole step.
PRESETS = {
    "tiny": {"frames": 17, "size": 64, "batch": 4, "transformer": None},
    "small": {"frames": 33, "size": 128, "batch": 2, "transformer": dict(
        num_attention_heads=2, attention_head_dim=128, ffn_dim=1024, num_layers=4, freq_dim=256,
        rope_max_seq_len=1024)},
}
# The real-model run (--model): A2's training shape, batch 1, bf16 (override with --set).
MODEL_OVERRIDES = ["model.preset=null", "data.num_frames=81", "data.resolution=[480,832]",
                   "processors.clip.resolution=[512,512]", "train.micro_batch_size=1",
                   "train.mixed_precision=bf16"]

STEP_PHASES = ["data_wait", "cache_assembly", "vae_encode", "text_encode", "clip_encode", "conditioning_other",
               "noise_and_input", "forward_and_loss", "loss_check", "backward", "optimizer", "logging"]
DATA_CLIPS, DATA_FRAMES, DATA_SOURCE_HW, DATA_TARGET_HW = 4, 81, (720, 1280), (480, 832)


# --- small helpers ----------------------------------------------------------------------------


def stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_rss_mb() -> float:
    try:
        import psutil
    except ImportError:  # not a requirement: the peak so far is the current RSS at process start
        return peak_rss_mb()
    return psutil.Process().memory_info().rss / 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Phases:
    """Accumulates wall time per named phase of one step; on CUDA it synchronises around each phase
    so asynchronous kernels are charged to the phase that launched them."""

    def __init__(self, cuda: bool):
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.t: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def timed_functions(module, names_to_phase: dict, phases: Phases):
    """Charge every call of module.<fn> to a phase, by swapping the module attribute (callers look
    the function up in the module's globals at call time), and restore it afterwards."""
    saved = {n: getattr(module, n) for n in names_to_phase}

    def wrap(fn, phase):
        def inner(*a, **k):
            with phases(phase):
                return fn(*a, **k)
        return inner

    for n, phase in names_to_phase.items():
        setattr(module, n, wrap(saved[n], phase))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


# --- building one configuration ---------------------------------------------------------------


def config_sets(preset: str, data_root: Path, model: str | None, extra_sets: list[str], cached: bool) -> list[str]:
    """--set overrides of configs/e2v_tiny.yaml for one configuration; tools/precompute.py gets the
    same ones, so its cache entries match the cached run's fingerprint."""
    if preset == "model":
        sets = MODEL_OVERRIDES + [f"model.pretrained={model}"]
    else:
        p = PRESETS[preset]
        sets = [f"data.num_frames={p['frames']}", f"data.resolution=[{p['size']},{p['size']}]",
                f"train.micro_batch_size={p['batch']}"]
    sets += [f"data.datasets.0.data_root={data_root}", f"output_dir={BENCH_DIR / 'tmp' / 'runs'}",
             "data.num_workers=0", "train.warmup_steps=0",
             "validation.every_n_steps=0", "visualization.enabled=false"]  # not step costs: off in every run
    if cached:
        sets += ["cache.enabled=true", f"cache.dir={cache_dir(preset)}"]
    return sets + list(extra_sets)


def cache_dir(preset: str) -> Path:
    return BENCH_DIR / "tmp" / f"cache_{preset}"


def make_config(preset: str, data_root: Path, model: str | None, extra_sets: list[str], cached: bool = False):
    from e2v.config import load_config

    return load_config(TINY_CONFIG, config_sets(preset, data_root, model, extra_sets, cached))


def build_parts(preset: str, cfg, with_encoders: bool, device: str):
    """The parts train_e2v.py would build; for "small", the tiny encoders with a bigger
    transformer built from a custom WanTransformer3DModel config."""
    import torch
    from diffusers import WanTransformer3DModel

    from e2v.models import load_parts
    from e2v.tiny import build_tiny_parts, tiny_transformer_config
    from e2v.trainable import setup_training

    if preset == "model":
        parts = load_parts(cfg, with_encoders=with_encoders, device=device)
    else:
        parts = build_tiny_parts(cfg.model.tiny_seed, informative_vae=cfg.model.tiny_vae == "informative",
                                 with_encoders=with_encoders)
        if PRESETS[preset]["transformer"] is not None:
            tcfg = tiny_transformer_config("i2v")
            tcfg.update(PRESETS[preset]["transformer"])
            tcfg["added_kv_proj_dim"] = tcfg["num_attention_heads"] * tcfg["attention_head_dim"]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.model.tiny_seed)
                parts.transformer = WanTransformer3DModel(**tcfg)
    setup_training(parts.transformer, cfg, expanded=False)
    if cfg.train.gradient_checkpointing:
        parts.transformer.enable_gradient_checkpointing()
    for m in (parts.vae, parts.text_encoder, parts.image_encoder):
        if m is not None:
            m.to(device).requires_grad_(False)
    return parts


def init_single_rank() -> None:
    """A one-process gloo (or NCCL) group, so deepspeed.initialize runs inside this process."""
    from e2v.checkpoint import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()


def make_engine(transformer, cfg, cuda: bool, ds_config: dict | None = None):
    """deepspeed.initialize exactly as train_e2v.py calls it (or with an edited ds_config)."""
    import deepspeed
    import torch

    from e2v.config import resolve_deepspeed_config
    from e2v.engine import lr_lambda

    params = [p for p in transformer.parameters() if p.requires_grad]
    engine, _, _, scheduler = deepspeed.initialize(
        model=transformer, model_parameters=params, config=ds_config or resolve_deepspeed_config(cfg, 1, cuda),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)))
    return engine, scheduler


class BareLoop:
    """The same work as the engine step in plain PyTorch: forward, loss, backward, gradient
    clipping, AdamW (torch's, with the YAML's hyper-parameters), LambdaLR, zero_grad. In bf16
    configs the weights stay fp32 under autocast (DeepSpeed's bf16 keeps fp32 master weights)."""

    def __init__(self, transformer, cfg, device):
        import torch

        from e2v.engine import lr_lambda

        self.model = transformer.to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        t = cfg.train
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.grad_clip = t.grad_clip
        self.autocast = t.mixed_precision == "bf16"
        self.device = torch.device(device)

    def __call__(self, *args, **kwargs):
        import torch

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        import torch

        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)


class StepRunner:
    """One training step as train_e2v.py's loop does it (gradient accumulation 1), split into
    phases. `model` is the DeepSpeed engine or a BareLoop."""

    def __init__(self, cfg, parts, device, cuda: bool, tb_dir: Path | None):
        import torch
        from tqdm import tqdm

        from e2v.checkpoint import NonFiniteGuard
        from train_e2v import Log

        self.cfg, self.parts, self.device, self.cuda = cfg, parts, torch.device(device), cuda
        self.dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float32
        self.rng = random.Random(cfg.seed * 1000)
        self.gen = torch.Generator().manual_seed(cfg.seed * 1000)
        if tb_dir is not None:
            tb_dir.mkdir(parents=True, exist_ok=True)
        self.log = Log(tb_dir, 0) if tb_dir is not None else None
        # the loop's progress bar, writing where nobody reads (a terminal costs more: not ours)
        self.bar = tqdm(total=10**9, file=io.StringIO(), desc="train", mininterval=30) if tb_dir else None
        self.guard = NonFiniteGuard(cfg.train.skip_nonfinite, 0) if tb_dir else None
        self.global_step = 0

    def encode(self, batch, phases: Phases):
        import torch

        import e2v.conditioning as conditioning

        fns = {"encode_video": "vae_encode", "encode_text": "text_encode", "encode_clip_images": "clip_encode"}
        with timed_functions(conditioning, fns, phases), phases("encode_total"), torch.no_grad():
            c = conditioning.encode_batch(batch, self.parts, self.cfg, rng=self.rng, generator=self.gen)
        inner = sum(phases.t.get(p, 0.0) for p in fns.values())
        phases.t["conditioning_other"] = phases.t.pop("encode_total") - inner
        return c

    def step(self, model, c, phases: Phases, scheduler=None) -> float:
        """Everything after the conditions exist: flow sampling, model input, forward, loss,
        backward, optimizer, and (when logging) the loop's per-step bookkeeping."""
        from e2v.checkpoint import any_rank
        from e2v.step import add_step_stats, draw_flow, forward_loss, step_scalars

        t_step = time.perf_counter()
        with phases("noise_and_input"):
            sigma, noise, noisy_model_input = draw_flow(c, self.cfg.flow, self.gen)
        with phases("forward_and_loss"):
            loss, per_sample, model_pred, target = forward_loss(model, c, sigma, noise, noisy_model_input,
                                                                self.cfg, self.dtype)
        if self.guard is not None:
            with phases("loss_check"):  # the loop's non-finite check: all ranks agree before backward
                self.guard.bad(loss.item(), "loss", self.global_step + 1, [])
        with phases("backward"):
            model.backward(loss)
        with phases("optimizer"):
            model.step()
        if self.log is None:
            return loss.item()
        with phases("logging"):  # what the loop does after engine.step (checkpointing aside), its functions
            with phases("logging/loss_and_grad_norm"):
                loss_value, stats = loss.item(), {}
                add_step_stats(stats, sigma, per_sample, target, model_pred, self.cfg.flow)
                self.global_step += 1
                step_time = time.perf_counter() - t_step
                grad_norm = self.guard.grad_norm(model.get_global_grad_norm(), self.global_step, [])
            with phases("logging/tensorboard"):  # incl. the loop's sum of losses and skips over ranks
                self.log.scalars(self.global_step, step_scalars(
                    self.cfg, 1, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm, step_time=step_time,
                    data_time=0.0, step_losses=[loss_value], stats=stats, skipped_ids=set(), excluded=0, nonfinite=0))
            with phases("logging/progress_bar"):
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}", refresh=False)
            with phases("logging/stop_check"):
                any_rank(False)  # the per-step stop-signal check (a collective every step)
        return loss_value


# --- child: step breakdown (+ memory), online or cached -----------------------------------------


def child_steps(a) -> dict:
    """One configuration in this fresh process, as train_e2v.py runs it: `online` decodes and
    encodes every step; `cached` builds the transformer only and reads the entries
    tools/precompute.py wrote (e2v/cache.py), then runs the overhead comparison on those tensors."""
    import torch

    from e2v.cache import batch_conditions
    from e2v.data import index_samples, make_loader

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rss_start = current_rss_mb()
    init_single_rank()
    cached = a.mode == "cached"
    cfg = make_config(a.preset, Path(a.data_root), a.model, a.set, cached=cached)
    parts = build_parts(a.preset, cfg, with_encoders=not cached, device=device)
    runner = StepRunner(cfg, parts, device, cuda, BENCH_DIR / "tmp" / f"log_{a.preset}_{a.mode}")
    init_model = copy.deepcopy(parts.transformer) if cached and a.overhead_rounds else None
    engine, scheduler = make_engine(parts.transformer, cfg, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loader = iter(make_loader(cfg, index_samples(cfg, verbose=False), rank=0, world=1))
    steps, kept = [], []
    for i in range(a.warmup + a.steps):
        ph = Phases(cuda)
        with ph("data_wait"):
            batch = next(loader)
        if cached:
            with ph("cache_assembly"), torch.no_grad():
                c = batch_conditions(batch, parts, cfg, rng=runner.rng, generator=runner.gen)
        else:
            c = runner.encode(batch, ph)
        runner.step(engine, c, ph, scheduler)
        if i >= a.warmup:
            steps.append(ph.t)
        if len(kept) < a.cache_batches:
            kept.append(c)

    out = {"preset": a.preset, "mode": a.mode, "device": device, "batch": cfg.train.micro_batch_size,
           "frames": cfg.data.num_frames, "resolution": list(cfg.data.resolution),
           "latent_shape": list(latent_shape(cfg)),
           "transformer_params_M": round(sum(p.numel() for p in parts.transformer.parameters()) / 1e6, 3),
           "trainable_params_M": round(sum(p.numel() for p in parts.transformer.parameters() if p.requires_grad) / 1e6, 3),
           "phases_ms": summarise_phases(steps),
           "step_ms": stats([1e3 * sum(v for k, v in s.items() if "/" not in k) for s in steps]),
           "memory": {"rss_at_start_mb": round(rss_start, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
                      "cuda_max_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None}}
    if cached and a.overhead_rounds:
        out["overhead"] = overhead(cfg, runner, engine, scheduler, init_model, kept, device, cuda, a)
    return out


def latent_shape(cfg) -> tuple:
    f, (h, w) = cfg.data.num_frames, cfg.data.resolution
    return (cfg.train.micro_batch_size, 16, (f - 1) // 4 + 1, h // 8, w // 8)


def summarise_phases(steps: list[dict]) -> dict:
    names = STEP_PHASES + sorted({k for s in steps for k in s if "/" in k})  # + sub-phases, e.g. logging/...
    return {p: stats([1e3 * s.get(p, 0.0) for s in steps]) for p in names if any(p in s for s in steps)}


def child_check(a) -> dict:
    """The tool's own claims, fast (tests/test_bench.py): the phases of one online tiny step add
    up to its wall time, and the engine step and the bare loop do the same work."""
    from e2v.data import index_samples, make_loader

    init_single_rank()
    cfg = make_config("tiny", Path(a.data_root), None, a.set)
    parts = build_parts("tiny", cfg, with_encoders=True, device="cpu")
    init_model = copy.deepcopy(parts.transformer)
    runner = StepRunner(cfg, parts, "cpu", False, BENCH_DIR / "tmp" / "tb_check")
    engine, scheduler = make_engine(parts.transformer, cfg, False)
    loader = iter(make_loader(cfg, index_samples(cfg, verbose=False), rank=0, world=1))
    walls, steps, cache = [], [], []
    for _ in range(2):  # the second step is the measured one (the first allocates)
        ph = Phases(False)
        t0 = time.perf_counter()
        with ph("data_wait"):
            batch = next(loader)
        c = runner.encode(batch, ph)
        runner.step(engine, c, ph, scheduler)
        walls.append(time.perf_counter() - t0)
        steps.append(ph.t)
        cache.append(c)
    return {"phases_s": steps[-1], "wall_s": walls[-1],
            "equivalence": equivalence(cfg, parts, init_model, cache, "cpu", False)}


# --- overhead: DeepSpeed step vs bare loop, interleaved -----------------------------------------

# DeepSpeed configurations measured beside the shipped one: what the ZeRO-2 machinery costs on one
# rank, to say what a user with one GPU (or a small trainable set) could switch off.
DS_VARIANTS = {
    "zero2_no_overlap": lambda ds: ds["zero_optimization"].update(overlap_comm=False),
    "zero1": lambda ds: ds["zero_optimization"].update(stage=1),
    "zero0": lambda ds: ds["zero_optimization"].update(stage=0),
}


def equivalence(cfg, parts, init_model, cache, device, cuda, steps: int = 3) -> dict:
    """Same work, checked: from the same initial weights, batch, sigmas and noise, the engine step
    and the bare loop must give the same losses (fp32) for `steps` optimizer steps."""
    losses = {}
    for kind in ("engine", "bare"):
        model = copy.deepcopy(init_model)
        runner = StepRunner(cfg, dataclasses.replace(parts, transformer=model), device, cuda, None)
        stepper = make_engine(model, cfg, cuda)[0] if kind == "engine" else BareLoop(model, cfg, device)
        losses[kind] = [runner.step(stepper, cache[i % len(cache)], Phases(cuda)) for i in range(steps)]
    diff = max(abs(x - y) for x, y in zip(losses["engine"], losses["bare"]))
    return {"steps": steps, "losses_engine": losses["engine"], "losses_bare": losses["bare"], "max_abs_diff": diff}


def overhead(cfg, runner, engine, scheduler, init_model, cache, device, cuda, a) -> dict:
    """Rounds of k steps of each kind (the loop's full step, the bare engine step, the engine under
    DS_VARIANTS, the bare PyTorch loop), the order reversed every other round, so load changes on
    a shared machine hit every kind alike. Per round: each kind's median step; ratios per round."""
    from e2v.config import resolve_deepspeed_config

    # two more copies of the model: skipped for a real model, whose GPU holds two at most
    check = equivalence(cfg, runner.parts, init_model, cache, device, cuda) if a.preset != "model" else None
    steppers = {"engine": engine, "bare": BareLoop(copy.deepcopy(init_model), cfg, device)}
    # Variants on the tiny preset only: that is where fixed per-step costs show (and a real model
    # fits twice at most).
    for name, edit in (DS_VARIANTS.items() if a.preset == "tiny" else ()):
        ds = resolve_deepspeed_config(cfg, 1, cuda)
        edit(ds)
        steppers[name] = make_engine(copy.deepcopy(init_model), cfg, cuda, ds)[0]
    quiet = StepRunner(cfg, runner.parts, device, cuda, None)  # the same step without the logging
    kinds = ["full"] + list(steppers)
    for kind in kinds:  # first steps of a fresh engine allocate buffers: not what we measure
        for i in range(a.warmup):
            if kind == "full":
                runner.step(engine, cache[i % len(cache)], Phases(cuda), scheduler)
            else:
                quiet.step(steppers[kind], cache[i % len(cache)], Phases(cuda))
    rounds, phases = [], {k: [] for k in kinds}
    for r in range(a.overhead_rounds):
        times = {}
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            ts = []
            for i in range(a.overhead_steps):
                ph = Phases(cuda)
                t0 = time.perf_counter()
                if kind == "full":
                    runner.step(engine, cache[i % len(cache)], ph, scheduler)
                else:
                    quiet.step(steppers[kind], cache[i % len(cache)], ph)
                ts.append(time.perf_counter() - t0)
                phases[kind].append(ph.t)
            times[kind] = 1e3 * statistics.median(ts)
        rounds.append(times)
    kinds_out = {}
    for kind in kinds:
        kinds_out[kind] = {"step_ms": stats([x[kind] for x in rounds]),
                           "ratio_over_bare": stats([x[kind] / x["bare"] for x in rounds]),
                           "phases_ms": summarise_phases(phases[kind])}
    ratio = kinds_out["full"]["ratio_over_bare"]["median"]
    return {"rounds": a.overhead_rounds, "steps_per_round": a.overhead_steps, "kinds": kinds_out,
            "equivalence": check, "goal": GOAL_RATIO, "within_goal": ratio <= GOAL_RATIO,
            "profile": profile_steps(quiet, runner, engine, scheduler, steppers["bare"], cache, a.profile_steps)}


def profile_steps(quiet, runner, engine, scheduler, bare, cache, n: int) -> dict:
    """cProfile of n full steps and n bare steps. The own time (tottime) that grows from bare to
    full, per function and per source file, is where the overhead goes. cProfile inflates
    Python-heavy code, so read these as a ranking, not as milliseconds to subtract."""
    import cProfile

    own = {}
    for kind in ("full", "bare"):
        prof = cProfile.Profile()
        prof.enable()
        for i in range(n):
            if kind == "full":
                runner.step(engine, cache[i % len(cache)], Phases(False), scheduler)
            else:
                quiet.step(bare, cache[i % len(cache)], Phases(False))
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
    """site-packages/deepspeed/runtime/engine.py -> deepspeed/runtime/engine.py"""
    parts = Path(f).parts
    for anchor in ("site-packages", "main"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return Path(f).name


# --- child: data pipeline at 81 x 480 x 832 ---------------------------------------------------


def make_data_clips(root: Path) -> Path:
    """DATA_CLIPS clips of 81 frames at 720p (so the resize to 480x832 really runs) with a subject
    (RGBA), an object and a background (wider than 16:9), like a real E2V sample."""
    import imageio_ffmpeg
    from PIL import Image

    out = root / "data81"
    marker = out / ".complete"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, w = DATA_SOURCE_HW
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(DATA_CLIPS):
        rng = np.random.default_rng(i)
        texture = rng.integers(0, 24, (h // 8, w // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
        writer = imageio_ffmpeg.write_frames(str(out / f"{i:03d}.mp4"), (w, h), fps=16, codec="libx264",
                                             quality=None, output_params=["-crf", "23"], macro_block_size=1,
                                             ffmpeg_log_level="error")
        writer.send(None)
        for f in range(DATA_FRAMES):  # a moving gradient, a textured floor and a moving disc
            base = np.stack([(xx + 9 * f) % 256, (yy + 5 * f) % 256, np.full_like(xx, 60 + 40 * i)], -1)
            frame = (base.astype(np.uint8) // 2 + texture)
            cy, cx = h // 2 + int(120 * np.sin(f / 9 + i)), int(w * (0.2 + 0.6 * f / DATA_FRAMES))
            frame[(yy - cy) ** 2 + (xx - cx) ** 2 < 90 ** 2] = (220, 60 + 30 * i, 40)
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        (out / f"{i:03d}.txt").write_text("a person walks past an object in front of a textured background")
        person = np.zeros((640, 400, 4), np.uint8)
        person[80:560, 60:340] = (200, 120, 90, 255)
        Image.fromarray(person, "RGBA").save(out / f"{i:03d}_person.png")
        Image.fromarray(rng.integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(out / f"{i:03d}_object.png")
        Image.fromarray(rng.integers(0, 255, (720, 1440, 3), dtype=np.uint8)).save(out / f"{i:03d}_background.png")
    marker.write_text("ok")
    return out


def decode_decord(path) -> np.ndarray:
    """What e2v.media.load_video does before resizing: decord, one thread, a batch of indices."""
    from e2v.media import _reader, frame_indices

    vr = _reader(path)
    return vr.get_batch(frame_indices(len(vr), DATA_FRAMES)).asnumpy()


def decode_opencv(path) -> np.ndarray:
    """The alternative: OpenCV's VideoCapture, sequential reads, BGR -> RGB."""
    import cv2

    from e2v.media import MediaError, frame_indices

    cap = cv2.VideoCapture(str(path))
    frames = []
    while len(frames) < DATA_FRAMES:
        ok, bgr = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    cap.release()
    if not frames:
        raise MediaError(f"cannot decode video {path} with OpenCV")
    return np.stack([frames[i] for i in frame_indices(len(frames), DATA_FRAMES)])


DECODERS = {"decord": decode_decord, "opencv": decode_opencv}


def timed_load_video(decode, phases: Phases):
    """e2v.media.load_video with a given decoder, decode and resize timed apart."""
    from e2v.media import frames_to_video

    def load_video(path, num_frames, height, width, *, stride=1, resize_mode="center_crop", reshape_mode="bicubic"):
        with phases("decode"):
            frames = decode(path)
        with phases("resize_to_tensor"):
            return frames_to_video(frames, height, width, resize_mode, reshape_mode)
    return load_video


def pil_frames_to_video(frames_FHWC, height: int, width: int):
    """The resize e2v.media.frames_to_video did before it resized whole clips in torch: PIL
    per frame (centre crop, bicubic), then the float conversion. Kept here to measure the gain."""
    import torch
    from PIL import Image

    from e2v.media import center_crop

    frames = np.stack([np.asarray(center_crop(Image.fromarray(f), height, width)) for f in frames_FHWC])
    return torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2).contiguous()


def resize_alternative(samples, h: int, w: int, repeats: int) -> dict:
    """e2v.media.frames_to_video (torch, whole clip) against PIL per frame on the same decoded
    clips, interleaved."""
    from e2v.media import frames_to_video

    cur, pil, diffs = [], [], []
    for _ in range(repeats):
        for s in samples[:2]:
            frames = decode_decord(s.video)
            t0 = time.perf_counter()
            a_CFHW = frames_to_video(frames, h, w)
            t1 = time.perf_counter()
            b_CFHW = pil_frames_to_video(frames, h, w)
            t2 = time.perf_counter()
            cur.append(t1 - t0)
            pil.append(t2 - t1)
            d = (a_CFHW - b_CFHW).abs() * 127.5
            diffs.append((d.mean().item(), d.max().item()))
            del a_CFHW, b_CFHW, d
    return {"current_ms": stats([1e3 * t for t in cur]), "pil_per_frame_ms": stats([1e3 * t for t in pil]),
            "speedup": round(statistics.median(pil) / statistics.median(cur), 2),
            "mean_abs_diff_levels": round(max(x[0] for x in diffs), 4),
            "max_abs_diff_levels": round(max(x[1] for x in diffs), 2)}


def child_data(a) -> dict:
    """Per sample (one core): decode, resize + to-tensor, and the element images (to 480x832 and
    to CLIP 512x512) inside the real E2VDataset.load, with decord and with OpenCV; then a
    DataLoader over the same dataset (decord, e2v's path) with 0, 1 and 2 workers."""
    import torch

    import e2v.data as data
    from e2v.data import E2VDataset, collate, index_samples

    torch.set_num_threads(1)  # a worker's view: one sample, one core
    root = make_data_clips(BENCH_DIR / "tmp")
    h, w = DATA_TARGET_HW
    cfg = make_config("tiny", root, None, [f"data.num_frames={DATA_FRAMES}", f"data.resolution=[{h},{w}]",
                                           "processors.clip.resolution=[512,512]", "train.micro_batch_size=1"])
    samples = index_samples(cfg, verbose=False)
    dataset = E2VDataset(cfg, samples)
    original = data.load_video
    per_decoder, first = {}, {}
    for r in range(a.data_repeats):
        for name in (DECODERS if r % 2 == 0 else list(DECODERS)[::-1]):
            for s in samples:
                ph = Phases(False)
                data.load_video = timed_load_video(DECODERS[name], ph)  # E2VDataset.load looks it up here
                try:
                    with ph("item"):
                        item = dataset.load(s)
                finally:
                    data.load_video = original
                ph.t["elements_and_rest"] = ph.t["item"] - ph.t["decode"] - ph.t["resize_to_tensor"]
                per_decoder.setdefault(name, []).append(ph.t)
                first.setdefault(name, item["video"])
    # Both decoders must hand over the same pixels, or this compares different work.
    diff = (first["decord"] - first["opencv"]).abs().mean().item() * 127.5
    decoders = {}
    for name, rows in per_decoder.items():
        decoders[name] = {k: stats([1e3 * t[k] for t in rows]) for k in ("decode", "resize_to_tensor",
                                                                          "elements_and_rest", "item")}
        decoders[name]["samples_per_s_one_core"] = round(1e3 / decoders[name]["item"]["median"], 3)

    scaling = {}
    for workers in (0, 1, 2):
        sub = torch.utils.data.Subset(dataset, [i % len(dataset) for i in range(a.loader_samples)])
        loader = torch.utils.data.DataLoader(sub, batch_size=1, collate_fn=collate, num_workers=workers,
                                             prefetch_factor=2 if workers else None)
        t0 = time.perf_counter()
        got = sum(1 for _ in loader)
        dt = time.perf_counter() - t0
        scaling[str(workers)] = {"samples": got, "seconds": round(dt, 3), "samples_per_s": round(got / dt, 3),
                                 "samples_per_s_per_worker": round(got / dt / max(1, workers), 3)}
    for v in scaling.values():
        v["speedup_vs_1_worker"] = round(v["samples_per_s"] / scaling["1"]["samples_per_s"], 3)
    return {"source_hw": list(DATA_SOURCE_HW), "target": [DATA_FRAMES, h, w], "clips": len(samples),
            "elements": "person RGBA 400x640 (pad_white), object 300x300 (pad_white), background 1440x720 "
                        "(center_crop); CLIP path 512x512",
            "decoders": decoders, "decoder_mean_abs_diff_levels": round(diff, 3), "dataloader_scaling": scaling,
            "resize_alternative": resize_alternative(samples, h, w, a.data_repeats),
            "video_tensor_mb": round(3 * DATA_FRAMES * h * w * 4 / 2**20, 1),
            "memory": {"peak_rss_mb": round(peak_rss_mb(), 1)}}


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
    p.add_argument("--sections", default="steps,data", help="comma list of: steps (includes overhead and memory), data")
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
    p.add_argument("--child", choices=["steps", "data", "check"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["online", "cached"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    full = dict(steps=8, overhead_rounds=6, overhead_steps=3, profile_steps=4, data_repeats=2, loader_samples=6)
    quick = dict(steps=3, overhead_rounds=2, overhead_steps=2, profile_steps=2, data_repeats=1, loader_samples=4)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        result = {"steps": child_steps, "data": child_data, "check": child_check}[args.child](args)
        result["load1_end"], result["torch_threads"] = load1(), torch.get_num_threads()
        print("BENCH_JSON " + json.dumps(result), flush=True)
        return

    import torch

    if args.model and not (torch.cuda.is_available() or args.allow_cpu):
        raise SystemExit("--model needs a GPU (torch.cuda.is_available() is False here): the real Wan2.1 "
                         "transformer does not train on CPU. Run without --model for the CPU benchmarks.")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"steps", "data"}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from steps, data")
    (BENCH_DIR / "tmp").mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"[bench] {info['cpu']}, {info['cores']} cores, load {load1()}", flush=True)
    t0 = time.time()
    suffix = "_model" if args.model else ""
    if args.model:
        args.data_root = args.data_root or str(make_data_clips(BENCH_DIR / "tmp"))
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
    print(f"[bench] done in {time.time() - t0:.0f} s", flush=True)
    if not args.no_report:
        path = write_report()
        print(f"[bench] wrote {path}")


# --- RESULTS.md --------------------------------------------------------------------------------

PHASE_NAMES = {
    "data_wait": "data wait (main process: decode + preprocess, or cache file read)",
    "cache_assembly": "cached entries -> step tensors (conditions_from_cache)", "vae_encode": "VAE encode (target + condition)",
    "text_encode": "text encode (tokenize + UMT5)", "clip_encode": "CLIP encode (processor + vision)",
    "conditioning_other": "conditioning glue", "noise_and_input": "sigma, noise, model input",
    "forward_and_loss": "forward + loss", "loss_check": "non-finite loss check (all ranks)", "backward": "backward", "optimizer": "optimizer step",
    "logging": "logging (TensorBoard, tqdm, stop-signal check)",
}
KIND_NAMES = {"full": "train_e2v.py step (ZeRO-2, logging)", "engine": "engine step (ZeRO-2, no logging)",
              "bare": "bare PyTorch loop", "zero2_no_overlap": "ZeRO-2, overlap_comm off", "zero1": "ZeRO-1",
              "zero0": "ZeRO-0 (no partitioning)"}


def fmt(s: dict | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _load(r: dict) -> str:
    return f"{r.get('load1_before', '?')} -> {r.get('load1_after', '?')}"


def render_steps(res: dict, title: str) -> list[str]:
    out = [f"## 1. Step breakdown{title}", "",
           "One training step (gradient accumulation 1) as train_e2v.py runs it, split into phases; ms per step, "
           "median (min-max) over the timed steps. *Online*: DataLoader (0 workers) + VAE / UMT5 / CLIP every step. "
           "*Cached*: `cache.enabled` with the entries tools/precompute.py wrote (e2v/cache.py): the DataLoader "
           "reads one safetensors file per sample, conditions_from_cache builds the step's tensors, no encoder is "
           "loaded.", ""]
    for preset, r in res["presets"].items():
        on, ca = r["online"], r["cached"]
        out += [f"**{preset}**: batch {on['batch']}, {on['frames']} x {on['resolution'][0]} x {on['resolution'][1]} "
                f"pixels -> latents {' x '.join(map(str, on['latent_shape']))}; transformer "
                f"{on['transformer_params_M']} M params ({on['trainable_params_M']} M trainable: LoRA + the "
                f"modules e2v_tiny.yaml trains in full); {on['phases_ms']['forward_and_loss']['n']} timed steps, "
                f"torch threads {on.get('torch_threads', '?')}; "
                f"load {_load(on)} (online), {_load(ca)} (cached).", "",
                "| phase | online ms | share | cached ms | share |", "|---|---|---|---|---|"]
        ton, tca = on["step_ms"]["median"], ca["step_ms"]["median"]
        for p in STEP_PHASES:
            a, b = on["phases_ms"].get(p), ca["phases_ms"].get(p)
            if a is None and b is None:
                continue
            share = lambda x, t: f"{100 * x['median'] / t:.0f}%" if x else "-"  # noqa: E731
            out.append(f"| {PHASE_NAMES[p]} | {fmt(a, 2)} | {share(a, ton)} | {fmt(b, 2)} | {share(b, tca)} |")
        pre = r.get("precompute", {})
        out += [f"| **step** | **{fmt(on['step_ms'])}** | | **{fmt(ca['step_ms'])}** | |", "",
                f"online / cached step: **{r['online_over_cached']}x**. Filling the cache "
                f"(tools/precompute.py, {pre.get('samples', '?')} samples, process start included): "
                f"{pre.get('wall_s', '?')} s.", ""]
    return out


def render_overhead(res: dict, title: str) -> list[str]:
    out = [f"## 2. Overhead: the train_e2v.py step against a bare PyTorch loop{title}", "",
           "Cached tensors, the same model (copies of one initial state) and batches. Each round runs every "
           "kind for a few steps, the order reversed every other round; a kind's time is its per-round median, "
           "the ratio is per round, then median (min-max) over rounds. The bare loop is forward, loss, backward, "
           "clip_grad_norm_, torch AdamW, LambdaLR, zero_grad. Same work, checked: from the same initial weights "
           "the engine and the bare loop give the same losses step for step (max |diff| below).", ""]
    for preset, r in res["presets"].items():
        o = r["cached"].get("overhead")
        if not o:
            continue
        k = o["kinds"]
        eq = o["equivalence"]
        same = (f"losses engine vs bare over {eq['steps']} steps: max |diff| {eq['max_abs_diff']:.1e}" if eq
                else "same-work check skipped for a real model")
        out += [f"**{preset}** ({o['rounds']} rounds x {o['steps_per_round']} steps; {same})", "",
                "| step | ms | ratio over bare | forward + loss | backward | optimizer | logging |",
                "|---|---|---|---|---|---|---|"]
        for kind, v in k.items():
            ph = v["phases_ms"]
            cells = [fmt(ph.get(p), 2) for p in ("forward_and_loss", "backward", "optimizer", "logging")]
            out.append(f"| {KIND_NAMES.get(kind, kind)} | {fmt(v['step_ms'], 2)} | "
                       f"**{fmt(v['ratio_over_bare'], 3)}** | " + " | ".join(cells) + " |")
        verdict = "within" if o["within_goal"] else "OVER"
        prof = o["profile"]
        logs = ", ".join(f"{p.split('/')[1].replace('_', ' ')} {v['median']:.2f}"
                         for p, v in k["full"]["phases_ms"].items() if p.startswith("logging/"))
        calls = prof["python_calls_per_step"]
        files = ", ".join(f"{x['file']} {x['extra_ms']:+.2f}" for x in prof["top_files"][:4])
        funcs = ", ".join(f"{x['function'].split('/')[-1]} {x['extra_ms']:+.2f} ({x['calls_per_step']:g} calls)"
                          for x in prof["top_functions"][:4])
        out += ["", f"train_e2v.py step / bare: **{k['full']['ratio_over_bare']['median']:.3f}x**, {verdict} the "
                f"{o['goal']}x goal. Where the extra time goes (cProfile own time, full minus bare, ms per step; "
                f"cProfile inflates Python-heavy code, so this is a ranking): by file {files}; "
                f"by function {funcs}. Python function calls per step: {calls['full']} (train_e2v.py step) "
                f"against {calls['bare']} (bare). The logging phase, ms: {logs}.", ""]
    return out


def render_data(d: dict) -> list[str]:
    t = d["target"]
    out = ["## 3. Data pipeline at 81 x 480 x 832", "",
           f"{d['clips']} synthetic clips, {t[0]} frames at {d['source_hw'][0]}x{d['source_hw'][1]} (H.264, CRF 23), "
           f"centre-cropped and resized (torch antialiased bicubic, e2v.media) to {t[1]}x{t[2]}; elements: {d['elements']}. One sample is "
           f"one E2VDataset.load: a {d['video_tensor_mb']} MB float32 video tensor. ms per sample, one torch thread, "
           f"median (min-max) over {d['decoders']['decord']['item']['n']} loads. Decoded pixels of the two "
           f"decoders differ by {d['decoder_mean_abs_diff_levels']} levels (mean |diff|, of 255). "
           f"Load {_load(d)}.", "",
           "| decoder | decode | resize + to tensor | elements + rest | whole sample | samples/s (1 core) |",
           "|---|---|---|---|---|---|"]
    for name, v in d["decoders"].items():
        out.append(f"| {name} | {fmt(v['decode'])} | {fmt(v['resize_to_tensor'])} | {fmt(v['elements_and_rest'])} | "
                   f"{fmt(v['item'])} | {v['samples_per_s_one_core']} |")
    dec = d["decoders"]
    r = dec["opencv"]["decode"]["median"] / dec["decord"]["decode"]["median"]
    share = dec["decord"]["resize_to_tensor"]["median"] / dec["decord"]["item"]["median"]
    alt = d.get("resize_alternative")
    out += ["", f"OpenCV / decord decode time: **{r:.2f}x**. Resize + to-tensor is **{100 * share:.0f}%** of a "
            f"decord sample."]
    if alt:
        out += ["", f"Resize before and after: e2v.media.frames_to_video resizes the whole clip with torch's "
                f"antialiased filter on uint8 ({fmt(alt['current_ms'])} ms); PIL per frame, as it did before "
                f"(`pil_frames_to_video` here), takes {fmt(alt['pil_per_frame_ms'])} ms: **{alt['speedup']}x**; "
                f"pixels differ by {alt['mean_abs_diff_levels']} levels on average, "
                f"{alt['max_abs_diff_levels']} at most (of 255)."]
    out += ["", "DataLoader over the same samples (decord, batch 1, wall time from the first "
            "`iter` to the last sample, worker start-up included):", "",
            "| workers | samples | seconds | samples/s | per worker | vs 1 worker |", "|---|---|---|---|---|---|"]
    for w, v in d["dataloader_scaling"].items():
        out.append(f"| {w} | {v['samples']} | {v['seconds']} | {v['samples_per_s']} | {v['samples_per_s_per_worker']} "
                   f"| {v['speedup_vs_1_worker']}x |")
    return out + [""]


def render_memory(res: dict | None, data: dict | None, title: str) -> list[str]:
    out = [f"## 4. Peak memory{title}", "",
           "One fresh process per configuration (ru_maxrss only grows), read after the timed steps. RSS at start: "
           "the interpreter with torch imported. The cached process also holds one copy of the initial "
           "transformer for section 2 (its other copies come after this was read).", "", "| configuration | RSS at start MB | peak RSS MB | CUDA max allocated MB |",
           "|---|---|---|---|"]
    for preset, r in (res or {}).get("presets", {}).items():
        for mode in ("online", "cached"):
            m = r[mode]["memory"]
            out.append(f"| {preset} {mode} | {m['rss_at_start_mb']} | {m['peak_rss_mb']} | "
                       f"{m['cuda_max_allocated_mb'] if m['cuda_max_allocated_mb'] is not None else '-'} |")
    if data:
        out.append(f"| data pipeline (81 x 480 x 832, 2 decoders) | - | {data['memory']['peak_rss_mb']} | - |")
    return out + [""]


def _loads(node) -> list[float]:
    """Every load1_* value recorded anywhere in the results."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k.startswith("load1_") and isinstance(v, (int, float))] + \
            [x for v in node.values() for x in _loads(v)]
    return []


def render_summary(steps: dict | None, data: dict | None) -> list[str]:
    """The headline numbers, computed from the tables below (so they never disagree with them)."""
    out = ["## Summary", ""]
    for preset, r in (steps or {}).get("presets", {}).items():
        on = r["online"]
        top = max((p for p in STEP_PHASES if p in on["phases_ms"]), key=lambda p: on["phases_ms"][p]["median"])
        share = on["phases_ms"][top]["median"] / on["step_ms"]["median"]
        out.append(f"- {preset}, online: the largest phase is {PHASE_NAMES[top]} ({100 * share:.0f}% of the step); "
                   f"the cached step is {r['online_over_cached']}x faster.")
        o = r["cached"].get("overhead")
        if o:
            full = o["kinds"]["full"]["ratio_over_bare"]["median"]
            engine = o["kinds"]["engine"]["ratio_over_bare"]["median"]
            extra = o["kinds"]["full"]["step_ms"]["median"] - o["kinds"]["bare"]["step_ms"]["median"]
            out.append(f"- {preset}, overhead: train_e2v.py step / bare loop {full:.3f}x "
                       f"({'within' if o['within_goal'] else 'over'} {o['goal']}x; {extra:+.2f} ms per step), "
                       f"engine alone {engine:.3f}x; largest extra Python time in "
                       f"{o['profile']['top_files'][0]['file']}.")
    if data:
        dec = data["decoders"]["decord"]
        stage = max(("decode", "resize_to_tensor", "elements_and_rest"), key=lambda k: dec[k]["median"])
        sc = data["dataloader_scaling"]
        alt = data.get("resize_alternative")
        out.append(f"- data at 81 x 480 x 832: {dec['samples_per_s_one_core']} samples/s per core (decord); the "
                   f"largest stage is {stage.replace('_', ' ')} ({100 * dec[stage]['median'] / dec['item']['median']:.0f}%)"
                   + (f" (torch whole-clip resize, {alt['speedup']}x faster than PIL per frame)" if alt else "")
                   + f"; 2 workers give {sc['2']['speedup_vs_1_worker']}x the throughput of 1.")
    return out + [""] if len(out) > 2 else []


def render(bench_dir: Path = BENCH_DIR) -> Path:
    results = {p.stem: json.loads(p.read_text()) for p in sorted((bench_dir / "results").glob("*.json"))}
    any_res = next(iter(results.values()), None)
    lines = ["# Benchmarks", "",
             "Written by `make bench` (`python tools/bench.py`); do not edit by hand, rerun it. Raw numbers: "
             "`bench/results/*.json`. Times are ms, median (min-max) over repeats; absolute times depend on the "
             "machine and on its load (the 1-minute load average before -> after each run is given), the ratios "
             "are what compare across machines.", ""]
    if any_res:
        m = any_res["machine"]
        v = ", ".join(f"{k} {x}" for k, x in m["versions"].items() if x)
        lines += [f"- Machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}), "
                  f"GPU: {m['gpu'] or 'none'}", f"- Versions: Python {m['python']}, {v}",
                  "- Date: " + ", ".join(f"{k} {r['machine']['date_utc']}"
                                         + (f" (took {r['section_wall_s']:.0f} s)" if "section_wall_s" in r else "")
                                         + (" (--quick: too few repeats to trust)" if r.get("quick") else "")
                                         for k, r in results.items()),
                  f"- Load: the 1-minute load average of this {m['cores']}-core machine was "
                  f"{min(_loads(results)):.2f} to {max(_loads(results)):.2f} while these ran (each table gives "
                  f"its own). A load above {m['cores']} means other processes competed for the cores: times are "
                  f"inflated, ratios measured interleaved less so.",
                  ""]
    steps = results.get("steps")
    lines += render_summary(steps, results.get("data"))
    if steps:
        lines += render_steps(steps, "") + render_overhead(steps, "")
    if "data" in results:
        lines += render_data(results["data"])
    lines += render_memory(steps, results.get("data"), "")
    model = results.get("steps_model")
    lines += ["## 5. Real model (`--model PATH`, GPU)", ""]
    if model:
        lines += render_steps(model, " (real model)") + render_overhead(model, " (real model)")
        lines += render_memory(model, None, " (real model)")
    else:
        lines += ["Not run here (no GPU on this machine). On a GPU machine with a Wan2.1 diffusers folder:", "",
                  "    python tools/bench.py --model /path/to/Wan2.1-I2V-14B-480P-Diffusers [--set data.num_frames=33] "
                  "[--overhead-rounds 0]", "",
                  "runs sections 1, 2 and 4 for that model (81 x 480 x 832, batch 1, bf16, on the 720p bench clips) "
                  "into bench/results/steps_model.json, with torch.cuda.max_memory_allocated per configuration. "
                  "Section 2 keeps a second copy of the transformer for the bare loop: use --overhead-rounds 0 for "
                  "a model that does not fit twice.", ""]
    path = bench_dir / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


def write_report() -> Path:
    return render(BENCH_DIR)


if __name__ == "__main__":
    main()
