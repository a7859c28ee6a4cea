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

Legend: F frames, T span centres, h/w the small copy's height/width; small_Fhw3 uint8 RGB, grey_Fhw float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

SHOT_WIDTH = 160  # PySceneDetect's auto-downscale brings frames to about 256 wide; 160 keeps 64-px tests exact
HALF_SPANS = (3, 6, 10)  # d: dissolves of about 2d frames (0.4 to 1.3 s at 16 fps) are found
DISSOLVE_CHUNK = 64  # span centres tested at once


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
    """Every frame of a decord reader at SHOT_WIDTH wide (never wider than the source):
    small_Fhw3 uint8 (a 10-minute 30 fps video holds 18000 x 160 x 90 x 3: 0.8 GB)."""
    h, w = vr[0].shape[:2]
    width = min(SHOT_WIDTH, w)
    size = (width, max(8, round(h * width / w)))
    out = []
    for i in range(0, len(vr), chunk):
        batch = vr.get_batch(list(range(i, min(len(vr), i + chunk)))).asnumpy()
        out += [cv2.resize(f, size, interpolation=cv2.INTER_AREA) for f in batch]
    return np.stack(out)


def hard_cuts(small_Fhw3: np.ndarray, fps: float, cfg) -> list[dict]:
    """PySceneDetect's content and adaptive detectors over the frames, with each cut's scores: the
    content score (mean HSV change from the previous frame) and the adaptive ratio (that change
    over its 2 + 2 neighbours' mean, the adaptive detector's default window). No stats manager:
    with one the detectors also compute edge maps, half their time, for a weight of 0."""
    from scenedetect import AdaptiveDetector, ContentDetector, FrameTimecode  # only preparation needs it

    content = ContentDetector(threshold=cfg.threshold, min_scene_len=cfg.min_shot_frames)
    adaptive = AdaptiveDetector(adaptive_threshold=cfg.adaptive_threshold, min_scene_len=cfg.min_shot_frames,
                                min_content_val=cfg.adaptive_min_content)
    found: dict[int, set] = {}
    score_F = np.zeros(len(small_Fhw3))
    for name, det in (("content", content), ("adaptive", adaptive)):
        tc = None
        for i, frame in enumerate(small_Fhw3):
            tc = FrameTimecode(i, fps)
            for cut in det.process_frame(tc, np.ascontiguousarray(frame[..., ::-1])):  # BGR
                found.setdefault(int(cut.frame_num), set()).add(name)
            if name == "content":
                score_F[i] = det._frame_score or 0.0  # the score it just compared with its threshold
        if tc is not None:
            for cut in det.post_process(tc):
                found.setdefault(int(cut.frame_num), set()).add(name)
    cuts = []
    for f in sorted(found):
        if cuts and f - cuts[-1]["frame"] <= 1:  # the two detectors one frame apart: one cut
            cuts[-1]["by"] = sorted(set(cuts[-1]["by"]) | found[f])
            continue
        around = [score_F[j] for j in range(f - 2, f + 3) if j != f and 0 < j < len(score_F)]
        ratio = score_F[f] / max(float(np.mean(around)), 1e-5) if around else None
        cuts.append({"frame": f, "content": round(float(score_F[f]), 2),
                     "adaptive": None if ratio is None else round(min(ratio, 255.0), 2), "by": sorted(found[f])})
    return [c for c in cuts if 0 < c["frame"] < len(small_Fhw3)]


def _grey_z(g_Thw: np.ndarray) -> np.ndarray:
    """Grey frames, each to zero mean and unit variance: their products' mean is a correlation."""
    return (g_Thw - g_Thw.mean(axis=(1, 2), keepdims=True)) / (g_Thw.std(axis=(1, 2), keepdims=True) + 1e-3)


def dissolves(small_Fhw3: np.ndarray, cuts: list[dict], cfg) -> list[dict]:
    """Spans whose middle frames are blends of their ends (module docstring), merged, with the
    strongest evidence of each."""
    f_total = len(small_Fhw3)
    cut_frames = np.array([c["frame"] for c in cuts], int)
    # a blend is a blend at any scale and in grey: a twelfth of the numbers
    grey_Fhw = small_Fhw3[:, ::2, ::2].astype(np.float32).mean(axis=-1)
    spans = []
    for d in HALF_SPANS:  # every span centre t at once, in chunks (memory: a chunk of frames as float32)
        for t0 in range(d, f_total - d, DISSOLVE_CHUNK):
            t = np.arange(t0, min(f_total - d, t0 + DISSOLVE_CHUNK))
            a, b, m = grey_Fhw[t - d], grey_Fhw[t + d], grey_Fhw[t]
            diff = b - a
            change = np.abs(diff).mean(axis=(1, 2))
            weight = ((m - a) * diff).sum(axis=(1, 2)) / np.maximum((diff * diff).sum(axis=(1, 2)), 1e-6)
            residual = np.abs(m - a - weight[:, None, None] * diff).mean(axis=(1, 2)) / np.maximum(change, 1e-6)
            similar = (_grey_z(a) * _grey_z(b)).mean(axis=(1, 2))
            for i in np.flatnonzero((change >= cfg.dissolve_min_change) & (weight >= 0.2) & (weight <= 0.8)
                                    & (residual <= cfg.dissolve_max_residual)):
                c = int(t[i])
                if len(cut_frames) and np.any((cut_frames > c - d) & (cut_frames <= c + d)):
                    continue  # a hard cut inside: its ends are two shots, not a blend
                distinct = bool(similar[i] <= cfg.dissolve_max_similarity)  # not one picture relit
                spans.append((c - d, c + d, d, float(change[i]), float(residual[i]), float(weight[i]), distinct))
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
