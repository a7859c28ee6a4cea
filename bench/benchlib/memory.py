"""Section 4, peak memory: read in the step processes after their timed steps, one fresh process
per configuration (ru_maxrss never goes down), plus torch.cuda.max_memory_allocated on a GPU."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_rss_mb() -> float:
    try:
        import psutil
    except ImportError:  # not a requirement: the peak so far is the current RSS at process start
        return peak_rss_mb()
    return psutil.Process().memory_info().rss / 2**20


def reading(rss_at_start_mb: float, cuda: bool) -> dict:
    """This process's memory now: RSS at start (given), peak RSS, peak CUDA allocation."""
    import torch

    return {"rss_at_start_mb": round(rss_at_start_mb, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
            "cuda_max_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None}


def render_memory(res: dict | None, data: dict | None, title: str) -> list[str]:
    out = [f"## 4. Peak memory{title}", "",
           "One fresh process per configuration (ru_maxrss only grows), read after the timed steps. RSS at start: "
           "the interpreter with torch imported. The cached process also holds one copy of the initial "
           "transformer for section 2 (its other copies come after this was read).", "",
           "| configuration | gradient checkpointing | RSS at start MB | peak RSS MB | CUDA max allocated MB |",
           "|---|---|---|---|---|"]
    for preset, r in (res or {}).get("presets", {}).items():
        for mode in ("online", "cached"):
            m = r[mode]["memory"]
            ckpt = {True: "on", False: "off"}.get(r[mode].get("gradient_checkpointing"), "?")  # "?": older JSON
            out.append(f"| {preset} {mode} | {ckpt} | {m['rss_at_start_mb']} | {m['peak_rss_mb']} | "
                       f"{m['cuda_max_allocated_mb'] if m['cuda_max_allocated_mb'] is not None else '-'} |")
    if data:
        out.append(f"| data pipeline (81 x 480 x 832, 2 decoders) | - | - | {data['memory']['peak_rss_mb']} | - |")
    return out + [""]
