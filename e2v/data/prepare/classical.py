"""The classical backend (no weights): the background is the per-pixel temporal median of the shot,
the moving foreground (the subject) is what differs from it.

When the halves' medians differ over more than classical.max_camera_motion of the frame, either
the camera moves or a large subject fills them: if a fifth of the features matched between the
first, middle and last frames held still (background_held), the camera is still. A camera that
pans, zooms or turns a little is registered (register_shot): every frame is mapped
into the shot's middle frame by a similarity transform (ORB features matched to the middle frame,
RANSAC), the median and the differences are taken in that frame, and the masks are mapped back. A
shot whose registration fails (too few matching features) or leaves much of the frame differing
(parallax: a near and a far plane move differently; handheld shake with rolling shutter) is
skipped (shots_moving_camera): the median of frames that do not line up is no background.

Objects need evidence: a second moving region present in classical.min_object_presence of the
frames; with classical.static_objects a still region that stands out of the median background
against its own smoothed self (flat-coloured props; on photographs it finds a cat's eye or a cup
rim, so it is off by default). No evidence: no object, and nothing is painted out for one.

Costs and limits: a subject that stands still for much of the shot is part of the median (the
gates catch what it leaves: a mask that vanishes, the subject left in the background reference).
Holes the median cannot fill (pixels the subject covers in most frames, the area no frame of a pan
saw) are painted by the shared fill (e2v.data.prepare.fill.fill_background, OpenCV's Telea inpainting).

Legend: F track frames, H/W target height/width; frames_FHW3 uint8, masks_FHW bool, to_ref_F33
float64 homographies (frame -> reference frame).
"""

from __future__ import annotations

import cv2
import numpy as np

from .config import Elements
from .fill import fill_background, foreground_share
from .masks import ShotMasks, clean, largest_components

MIN_INLIERS = 12  # RANSAC inliers below this: the frame cannot be registered
# A still camera with a large subject: the subject fills the halves' medians, yet a fifth of the
# features matched between two of (first, middle, last) frame stay within 1.5 px (the test
# footage: 0.28 for a subject 90% of the frame high, 0.07 at most for its pan and zoom)
STILL_SHARE = 0.2


def temporal_median(frames_FHW3: np.ndarray, max_frames: int) -> np.ndarray:
    """Per-pixel median over at most max_frames evenly spaced frames: background_HW3 uint8."""
    pick = np.unique(np.linspace(0, len(frames_FHW3) - 1, min(max_frames, len(frames_FHW3))).round().astype(int))
    return np.median(frames_FHW3[pick], axis=0).round().astype(np.uint8)


def masked_median(frames_FHW3: np.ndarray, valid_FHW: np.ndarray, max_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The median over the frames where each pixel is valid (registered frames cover part of the
    reference): (background_HW3 uint8, seen_HW bool: some frame saw the pixel)."""
    pick = np.unique(np.linspace(0, len(frames_FHW3) - 1, min(max_frames, len(frames_FHW3))).round().astype(int))
    x = frames_FHW3[pick].astype(np.float32)
    x[~valid_FHW[pick]] = np.nan
    seen_HW = valid_FHW[pick].any(axis=0)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN pixels: nobody saw them
            med = np.nanmedian(x, axis=0)
    return np.nan_to_num(med).round().astype(np.uint8), seen_HW


def difference(frames_FHW3: np.ndarray, background_HW3: np.ndarray) -> np.ndarray:
    """Largest per-channel |frame - background| in levels: diff_FHW."""
    return np.abs(frames_FHW3.astype(np.int16) - background_HW3.astype(np.int16)).max(axis=-1)


def register_shot(frames_FHW3: np.ndarray) -> tuple[np.ndarray | None, dict]:
    """Similarity transforms mapping every frame into the middle frame (to_ref_F33), or None when a
    frame cannot be registered; and what was measured (camera: registered / unregistrable, the
    worst pair's inliers, the largest frame-corner shift in pixels). Each frame is matched to the
    next (a small, reliable step: matched straight to the middle frame, half a pan away, the
    features of a repetitive texture pair up wrongly) and the steps are chained to the middle."""
    f, h, w = frames_FHW3.shape[:3]
    # frames are never upscaled for it: ORB on an upscaled frame matched its blur, and the pan of
    # the test footage registered 5x wrong at 48 x 80 (fine at 96 x 160)
    orb = _orb()
    matcher = cv2.BFMatcher(cv2.NORM_HAMMING, crossCheck=True)
    feats = [_features(orb, fr) for fr in frames_FHW3]
    step_F33 = np.repeat(np.eye(3)[None], f, axis=0)  # step[i]: frame i -> frame i + 1
    worst = 10 ** 9
    for i in range(f - 1):
        (k0, d0), (k1, d1) = feats[i], feats[i + 1]
        matches = matcher.match(d0, d1) if d0 is not None and d1 is not None else []
        if len(matches) < MIN_INLIERS:
            return None, {"camera": "unregistrable", "frame": i, "inliers": len(matches)}
        src = np.float32([k0[m.queryIdx].pt for m in matches])
        dst = np.float32([k1[m.trainIdx].pt for m in matches])
        # a pan, zoom or small turn is a similarity transform (4 parameters): far steadier on small
        # frames than a full homography's 8, whose perspective terms fit the noise
        sim, inl = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=1.5)
        if sim is None or int(inl.sum()) < MIN_INLIERS:
            return None, {"camera": "unregistrable", "frame": i, "inliers": 0 if inl is None else int(inl.sum())}
        step_F33[i] = np.vstack([sim, [0, 0, 1]])
        worst = min(worst, int(inl.sum()))
    ref = f // 2
    to_ref = np.repeat(np.eye(3)[None], f, axis=0)
    for i in range(ref - 1, -1, -1):
        to_ref[i] = to_ref[i + 1] @ step_F33[i]
    for i in range(ref + 1, f):
        to_ref[i] = to_ref[i - 1] @ np.linalg.inv(step_F33[i - 1])
    corners = np.array([[0, 0], [w, 0], [0, h], [w, h]], np.float64)
    shift = max(float(np.abs(cv2.perspectiveTransform(corners[None], m)[0] - corners).max()) for m in to_ref)
    return to_ref, {"camera": "registered", "min_inliers": worst, "max_shift_px": round(shift, 1)}


def _orb():
    # small patches: frames under 100 pixels high still give features (ORB's default 31 leaves little)
    return cv2.ORB_create(nfeatures=800, edgeThreshold=15, patchSize=15, fastThreshold=8)


def _features(orb, frame_HW3: np.ndarray):
    """ORB keypoints and descriptors of the grey frame."""
    return orb.detectAndCompute(cv2.cvtColor(np.ascontiguousarray(frame_HW3), cv2.COLOR_RGB2GRAY), None)


def background_held(frames_FHW3: np.ndarray) -> float:
    """The largest share, over the frame pairs (first, last), (first, middle), (middle, last), of
    matched ORB features that stayed within 1.5 px: the background of a still camera stays put."""
    orb, matcher = _orb(), cv2.BFMatcher(cv2.NORM_HAMMING, crossCheck=True)
    f = len(frames_FHW3)
    feats = {i: _features(orb, frames_FHW3[i]) for i in {0, f // 2, f - 1}}
    best = 0.0
    for i, j in ((0, f - 1), (0, f // 2), (f // 2, f - 1)):
        (k0, d0), (k1, d1) = feats[i], feats[j]
        matches = matcher.match(d0, d1) if d0 is not None and d1 is not None else []
        if len(matches) >= MIN_INLIERS:
            moved = np.array([np.subtract(k1[m.trainIdx].pt, k0[m.queryIdx].pt) for m in matches])
            best = max(best, float((np.abs(moved).max(axis=1) < 1.5).mean()))
    return best


def warp(images, to_ref_F33: np.ndarray, size_hw: tuple[int, int], inverse: bool = False, nearest: bool = False):
    """Each image warped by its homography (or its inverse) to size_hw: a list of arrays."""
    flags = cv2.INTER_NEAREST if nearest else cv2.INTER_LINEAR
    if inverse:
        flags |= cv2.WARP_INVERSE_MAP
    return [cv2.warpPerspective(np.ascontiguousarray(im), m, (size_hw[1], size_hw[0]), flags=flags,
                                borderMode=cv2.BORDER_CONSTANT, borderValue=0) for im, m in zip(images, to_ref_F33)]


class ClassicalBackend:
    name = "classical"

    def __init__(self, cfg: Elements):
        self.cfg, self.c = cfg, cfg.classical

    def static_object_masks(self, background_HW3: np.ndarray, count: int) -> list[np.ndarray]:
        """Static objects: pixels of the median background far from its large-window median
        filter (the window is over twice an object's width, so the filter keeps the surround),
        the `count` largest components."""
        short = min(background_HW3.shape[:2])
        k = self.c.object_kernel or (short // 2) | 1
        smooth_HW3 = cv2.medianBlur(np.ascontiguousarray(background_HW3), k)
        stands_out = difference(background_HW3[None], smooth_HW3)[0] > self.c.object_threshold
        return largest_components(clean(stands_out, self.c.open_px + 1, self.c.close_px), count)

    def camera_moves(self, frames_FHW3: np.ndarray, valid_FHW: np.ndarray | None = None) -> float:
        """Share of the frame where the medians of the shot's first and second halves differ: near
        the subject's share for a still (or well registered) camera, most of the frame for a pan or
        zoom left unregistered, or parallax."""
        half = len(frames_FHW3) // 2
        if valid_FHW is None:
            a_HW3 = temporal_median(frames_FHW3[:half], self.c.median_frames)
            b_HW3 = temporal_median(frames_FHW3[half:], self.c.median_frames)
            return float((difference(a_HW3[None], b_HW3)[0] > self.c.diff_threshold).mean())
        a_HW3, seen_a = masked_median(frames_FHW3[:half], valid_FHW[:half], self.c.median_frames)
        b_HW3, seen_b = masked_median(frames_FHW3[half:], valid_FHW[half:], self.c.median_frames)
        both = seen_a & seen_b
        return float((difference(a_HW3[None], b_HW3)[0] > self.c.diff_threshold)[both].mean()) if both.any() else 1.0

    def analyse(self, frames_FHW3: np.ndarray, subject: str, objects: list[str]) -> ShotMasks:
        f, h, w = frames_FHW3.shape[:3]
        motion = self.camera_moves(frames_FHW3)
        to_ref, camera = None, {"camera": "still", "motion": round(motion, 4)}
        work_FHW3, valid_FHW = frames_FHW3, None
        if motion > self.c.max_camera_motion:  # only then registered: a still shot keeps the exact median
            if not self.c.register:
                return ShotMasks(subject=subject, backend=self.name, problem="moving_camera", camera=camera)
            held = background_held(frames_FHW3)
            if held >= STILL_SHARE:  # the background stayed put: a large subject fills the halves' medians
                camera["camera"], camera["features_held"] = "still", round(held, 3)
            else:
                to_ref, camera = register_shot(frames_FHW3)
                camera.update(motion=round(motion, 4), features_held=round(held, 3))
                if to_ref is None:
                    return ShotMasks(subject=subject, backend=self.name, problem="moving_camera", camera=camera)
        if to_ref is not None:
            work_FHW3 = np.stack(warp(frames_FHW3, to_ref, (h, w)))
            valid_FHW = np.stack(warp(np.ones((f, h, w), np.uint8), to_ref, (h, w), nearest=True)).astype(bool)
            residual = self.camera_moves(work_FHW3, valid_FHW)
            camera["residual_motion"] = round(residual, 4)
            if residual > self.c.max_camera_motion:  # parallax or shake the similarity cannot follow
                return ShotMasks(subject=subject, backend=self.name, problem="moving_camera", camera=camera)
        if valid_FHW is None:
            background_HW3 = temporal_median(work_FHW3, self.c.median_frames)
            moving_FHW = difference(work_FHW3, background_HW3) > self.c.diff_threshold
        else:
            background_HW3, _ = masked_median(work_FHW3, valid_FHW, self.c.median_frames)
            moving_FHW = (difference(work_FHW3, background_HW3) > self.c.diff_threshold) & valid_FHW
        out = ShotMasks(subject=subject, backend=self.name, models=[], to_reference=to_ref, camera=camera)
        keep = 1 + len(objects)
        parts_F = [largest_components(clean(m, self.c.open_px, self.c.close_px), max(keep, self.c.max_components))
                   for m in moving_FHW]
        subject_FHW = np.zeros_like(moving_FHW)
        for i, parts in enumerate(parts_F):
            if parts:
                subject_FHW[i] = np.logical_or.reduce(parts[:self.c.max_components])
        found = self._objects(parts_F, background_HW3, len(objects), (f, h, w))
        masks = {subject: subject_FHW, **{name: found[i] for i, name in enumerate(objects) if i < len(found)}}
        for name in objects:
            masks.setdefault(name, np.zeros_like(moving_FHW))
        for name, m_FHW in masks.items():
            if to_ref is not None:  # back from the reference frame to each frame's own view
                m_FHW = np.stack(warp(m_FHW.astype(np.uint8), to_ref, (h, w), inverse=True, nearest=True)).astype(bool)
            out.masks[name] = m_FHW
            out.scores[name] = m_FHW.any(axis=(1, 2)).astype(np.float32)  # no confidence: found or not
        return out

    def _objects(self, parts_F: list[list[np.ndarray]], background_HW3: np.ndarray, count: int, shape) -> list[np.ndarray]:
        """Each object with evidence (module docstring) as masks_FHW, largest first."""
        if not count:
            return []
        n = self.c.max_components
        second_FHW = np.zeros(shape, bool)
        for i, parts in enumerate(parts_F):
            big = [p for p in parts[n:n + 1] if p.mean() >= self.cfg.min_area_share]
            if big:
                second_FHW[i] = big[0]
        found = []
        if second_FHW.any(axis=(1, 2)).mean() >= self.c.min_object_presence:
            found.append(second_FHW)
        if self.c.static_objects and len(found) < count:
            found += [np.broadcast_to(m, shape) for m in self.static_object_masks(background_HW3, count - len(found))]
        return found

    def background(self, frames_FHW3: np.ndarray, shot: ShotMasks, positions: list[int], emitted: list[str],
                   view: int) -> tuple[np.ndarray, float, float]:
        """The clean background from the track frames at `positions`, as the camera sees it at track
        frame `view`: their median, with the pixels the foreground covers in most of them (the
        median shows foreground there), the emitted objects and (a moving camera) what no frame saw
        filled. Returns (background_HW3, foreground share: the mean share of the frame the
        foreground covers in those frames, the OpenS2V filter's measure; the share of the
        background that is filled, not seen)."""
        h, w = frames_FHW3.shape[1:3]
        fg_FHW = np.logical_or.reduce([shot.masks[n] for n in emitted])[positions]
        share = float(np.mean([foreground_share(m) for m in fg_FHW]))
        if shot.to_reference is None:
            median_HW3 = temporal_median(frames_FHW3[positions], self.c.median_frames)
            hole_HW = fg_FHW.mean(axis=0) > 0.5
            statics = [shot.masks[n][0] for n in emitted if n != shot.subject and np.all(shot.masks[n] == shot.masks[n][0])]
            hole_HW = np.logical_or.reduce([hole_HW, *statics])
            return fill_background(median_HW3, hole_HW), share, float(hole_HW.mean())
        homs = shot.to_reference[positions]
        frames = np.stack(warp(frames_FHW3[positions], homs, (h, w)))
        valid = np.stack(warp(np.ones((len(positions), h, w), np.uint8), homs, (h, w), nearest=True)).astype(bool)
        fg = np.stack(warp(fg_FHW.astype(np.uint8), homs, (h, w), nearest=True)).astype(bool)
        median_HW3, seen_HW = masked_median(frames, valid & ~fg, self.c.median_frames)
        plate_HW3 = fill_background(median_HW3, ~seen_HW)
        back = shot.to_reference[view:view + 1]
        view_HW3 = warp([plate_HW3], back, (h, w), inverse=True)[0]
        covered = warp([np.ones((h, w), np.uint8)], back, (h, w), inverse=True, nearest=True)[0].astype(bool)
        unseen = warp([(~seen_HW).astype(np.uint8)], back, (h, w), inverse=True, nearest=True)[0].astype(bool)
        return fill_background(view_HW3, ~covered), share, float((~covered | unseen).mean())
