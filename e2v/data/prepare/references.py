"""References from outside the clip: which track frame each element is cut from, and the cut-outs
in e2v's element formats (the subject an RGBA cut-out with a transparent surround, an object an
RGB crop on white, as tools/make_demo_dataset.py's references are).

Why outside: a reference cut from the very frames the model must produce teaches it to paste the
reference back (copy-paste); Phantom and OpenS2V pair a clip with references from other frames
(cross-paired data) for this reason. A reference comes from a track frame at least
elements.reference_gap_seconds away from its window; only a shot with no frame that far away gives
references from inside, and the manifest says so (outside_window: false).

Legend: F track frames, H/W target height/width; frames_FHW3 uint8, masks_FHW bool, scores_F float.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import Elements
from .masks import bbox, sharpness


@dataclass
class Choice:
    position: int | None  # track position of the chosen frame; None: no frame passes the filters
    outside: bool  # the frame lies outside the window (with the gap)
    area_share: float = 0.0
    score: float = 0.0
    sharpness: float = 0.0
    dropped_by: str = ""  # the filter that removed the last candidate, when none is left
    at_edge: bool = False  # the mask touches the frame's edge (the element may be cut off)
    identity: float | None = None  # the identity check's score against the window (identity.py); None: not checked


def outside_positions(track_len: int, window: tuple[int, int], gap_frames: int) -> list[int]:
    """Track positions at least gap_frames before the window's first or after its last frame."""
    start, end = window
    return [p for p in range(track_len) if p <= start - 1 - gap_frames or p >= end + gap_frames]


def choose(frames_FHW3: np.ndarray, masks_FHW: np.ndarray, scores_F: np.ndarray, window: tuple[int, int],
           gap_frames: int, cfg: Elements) -> list[Choice]:
    """The frames to cut an element from, best first: outside the window, or inside only when the
    shot has no frame outside (too short for the gap; the manifest says so). Among the frames
    passing the filters (size, score, sharpness), the masks that do not touch the frame's edge (a
    subject cut by the edge is half a subject) come first, each group nearest its typical size first. None passing:
    one Choice with position None naming the filter that removed the last candidate; never a frame
    from inside instead (that would be the copy-paste the gap prevents). The identity check takes
    the first that shows the clip's element."""
    outside = outside_positions(len(frames_FHW3), window, gap_frames)
    pool, is_outside = (outside, True) if outside else (list(range(*window)), False)
    last_drop = "no_detection"
    passing = []
    for p in pool:
        m = masks_FHW[p]
        area = float(m.mean())
        if area == 0:
            continue
        if area < cfg.min_area_share:
            last_drop = "min_area"
            continue
        if scores_F[p] < cfg.min_score:
            last_drop = "min_score"
            continue
        sharp = sharpness(frames_FHW3[p], m)
        if sharp < cfg.min_sharpness:
            last_drop = "blur"
            continue
        passing.append((not touches_edge(m), area, p, float(scores_F[p]), sharp))
    if not passing:
        return [Choice(None, False, dropped_by=last_drop)]
    typical = float(np.median([c[1] for c in passing]))
    # the mask nearest the typical size, not the largest: an oversized mask is the element plus
    # what the segmentation got wrong (a registered pan's edge frames, a shadow)
    ranked = sorted(passing, key=lambda c: (c[0], -abs(c[1] - typical), c[4]), reverse=True)
    return [Choice(p, is_outside, area, score, sharp, at_edge=not inside) for inside, area, p, score, sharp in ranked]


def touches_edge(mask_HW: np.ndarray) -> bool:
    return bool(mask_HW[0].any() or mask_HW[-1].any() or mask_HW[:, 0].any() or mask_HW[:, -1].any())


def cutout_rgba(frame_HW3: np.ndarray, mask_HW: np.ndarray, margin: int) -> np.ndarray:
    """The subject: its bounding box (plus margin), alpha 255 on the mask and 0 around it, white
    under alpha 0: HW4. White there, so a reader that drops alpha (Pillow's convert("RGB"), as
    SkyReels-V3's pipeline reads a reference) sees the same cut-out on white as one that
    composites (data.reference_read's two rules agree), not the frame around the subject."""
    y0, y1, x0, x1 = bbox(mask_HW, margin)
    inside = mask_HW[y0:y1, x0:x1]
    rgb = np.where(inside[..., None], frame_HW3[y0:y1, x0:x1], np.uint8(255)).astype(np.uint8)
    return np.dstack([rgb, inside.astype(np.uint8) * 255])


def crop_on_white(frame_HW3: np.ndarray, mask_HW: np.ndarray, margin: int) -> np.ndarray:
    """An object: its bounding box (plus margin) with everything off the mask white: HW3."""
    y0, y1, x0, x1 = bbox(mask_HW, margin)
    crop = frame_HW3[y0:y1, x0:x1].copy()
    crop[~mask_HW[y0:y1, x0:x1]] = 255
    return crop
