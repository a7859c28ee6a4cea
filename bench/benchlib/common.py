"""What every bench section shares: paths, presets, the config of one configuration, and timing.
Torch-free at import, so the parent process and the report writer stay light."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"
TINY_CONFIG = ROOT / "configs" / "e2v_tiny_lora.yaml"
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
# The real-model run (--model): A2's training shape, batch 1, bf16 (override with --set). Gradient
# checkpointing on: without it the 14B transformer's activations at 81 x 480 x 832 are ~373 GB,
# which no GPU holds (docs/architecture.md, "Precision and activation memory"; tools/estimate_memory.py
# gives the numbers). Checkpointing gives bit-identical losses, so the step measured is the step trained.
MODEL_OVERRIDES = ["model.preset=null", "data.num_frames=81", "data.resolution=[480,832]",
                   "processors.clip.resolution=[512,512]", "train.micro_batch_size=1",
                   "train.mixed_precision=bf16", "train.gradient_checkpointing=true"]

STEP_PHASES = ["data_wait", "cache_assembly", "vae_encode", "text_encode", "clip_encode", "conditioning_other",
               "noise_and_input", "forward_and_loss", "loss_check", "backward", "optimizer", "logging"]


def stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def summarise_phases(steps: list[dict]) -> dict:
    """Per phase, ms: stats over steps; sub-phases (`logging/...`) after the top-level ones."""
    names = STEP_PHASES + sorted({k for s in steps for k in s if "/" in k})
    return {p: stats([1e3 * s.get(p, 0.0) for s in steps]) for p in names if any(p in s for s in steps)}


class Phases:
    """Accumulates the time of each named phase of one step: wall time on a CPU; on CUDA the time
    between two CUDA events recorded around the phase, after a synchronisation, so asynchronous
    kernels are charged to the phase that launched them and the figure is the GPU's own clock."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda = cuda
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
        self.t: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        if self.cuda:
            start, end = self.event(), self.event()
            start.record()
        try:
            yield
        finally:
            if self.cuda:
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3  # ms -> s
            else:
                seconds = time.perf_counter() - t0
            self.t[name] = self.t.get(name, 0.0) + seconds


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


# --- the config of one configuration ------------------------------------------------------------


def cache_dir(preset: str) -> Path:
    return BENCH_DIR / "tmp" / f"cache_{preset}"


def config_sets(preset: str, data_root: Path, model: str | None, extra_sets: list[str], cached: bool) -> list[str]:
    """--set overrides of configs/e2v_tiny_lora.yaml for one configuration; tools/precompute.py gets the
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


def make_config(preset: str, data_root: Path, model: str | None, extra_sets: list[str], cached: bool = False):
    from e2v.config.load import load_config

    return load_config(TINY_CONFIG, config_sets(preset, data_root, model, extra_sets, cached))
