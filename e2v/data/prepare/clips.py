"""Clips: windows of `num_frames` frames at `fps` cut from a shot, the size and aspect filters,
the crop to the trainer's resolution, and the H.264 writer.

The window rule is the trainer's: frames are taken by time at clips.fps (e2v.data.media.time_indices,
the same function data.fps loading uses), so a prepared clip re-read with the same data.fps gives
back the same frames. Clips are written at the target resolution and rate, so the trainer reads
them by index or by time alike.

Legend: F frames, H/W height/width; uint8 frames_FHW3 (RGB), bool masks_FHW / mask_HW.
"""

from __future__ import annotations

import os
from pathlib import Path

import imageio_ffmpeg
import numpy as np

from e2v.data.media import frames_at_rate, frames_to_video, time_indices


def track(times_s: np.ndarray, first: int, last: int, fps: float, max_seconds: float) -> list[int]:
    """The shot's frames [first, last) sampled by time at fps (e2v.data.media.time_indices, the rule the
    trainer's data.fps loading uses), over at most max_seconds: source frame indices."""
    shot_times = times_s[first:last]
    count = min(frames_at_rate(shot_times, fps), int(max_seconds * fps) + 1)
    return [first + i for i in time_indices(shot_times, fps, count)] if count else []


def windows(track_len: int, num_frames: int, limit: int) -> list[tuple[int, int]]:
    """Up to `limit` non-overlapping windows [start, end) of num_frames positions in a track of
    track_len; [] when the track is shorter. Spread with equal gaps, so the frames between and
    around them give references from outside each window."""
    if track_len < num_frames:
        return []
    count = min(limit, track_len // num_frames)
    spare = track_len - count * num_frames
    starts = [round(spare * (k + 1) / (count + 1)) + k * num_frames for k in range(count)]
    if count == 1 and spare:  # one window: at the start, the rest of the shot left for references
        starts = [0]
    return [(s0, s0 + num_frames) for s0 in starts]


def orientation_sizes(resolution: list[int], orientations: list[str]) -> dict[str, tuple[int, int]]:
    """The target [H, W] per allowed orientation, each at clips.resolution's pixel count: landscape
    the wide one, portrait its transpose, square the side nearest sqrt(H x W) in multiples of 16."""
    h, w = sorted(resolution)
    side = max(16, round((h * w) ** 0.5 / 16) * 16)
    sizes = {"landscape": (h, w), "portrait": (w, h), "square": (side, side)}
    out: dict[str, tuple[int, int]] = {}
    for o in orientations:  # a square resolution's orientations are one size: listed once
        if sizes[o] not in out.values():
            out[o] = sizes[o]
    return out


def choose_target(height: int, width: int, sizes: dict[str, tuple[int, int]]) -> tuple[str, tuple[int, int]]:
    """The orientation whose aspect is nearest the source's, in log space (the trainer's
    resolution_buckets rule, e2v/data/buckets.py): (name, (H, W))."""
    aspect = np.log(width / height)
    name = min(sizes, key=lambda o: abs(np.log(sizes[o][1] / sizes[o][0]) - aspect))
    return name, sizes[name]


def cover_size(height: int, width: int, target_hw: tuple[int, int]) -> tuple[int, int]:
    """The source resized, aspect kept, to just cover the target: (H, W), one side the target's."""
    th, tw = target_hw
    scale = max(th / height, tw / width)
    return max(th, round(height * scale)), max(tw, round(width * scale))


def to_cover(frames_FHW3: np.ndarray, target_hw: tuple[int, int]) -> np.ndarray:
    """Frames resized (aspect kept, antialiased bicubic: the trainer's e2v.data.media.frames_to_video)
    to cover the target; the crop inside them is chosen later (best_crop): uint8 frames_FHW3."""
    ch, cw = cover_size(*frames_FHW3.shape[1:3], target_hw)
    video_CFHW = frames_to_video(np.ascontiguousarray(frames_FHW3), ch, cw, "resize", "bicubic")
    return video_CFHW.permute(1, 2, 3, 0).numpy()


def best_crop(keep_FHW: np.ndarray, target_hw: tuple[int, int]) -> tuple[int, int]:
    """The target-sized crop (y0, x0) of cover-sized frames that keeps the most of `keep` (the
    subject's and objects' pixels over the shot's frames); the centre when nothing is kept or it
    fits anywhere. Only the axis the cover overhangs moves."""
    ch, cw = keep_FHW.shape[1:]
    th, tw = target_hw
    centre = ((ch - th) // 2, (cw - tw) // 2)
    if not keep_FHW.any() or (ch, cw) == (th, tw):
        return centre
    axis, side, length = (2, cw, tw) if cw > tw else (1, ch, th)
    profile = keep_FHW.sum(axis=(0, 3 - axis)).astype(np.float64)  # kept pixels per column (or row)
    sums = np.convolve(profile, np.ones(length), "valid")  # kept pixels per crop offset
    ties = np.flatnonzero(sums >= sums.max() - 1e-9)
    offset = int(ties[np.argmin(np.abs(ties - centre[axis - 1]))])  # of the best, the nearest the centre
    return (offset, centre[1]) if axis == 1 else (centre[0], offset)


def crop_share(height: int, width: int, target_hw: tuple[int, int]) -> float:
    """Share of an H x W frame the centre crop to the target's aspect cuts away."""
    th, tw = target_hw
    if width / height > tw / th:
        return 1 - (height * tw / th) / width
    return 1 - (width * th / tw) / height


def size_problem(height: int, width: int, target_hw: tuple[int, int], min_scale: float, max_crop: float) -> str | None:
    """Why a source of this size gives no clips ('too_small', 'aspect'), or None."""
    share = crop_share(height, width, target_hw)
    if share > max_crop:
        return "aspect"
    th, tw = target_hw
    ch, cw = (height, round(height * tw / th)) if width / height > tw / th else (round(width * th / tw), width)
    if ch < th * min_scale or cw < tw * min_scale:
        return "too_small"
    return None


def frames_to_crop(frames_FHW3: np.ndarray, target_hw: tuple[int, int], crop: tuple[int, int]) -> np.ndarray:
    """Source frames as a sample shows them: resized to cover the target and cropped at (y0, x0)
    (the manifest's `crop`)."""
    (y0, x0), (th, tw) = crop, target_hw
    return to_cover(frames_FHW3, target_hw)[:, y0:y0 + th, x0:x0 + tw]


def write_h264(path: Path, frames_FHW3: np.ndarray, fps: float, crf: int = 18) -> None:
    """H.264 mp4 (yuv444p: colour edges of small frames survive; no audio) from imageio-ffmpeg's
    bundled ffmpeg, written to a temp file in the same folder and renamed into place, so a kill
    leaves either the old file or the whole new one."""
    _, h, w, _ = frames_FHW3.shape
    tmp = path.with_name(path.name + ".part")  # not a video suffix: never discovered as a sample
    writer = imageio_ffmpeg.write_frames(
        str(tmp), (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv444p", quality=None, macro_block_size=1,
        ffmpeg_log_level="error", output_params=["-crf", str(crf), "-an", "-threads", "1", "-f", "mp4"])
    writer.send(None)
    for frame in frames_FHW3:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
    os.replace(tmp, path)
