"""The classical background fill: what is left of a frame once its foreground masks are cut out,
with the holes painted from their surround. Data preparation (the classical backend's holes the
temporal median cannot fill) and dataset importers (a background from one annotated frame) share
it, so a background means the same thing whichever way a sample was made.

Legend: H/W height/width; frames are uint8 RGB frame_HW3, masks bool mask_HW (True = foreground).
"""

from __future__ import annotations

import numpy as np

# OpenS2V leaves the background out when the foreground covers more than this share of the
# frame: a fill that large is invented, not seen.
MAX_FOREGROUND_SHARE = 0.45


def foreground_share(mask_HW: np.ndarray) -> float:
    """The share of the frame the foreground covers, in [0, 1]."""
    return float(np.count_nonzero(mask_HW)) / max(1, mask_HW.size)


def fill_background(frame_HW3: np.ndarray, mask_HW: np.ndarray, *, dilate: int = 3, radius: int = 5) -> np.ndarray:
    """The frame with the masked pixels removed and filled by OpenCV's Telea inpainting.

    The mask is dilated by `dilate` pixels first: a segmentation edge leaves a rim of foreground
    colour that the fill would otherwise spread into the hole."""
    if frame_HW3.dtype != np.uint8 or frame_HW3.ndim != 3 or frame_HW3.shape[2] != 3:
        raise ValueError(f"fill_background wants a uint8 H x W x 3 frame, got {frame_HW3.dtype} {frame_HW3.shape}")
    if mask_HW.shape != frame_HW3.shape[:2]:
        raise ValueError(f"mask {mask_HW.shape} does not match the frame {frame_HW3.shape[:2]}")
    import cv2  # here, not at import: OpenCV starts a thread as it loads, and training processes import this module

    hole = mask_HW.astype(np.uint8)
    if not hole.any():
        return frame_HW3.copy()
    if dilate > 0:
        hole = cv2.dilate(hole, np.ones((2 * dilate + 1, 2 * dilate + 1), np.uint8))
    return cv2.inpaint(np.ascontiguousarray(frame_HW3), hole * 255, radius, cv2.INPAINT_TELEA)
