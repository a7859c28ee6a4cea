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

from .clips import masks_to_target, to_target
from .manifest import all_records
from .masks import iou


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
            true_HW = masks_to_target(subject_FHW[ref["source_frame"]][None], target_hw)[0]
            y0, y1, x0, x1 = ref["box"]
            alpha = np.asarray(Image.open(out / f"{s['id']}_person.png"))[..., 3] > 127
            got_HW = np.zeros(target_hw, bool)
            got_HW[y0:y1, x0:x1] = alpha
            ious.append(iou(got_HW, true_HW))
            outside += [v["outside_window"] for v in s["references"].values()]
            bg_path = out / f"{s['id']}_background.png"
            if bg_path.exists():
                clean = np.asarray(Image.open(raw / "truth" / f"{name}_shot{s['shot']}_background.png").convert("RGB"))
                clean_HW3 = to_target(clean[None], target_hw)[0]
                got = np.asarray(Image.open(bg_path).convert("RGB"))
                maes.append(float(np.abs(got.astype(np.int16) - clean_HW3).mean()))
    return {"videos": len(truth), "cuts": sum(len(t["cuts"]) for t in truth.values()), "cuts_within_1_frame":
            len(cut_errors), "cuts_missed": missed, "cuts_extra": extra, "clips": clips,
            "subject_iou_mean": round(float(np.mean(ious)), 4) if ious else None,
            "subject_iou_min": round(float(np.min(ious)), 4) if ious else None,
            "background_mae_mean": round(float(np.mean(maes)), 3) if maes else None,
            "background_mae_max": round(float(np.max(maes)), 3) if maes else None,
            "backgrounds": len(maes),
            "references_outside_window": round(float(np.mean(outside)), 4) if outside else None}
