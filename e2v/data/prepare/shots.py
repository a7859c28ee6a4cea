"""Shots: hard cuts found by PySceneDetect's content detector (HSV change between consecutive
frames above shots.threshold), as frame ranges [start, end) of the decoded stream."""

from __future__ import annotations

from pathlib import Path

from e2v.data.media import MediaError


def detect_cuts(path: Path, threshold: float, min_shot_frames: int) -> list[int]:
    """Frame indices where a new shot starts (0 excluded)."""
    from scenedetect import ContentDetector, detect  # imported here: only preparation needs it

    try:
        scenes = detect(str(path), ContentDetector(threshold=threshold, min_scene_len=min_shot_frames))
    except Exception as e:
        raise MediaError(f"shot detection failed on {path}: {type(e).__name__}: {e}") from e
    return [int(start.frame_num) for start, _ in scenes[1:]]


def shot_ranges(cuts: list[int], total: int) -> list[tuple[int, int]]:
    """[start, end) of every shot of a total-frame video cut at `cuts`."""
    bounds = [0] + [c for c in cuts if 0 < c < total] + [total]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
