"""The classical backend (no weights): for a static camera the background is the per-pixel
temporal median of the shot, the moving foreground (the subject) is what differs from it, and a
static object is what stands out of the median background against its own smoothed self.

Costs and limits: a moving camera breaks the median (the background smears and the difference
marks most of the frame; the foreground-share filter then drops the background), and a subject
that stands still through the shot is part of the median. Holes the median cannot fill (pixels the
subject covers in most frames) and the object's area are painted by the shared fill
(e2v.data.prepare.fill.fill_background, OpenCV's Telea inpainting).

Legend: F track frames, H/W target height/width; frames_FHW3 uint8, masks_FHW bool.
"""

from __future__ import annotations

import cv2
import numpy as np

from .config import Elements
from .fill import fill_background, foreground_share
from .masks import ShotMasks, clean, largest_components


def temporal_median(frames_FHW3: np.ndarray, max_frames: int) -> np.ndarray:
    """Per-pixel median over at most max_frames evenly spaced frames: background_HW3 uint8."""
    pick = np.unique(np.linspace(0, len(frames_FHW3) - 1, min(max_frames, len(frames_FHW3))).round().astype(int))
    return np.median(frames_FHW3[pick], axis=0).round().astype(np.uint8)


def difference(frames_FHW3: np.ndarray, background_HW3: np.ndarray) -> np.ndarray:
    """Largest per-channel |frame - background| in levels: diff_FHW."""
    return np.abs(frames_FHW3.astype(np.int16) - background_HW3.astype(np.int16)).max(axis=-1)


class ClassicalBackend:
    name = "classical"

    def __init__(self, cfg: Elements):
        self.cfg, self.c = cfg, cfg.classical

    def object_masks(self, background_HW3: np.ndarray, count: int) -> list[np.ndarray]:
        """Static objects: pixels of the median background far from its large-window median
        filter (the window is over twice an object's width, so the filter keeps the surround),
        the `count` largest components."""
        short = min(background_HW3.shape[:2])
        k = self.c.object_kernel or (short // 2) | 1
        smooth_HW3 = cv2.medianBlur(np.ascontiguousarray(background_HW3), k)
        stands_out = difference(background_HW3[None], smooth_HW3)[0] > self.c.object_threshold
        return largest_components(clean(stands_out, self.c.open_px + 1, self.c.close_px), count)

    def camera_moves(self, frames_FHW3: np.ndarray) -> float:
        """Share of the frame where the medians of the shot's first and second halves differ: near
        the subject's share for a still camera, most of the frame for a pan or zoom."""
        half = len(frames_FHW3) // 2
        a_HW3 = temporal_median(frames_FHW3[:half], self.c.median_frames)
        b_HW3 = temporal_median(frames_FHW3[half:], self.c.median_frames)
        return float((difference(a_HW3[None], b_HW3)[0] > self.c.diff_threshold).mean())

    def analyse(self, frames_FHW3: np.ndarray, subject: str, objects: list[str]) -> ShotMasks:
        if self.camera_moves(frames_FHW3) > self.c.max_camera_motion:
            return ShotMasks(subject=subject, backend=self.name, problem="moving_camera")
        background_HW3 = temporal_median(frames_FHW3, self.c.median_frames)
        moving_FHW = difference(frames_FHW3, background_HW3) > self.c.diff_threshold
        out = ShotMasks(subject=subject, backend=self.name, models=[])
        subject_FHW = np.zeros_like(moving_FHW)
        for f, m in enumerate(moving_FHW):
            parts = largest_components(clean(m, self.c.open_px, self.c.close_px), self.c.max_components)
            if parts:
                subject_FHW[f] = np.logical_or.reduce(parts)
        out.masks[subject] = subject_FHW
        out.scores[subject] = subject_FHW.any(axis=(1, 2)).astype(np.float32)  # no confidence: found or not
        found = self.object_masks(background_HW3, len(objects))
        for i, name in enumerate(objects):
            m_HW = found[i] if i < len(found) else np.zeros(background_HW3.shape[:2], bool)
            out.masks[name] = np.broadcast_to(m_HW, moving_FHW.shape)
            out.scores[name] = np.full(len(frames_FHW3), float(m_HW.any()), np.float32)
        return out

    def background(self, frames_FHW3: np.ndarray, shot: ShotMasks, positions: list[int]) -> tuple[np.ndarray, float]:
        """The clean background from the track frames at `positions`: their median, with the pixels
        the foreground covers in most of them (the median shows foreground there) and the static
        objects filled. Returns (background_HW3, foreground share: the mean share of the frame the
        foreground covers in those frames, the OpenS2V filter's measure)."""
        frames = frames_FHW3[positions]
        median_HW3 = temporal_median(frames, self.c.median_frames)
        fg_FHW = shot.foreground()[positions]
        hole_HW = fg_FHW.mean(axis=0) > 0.5
        statics = [m[0] for name, m in shot.masks.items() if name != shot.subject]
        hole_HW = np.logical_or.reduce([hole_HW, *statics])
        share = float(np.mean([foreground_share(m) for m in fg_FHW]))
        return fill_background(median_HW3, hole_HW), share
