"""The preparation's summary (DATASET_DIR/prepare_summary.json and the terminal): totals, the
seconds per minute of footage by stage, every video with its samples and the reasons it lost
clips, the flags, and, when shots are shorter than a window, what length the footage allows
with the keys to change (a run that writes no sample ends with it and a non-zero exit).
"""

from __future__ import annotations

from collections import Counter

from e2v.data.prepare.config import PrepareConfig

# counts that say why a video gave fewer clips (the per-video reasons)
REASON_PREFIXES = ("shots_too_short", "shots_moving_camera", "shots_undecodable", "clips_dropped", "elements_dropped",
                   "elements_none", "videos_dropped", "flagged_")


def reasons(counts: dict) -> dict:
    return {k: v for k, v in sorted(counts.items()) if k.startswith(REASON_PREFIXES) and v}


def frames_that_fit(track_frames: int) -> list[int]:
    """The 4k+1 clip lengths (17, 33, ... the trainer's default frame buckets, every 16 frames)
    a track of this many frames holds."""
    return [f for f in range(17, track_frames + 1, 16)]


def length_advice(records: list[dict], cfg: PrepareConfig) -> list[str]:
    """Lines explaining shots too short for a window, with the numbers and the keys; [] if none."""
    short = [n for r in records for n in r.get("track_frames_short", [])]
    if not short:
        return []
    c, gap = cfg.clips, cfg.elements.reference_gap_seconds
    longest = max(short)
    need_s = (c.num_frames - 1) / c.fps
    fits = frames_that_fit(longest)
    lines = [f"{len(short)} shots are shorter than a window: clips.num_frames {c.num_frames} at clips.fps {c.fps:g} "
             f"needs {need_s:.2f} s of one shot (plus elements.reference_gap_seconds {gap:g} s and more for a "
             f"reference from outside the window); the longest of them holds {longest} frames at {c.fps:g} fps "
             f"({(longest - 1) / c.fps:.2f} s)."]
    if fits:
        lines.append(f"Fix: --set clips.num_frames={fits[-1]} (4k+1 lengths that fit it: {', '.join(map(str, fits))}; "
                     f"the trainer's data.num_frames must match, or train with data.auto_frame_buckets: true and "
                     f"data.frame_buckets: {fits}), or a lower clips.fps.")
    else:
        lines.append(f"Fix: a lower clips.fps (frames are taken by time), or longer shots: even 17 frames need "
                     f"{16 / c.fps:.2f} s at {c.fps:g} fps.")
    return lines


def summarize(records: list[dict], cfg: PrepareConfig) -> dict:
    totals: Counter = Counter()
    for r in records:
        totals.update(r.get("counts", {}))
        totals[f"videos_{r['status']}"] += 1
    minutes = totals["footage_seconds"] / 60 or float("nan")
    per_minute = {k[len("seconds_"):]: round(v / minutes, 2) for k, v in totals.items() if k.startswith("seconds_")}
    videos = [{"source": r["source"], "status": r["status"], "kind": r.get("kind", ""), "what": r.get("what", ""),
               "samples": len(r.get("samples", [])), "orientation": r.get("orientation", ""),
               "reasons": reasons(r.get("counts", {})), "notes": r.get("notes", [])} for r in records]
    refs = [v for r in records for s in r["samples"] for v in s["references"].values()]
    sizes = sorted({tuple(s["crop"]["hw"]) for r in records for s in r["samples"] if "crop" in s})
    summary = {"counts": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in sorted(totals.items())
                          if not k.startswith("seconds_")},
               "seconds_per_footage_minute": per_minute,
               "references_outside_window": f"{sum(bool(v.get('outside_window')) for v in refs)}/{len(refs)}",
               "sample_sizes_hw": [list(s) for s in sizes],
               "inputs": videos, "length_advice": length_advice(records, cfg)}
    if not totals["clips"]:
        summary["no_samples"] = ("no sample was written: " + ("; ".join(summary["length_advice"]) or
                                 "every video's reasons are listed above"))
    return summary


def describe(summary: dict) -> str:
    """The summary as the lines the preparer says at its end: counts, timings, one line per video."""
    lines = ["counts:", *(f"  {k:<48} {v}" for k, v in summary["counts"].items()),
             f"references outside their window: {summary['references_outside_window']}",
             "seconds per minute of footage: " +
             ", ".join(f"{k} {v}" for k, v in summary["seconds_per_footage_minute"].items()),
             "per video:"]
    for n in summary["inputs"]:
        line = f"  {n['status'].upper():<8} {n['source']}" + (f" [{n['kind']}]" if n.get("kind") else "")
        if n["status"] == "done":
            line += f": {n['samples']} samples" + (f" ({n['orientation']})" if n.get("orientation") else "")
        if n["what"]:
            line += f": {n['what']}"
        if n["reasons"]:
            line += "; " + ", ".join(f"{k} {v}" for k, v in n["reasons"].items())
        if n["notes"]:
            line += f" ({'; '.join(n['notes'])})"
        lines.append(line)
    if len(summary["sample_sizes_hw"]) > 1:
        lines.append(f"samples come in {len(summary['sample_sizes_hw'])} sizes: train with "
                     f"data.resolution_buckets: {summary['sample_sizes_hw']}")
    return "\n".join(lines + summary["length_advice"])
