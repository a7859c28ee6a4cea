"""Scoring a prepared dataset against the truth bench/make_raw_footage.py writes: cuts found within
one frame, the subject reference's mask IoU, the background's mean absolute error against the
clean background, and the share of references taken outside their clip's window. The test and the
benchmark (bench/bench_prepare.py) both call `score`, so they measure the same thing.

Legend: H/W target height/width; masks_FHW / mask_HW bool, images HW3 uint8.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from .clips import frames_to_crop, to_cover
from .manifest import all_records
from .masks import iou


def reference_mask(out: Path, sample: dict, name: str) -> np.ndarray:
    """A cut-out reference's alpha placed back in its frame (the source resized to cover the
    sample's size, where references are cut): mask_HW."""
    y0, y1, x0, x1 = sample["references"][name]["box"]
    alpha = np.asarray(Image.open(out / f"{sample['id']}_{name}.png"))[..., 3] > 127
    got_HW = np.zeros(sample["crop"]["cover_hw"], bool)
    got_HW[y0:y1, x0:x1] = alpha
    return got_HW


def truth_mask(mask_HW: np.ndarray, sample: dict) -> np.ndarray:
    """A source-size truth mask at the cover size the sample's references are cut at."""
    grey_1HW3 = np.repeat(mask_HW[None, ..., None].astype(np.uint8) * 255, 3, axis=-1)
    return to_cover(grey_1HW3, tuple(sample["crop"]["hw"]))[0, ..., 0] >= 128


def truth_view(image_HW3: np.ndarray, sample: dict) -> np.ndarray:
    """A source-size truth frame as the sample shows it: the cover resize and the sample's crop."""
    c = sample["crop"]
    return frames_to_crop(image_HW3[None], tuple(c["hw"]), (c["y0"], c["x0"]))[0]


def crop_slices(sample: dict) -> tuple[slice, slice]:
    c = sample["crop"]
    return slice(c["y0"], c["y0"] + c["hw"][0]), slice(c["x0"], c["x0"] + c["hw"][1])


def score(raw: Path, out: Path, target_hw: tuple[int, int]) -> dict:
    truth = json.loads((raw / "truth.json").read_text())
    records = {r["source"]: r for r in all_records(out)}
    cut_errors, missed, extra, ious, maes, outside, clips = [], 0, 0, [], [], [], 0
    for name, t in truth.items():
        r = records.get(f"{name}.mp4")
        if r is None or r["status"] != "done":
            missed += len(t["cuts"])
            continue
        found = list(r["cuts"])
        for c in t["cuts"]:
            near = min(found, key=lambda f: abs(f - c), default=None)
            if near is None or abs(near - c) > 1:
                missed += 1
            else:
                cut_errors.append(abs(near - c))
                found.remove(near)
        extra += len(found)
        masks = np.load(raw / "truth" / f"{name}.npz")
        subject_FHW = masks["subject"]
        for s in r["samples"]:
            clips += 1
            ref = s["references"]["person"]
            ious.append(iou(reference_mask(out, s, "person"), truth_mask(subject_FHW[ref["source_frame"]], s)))
            outside += [v["outside_window"] for v in s["references"].values()]
            bg_path = out / f"{s['id']}_background.png"
            if bg_path.exists():
                clean = np.asarray(Image.open(raw / "truth" / f"{name}_shot{s['shot']}_background.png").convert("RGB"))
                clean_HW3 = truth_view(clean, s)
                got = np.asarray(Image.open(bg_path).convert("RGB"))
                err_HW = np.abs(got.astype(np.int16) - clean_HW3).mean(axis=-1)
                if "object" not in s["references"]:  # the object was not emitted, so it stays in the plate
                    err_HW = err_HW[~truth_mask(masks["object"][s["shot"]], s)[crop_slices(s)]]
                maes.append(float(err_HW.mean()))
    return {"videos": len(truth), "cuts": sum(len(t["cuts"]) for t in truth.values()), "cuts_within_1_frame":
            len(cut_errors), "cuts_missed": missed, "cuts_extra": extra, "clips": clips,
            "subject_iou_mean": round(float(np.mean(ious)), 4) if ious else None,
            "subject_iou_min": round(float(np.min(ious)), 4) if ious else None,
            "background_mae_mean": round(float(np.mean(maes)), 3) if maes else None,
            "background_mae_max": round(float(np.max(maes)), 3) if maes else None,
            "backgrounds": len(maes),
            "references_outside_window": round(float(np.mean(outside)), 4) if outside else None}




def score_hard(raw: Path, out: Path) -> dict:
    """bench/make_raw_footage.py write_hard_footage's cases, per video: cuts and dissolves found,
    samples kept, subject IoU of the reference, whether the reference shows the clip's subject
    (the truth's subject id at the reference frame against the window's), the background's mean
    error against the clean frame the reference shows, and what was dropped or flagged and why."""
    truth = json.loads((raw / "truth_hard.json").read_text())
    records = {r["source"]: r for r in all_records(out)}
    cases = {}
    for name, t in truth.items():
        r = records.get(f"{name}.mp4", {})
        found = r.get("cuts", [])
        dissolves = r.get("boundaries", {}).get("dissolves", [])
        case = {"cuts": len(t["cuts"]), "cuts_within_1_frame": sum(any(abs(f - c) <= 1 for f in found) for c in t["cuts"]),
                "cuts_extra": sum(all(abs(f - c) > 1 for c in t["cuts"]) for f in found),
                "dissolves": len(t["dissolves"]),
                "dissolves_found": sum(any(d["start"] <= e and d["end"] >= s for d in dissolves) for s, e in t["dissolves"]),
                "samples": len(r.get("samples", [])), "orientation": r.get("orientation"),
                "dropped_or_flagged": {k: v for k, v in r.get("counts", {}).items()
                                       if k.startswith(("clips_dropped", "shots_moving", "shots_too", "flagged_gate"))},
                "identity_rejections": sum(v for k, v in r.get("counts", {}).items() if k.endswith("_identity")),
                "ious": [], "purity": [], "wrong_subject": 0, "background_mae": [], "orientations": []}
        if not r.get("samples"):
            cases[name] = case
            continue
        m = np.load(raw / "truth" / f"{name}.npz")
        for s in r["samples"]:
            hw = s["crop"]["hw"]
            case["orientations"].append("portrait" if hw[0] > hw[1] else "landscape")
            ref = s["references"]["person"]
            f = ref["source_frame"]
            got_HW, true_HW = reference_mask(out, s, "person"), truth_mask(m["subject"][f], s)
            case["ious"].append(iou(got_HW, true_HW))
            case["purity"].append(float((got_HW & true_HW).sum() / max(1, got_HW.sum())))  # of the cut-out, subject
            window_ids = m["subject_id"][s["window"]["source_frames"]]
            if m["subject_id"][f] != np.bincount(window_ids).argmax() or case["ious"][-1] < 0.5:
                case["wrong_subject"] += 1  # another subject, or not the subject at all
            if (out / f"{s['id']}_background.png").exists():
                view = s["references"]["background"].get("view_frame", s["window"]["source_frames"][len(s["window"]["source_frames"]) // 2])
                clean_HW3 = truth_view(m["background"][view], s)
                got = np.asarray(Image.open(out / f"{s['id']}_background.png").convert("RGB"))
                case["background_mae"].append(float(np.abs(got.astype(np.int16) - clean_HW3).mean()))
        cases[name] = case
    for case in cases.values():  # worst and mean: IoU and purity at their lowest, the error at its highest
        for key, base, worst in (("ious", "subject_iou", min), ("purity", "purity", min), ("background_mae", "background_mae", max)):
            v = case.pop(key)
            case[f"{base}_{worst.__name__}"] = round(worst(v), 3) if v else None
            case[f"{base}_mean"] = round(float(np.mean(v)), 3) if v else None
    return cases
