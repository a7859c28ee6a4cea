"""The GPU check's validation section: configs/e2v_t2v_1.3b_24gb.yaml trained from its cache for 2
steps under the 24 GiB cap WITH validation on (step 0 and the last step: losses at a sigma, one
generated video, decoded tiled), the run the other 24 GB section turns validation off for. What it
shows on a GPU: validation from the cache brings no text encoder, and the VAE and the CLIP visit the
device one at a time (e2v/eval/validation.py), so the validation phase fits where training fits.

Registered in bench/gpulib/sections.py's SECTIONS as
    Section("validation_24gb", 90, section_validation, "Validation of a 24 GB config under a 24 GiB cap")
"""

from __future__ import annotations

from bench.gpulib.common import LIMIT_GIB, REAL, Ctx, capped_run, capped_sets, dataset

CONFIG = "configs/e2v_t2v_1.3b_24gb.yaml"


def validation_sets(steps: int) -> list[str]:
    """Validation at step 0 and the last step on 2 held-out samples: one sigma, one video of 2
    denoising steps (CFG on, as the config samples), enough to put every phase on the device."""
    return [f"validation.every_n_steps={steps}", "validation.num_samples=2", "validation.num_videos=1",
            "validation.num_inference_steps=2", "validation.sigmas=[0.5]"]


def section_validation(ctx: Ctx) -> dict:
    """2 steps of the 1.3B 24 GB config from its cache with validation, capped at 24 GiB: passed
    when it ran, logged validation losses at steps 0 and 2, and wrote the video."""
    steps, name = 2, "validation_24gb"
    data = dataset(ctx, "data_validation", samples=4)  # 2 held out, 2 to train on
    sets = capped_sets(ctx, name, "1.3b", data, steps, validation=tuple(validation_sets(steps)))
    out = {"limit_gib": LIMIT_GIB, **capped_run(ctx, name, CONFIG, sets)}
    if "run" not in out:
        return out
    video = ctx.work / "runs" / name / "samples" / f"step_{steps:06d}" / "00.mp4"
    out["validated_steps"] = sorted(out["run"].get("val_loss", {}))
    out["video_written"] = video.is_file() and video.stat().st_size > 0
    out["frames"], out["resolution"] = ctx.sizes.frames, list(ctx.sizes.resolution)
    out["real_size"] = ctx.sizes == REAL
    out["passed"] = bool(out["passed"] and out["validated_steps"] == [0, steps] and out["video_written"])
    return out
