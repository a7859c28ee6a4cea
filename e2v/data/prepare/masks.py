"""What a segmentation backend hands the reference cutter, and the mask operations both backends
share (components, IoU, sharpness).

Legend: F track frames (the shot sampled at clips.fps), H/W the target height/width;
frames_FHW3 uint8 RGB, masks_FHW bool (True = the element), scores_F float in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np


@dataclass
class ShotMasks:
    """Per element name (subject and objects): a mask and a detection score per track frame."""
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # name -> masks_FHW
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # name -> scores_F
    subject: str = ""  # the name of the subject element (the rest are objects)
    backend: str = ""
    models: list[str] = field(default_factory=list)
    problem: str = ""  # set when the backend cannot use the shot (the summary counts shots_<problem>)
    # classical backend on a moving camera: per frame the homography into the shot's reference
    # frame (F x 3 x 3) and how well it fits; None for a still camera
    to_reference: np.ndarray | None = None
    camera: dict = field(default_factory=dict)

    def foreground(self) -> np.ndarray:
        """The union of every element's mask: masks_FHW."""
        return np.logical_or.reduce(list(self.masks.values()))


def disk(radius: int) -> np.ndarray:
    return cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))


def clean(mask_HW: np.ndarray, open_px: int, close_px: int) -> np.ndarray:
    """Opening removes specks (noise, compression), closing fills pinholes."""
    m = mask_HW.astype(np.uint8)
    if open_px > 0:
        m = cv2.morphologyEx(m, cv2.MORPH_OPEN, disk(open_px))
    if close_px > 0:
        m = cv2.morphologyEx(m, cv2.MORPH_CLOSE, disk(close_px))
    return m.astype(bool)


def largest_components(mask_HW: np.ndarray, keep: int) -> list[np.ndarray]:
    """The `keep` largest 8-connected components, largest first, each a mask_HW."""
    n, labels, stats, _ = cv2.connectedComponentsWithStats(mask_HW.astype(np.uint8), connectivity=8)
    order = np.argsort(-stats[1:, cv2.CC_STAT_AREA])[:keep] + 1
    return [labels == i for i in order]


def iou(a_HW: np.ndarray, b_HW: np.ndarray) -> float:
    union = np.logical_or(a_HW, b_HW).sum()
    return 1.0 if union == 0 else float(np.logical_and(a_HW, b_HW).sum() / union)


def sharpness(frame_HW3: np.ndarray, mask_HW: np.ndarray) -> float:
    """Variance of the Laplacian of the grey pixels in the mask's bounding box (the blur filter:
    a motion-blurred or out-of-focus reference has few edges)."""
    box = bbox(mask_HW)
    if box is None:
        return 0.0
    y0, y1, x0, x1 = box
    grey = cv2.cvtColor(np.ascontiguousarray(frame_HW3[y0:y1, x0:x1]), cv2.COLOR_RGB2GRAY)
    return float(cv2.Laplacian(grey, cv2.CV_64F).var())


def bbox(mask_HW: np.ndarray, margin: int = 0) -> tuple[int, int, int, int] | None:
    """(y0, y1, x0, x1) of the mask's pixels plus a margin, clipped to the frame; None if empty."""
    ys, xs = np.nonzero(mask_HW)
    if len(ys) == 0:
        return None
    h, w = mask_HW.shape
    return (max(0, ys.min() - margin), min(h, ys.max() + 1 + margin),
            max(0, xs.min() - margin), min(w, xs.max() + 1 + margin))
