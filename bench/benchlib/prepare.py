"""The data-preparation section of bench/RESULTS.md, from bench/results/prepare.json
(bench/bench_prepare.py): ground-truth figures and the CPU time per minute of footage by stage."""

from __future__ import annotations

STAGE_NAMES = {"probe": "probe (open, timestamps)", "shots": "shots (PySceneDetect)",
               "decode": "decode + crop/resize to the target", "elements": "elements (classical: median, masks, "
               "references)", "captions": "captions (model)", "write": "write (H.264, PNGs, contact sheet)"}


def render_prepare(d: dict) -> list[str]:
    s, c = d["score"], d["case"]
    lines = ["## 6. Data preparation (tools/prepare_data.py, classical backend)", "",
             f"`python bench/bench_prepare.py` ({d['machine']['date_utc']}, load {d['load_before']:.2f} -> "
             f"{d['load_after']:.2f}): {c['videos']} generated videos of {c['shots']} shots "
             f"(bench/make_raw_footage.py, {c['source_hw'][0]}x{c['source_hw'][1]} at {c['source_fps']:g} fps, "
             f"{d['footage_minutes']:.2f} min of footage) -> clips of {c['num_frames']} frames at {c['fps']:g} fps, "
             f"{c['target_hw'][0]}x{c['target_hw'][1]}; scored against the generator's truth (e2v/data/prepare/truth.py).",
             "", "| figure | measured | goal |", "|---|---|---|",
             f"| cuts found within 1 frame | {s['cuts_within_1_frame']}/{s['cuts']} ({s['cuts_extra']} extra) | all |",
             f"| subject mask IoU, mean over {s['clips']} clips (min) | {s['subject_iou_mean']:.3f} "
             f"({s['subject_iou_min']:.3f}) | >= 0.85 |",
             f"| background mean abs. error, levels of 255 (max) | {s['background_mae_mean']:.2f} "
             f"({s['background_mae_max']:.2f}) | <= 6 |",
             f"| references outside their clip's window | {s['references_outside_window'] * 100:.0f}% | 100% when the "
             "shot is long enough |", "",
             f"{s['clips']} clips from {d['counts'].get('shots', 0)} shots; dropped by the filters: "
             + (", ".join(f"{k} {v}" for k, v in d["counts"].items() if "dropped" in k) or "none") + ".", "",
             f"Wall time {d['wall_s']:.0f} s, of which the dataset check {d['check_s']:.0f} s. Seconds per minute of "
             f"footage, by stage (wall time of one process on {d['machine']['cores']} cores; a load above the core "
             "count inflates them):", "", "| stage | s / footage minute |", "|---|---|"]
    lines += [f"| {STAGE_NAMES.get(k, k)} | {v:.2f} |" for k, v in d["seconds_per_footage_minute"].items()]
    return lines + ["", "Not measured here: the learned backend (SAM 3) and the model captioner with real weights "
                    "(no weights or GPU on this machine); their per-frame cost is one model forward per element.", ""]
