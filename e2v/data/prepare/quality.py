"""Quality gates on every sample, measured on the clip as written (the crop of the window):

- presence: the share of the window's frames in which the subject's mask covers at least
  elements.min_area_share of the frame. A subject that stood still long enough to become part of
  the classical backend's median shows as a mask that vanishes; a detector that lost it, the same.
- background_residue: the share of the window's background pixels (outside every emitted mask,
  dilated by 2 pixels against edge blur) that differ from the background reference by more than
  classical.diff_threshold levels: a subject left in the plate, or a plate of another view.
- background_filled: the share of the background reference that no frame showed and the fill
  painted (a subject covering most of the frame most of the time leaves the plate invented).
- subject_at_edge: the share of the window's frames in which the subject touches the crop's edge
  (a flag, not a gate: a subject walking out of the frame is ordinary footage).

gate_failures names the gates a sample fails (gates.min_presence, gates.max_background_residue,
gates.max_background_filled);
run.py drops it or writes it flagged (gates.action). Every score goes to the manifest.

Legend: F window frames, H/W target height/width; clip_FHW3 uint8, masks_FHW bool.
"""

from __future__ import annotations

import cv2
import numpy as np

from .references import touches_edge


def quality(clip_FHW3: np.ndarray, subject_FHW: np.ndarray, foreground_FHW: np.ndarray,
            background_FHW3: np.ndarray | None, min_area_share: float, diff_threshold: float) -> dict:
    """background_FHW3: the background reference as each window frame sees it (one plate repeated
    for a still camera, warped to each frame's view for a registered one; pixels no plate covers
    belong to foreground_FHW)."""
    presence = float((subject_FHW.mean(axis=(1, 2)) >= min_area_share).mean())
    at_edge = float(np.mean([touches_edge(m) for m in subject_FHW]))
    q = {"presence": round(presence, 4), "subject_at_edge": round(at_edge, 4),
         "foreground_share": round(float(foreground_FHW.mean()), 4), "background_residue": None}
    if background_FHW3 is not None:
        grown = np.stack([cv2.dilate(m.astype(np.uint8), np.ones((5, 5), np.uint8)) for m in foreground_FHW]).astype(bool)
        differs = np.abs(clip_FHW3.astype(np.int16) - background_FHW3.astype(np.int16)).max(axis=-1) > diff_threshold
        q["background_residue"] = round(float(differs[~grown].mean()) if (~grown).any() else 0.0, 4)
    return q


def gate_failures(q: dict, gates) -> list[str]:
    failed = []
    if q["presence"] < gates.min_presence:
        failed.append("presence")
    if q["background_residue"] is not None and q["background_residue"] > gates.max_background_residue:
        failed.append("background_residue")
    if q.get("background_filled") is not None and q["background_filled"] > gates.max_background_filled:
        failed.append("background_filled")
    return failed
