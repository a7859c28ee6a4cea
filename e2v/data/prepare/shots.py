"""Shots: the boundaries between them, found on small copies of the frames (SHOT_WIDTH pixels wide).

Hard cuts get two opinions from PySceneDetect: its content detector (mean HSV change between
consecutive frames above shots.threshold) and its adaptive detector (that change against the mean
of its neighbours, above shots.adaptive_threshold: a cut between two busy, similar-looking shots
is small in absolute terms but stands out of its neighbours). A cut either finds is a cut; the
manifest keeps both scores.

PySceneDetect has no detector for gradual transitions, so dissolves and fades are found here: a
cross-fade's middle frame is a blend of the frames on either side of it, M = (1 - a) A + a B,
while the middle of a pan or of a moving subject is not, and a lighting ramp blends a frame with
a brighter copy of itself. A span of 2 d frames is a dissolve when its ends differ (mean change at
least shots.dissolve_min_change levels), they are different pictures (their normalised grey
correlation is below shots.dissolve_max_similarity: not one scene relit), the best blend weight a
of the middle frame lies in [0.2, 0.8] (a hard cut's middle equals one end) and the blend explains
the middle frame (residual at most shots.dissolve_max_residual of the ends' difference). A
dissolve's frames belong to neither shot: they are cut out.

Legend: F frames, h/w the small copy's height/width; small_Fhw3 float32 RGB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

SHOT_WIDTH = 160  # PySceneDetect's auto-downscale brings frames to about 256 wide; 160 keeps 64-px tests exact
HALF_SPANS = (3, 6, 10)  # d: dissolves of about 2d frames (0.4 to 1.3 s at 16 fps) are found


@dataclass
class Boundaries:
    cuts: list[dict] = field(default_factory=list)  # {"frame", "content", "adaptive", "by"}
    dissolves: list[dict] = field(default_factory=list)  # {"start", "end" (inclusive), "change", "residual", "weight"}

    def shot_ranges(self, total: int) -> list[tuple[int, int]]:
        """[start, end) of every shot of a total-frame video, the dissolves' frames left out."""
        gaps = sorted([(c["frame"], c["frame"]) for c in self.cuts] + [(d["start"], d["end"] + 1) for d in self.dissolves])
        shots, start = [], 0
        for a, b in gaps:
            if a > start:
                shots.append((start, min(a, total)))
            start = max(start, b)
        if total > start:
            shots.append((start, total))
        return shots


def small_frames(vr, chunk: int = 32) -> np.ndarray:
    """Every frame of a decord reader at SHOT_WIDTH wide: small_Fhw3 float32."""
    h, w = vr[0].shape[:2]
    size = (SHOT_WIDTH, max(8, round(h * SHOT_WIDTH / w)))
    out = []
    for i in range(0, len(vr), chunk):
        batch = vr.get_batch(list(range(i, min(len(vr), i + chunk)))).asnumpy()
        out += [cv2.resize(f, size, interpolation=cv2.INTER_AREA) for f in batch]
    return np.stack(out).astype(np.float32)


def hard_cuts(small_Fhw3: np.ndarray, fps: float, cfg) -> list[dict]:
    """PySceneDetect's content and adaptive detectors over the frames, with each cut's scores."""
    from scenedetect import AdaptiveDetector, ContentDetector, FrameTimecode, StatsManager  # only preparation needs it

    stats = StatsManager()
    content = ContentDetector(threshold=cfg.threshold, min_scene_len=cfg.min_shot_frames)
    adaptive = AdaptiveDetector(adaptive_threshold=cfg.adaptive_threshold, min_scene_len=cfg.min_shot_frames,
                                min_content_val=cfg.adaptive_min_content)
    found: dict[int, set] = {}
    for name, det in (("content", content), ("adaptive", adaptive)):
        det.stats_manager = stats
        tc = None
        for i, frame in enumerate(small_Fhw3):
            tc = FrameTimecode(i, fps)
            for cut in det.process_frame(tc, np.ascontiguousarray(frame[..., ::-1].astype(np.uint8))):  # BGR
                found.setdefault(int(cut.frame_num), set()).add(name)
        if tc is not None:
            for cut in det.post_process(tc):
                found.setdefault(int(cut.frame_num), set()).add(name)
    cuts = []
    for f in sorted(found):
        if cuts and f - cuts[-1]["frame"] <= 1:  # the two detectors one frame apart: one cut
            cuts[-1]["by"] = sorted(set(cuts[-1]["by"]) | found[f])
            continue
        tc = FrameTimecode(f, fps)
        content_val = stats.get_metrics(tc, ["content_val"])[0] if stats.metrics_exist(tc, ["content_val"]) else None
        key = f"adaptive_ratio (w={adaptive.window_width})"
        ratio = stats.get_metrics(tc, [key])[0] if stats.metrics_exist(tc, [key]) else None
        cuts.append({"frame": f, "content": None if content_val is None else round(float(content_val), 2),
                     "adaptive": None if ratio is None else round(float(ratio), 2), "by": sorted(found[f])})
    return [c for c in cuts if 0 < c["frame"] < len(small_Fhw3)]


def _grey_z(frame_hw3: np.ndarray) -> np.ndarray:
    g = frame_hw3.mean(axis=-1)
    return (g - g.mean()) / (g.std() + 1e-3)


def dissolves(small_Fhw3: np.ndarray, cuts: list[dict], cfg) -> list[dict]:
    """Spans whose middle frames are blends of their ends (module docstring), merged, with the
    strongest evidence of each."""
    f_total = len(small_Fhw3)
    cut_frames = np.array([c["frame"] for c in cuts], int)
    spans = []
    for d in HALF_SPANS:
        for t in range(d, f_total - d):
            if len(cut_frames) and np.any((cut_frames > t - d) & (cut_frames <= t + d)):
                continue  # a hard cut inside: its ends are two shots, not a blend
            a, b, m = small_Fhw3[t - d], small_Fhw3[t + d], small_Fhw3[t]
            diff = b - a
            change = float(np.abs(diff).mean())
            if change < cfg.dissolve_min_change:
                continue
            weight = float(((m - a) * diff).sum() / max(float((diff * diff).sum()), 1e-6))
            if not 0.2 <= weight <= 0.8:
                continue
            residual = float(np.abs(m - a - weight * diff).mean()) / change
            if residual > cfg.dissolve_max_residual:
                continue
            distinct = float((_grey_z(a) * _grey_z(b)).mean()) <= cfg.dissolve_max_similarity  # not one picture relit
            spans.append((t - d, t + d, d, change, residual, weight, distinct))
    groups: list[list[tuple]] = []
    for span in sorted(spans):
        if groups and span[0] <= max(x[1] for x in groups[-1]):
            groups[-1].append(span)
        else:
            groups.append([span])
    out = []
    for group in [g for g in groups if any(x[6] for x in g)]:
        # a frame just outside a dissolve is a blend too (weight 0 or 1), so long spans overreach:
        # the extent is the shortest spans' union, the evidence the best span's
        shortest = [x for x in group if x[2] == min(x[2] for x in group)]
        best = min((x for x in group if x[6]), key=lambda x: x[4])
        out.append({"start": min(x[0] for x in shortest), "end": max(x[1] for x in shortest), "change": round(best[3], 2),
                    "residual": round(best[4], 3), "weight": round(best[5], 3)})
    return out


def detect(vr, fps: float, cfg) -> Boundaries:
    """The cuts and dissolves of a decord reader's video (cfg: the prepare config's shots)."""
    small_Fhw3 = small_frames(vr)
    cuts = hard_cuts(small_Fhw3, fps, cfg)
    return Boundaries(cuts, dissolves(small_Fhw3, cuts, cfg) if cfg.dissolves else [])
