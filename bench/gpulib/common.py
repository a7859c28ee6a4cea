"""What the GPU check's sections share: the sizes they run at, the call's context and budget, the
model folders and data they build, and the training launches (through a wrapper that records the
peak CUDA memory and can cap it)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

# The GPU check runs with the machine's own interpreter, e2v not installed in it (`make gpu-check`
# installs no package: docs/gpu.md): e2v and bench are found from the checkout's root.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
GIB = 2**30
LIMIT_GIB = 24.0  # the "small GPU" this check holds the 24 GB configs to
TORCH_ADAM = "deepspeed.optimizer=torch_adamw"  # torch's AdamW (the default): nothing is JIT-built, said explicitly
# Two runs of one bf16 step with a different place for the saved activations: the forward is the
# same computation (first loss equal to ~1e-3), later losses follow slightly different reductions.
LOSS_RTOL = {1: 1e-3, 2: 1e-2}
PARTITIONED = "partitioned at load (zero.Init"  # e2v/models/zero3_load.py's line


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a section runs at: the real shapes on a GPU, tiny ones with --allow-cpu."""
    frames: int  # the 1.3B step, the VAE and the 24 GB runs
    size: int  # square clips; the trainer center-crops `resolution`
    resolution: tuple[int, int]
    offload_frames: int  # the activation-offload pair
    main_frames: int  # the main path (its point is the code path at real widths, not the size)
    steps: int  # timed steps of the step section, and steps of the main path before its resume
    samples: int  # clips in the generated dataset


REAL = Sizes(frames=81, size=832, resolution=(480, 832), offload_frames=33, main_frames=17, steps=3, samples=2)
TINY = Sizes(frames=17, size=64, resolution=(64, 64), offload_frames=9, main_frames=9, steps=2, samples=2)


@dataclasses.dataclass
class Ctx:
    cuda: bool
    sizes: Sizes
    work: Path
    deadline: float  # time.monotonic() at which the call's budget ends
    folders: dict = dataclasses.field(default_factory=dict)
    only: list = dataclasses.field(default_factory=list)  # --only's sections (empty: all)
    packages: dict = dataclasses.field(default_factory=lambda: {"installed_from": None, "problems": {}})

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def res_set(self) -> str:
        return f"data.resolution=[{self.sizes.resolution[0]},{self.sizes.resolution[1]}]"




def model_folders(ctx: Ctx, kind: str) -> dict[str, Path]:
    """Random-weight folders: kind "1.3b" (Wan2.1-T2V-1.3B + CLIP ViT-H/14), "wide" (I2V-14B
    widths, 2 layers + a 2-layer CLIP); with --allow-cpu the tiny preset's folders for both."""
    from bench.smokelib.build import build_folders, build_tiny_folders

    if kind not in ctx.folders:
        if not ctx.cuda:
            tiny = build_tiny_folders(ctx.work / "tiny_folders")
            ctx.folders.update({"1.3b": {"t2v": tiny["t2v"], "clip": tiny["clip"]},
                                "wide": {"t2v": tiny["i2v"], "clip": tiny["clip"]}})
        else:
            scale = {"1.3b": "full", "wide": "wide"}[kind]
            ctx.folders[kind] = build_folders(ROOT / "smoke_real", scale, log=lambda m: print(m, flush=True))
    return ctx.folders[kind]


def demo_data_command(out: Path, sizes: Sizes, frames: int | None = None, samples: int | None = None) -> list[str]:
    """tools/make_demo_dataset.py at these sizes, as .npz frames (no ffmpeg on the GPU machines);
    --real-size when the size is beyond a demo's."""
    cmd = [sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(out), "--num-samples",
           str(samples or sizes.samples), "--size", str(sizes.size), "--frames", str(frames or sizes.frames),
           "--video-format", "npz"]
    return cmd + (["--real-size"] if sizes.size > 512 or (frames or sizes.frames) > 33 else [])


def dataset(ctx: Ctx, name: str, **kw) -> Path:
    out = ctx.work / name
    subprocess.run(demo_data_command(out, ctx.sizes, **kw), check=True, capture_output=True)
    return out


def tiny_dataset(ctx: Ctx) -> Path:
    """8 samples at 17 x 64 x 64 for the tiny presets, on a GPU too (validation holds 2 out)."""
    out = ctx.work / "data_tiny"
    subprocess.run(demo_data_command(out, TINY, samples=8), check=True, capture_output=True)
    return out


WRAPPER = r"""
import atexit, json, os, runpy, sys, torch
sys.path.insert(0, {root!r})
info = {{}}
if torch.cuda.is_available() and {fraction_gib!r}:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, {fraction_gib!r} * 2**30 / total), 0)
    info["fraction"] = {fraction_gib!r} * 2**30 / total

def write():
    if torch.cuda.is_available():
        info.update(max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    max_memory_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
    if os.environ.get("RANK", "0") == "0":
        open({out!r}, "w").write(json.dumps(info))

atexit.register(write)
try:
    runpy.run_path({train!r}, run_name="__main__")
except torch.OutOfMemoryError as e:
    info["oom"] = str(e)[:3000]
    raise
"""


def write_wrapper(ctx: Ctx, name: str, fraction_gib: float | None = None) -> tuple[Path, Path]:
    """train_e2v.py run through a wrapper that records the rank's peak CUDA memory at exit (an
    out-of-memory error too) and, with `fraction_gib`, caps the process at that much of the GPU."""
    peak, script = ctx.work / f"{name}_peak.json", ctx.work / f"{name}_train.py"
    peak.unlink(missing_ok=True)
    script.write_text(WRAPPER.format(root=str(ROOT), out=str(peak), train=str(ROOT / "train_e2v.py"),
                                     fraction_gib=fraction_gib))
    return script, peak


def start_training(name: str, config: str, sets: list[str], script: Path, extra: list[str], log_dir: Path,
                   timeout: float) -> dict:
    """`deepspeed --num_gpus 1 <script> --config ... --set ...` as a user types it (tests swap in
    their warm launcher). -> rc, wall_s, log"""
    from bench.smokelib.measure import run_measured
    from e2v.runtime.launch import train_command

    return run_measured(name, train_command(config, *sets, script=script, extra=tuple(extra)), log_dir, timeout=timeout)


def train(ctx: Ctx, name: str, config: str, sets: list[str], fraction_gib: float | None = None,
          extra: tuple = ()) -> dict:
    """One training launch: rc, losses, step times, peak CUDA memory (GiB), the log's tail on failure."""
    from e2v.runtime.launch import read_scalars

    script, peak = write_wrapper(ctx, name, fraction_gib)
    r = start_training(name, config, sets + [TORCH_ADAM], script, list(extra), ctx.work / "logs", max(ctx.left(), 10))
    scalars = read_scalars(ctx.work / "runs" / name)
    r["losses"] = {s: v["train/loss"] for s, v in sorted(scalars.items()) if "train/loss" in v}
    r["val_loss"] = {s: v["val/loss"] for s, v in sorted(scalars.items()) if "val/loss" in v}
    times = [v["perf/step_time_s"] for s, v in sorted(scalars.items()) if "perf/step_time_s" in v]
    r["step_time_s"] = times
    r["step_time_after_first_s"] = sum(times[1:]) / len(times[1:]) if len(times) > 1 else None
    r.update(json.loads(peak.read_text()) if peak.exists() else {})
    r["passed"] = r["rc"] == 0 and bool(r["losses"])
    log = Path(r["log"]) if Path(r["log"]).is_absolute() else ROOT / r["log"]
    r["log_text_tail"] = "" if r["passed"] else "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return r


def run_sets(ctx: Ctx, name: str, data: Path, steps: int, frames: int) -> list[str]:
    return [f"data.datasets.0.data_root={data}", f"output_dir={ctx.work / 'runs'}", f"run_id={name}",
            f"train.max_steps={steps}", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
            f"train.checkpoint_every={steps}", "train.log_every=1", "validation.every_n_steps=0",
            "visualization.enabled=false", f"data.num_frames={frames}", ctx.res_set, "data.num_workers=0"]


def precompute(ctx: Ctx, config: str, sets: list[str]) -> dict:
    """tools/precompute.py with the run's settings (on the GPU when there is one)."""
    cmd = [sys.executable, str(ROOT / "tools/precompute.py"), "--config", config]
    cmd += [a for s in sets + [TORCH_ADAM] if s != "cache.enabled=true" for a in ("--set", s)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(ctx.left(), 10))
    return {"rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1),
            "error": p.stderr[-2000:] if p.returncode else None}


def gpu_estimate(config: str, sets: list[str], gpu_mem_gb: float = LIMIT_GIB) -> dict:
    """tools/estimate_memory.py's row for the config as set (GiB per GPU), and whether it fits."""
    from e2v.config.load import load_config
    from e2v.train.memory import estimate

    cfg = load_config(str(ROOT / config), sets, check_paths=False)
    row = estimate(cfg, 1, gpu_mem_gb)["configured"]
    return {"gpu_total_gib": round(row["gpu_total_gb"], 2), "validation_gib": round(row["validation_gb"], 2),
            "fits": row["fits"], "activations_gib": round(row["activations_gb"], 2), "params_gib": round(row["params_gb"], 2)}


def capped_sets(ctx: Ctx, name: str, kind: str, data: Path, steps: int, validation: tuple[str, ...] = ()) -> list[str]:
    """The --set list of a 24 GB config's capped run: the model folders of `kind`, run_sets, the run's
    own cache folder; `validation` replaces run_sets' validation keys (validation off)."""
    folders = model_folders(ctx, kind)
    sets = [f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}"]
    sets += [s for s in run_sets(ctx, name, data, steps, ctx.sizes.frames) if not (validation and s.startswith("validation."))]
    return sets + list(validation) + [f"cache.dir={ctx.work / ('cache_' + name)}"]


def capped_run(ctx: Ctx, name: str, config: str, sets: list[str]) -> dict:
    """A 24 GB config from its cache (tools/precompute.py first, uncapped), then trained capped at
    LIMIT_GIB: the precompute, tools/estimate_memory.py's row, the run and its verdict (verdict_24gb)."""
    r = {"precompute": precompute(ctx, config, sets), "estimate": gpu_estimate(config, sets)}
    if r["precompute"]["rc"] != 0:
        return {**r, "passed": False}
    r["run"] = train(ctx, name, config, sets, fraction_gib=LIMIT_GIB)
    return {**r, **verdict_24gb(r["run"])}


def verdict_24gb(run: dict) -> dict:
    """Pass, or by how much the run exceeded the cap: what the allocator held at its peak plus the
    allocation it was refused (the out-of-memory message's "Tried to allocate"). Without a peak
    read (a crash before the wrapper's exit hook), only the refused size: an upper bound, since the
    process held at most the cap."""
    oom = run.get("oom") or ("out of memory" in run.get("log_text_tail", "").lower() and run["log_text_tail"]) or ""
    if not oom:
        return {"passed": run["passed"], "exceeds_by_gib": None}
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB)", oom)
    refused = (float(m.group(1)) / (1 if m.group(2) == "GiB" else 1024)) if m else None
    held = run.get("max_memory_reserved_gib") or run.get("max_memory_allocated_gib")
    exceeds = round(held + refused - LIMIT_GIB, 2) if held is not None and refused is not None else None
    return {"passed": False, "oom": True, "refused_gib": refused, "exceeds_by_gib": exceeds}
