"""Contact sheets: one PNG per prepared clip, a title line (sample id, source, shot, window and any
flags), then its first, middle and last frames | its references (the subject's transparency shown
on a grey checkerboard), each tile labelled, for a person to flip through.

Legend: frames_FHW3 uint8 RGB; images HW3 / HW4 uint8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

LABEL = 14  # pixels of the text line above each tile and of the title

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


def _labelled(tile: np.ndarray, text: str) -> np.ndarray:
    band = Image.new("RGB", (tile.shape[1], LABEL), (255, 255, 255))
    ImageDraw.Draw(band).text((2, 1), text, fill=(0, 0, 0))  # PIL's built-in bitmap font: nothing to install
    return np.concatenate([np.asarray(band), tile])


def write_sheet(path: Path, frames_FHW3: np.ndarray, references: dict[str, np.ndarray], title: str = "") -> None:
    f = len(frames_FHW3)
    tiles = [_labelled(_thumb(frames_FHW3[i]), f"frame {i}") for i in (0, f // 2, f - 1)]
    tiles += [np.full((ROW + LABEL, GAP * 3, 3), 255, np.uint8)]
    tiles += [_labelled(_thumb(img), name) for name, img in references.items()]
    row = []
    for t in tiles:
        row += [t, np.full((ROW + LABEL, GAP, 3), 255, np.uint8)]
    body = np.concatenate(row, axis=1)
    head = Image.new("RGB", (body.shape[1], LABEL + 2), (255, 255, 255))
    ImageDraw.Draw(head).text((2, 1), title, fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    Image.fromarray(np.concatenate([np.asarray(head), body])).save(tmp, format="PNG")
    tmp.replace(path)
