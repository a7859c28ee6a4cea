"""`make gpu-check`: what a user decides by, measured on one CUDA GPU in one call of at most 8
minutes (`--budget`, default 480 s). Sections run in order of value, each with its own time budget;
a section the remaining time cannot finish is skipped and says so (the budgets add up to more than
480 s: the last sections of a default call may be skipped; `--only` runs them in another). bench/RESULTS_GPU.md and
bench/results/gpu.json are rewritten after EVERY section, so a call cut short keeps what it measured.

  environment         GPU, driver, torch / CUDA / deepspeed / diffusers versions, TORCH_CUDA_ARCH_LIST,
                      the optimizer the plan picks and why (this check sets torch's AdamW explicitly:
                      deepspeed.torch_adam=true, so nothing is JIT-built)
  step_1.3b           Wan2.1-T2V-1.3B expanded for elements, real shapes with random weights
                      (tools/smokelib/build.py), 81 x 480 x 832, ZeRO-2, checkpointing: the online step
                      and, after tools/precompute.py on the GPU, the cached step, split into phases
                      (VAE encodes, CLIP, text, forward, backward, optimizer) timed with CUDA events
                      (tools/bench.py --model: the step is train_e2v.py's), torch.cuda.max_memory_allocated
                      against tools/estimate_memory.py
  vae_dtype           model.vae_dtype bf16 against fp32 (the default, as A2 encodes): encode time of one
                      81 x 480 x 832 clip and the relative error of its latents
  main_path           configs/e2v.yaml's path at the I2V-14B widths with 2 layers: zero3_offload with the
                      transformer partitioned at load, 3 steps, `--resume latest` for a 4th, the export,
                      and tools/sample.py on it (the mp4 must not be constant)
  gpu_24gb            configs/e2v_t2v_1.3b_24gb.yaml (real 1.3B shapes) and configs/e2v_24gb.yaml (the
                      I2V-14B widths, 2 layers: under zero3_offload with activation offload a GPU holds
                      one working layer, so its peak does not grow with depth) under
                      torch.cuda.set_per_process_memory_fraction = 24 GiB: pass, or by how much they exceed
  activation_offload  train.activation_offload off and on at 33 x 480 x 832 (1.3B): equal losses, step
                      time, peak memory
  wan22               the tiny Wan2.2 TI2V and two-expert presets through training and validation
  attention           which scaled-dot-product-attention kernel a bf16 Wan forward launches

    python tools/gpu_check.py                       # everything, 480 s
    python tools/gpu_check.py --only step_1.3b      # one section (comma list for several)
    python tools/gpu_check.py --budget 240          # a shorter slot: the later sections are skipped
    python tools/gpu_check.py --allow-cpu           # every section at tiny sizes on the CPU (tests);
                                                    # writes under bench/tmp/ unless --out

Without CUDA (and without --allow-cpu) it exits at once (status 2) with one line; nothing is written.

Running it on a fresh GPU machine. Such a machine has a CUDA torch, transformers and peft, but
often no deepspeed, diffusers, decord or imageio-ffmpeg, no network and no ffmpeg. Before the slot,
on a machine with network, build the wheels and carry them with the checkout:
    pip wheel --no-deps -w wheels deepspeed==0.19.8 diffusers==0.42.1 decord==0.6.0 imageio-ffmpeg
(deepspeed's is built from its sdist: no ops are compiled then, and this check compiles none at
run time; imageio-ffmpeg's wheel carries an ffmpeg binary, which tools/sample.py's mp4 needs).
On the GPU machine:
    pip install --no-deps wheels/*.whl && python tools/gpu_check.py
Leave TORCH_CUDA_ARCH_LIST unset, or give plain numbers (e.g. "9.0"): DeepSpeed 0.19.8's op builder
fails on "9.0a" (int('0a')) when anything JIT-builds an op; the environment section records it.
The data is generated here without ffmpeg (tools/make_demo_dataset.py --real-size --video-format
npz: 81 x 832 x 832 uint8 frames; the trainer center-crops 480 x 832), and so are the random-weight
model folders (smoke_real/, ~1 min on 16 cores; kept for a second call on the same machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 2**30
LIMIT_GIB = 24.0  # the "small GPU" this check holds the 24 GB configs to
TORCH_ADAM = "deepspeed.torch_adam=true"  # torch's AdamW: no JIT build, whatever the default becomes
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

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def res_set(self) -> str:
        return f"data.resolution=[{self.sizes.resolution[0]},{self.sizes.resolution[1]}]"


# --- what the sections share: model folders, data, training launches ---------------------------


def model_folders(ctx: Ctx, kind: str) -> dict[str, Path]:
    """Random-weight folders: kind "1.3b" (Wan2.1-T2V-1.3B + CLIP ViT-H/14), "wide" (I2V-14B
    widths, 2 layers + a 2-layer CLIP); with --allow-cpu the tiny preset's folders for both."""
    from tools.smokelib.build import build_folders, build_tiny_folders

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
    from tools.smokelib.measure import run_measured, train_command

    return run_measured(name, train_command(config, *sets, script=script, extra=tuple(extra)), log_dir, timeout=timeout)


def train(ctx: Ctx, name: str, config: str, sets: list[str], fraction_gib: float | None = None,
          extra: tuple = ()) -> dict:
    """One training launch: rc, losses, step times, peak CUDA memory (GiB), the log's tail on failure."""
    from tools.smokelib.measure import read_scalars

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
    from tools.estimate_memory import estimate

    cfg = load_config(str(ROOT / config), sets, check_paths=False)
    row = estimate(cfg, 1, gpu_mem_gb)["configured"]
    return {"gpu_total_gib": round(row["gpu_total_gb"], 2), "fits": row["fits"],
            "activations_gib": round(row["activations_gb"], 2), "params_gib": round(row["params_gb"], 2)}


# --- the sections -------------------------------------------------------------------------------


def section_environment(ctx: Ctx) -> dict:
    import importlib.metadata as md

    import torch

    from e2v.runtime.device import choose_adam

    versions = {}
    for pkg in ("torch", "deepspeed", "diffusers", "transformers", "peft", "decord", "imageio-ffmpeg"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    # the sections that need each: deepspeed every launch, diffusers every model, decord the mp4
    # clips of users' data (not this check's), imageio-ffmpeg the mp4s of sample.py and validation
    out = {"missing": [k for k, x in versions.items() if x is None and k != "decord"]}
    out |= {"versions": versions, "cuda": torch.version.cuda, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
           "device": "cpu"}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / GIB, 1),
                   capability=f"{props.major}.{props.minor}", arch_list_compiled=torch.cuda.get_arch_list())
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
            out["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    arch = out["TORCH_CUDA_ARCH_LIST"] or ""
    out["arch_list_problem"] = ("letters in TORCH_CUDA_ARCH_LIST break DeepSpeed 0.19.8's op builds (int('0a')); "
                                "this check builds none" if re.search(r"\d[a-z]", arch) else None)
    # What the plan picks: this check's explicit setting, and what the default would pick here.
    out["optimizer"] = {"this_check": choose_adam(True, ctx.cuda, False)[1]}
    for offload in (False, True):
        use_torch, why = choose_adam(None, ctx.cuda, offload)
        out["optimizer"][f"default_{'offload' if offload else 'gpu'}"] = why
    out["passed"] = not {"deepspeed", "diffusers"} & set(out["missing"])  # nothing else can run without them
    return out


def bench_command(folders: dict, data: Path, ctx: Ctx) -> list[str]:
    """tools/bench.py's step section on the 1.3B folder (--model: online, then tools/precompute.py,
    then cached, each in a fresh process; the overhead rounds off: they train a second copy)."""
    h, w = ctx.sizes.resolution
    cmd = [sys.executable, str(ROOT / "tools/bench.py"), "--model", str(folders["t2v"]), "--sections", "steps",
           "--steps", str(ctx.sizes.steps), "--warmup", "1", "--overhead-rounds", "0", "--no-report",
           "--data-root", str(data)]
    for s in ("model.base=t2v", f"model.image_encoder={folders['clip']}", TORCH_ADAM,
              f"data.num_frames={ctx.sizes.frames}", f"data.resolution=[{h},{w}]"):
        cmd += ["--set", s]
    return cmd + ([] if ctx.cuda else ["--allow-cpu"])


STEP_PHASES = {"vae_encode": "VAE encodes", "clip_encode": "CLIP", "text_encode": "text", "forward_and_loss": "forward",
               "backward": "backward", "optimizer": "optimizer", "data_wait": "data", "cache_assembly": "cache read"}


def read_bench(path: Path, estimates: dict) -> dict:
    """The online and cached runs of what `bench_command` wrote: median step, phase medians (ms),
    peak CUDA allocation against the estimate."""
    runs = json.loads(path.read_text())["presets"]["model"]
    out = {"precompute_s": runs["precompute"]["wall_s"], "online_over_cached": runs["online_over_cached"]}
    for mode in ("online", "cached"):
        r = runs[mode]
        alloc = r["memory"]["cuda_max_allocated_mb"]
        out[mode] = {"step_s": round(r["step_ms"]["median"] / 1e3, 3),
                     "phases_s": {k: round(r["phases_ms"][k]["median"] / 1e3, 3) for k in STEP_PHASES if k in r["phases_ms"]},
                     "max_memory_allocated_gib": round(alloc / 1024, 2) if alloc is not None else None,
                     "estimate_gib": estimates[mode], "latent_shape": r["latent_shape"], "device": r["device"]}
    return out


def section_step(ctx: Ctx) -> dict:
    from tools.benchlib.common import config_sets

    folders = model_folders(ctx, "1.3b")
    data = dataset(ctx, "data_e2v")
    cmd = bench_command(folders, data, ctx)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(ctx.left(), 10))
    if p.returncode != 0:
        return {"passed": False, "command": " ".join(cmd), "error": (p.stdout[-1500:] + p.stderr[-3000:])}
    sets = [s for i, s in enumerate(cmd) if i and cmd[i - 1] == "--set"]
    estimates = {mode: gpu_estimate("configs/e2v_tiny_lora.yaml",
                                    config_sets("model", data, str(folders["t2v"]), sets, mode == "cached"),
                                    gpu_mem_gb=80)["gpu_total_gib"] for mode in ("online", "cached")}
    written = ROOT / ("bench/results" if ctx.cuda else "bench/tmp/results") / "steps_model.json"
    out = read_bench(written, estimates)
    out["command"] = " ".join(cmd)
    out["passed"] = out["online"]["step_s"] > 0 and out["cached"]["step_s"] > 0
    return out


def section_vae_dtype(ctx: Ctx) -> dict:
    """One clip of the generated data encoded by the VAE as model.vae_dtype loads it, fp32 then bf16
    (e2v.conditioning.encode.encode_video, posterior mean): time (after a warm-up encode) and
    |z_bf16 - z_fp32| / |z_fp32| over the whole latent."""
    import torch

    from e2v.conditioning.encode import encode_video
    from e2v.config.load import load_config
    from e2v.data.media import load_video
    from e2v.models.load import load_parts

    folders = model_folders(ctx, "1.3b")
    data = dataset(ctx, "data_e2v")
    h, w = ctx.sizes.resolution
    clip = next(p for p in sorted(data.iterdir()) if p.suffix == ".npz")
    video = load_video(clip, ctx.sizes.frames, h, w)[None]  # uint8 [1, 3, F, H, W]
    device = "cuda" if ctx.cuda else "cpu"
    out, latents = {"clip": f"{ctx.sizes.frames} x {h} x {w}"}, {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config(str(ROOT / "configs/e2v_t2v_1.3b.yaml"),
                          [f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}",
                           f"model.vae_dtype={dtype}", "e2v_type=vae"], check_paths=False)
        vae = load_parts(cfg, device=device, with_transformer=False).vae
        times = []
        with torch.no_grad():
            for _ in range(2):  # the first allocates and picks kernels
                if ctx.cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                z = encode_video(video, vae, sample_mode="argmax")
                if ctx.cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        latents[dtype] = z.float().cpu()
        out[dtype] = {"encode_s": round(times[-1], 3), "vae_param_dtype": str(next(vae.parameters()).dtype)}
        del vae
        if ctx.cuda:
            torch.cuda.empty_cache()
    ref = latents["fp32"]
    out["relative_latent_error"] = float((latents["bf16"] - ref).norm() / ref.norm())
    out["speedup"] = round(out["fp32"]["encode_s"] / out["bf16"]["encode_s"], 2)
    out["latent_shape"] = list(ref.shape)
    # A measurement, not a threshold: the user weighs the error against the time (the tiny VAE on a
    # CPU shows ~0.25, its latents being small numbers around large means). It must exist and be finite.
    out["passed"] = out["bf16"]["vae_param_dtype"] == "torch.bfloat16" and 0 < out["relative_latent_error"] < float("inf")
    return out


def section_main_path(ctx: Ctx) -> dict:
    """configs/e2v.yaml (zero3_offload) on the wide folder: steps, resume, export, sample."""
    folders = model_folders(ctx, "wide")
    data = dataset(ctx, "data_e2v")
    n, frames = ctx.sizes.steps, ctx.sizes.main_frames  # 3 steps on the GPU, then the resumed 4th
    base = [f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}"]
    sets = base + run_sets(ctx, "main_path", data, n, frames)
    shutil.rmtree(ctx.work / "runs" / "main_path", ignore_errors=True)
    out = {"first": train(ctx, "main_path", "configs/e2v.yaml", sets)}
    first_log = (ROOT / out["first"]["log"]).read_text(errors="replace") if out["first"]["rc"] == 0 else ""
    out["partitioned_load"] = PARTITIONED in first_log
    if out["first"]["passed"]:
        resumed = [s.replace(f"train.max_steps={n}", f"train.max_steps={n + 1}") for s in sets]
        out["resumed"] = train(ctx, "main_path", "configs/e2v.yaml", resumed, extra=("--resume", "latest"))
        resumed_log = (ROOT / out["resumed"]["log"]).read_text(errors="replace")
        out["resumed"]["from_step"] = int(m.group(1)) if (m := re.search(r"resumed from .* at step (\d+)", resumed_log)) else None
        out["resumed"]["losses"] = {s: v for s, v in out["resumed"]["losses"].items() if s > n}
    lora = ctx.work / "runs" / "main_path" / "lora"
    out["export_files"] = sorted(p.name for p in lora.iterdir()) if lora.is_dir() else []
    if out["export_files"]:
        out["sample"] = sample(ctx, base, data, lora, frames)
    out["passed"] = (out["first"]["passed"] and out["partitioned_load"] and out.get("resumed", {}).get("passed", False)
                     and out["resumed"]["from_step"] == n and n + 1 in out["resumed"]["losses"]
                     and out.get("sample", {}).get("passed", False))
    return out


def sample(ctx: Ctx, base: list[str], data: Path, lora: Path, frames: int) -> dict:
    """tools/sample.py on the export, 2 denoising steps; the mp4 read back must not be constant."""
    import numpy as np

    h, w = ctx.sizes.resolution
    mp4 = ctx.work / "main_path_sample.mp4"
    mp4.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "tools/sample.py"), "--config", "configs/e2v.yaml", "--lora", str(lora),
           "--element", f"subject={data / '000_person.png'}", "--element", f"object={data / '000_object.png'}",
           "--element", f"background={data / '000_background.png'}", "--prompt", "a shape moves",
           "--out", str(mp4), "--steps", "2", "--frames", str(frames), "--height", str(h), "--width", str(w)]
    for s in base + [TORCH_ADAM]:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(ctx.left(), 10))
    out = {"rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    if p.returncode != 0 or not mp4.exists():
        return {**out, "passed": False, "error": p.stdout[-800:] + p.stderr[-2000:]}
    import imageio.v2 as imageio

    frames_FHWC = np.stack(imageio.mimread(str(mp4), memtest=False))
    out.update(shape=list(frames_FHWC.shape), pixel_std=round(float(frames_FHWC.std()), 2),
               frame_to_frame_change=round(float(np.abs(np.diff(frames_FHWC.astype(np.int16), axis=0)).mean()), 3))
    out["passed"] = out["pixel_std"] > 1.0  # a constant (or blank) video has std 0
    return out


CONFIGS_24GB = {"e2v_t2v_1.3b_24gb": ("configs/e2v_t2v_1.3b_24gb.yaml", "1.3b"),
                "e2v_24gb": ("configs/e2v_24gb.yaml", "wide")}


def section_24gb(ctx: Ctx) -> dict:
    """Each 24 GB config from its cache (tools/precompute.py first, uncapped), 2 steps capped at 24 GiB."""
    data = dataset(ctx, "data_e2v")
    out = {"limit_gib": LIMIT_GIB}
    for name, (config, kind) in CONFIGS_24GB.items():
        folders = model_folders(ctx, kind)
        h, w = REAL.resolution
        model = [f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}"]
        sets = model + run_sets(ctx, name, data, 2, ctx.sizes.frames) + [f"cache.dir={ctx.work / ('cache_' + name)}"]
        r = {"precompute": precompute(ctx, config, sets)}
        r["estimate"] = gpu_estimate(config, sets)
        if kind == "wide":  # the released depth: the figure the config's docs quote
            r["estimate_40_layers"] = gpu_estimate(config, [s for s in sets if not s.startswith("model.")]
                                                   + [f"data.num_frames={REAL.frames}", f"data.resolution=[{h},{w}]"])
        if r["precompute"]["rc"] == 0:
            r["run"] = train(ctx, name, config, sets, fraction_gib=LIMIT_GIB)
            r.update(verdict_24gb(r["run"]))
        else:
            r["passed"] = False
        out[name] = r
    out["passed"] = all(out[n]["passed"] for n in CONFIGS_24GB)
    return out


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


def section_activation_offload(ctx: Ctx) -> dict:
    """The 1.3B config online at offload_frames, train.activation_offload off then on."""
    folders = model_folders(ctx, "1.3b")
    data = dataset(ctx, "data_e2v")
    out = {"frames": ctx.sizes.offload_frames}
    for on in (False, True):
        name = f"activation_offload_{'on' if on else 'off'}"
        sets = ([f"model.pretrained={folders['t2v']}", f"model.image_encoder={folders['clip']}",
                 "deepspeed.config=ds_configs/zero2.json", "train.gradient_checkpointing=true",
                 f"train.activation_offload={str(on).lower()}"]
                + run_sets(ctx, name, data, 3, ctx.sizes.offload_frames))
        shutil.rmtree(ctx.work / "runs" / name, ignore_errors=True)
        out["on" if on else "off"] = train(ctx, name, "configs/e2v_t2v_1.3b.yaml", sets)
    off, on = out["off"], out["on"]
    out["losses"] = compare_losses(off["losses"], on["losses"])
    out["passed"] = off["passed"] and on["passed"] and out["losses"]["passed"]
    return out


def compare_losses(a: dict, b: dict) -> dict:
    steps = sorted(set(a) & set(b))
    out = {"passed": bool(steps), "steps": {}}
    for s in steps:
        rel = abs(a[s] - b[s]) / max(abs(a[s]), 1e-12)
        tol = LOSS_RTOL.get(s, LOSS_RTOL[2])
        out["steps"][s] = {"off": a[s], "on": b[s], "rel_diff": rel, "rtol": tol}
        out["passed"] &= rel <= tol
    return out


WAN22_RUNS = {
    "ti2v": ("configs/e2v_wan22_ti2v_tiny.yaml", []),
    "two_experts": ("configs/e2v_tiny_lora.yaml", ["model.preset=tiny_wan22_a14b", "model.expert=both"]),
}


def section_wan22(ctx: Ctx) -> dict:
    """The tiny Wan2.2 presets (their code paths, not their sizes) through 2 steps and validation."""
    data = tiny_dataset(ctx)
    out = {}
    for name, (config, extra) in WAN22_RUNS.items():
        sets = [f"data.datasets.0.data_root={data}", f"output_dir={ctx.work / 'runs'}", f"run_id=wan22_{name}",
                "train.max_steps=2", "train.checkpoint_every=2", "train.warmup_steps=0", "train.log_every=1",
                "validation.every_n_steps=2", "validation.num_samples=2", "validation.num_videos=1",
                "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.enabled=false",
                "data.resolution=[64,64]", "data.num_workers=0"] + extra
        shutil.rmtree(ctx.work / "runs" / f"wan22_{name}", ignore_errors=True)
        r = train(ctx, f"wan22_{name}", config, sets)
        r["passed"] = r["passed"] and bool(r["val_loss"])
        out[name] = r
    out["passed"] = all(out[n]["passed"] for n in WAN22_RUNS)
    return out


def section_attention(ctx: Ctx) -> dict:
    """The SDPA flags, and the attention kernels one bf16 forward of a Wan transformer with the real
    head size (128) launches, found by name in a profiler trace (the CPU's ops with --allow-cpu)."""
    import torch
    from diffusers import WanTransformer3DModel
    from torch.profiler import ProfilerActivity, profile

    device = "cuda" if ctx.cuda else "cpu"
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "math", "cudnn") if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")}
    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=64, freq_dim=32, ffn_dim=64, num_layers=1, cross_attn_norm=True,
                                  qk_norm="rms_norm_across_heads", eps=1e-6).to(device, torch.bfloat16)
    x = torch.randn(1, 16, 5, 32, 32, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, 64, 64, device=device, dtype=torch.bfloat16)
    t = torch.tensor([500.0], device=device)
    with torch.no_grad():
        model(x, timestep=t, encoder_hidden_states=text)
        with profile(activities=[ProfilerActivity.CUDA if ctx.cuda else ProfilerActivity.CPU]) as prof:
            model(x, timestep=t, encoder_hidden_states=text)
            if ctx.cuda:
                torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()})
    attention = [n for n in names if re.search(r"flash|fmha|efficient_attention|cudnn.*(attn|sdpa)|sdpa|attention", n, re.I)]
    kind = ("flash" if any(re.search("flash", n, re.I) for n in attention) else
            "mem_efficient" if any(re.search("efficient|fmha|cutlass", n, re.I) for n in attention) else
            "cudnn" if any(re.search("cudnn", n, re.I) for n in attention) else "math (no fused attention kernel seen)")
    return {"sdp_flags": flags, "backend": kind, "attention_kernels": attention[:8], "passed": bool(names)}


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    budget_s: float  # what it needs on an H100/H200, folder builds included when it is the first to need them
    run: object
    title: str


# Budgets: guesses for an H100 / H200 with 16 cores (process start-up and folder builds dominate
# the short sections); they sum to more than 480 s on purpose: the default call runs the sections
# worth the most, says which it skipped, and `--only` takes those in a second call. Replace them by
# the wall times the first GPU report shows.
SECTIONS = (
    Section("environment", 5, section_environment, "Environment"),
    Section("step_1.3b", 170, section_step, "Wan2.1-T2V-1.3B E2V step, online and cached"),
    Section("vae_dtype", 30, section_vae_dtype, "VAE in bf16 against fp32"),
    Section("main_path", 110, section_main_path, "Main path at the I2V-14B widths (2 layers), ZeRO-3 offload"),
    Section("gpu_24gb", 120, section_24gb, "24 GB configs under a 24 GiB cap"),
    Section("activation_offload", 70, section_activation_offload, "train.activation_offload off / on"),
    Section("wan22", 40, section_wan22, "Wan2.2 tiny presets: training and validation"),
    Section("attention", 5, section_attention, "Attention kernel"),
)
NAMES = [s.name for s in SECTIONS]


# --- the report ---------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ok(r: dict) -> str:
    return "skipped" if "skipped" in r else ("ok" if r.get("passed") else "FAILED")


def render(result: dict) -> str:
    """bench/RESULTS_GPU.md from a result dict (the one gpu.json holds)."""
    lines = [f"# GPU check: {result['device']}", "",
             f"`python tools/gpu_check.py{result.get('argv', '')}` on {result['device']}, {result['date_utc']}: "
             f"{result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget. "
             f"Overall: {'PASSED' if result.get('passed') else 'FAILED'}"
             f"{' (so far)' if not result.get('finished') else ''}.", ""]
    if not result.get("cuda"):
        lines += ["**CPU at tiny sizes (--allow-cpu): checks the tool's code paths; no figure here is a GPU's.**", ""]
    lines += ["| section | result | wall s |", "|---|---|---|"]
    for s in SECTIONS:
        r = result["sections"].get(s.name)
        if r is not None:
            lines.append(f"| {s.name} | {_ok(r)}{': ' + r['skipped'] if 'skipped' in r else ''} | {_f(r.get('wall_s'), '{:.0f}')} |")
    lines.append("")
    for s in SECTIONS:
        r = result["sections"].get(s.name)
        if r is None or "skipped" in r:
            continue
        lines += [f"## {s.name}: {s.title}", ""]
        if "error" in r and not r.get("passed"):
            lines += ["```", str(r["error"])[-1500:], "```", ""]
        lines += RENDERERS.get(s.name, lambda r: [])(r) + [""]
    return "\n".join(lines)


def _render_environment(r: dict) -> list[str]:
    v = r.get("versions", {})
    missing = (["- **missing: " + ", ".join(r["missing"]) + "** (install the carried wheels: the module docstring)"]
               if r.get("missing") else [])
    return missing + [f"- device: {r.get('device')} ({_f(r.get('memory_gib'), '{:.1f}')} GiB, compute capability "
            f"{r.get('capability', '-')}), driver {r.get('driver', '-')}, CUDA {r.get('cuda')}",
            "- " + ", ".join(f"{k} {x}" for k, x in v.items()),
            f"- TORCH_CUDA_ARCH_LIST: {r.get('TORCH_CUDA_ARCH_LIST') or 'unset'}"
            + (f" ({r['arch_list_problem']})" if r.get("arch_list_problem") else ""),
            "- optimizer: " + "; ".join(f"{k}: {x}" for k, x in r.get("optimizer", {}).items())]


def _render_step(r: dict) -> list[str]:
    if "online" not in r:
        return []
    rows = ["| mode | step s | " + " | ".join(STEP_PHASES.values()) + " | max allocated GiB | estimate GiB |",
            "|---|---|" + "---|" * len(STEP_PHASES) + "---|---|"]
    for mode in ("online", "cached"):
        m = r[mode]
        rows.append(f"| {mode} | {m['step_s']:.2f} | " + " | ".join(_f(m["phases_s"].get(k)) for k in STEP_PHASES)
                    + f" | {_f(m['max_memory_allocated_gib'], '{:.1f}')} | {m['estimate_gib']:.1f} |")
    return rows + ["", f"Latents {r['online']['latent_shape']}; precompute {r['precompute_s']} s; online / cached "
                       f"{r['online_over_cached']}. Phases: medians over the timed steps (CUDA events on a GPU)."]


def _render_vae(r: dict) -> list[str]:
    if "fp32" not in r:
        return []
    return [f"One {r['clip']} clip, latents {r['latent_shape']}: fp32 {r['fp32']['encode_s']:.2f} s, bf16 "
            f"{r['bf16']['encode_s']:.2f} s ({r['speedup']}x); relative latent error of bf16 "
            f"{r['relative_latent_error']:.2e}. Random weights: the error of the released VAE may differ."]


def _run_line(name: str, x: dict) -> str:
    return (f"| {name} | {_ok(x)} | {x.get('rc')} | {x.get('losses')} | {_f(x.get('step_time_after_first_s'))} | "
            f"{_f(x.get('max_memory_allocated_gib'))} |")


RUN_HEADER = ["| run | result | rc | losses | step s (after the first) | max allocated GiB |", "|---|---|---|---|---|---|"]


def _render_main(r: dict) -> list[str]:
    out = RUN_HEADER + [_run_line(k, r[k]) for k in ("first", "resumed") if k in r]
    s = r.get("sample", {})
    return out + ["", f"Partitioned at load: {'yes' if r.get('partitioned_load') else 'NO'}; resumed from step "
                      f"{r.get('resumed', {}).get('from_step')}; export: {', '.join(r.get('export_files', [])) or 'none'}; "
                      f"sample: {_ok(s) if s else '-'} (shape {s.get('shape')}, pixel std {s.get('pixel_std')}, "
                      f"mean frame-to-frame change {s.get('frame_to_frame_change')})"]


def _render_24gb(r: dict) -> list[str]:
    out = ["| config | result | estimate GiB | max allocated GiB | max reserved GiB | exceeds by GiB | step s |",
           "|---|---|---|---|---|---|---|"]
    for name in CONFIGS_24GB:
        x = r.get(name)
        if x:
            run = x.get("run", {})
            est = x["estimate"]["gpu_total_gib"]
            est40 = f" (40 layers: {x['estimate_40_layers']['gpu_total_gib']:.1f})" if "estimate_40_layers" in x else ""
            out.append(f"| {name} | {_ok(x)} | {est:.1f}{est40} | {_f(run.get('max_memory_allocated_gib'))} | "
                       f"{_f(run.get('max_memory_reserved_gib'))} | {_f(x.get('exceeds_by_gib'))}"
                       f"{' (refused ' + _f(x.get('refused_gib')) + ')' if x.get('oom') else ''} | "
                       f"{_f(run.get('step_time_after_first_s'))} |")
    return out + ["", f"Each under torch.cuda.set_per_process_memory_fraction = {r.get('limit_gib')} GiB of the card."]


def _render_offload(r: dict) -> list[str]:
    out = RUN_HEADER + [_run_line(f"offload {k}", r[k]) for k in ("off", "on") if k in r]
    return out + ["", f"{r.get('frames')} frames; losses equal within tolerance: "
                      f"{'yes' if r.get('losses', {}).get('passed') else 'NO'}"]


def _render_wan22(r: dict) -> list[str]:
    out = ["| preset | result | losses | validation loss |", "|---|---|---|---|"]
    return out + [f"| {n} | {_ok(r[n])} | {r[n].get('losses')} | {r[n].get('val_loss')} |" for n in WAN22_RUNS if n in r]


def _render_attention(r: dict) -> list[str]:
    return [f"Kernel used: **{r['backend']}**; SDPA flags: " + ", ".join(f"{k} {v}" for k, v in r["sdp_flags"].items()),
            "", "Kernels seen: " + (", ".join(f"`{k}`" for k in r["attention_kernels"]) or "none")] if "backend" in r else []


RENDERERS = {"environment": _render_environment, "step_1.3b": _render_step, "vae_dtype": _render_vae,
             "main_path": _render_main, "gpu_24gb": _render_24gb, "activation_offload": _render_offload,
             "wan22": _render_wan22, "attention": _render_attention}


def write_report(result: dict, out_dir: Path) -> tuple[Path, Path]:
    md, js = out_dir / "RESULTS_GPU.md", out_dir / "results" / "gpu.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(render(result) + "\n")
    return md, js


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
    cuda = problem is None
    out_dir = args.out or (ROOT / "bench" if cuda else ROOT / "bench" / "tmp")
    work = args.work or ROOT / "smoke_real" / ("gpu" if cuda else "gpu_cpu")
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    ctx = Ctx(cuda=cuda, sizes=REAL if cuda else TINY, work=work, deadline=t_start + args.budget)
    result = {"device": torch.cuda.get_device_name(0) if cuda else "CPU (--allow-cpu, tiny sizes)", "cuda": cuda,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "argv": "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
              "budget_s": args.budget, "elapsed_s": 0.0, "sections": {}, "finished": False}
    for s in SECTIONS:
        if args.only and s.name not in args.only:
            continue
        left = ctx.left()
        if s.budget_s > left:  # on a GPU; at tiny sizes on a CPU the budgets are not the times
            r = {"skipped": f"needs ~{s.budget_s:.0f} s, {max(left, 0):.0f} s left", "passed": True}
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
        result["passed"] = all(x.get("passed") for x in result["sections"].values())
        write_report(result, out_dir)
    result["finished"] = True
    md, js = write_report(result, out_dir)
    print(f"[gpu-check] {'PASSED' if result['passed'] else 'FAILED'} in {result['elapsed_s']:.0f} s: {md}, {js}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
