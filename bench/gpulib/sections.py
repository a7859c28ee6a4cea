"""The GPU check's sections, in order of value, each with its time budget (SECTIONS)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.gpulib.causal_section import section_causal_step
from bench.gpulib.common import (
    GIB,
    LIMIT_GIB,
    LOSS_RTOL,
    PARTITIONED,
    REAL,
    ROOT,
    TORCH_ADAM,
    Ctx,
    capped_run,
    capped_sets,
    dataset,
    gpu_estimate,
    model_folders,
    run_sets,
    tiny_dataset,
    train,
)
from bench.gpulib.fp8_section import section_fp8_14b
from bench.gpulib.speed_section import SPEED_BUDGET_S, section_speed
from bench.gpulib.validation_section import section_validation


def section_environment(ctx: Ctx) -> dict:
    import importlib.metadata as md
    from types import SimpleNamespace

    import torch

    from e2v.runtime.adam import TORCH_ADAMW, arch_list_problem
    from e2v.train.ds_config import adam_choice

    versions = {}
    for pkg in ("torch", "deepspeed", "diffusers", "transformers", "peft", "decord", "imageio-ffmpeg"):
        try:
            versions[pkg] = md.version(pkg)  # what the report shows; whether it works is the import below
        except md.PackageNotFoundError:
            versions[pkg] = None
    # imported, not looked up: bench/gpulib/packages.py (NEEDS, DEEP, the e2v modules), before any section
    out = {"import_problems": ctx.packages["problems"], "installed_from": ctx.packages.get("installed_from"),
           "pip": ctx.packages.get("pip")}
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
    # DeepSpeed's op builder and a letter in the arch list (e.g. "9.0a"): only an opted-in build meets it
    out["arch_list_problem"] = arch_list_problem(out["TORCH_CUDA_ARCH_LIST"])
    # What the plan picks (the YAML decides, never the machine): the default, with and without offload.
    cfg = SimpleNamespace(deepspeed=SimpleNamespace(optimizer=TORCH_ADAMW))
    offloaded = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    out["optimizer"] = {"default_gpu": adam_choice(cfg, {}, ctx.cuda)[1],
                        "default_offload": adam_choice(cfg, offloaded, ctx.cuda)[1]}
    out["passed"] = not out["import_problems"]
    return out


# The step section's steps must also train: a fixed timestep (the loss then moves with the weights,
# not with the sigma drawn), a real lr reached by warmup over the steps (an earlier H200 run at
# 1e-4 without warmup went 1.76 -> 9.37 -> 5.51), so the loss falls from the first step to the last.
STEP_TRAINING = ("train.lr=1e-4", "train.warmup_steps=4", "flow.denoising_step_list=[500]")


def loss_falls(losses: list[float]) -> dict:
    """Every loss finite and the last below the first."""
    import math

    ok = len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    return {"losses": [round(x, 5) for x in losses], "passed": ok}


def bench_command(folders: dict, data: Path, ctx: Ctx) -> list[str]:
    """bench/bench.py's step section on the 1.3B folder (--model: online, then tools/precompute.py,
    then cached, each in a fresh process; the overhead rounds off: they train a second copy)."""
    h, w = ctx.sizes.resolution
    cmd = [sys.executable, str(ROOT / "bench/bench.py"), "--model", str(folders["t2v"]), "--sections", "steps",
           "--steps", str(ctx.sizes.steps), "--warmup", "1", "--overhead-rounds", "0", "--no-report",
           "--data-root", str(data)]
    for s in ("model.base=t2v", f"model.image_encoder={folders['clip']}", TORCH_ADAM, *STEP_TRAINING,
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
                     "estimate_gib": estimates[mode], "latent_shape": r["latent_shape"], "device": r["device"],
                     "loss_falls": loss_falls(r.get("losses", [])), "speed": r.get("speed")}
    return out


def section_step(ctx: Ctx) -> dict:
    from bench.benchlib.common import config_sets

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
    out["passed"] = all(out[m]["step_s"] > 0 and out[m]["loss_falls"]["passed"] for m in ("online", "cached"))
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


SAMPLE_PSNR_DB = 25.0  # bf16 against the fp32 reference, same seed: a broken kernel or cast lands far below


def sample(ctx: Ctx, base: list[str], data: Path, lora: Path, frames: int) -> dict:
    """tools/sample.py on the export, 2 denoising steps, with the transformer in bf16 (the GPU's
    default) and, as the reference, in fp32, same seed: the bf16 video must not be constant and must
    match the reference (PSNR over the decoded mp4s)."""
    import numpy as np

    h, w = ctx.sizes.resolution
    cmd = [sys.executable, str(ROOT / "tools/sample.py"), "--config", "configs/e2v.yaml", "--lora", str(lora),
           "--element", f"subject={data / '000_person.png'}", "--element", f"object={data / '000_object.png'}",
           "--element", f"background={data / '000_background.png'}", "--prompt", "a shape moves",
           "--steps", "2", "--frames", str(frames), "--height", str(h), "--width", str(w)]
    for s in base + [TORCH_ADAM]:
        cmd += ["--set", s]
    out, videos = {}, {}
    for dtype in ("bf16", "fp32"):
        mp4 = ctx.work / f"main_path_sample_{dtype}.mp4"
        mp4.unlink(missing_ok=True)
        t0 = time.perf_counter()
        p = subprocess.run(cmd + ["--out", str(mp4), "--dtype", dtype], cwd=ROOT, capture_output=True, text=True,
                           timeout=max(ctx.left(), 10))
        out[f"{dtype}_wall_s"] = round(time.perf_counter() - t0, 1)
        if p.returncode != 0 or not mp4.exists():
            return {**out, "rc": p.returncode, "passed": False, "error": f"--dtype {dtype}: " + p.stdout[-800:] + p.stderr[-2000:]}
        import imageio.v2 as imageio

        videos[dtype] = np.stack(imageio.mimread(str(mp4), memtest=False)).astype(np.float64)
    frames_FHWC, ref_FHWC = videos["bf16"], videos["fp32"]
    mse = float(((frames_FHWC - ref_FHWC) ** 2).mean())
    out.update(rc=0, shape=list(frames_FHWC.shape), pixel_std=round(float(frames_FHWC.std()), 2),
               frame_to_frame_change=round(float(np.abs(np.diff(frames_FHWC, axis=0)).mean()), 3),
               psnr_db_vs_fp32=round(10 * np.log10(255.0**2 / mse), 2) if mse > 0 else float("inf"))
    out["passed"] = out["pixel_std"] > 1.0 and out["psnr_db_vs_fp32"] >= SAMPLE_PSNR_DB  # std 0: a constant video
    return out


CONFIGS_24GB = {"e2v_t2v_1.3b_24gb": ("configs/e2v_t2v_1.3b_24gb.yaml", "1.3b"),
                "e2v_24gb": ("configs/e2v_24gb.yaml", "wide")}


def section_24gb(ctx: Ctx) -> dict:
    """Each 24 GB config from its cache (tools/precompute.py first, uncapped), 2 steps capped at 24 GiB."""
    data = dataset(ctx, "data_e2v")
    out = {"limit_gib": LIMIT_GIB}
    for name, (config, kind) in CONFIGS_24GB.items():
        sets = capped_sets(ctx, name, kind, data, 2)
        r = {}
        if kind == "wide":  # the released depth: the figure the config's docs quote
            h, w = REAL.resolution
            r["estimate_40_layers"] = gpu_estimate(config, [s for s in sets if not s.startswith("model.")]
                                                   + [f"data.num_frames={REAL.frames}", f"data.resolution=[{h},{w}]"])
        out[name] = {**capped_run(ctx, name, config, sets), **r}
    out["passed"] = all(out[n]["passed"] for n in CONFIGS_24GB)
    return out


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
    if ctx.cuda:  # what the option is for: the saved activations leave the GPU
        peaks = off.get("max_memory_allocated_gib"), on.get("max_memory_allocated_gib")
        out["peak_saved_gib"] = round(peaks[0] - peaks[1], 2) if None not in peaks else None
        out["passed"] &= out["peak_saved_gib"] is not None and out["peak_saved_gib"] > 0
    else:
        out["skipped_checks"] = ["the peak drop (no CUDA: activation offload is a no-op on the CPU)"]
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


def section_offload_adam(ctx: Ctx) -> dict:
    """torch's AdamW on the offloaded CPU partition, as training builds it (bench/gpulib/offload_adam.py,
    its own process): on a CUDA build it must be the fused kernel on the CPU partition (pinned or
    not: reported), match torch's reference AdamW step for step, and lower the loss."""
    cmd = [sys.executable, str(ROOT / "bench/gpulib/offload_adam.py")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(ctx.left(), 10))
    line = next((x for x in p.stdout.splitlines() if x.startswith("OFFLOAD_ADAM ")), None)
    if p.returncode != 0 or line is None:
        return {"passed": False, "error": p.stdout[-1000:] + p.stderr[-3000:]}
    out = json.loads(line.split(" ", 1)[1])
    out["matches_reference"] = max(out["max_abs_diff"]) <= out["atol"]
    out["passed"] = (out["matches_reference"] and out["partition_device"] == "cpu" and loss_falls(out["losses"])["passed"])
    if ctx.cuda:
        out["passed"] &= out["fused"]  # pinned: reported (page-locked blocks may round up host RAM), not required
    else:
        out["skipped_checks"] = ["the fused kernel (no CUDA: e2v fuses torch's AdamW only "
                                 "under a CUDA build; this ran the unfused one)"]
    return out


WAN22_RUNS = {
    "ti2v": ("configs/e2v_wan22_ti2v_tiny.yaml", []),
    "two_experts": ("configs/e2v_tiny_lora.yaml", ["model.preset=tiny_wan22_a14b", "model.expert=both"]),
}


# The sequence layout (SkyReels-V3 R2V's 4 slots, Phantom's as many as references) on the tiny T2V.
R2V_RUNS = {
    "v3_slots4": ("configs/r2v_tiny.yaml", ["cache.enabled=false"]),
    "phantom_as_many": ("configs/r2v_tiny.yaml", ["cache.enabled=false", "conditioning.sequence.slots=null"]),
}


def section_wan22(ctx: Ctx) -> dict:
    """The tiny Wan2.2 presets (their code paths, not their sizes) through 2 steps and validation."""
    return tiny_runs(ctx, "wan22", WAN22_RUNS)


def section_r2v(ctx: Ctx) -> dict:
    """The sequence layout on the tiny T2V (its code path on the GPU) through 2 steps and validation."""
    return tiny_runs(ctx, "r2v", R2V_RUNS)


def tiny_runs(ctx: Ctx, prefix: str, runs: dict) -> dict:
    """Each (config, extra sets) of `runs` through 2 steps and a validation with one generated video."""
    data = tiny_dataset(ctx)
    out = {}
    for name, (config, extra) in runs.items():
        sets = [f"data.datasets.0.data_root={data}", f"output_dir={ctx.work / 'runs'}", f"run_id={prefix}_{name}",
                "train.max_steps=2", "train.checkpoint_every=2", "train.warmup_steps=0", "train.log_every=1",
                "validation.every_n_steps=2", "validation.num_samples=2", "validation.num_videos=1",
                "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.enabled=false",
                "data.resolution=[64,64]", "data.num_workers=0"] + extra
        shutil.rmtree(ctx.work / "runs" / f"{prefix}_{name}", ignore_errors=True)
        r = train(ctx, f"{prefix}_{name}", config, sets)
        r["passed"] = r["passed"] and bool(r["val_loss"])
        out[name] = r
    out["passed"] = all(out[n]["passed"] for n in runs)
    return out


# The op torch's scaled_dot_product_attention dispatches to, by backend: recorded on the host side
# of the profiler trace on every device, so the kernel is named by what ran, not by a kernel-name
# pattern (cuDNN's SDPA kernels have "flash" in their names).
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
            "aten::_scaled_dot_product_efficient_attention": "efficient",
            "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
            "aten::_scaled_dot_product_attention_math": "math",
            "aten::_scaled_dot_product_fused_attention_overrideable": "fused (device plug-in)"}


def sdpa_backends(op_names) -> list[str]:
    """The SDPA backends whose ops appear among these profiler op names."""
    return sorted({SDPA_OPS[n] for n in op_names if n in SDPA_OPS})


def section_attention(ctx: Ctx) -> dict:
    """The SDPA flags, and the backend one bf16 forward of a Wan transformer with the real head size
    (128) dispatches to: the aten op in the profiler trace (SDPA_OPS), with the device kernels that
    ran under it (CUDA). On a GPU the math fallback fails the section: it is the slow path."""
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
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with torch.no_grad():
        model(x, timestep=t, encoder_hidden_states=text)
        with profile(activities=activities) as prof:
            model(x, timestep=t, encoder_hidden_states=text)
            if ctx.cuda:
                torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()})
    backends = sdpa_backends(names)
    kernels = [n for n in names if n not in SDPA_OPS and not n.startswith("aten::")
               and re.search(r"flash|fmha|attention|sdpa|cudnn", n, re.I)]
    out = {"sdp_flags": flags, "sdpa_ops": [n for n in names if n in SDPA_OPS], "backends": backends,
           "backend": " + ".join(backends) or "none seen", "attention_kernels": kernels[:8]}
    out["passed"] = len(backends) >= 1 and not (ctx.cuda and "math" in backends)
    return out


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
    Section("speed", SPEED_BUDGET_S, section_speed,
            "1.3B cached step per attention backend, eager and compiled: MFU, and the fastest keys"),
    Section("vae_dtype", 30, section_vae_dtype, "VAE in bf16 against fp32"),
    Section("main_path", 110, section_main_path, "Main path at the I2V-14B widths (2 layers), ZeRO-3 offload"),
    Section("gpu_24gb", 120, section_24gb, "24 GB configs under a 24 GiB cap"),
    Section("validation_24gb", 90, section_validation, "Validation of a 24 GB config under a 24 GiB cap"),
    Section("activation_offload", 70, section_activation_offload, "train.activation_offload off / on"),
    Section("offload_adam", 30, section_offload_adam, "torch's fused AdamW on the offloaded CPU partition"),
    Section("wan22", 40, section_wan22, "Wan2.2 tiny presets: training and validation"),
    Section("r2v", 40, section_r2v, "Sequence layout (SkyReels-V3 R2V / Phantom) on the tiny T2V: training and validation"),
    Section("attention", 5, section_attention, "Attention backend"),
    Section("fp8_14b", 90, section_fp8_14b, "fp8 base at the I2V-14B widths under a 24 GiB cap"),
    Section("causal_step", 120, section_causal_step, "Causal training step against the bidirectional, 1.3B at 480 x 832 x 81"),
)
NAMES = [s.name for s in SECTIONS]
