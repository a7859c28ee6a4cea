"""Contact sheets: one PNG per prepared clip, its first, middle and last frames | its references
(the subject's transparency shown on a grey checkerboard), for a person to flip through.

Legend: frames_FHW3 uint8 RGB; images HW3 / HW4 uint8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

ROW = 128  # sheet height in pixels
GAP = 6


def _checker(h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.where(((yy // 8 + xx // 8) % 2)[..., None] == 0, 200, 150).astype(np.uint8).repeat(3, axis=2)


def _thumb(image: np.ndarray) -> np.ndarray:
    if image.shape[2] == 4:  # composite over a checkerboard so transparency is visible
        alpha = image[..., 3:4].astype(np.float32) / 255
        image = (image[..., :3] * alpha + _checker(*image.shape[:2]) * (1 - alpha)).astype(np.uint8)
    h, w = image.shape[:2]
    return np.asarray(Image.fromarray(image).resize((max(1, round(w * ROW / h)), ROW), Image.BICUBIC))


def write_sheet(path: Path, frames_FHW3: np.ndarray, references: dict[str, np.ndarray]) -> None:
    f = len(frames_FHW3)
    tiles = [_thumb(frames_FHW3[i]) for i in (0, f // 2, f - 1)] + [np.full((ROW, GAP * 3, 3), 255, np.uint8)]
    tiles += [_thumb(img) for img in references.values()]
    row = []
    for t in tiles:
        row += [t, np.full((ROW, GAP, 3), 255, np.uint8)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    Image.fromarray(np.concatenate(row, axis=1)).save(tmp, format="PNG")
    tmp.replace(path)
