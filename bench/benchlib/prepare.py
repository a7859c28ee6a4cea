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
    if "hard" in d:
        lines += render_hard(d["hard"])
    return lines + ["", "Not measured here: the learned backend (SAM 3) and the model captioner with real weights "
                    "(no weights or GPU on this machine); their per-frame cost is one model forward per element.", ""]


def _f(v, fmt=".3f") -> str:
    return "-" if v is None else format(v, fmt)


def render_hard(h: dict) -> list[str]:
    """The per-case table of the hard footage (tests/unit/test_prepare_hard.py's cases and settings)."""
    lines = ["", "### Footage it did not make (bench/make_raw_footage.py write_hard_footage)", "",
             f"scikit-image photographs, 96x160 at 16 fps ({h['footage_minutes']:.2f} min) -> 96x160 (portrait "
             f"160x96) clips of 17 frames at 8 fps; wall time {h['wall_s']:.0f} s with the check (exit "
             f"{h['check_exit_code']}). IoU and purity (the share of the subject cut-out that is subject) of the "
             "subject reference, background error in levels of 255 against the clean frame the reference shows, "
             "wrong: references showing another subject (or none), identity: references the check rejected.", "",
             "| case | cuts within 1 frame | dissolves found | samples kept | dropped / flagged | IoU min | "
             "purity min | bg error max | wrong | identity |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in h["cases"].items():
        dropped = ", ".join(f"{k} {v}" for k, v in c["dropped_or_flagged"].items()) or "-"
        lines.append(f"| {name} | {c['cuts_within_1_frame']}/{c['cuts']} ({c['cuts_extra']} extra) | "
                     f"{c['dissolves_found']}/{c['dissolves']} | {c['samples']} ({', '.join(c['orientations']) or '-'}) | "
                     f"{dropped} | {_f(c['subject_iou_min'])} | {_f(c['purity_min'])} | "
                     f"{_f(c['background_mae_max'], '.2f')} | {c['wrong_subject']} | {c['identity_rejections']} |")
    lines += ["", "Seconds per footage minute here: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                           h["seconds_per_footage_minute"].items()) + ".",
              "", "What the classical backend still cannot do: separate a subject that stands still from the background "
              "(the median absorbs it; the still_then_moving sample is dropped by the identity check, not cut out); "
              "see a cut that changes only the subject (same_place: both detectors miss it; the identity check drops "
              "the samples whose references would show the other subject); register frames under about 100 pixels high "
              "(ORB finds too little texture; at 64x64 clips the demo's pan is dropped by the background gate); follow "
              "parallax or rolling-shutter shake (skipped as moving camera); give a clean background behind a subject that "
              "covers most of the frame most of the time (large_subject: the plate is mostly painted, the sample "
              "dropped by the background_filled gate). Not measured: real phone footage, long "
              "shots, the identity check's learned measure with real weights (its plumbing runs on a tiny random model)."]
    return lines
