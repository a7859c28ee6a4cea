"""Raw footage with known truth, for testing and measuring tools/prepare_data.py.

    python bench/make_raw_footage.py OUT_DIR [--videos 4] [--shots 3] [--shot-seconds 4.5]
                                             [--height 96] [--width 128] [--fps 16] [--seed 0]

Each video is several shots joined by hard cuts. A shot has a static background (a smooth
two-colour gradient with a faint texture: a camera on a tripod), a static object (a polygon) and a
subject (an ellipse) that travels back and forth across the frame, every colour, size and position
drawn per shot. OUT_DIR/truth.json lists per video its cut frames and per shot its frame range;
OUT_DIR/truth/<video>_shot<k>_background.png is the clean background (no subject, no object) and
OUT_DIR/truth/<video>.npz holds the per-frame subject masks (`subject`, bool [F, H, W]) and the
per-shot object masks (`object`, bool [shots, H, W]). Videos are H.264 at --fps; a sidecar
caption (video.txt) is written for every other video, so both caption paths run.

Everything depends only on --seed and the video's index.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import subprocess
from pathlib import Path

import cv2
import imageio_ffmpeg
import numpy as np
from PIL import Image

from e2v.data.prepare.clips import write_h264

MIN_CONTRAST = 70  # levels (max channel) between the subject / object colour and the background's


def _colour(rng, sat, val) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(*sat), rng.uniform(*val))) * 255


def _distinct(rng, against: list[np.ndarray]) -> np.ndarray:
    for _ in range(200):
        c = _colour(rng, (0.7, 1.0), (0.75, 1.0)) if rng.uniform() < 0.8 else _colour(rng, (0.0, 0.2), (0.0, 0.12))
        if all(np.abs(c - a).max() >= MIN_CONTRAST for a in against):
            return c
    return 255 - against[0]


def render_shot(rng: np.random.Generator, height: int, width: int, frames: int):
    """frames_FHW3 uint8, clean background HW3 uint8, subject masks FHW bool, object mask HW bool."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    c0, c1 = _colour(rng, (0.1, 0.45), (0.3, 0.55)), _colour(rng, (0.1, 0.45), (0.45, 0.7))
    angle = rng.uniform(0, np.pi)
    ramp = ((xx * np.cos(angle) + yy * np.sin(angle)) / (height + width) + 0.5).clip(0, 1)[..., None]
    texture = 4 * np.sin(xx / rng.uniform(3, 7)) * np.sin(yy / rng.uniform(3, 7))
    clean = np.clip(c0 * (1 - ramp) + c1 * ramp + texture[..., None], 0, 255).astype(np.uint8)
    mean_bg = [c0, c1, (c0 + c1) / 2]
    # object: a regular polygon, 10-16% of the short side in radius, away from the edges
    short = min(height, width)
    r_obj = rng.uniform(0.1, 0.16) * short
    centre = rng.uniform([r_obj + 4, r_obj + 4], [height - r_obj - 4, width - r_obj - 4])
    sides, turn = int(rng.integers(3, 7)), rng.uniform(0, np.pi)
    pts = np.array([[centre[1] + r_obj * np.cos(turn + 2 * np.pi * k / sides),
                     centre[0] + r_obj * np.sin(turn + 2 * np.pi * k / sides)] for k in range(sides)])
    obj_mask = np.zeros((height, width), np.uint8)
    cv2.fillPoly(obj_mask, [np.round(pts).astype(np.int32)], 1)
    obj_colour = _distinct(rng, mean_bg)
    scene = clean.copy()
    scene[obj_mask.astype(bool)] = obj_colour.astype(np.uint8)
    # subject: an upright ellipse bouncing across the frame, one crossing per ~1.2-2 s of frames
    ry = rng.uniform(0.18, 0.28) * short
    rx = ry * rng.uniform(0.5, 0.8)
    subj_colour = _distinct(rng, mean_bg + [obj_colour])
    period = rng.uniform(20, 32)  # frames per crossing
    phase, y0, wobble = rng.uniform(0, 2), rng.uniform(ry + 2, height - ry - 2), rng.uniform(0, 0.15) * height
    out, masks = np.empty((frames, height, width, 3), np.uint8), np.zeros((frames, height, width), bool)
    for f in range(frames):
        tri = abs(((f / period + phase) % 2) - 1)  # 0..1..0
        cx = rx + 2 + tri * (width - 2 * rx - 4)
        cy = np.clip(y0 + wobble * np.sin(f / 7), ry + 2, height - ry - 2)
        m = np.zeros((height, width), np.uint8)
        cv2.ellipse(m, (int(round(cx)), int(round(cy))), (int(round(rx)), int(round(ry))), 0, 0, 360, 1, -1)
        frame = scene.copy()
        frame[m.astype(bool)] = subj_colour.astype(np.uint8)
        out[f], masks[f] = frame, m.astype(bool)
    return out, clean, masks, obj_mask.astype(bool)


def make_video(out: Path, name: str, index: int, seed: int, shots: int, shot_frames: int, height: int,
               width: int, fps: float) -> dict:
    rng = np.random.default_rng([seed, index])
    all_frames, subj, objs, ranges = [], [], [], []
    truth_dir = out / "truth"
    for k in range(shots):
        n = int(shot_frames * rng.uniform(0.9, 1.1))  # shots of slightly different lengths
        frames, clean, masks, obj = render_shot(rng, height, width, n)
        start = sum(len(f) for f in all_frames)
        ranges.append([start, start + n])
        all_frames.append(frames)
        subj.append(masks)
        objs.append(obj)
        Image.fromarray(clean).save(truth_dir / f"{name}_shot{k}_background.png")
    write_h264(out / f"{name}.mp4", np.concatenate(all_frames), fps, crf=12)
    np.savez_compressed(truth_dir / f"{name}.npz", subject=np.concatenate(subj), object=np.stack(objs))
    if index % 2 == 0:
        (out / f"{name}.txt").write_text(f"a coloured shape moves past a polygon, video {index}\n")
    return {"cuts": [r[0] for r in ranges[1:]], "shots": ranges, "fps": fps, "height": height, "width": width}


def _ffmpeg(*args: str) -> None:
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", *args], check=True)


def write_bad_inputs(out: Path, seed: int = 1) -> dict[str, str]:
    """The inputs a real folder holds that must not stop a run, each with what should happen:
    file name -> the expected record status (done, bad or skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (out / "unreadable.mp4").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (out / "zero length.mp4").write_bytes(b"")
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=440:duration=1", "-c:a", "aac", str(out / "audio_only.m4a"))
    frames, *_ = render_shot(rng, 96, 128, 56)
    write_h264(out / "vfr_phone_src.mp4", frames, 16.0, crf=12)
    # a phone's variable frame rate: frame intervals alternate 1/16 s and 2/16 s
    _ffmpeg("-i", str(out / "vfr_phone_src.mp4"), "-vf", "setpts='(N+floor(N/2))/16/TB'", "-fps_mode", "passthrough",
            "-c:v", "libx264", "-crf", "12", "-pix_fmt", "yuv444p", str(out / "vfr_phone.mp4"))
    (out / "vfr_phone_src.mp4").unlink()
    frames, *_ = render_shot(rng, 128, 96, 56)
    write_h264(out / "portrait.mp4", frames, 16.0, crf=12)
    frames, *_ = render_shot(rng, 32, 32, 56)
    write_h264(out / "tiny.mp4", frames, 16.0, crf=12)
    frames, *_ = render_shot(rng, 96, 128, 56)
    write_h264(out / "Mi vídeo de playa ☀.mp4", frames, 16.0, crf=12)
    small, *_ = render_shot(rng, 90, 160, 17)  # 4K: drawn small, scaled up frame by frame as it is written
    writer = imageio_ffmpeg.write_frames(str(out / "uhd_4k.mp4"), (3840, 2160), fps=8, codec="libx264",
                                         pix_fmt_out="yuv420p", quality=None, macro_block_size=1,
                                         ffmpeg_log_level="error", output_params=["-preset", "ultrafast", "-an"])
    writer.send(None)
    for f in small:
        writer.send(np.ascontiguousarray(cv2.resize(f, (3840, 2160), interpolation=cv2.INTER_NEAREST)))
    writer.close()
    return {"unreadable.mp4": "bad", "zero length.mp4": "bad", "audio_only.m4a": "bad", "vfr_phone.mp4": "done",
            "portrait.mp4": "done", "tiny.mp4": "skipped", "Mi vídeo de playa ☀.mp4": "done", "uhd_4k.mp4": "done"}


def write_photo_footage(out: Path, height: int = 96, width: int = 128, fps: float = 16.0, shot_frames: int = 72) -> dict:
    """Clips made from real photographs that scikit-image ships (nothing downloaded): the astronaut's
    head and shoulders cut out as the subject, moving across the chelsea (cat) and coffee photos,
    with the camera still (shot 0), panning (shot 1) and zooming (shot 2), joined by hard cuts.
    Writes OUT/photos.mp4 and OUT/truth/photos.npz (`subject` masks); returns the cut frames."""
    from skimage import data

    (out / "truth").mkdir(parents=True, exist_ok=True)
    person = data.astronaut()[20:300, 120:360]  # head and shoulders
    ph, pw = person.shape[:2]
    alpha = np.zeros((ph, pw), np.uint8)
    cv2.ellipse(alpha, (pw // 2, ph // 2), (pw // 2 - 2, ph // 2 - 2), 0, 0, 360, 1, -1)
    sh = int(height * 0.55)
    sw = int(pw * sh / ph)
    person = cv2.resize(person, (sw, sh), interpolation=cv2.INTER_AREA)
    alpha = cv2.resize(alpha, (sw, sh), interpolation=cv2.INTER_NEAREST).astype(bool)
    frames, masks = [], []
    for shot, (photo, motion) in enumerate([(data.chelsea(), "still"), (data.coffee(), "pan"), (data.chelsea(), "zoom")]):
        big = cv2.resize(photo, (width * 2, height * 2), interpolation=cv2.INTER_AREA)
        for f in range(shot_frames):
            t = f / (shot_frames - 1)
            if motion == "still":
                view = big[height // 2:height // 2 + height * 1, width // 2:width // 2 + width]
                view = cv2.resize(big[height // 4:height // 4 + height * 3 // 2, width // 4:width // 4 + width * 3 // 2],
                                  (width, height), interpolation=cv2.INTER_AREA)
            elif motion == "pan":
                x0 = int(t * width * 0.5)
                view = cv2.resize(big[:height * 3 // 2, x0:x0 + width * 3 // 2], (width, height),
                                  interpolation=cv2.INTER_AREA)
            else:
                z = 1.5 - 0.4 * t  # crop side shrinks: the camera zooms in
                ch, cw = int(height * z), int(width * z)
                y0, x0 = (height * 2 - ch) // 2, (width * 2 - cw) // 2
                view = cv2.resize(big[y0:y0 + ch, x0:x0 + cw], (width, height), interpolation=cv2.INTER_AREA)
            frame = view.copy()
            tri = abs(((f / 30 + 0.3 * shot) % 2) - 1)
            x = int(tri * (width - sw))
            y = height - sh
            frame[y:y + sh, x:x + sw][alpha] = person[alpha]
            m = np.zeros((height, width), bool)
            m[y:y + sh, x:x + sw] = alpha
            frames.append(frame)
            masks.append(m)
    write_h264(out / "photos.mp4", np.stack(frames), fps, crf=12)
    np.savez_compressed(out / "truth" / "photos.npz", subject=np.stack(masks))
    return {"cuts": [shot_frames, 2 * shot_frames], "motion": ["still", "pan", "zoom"]}


def _cutout(image: np.ndarray, height: int) -> tuple[np.ndarray, np.ndarray]:
    """An elliptical cut-out of a photograph, `height` pixels tall: (rgb_hw3, alpha_hw bool)."""
    ph, pw = image.shape[:2]
    alpha = np.zeros((ph, pw), np.uint8)
    cv2.ellipse(alpha, (pw // 2, ph // 2), (pw // 2 - 2, ph // 2 - 2), 0, 0, 360, 1, -1)
    w = max(4, int(pw * height / ph))
    return (cv2.resize(image, (w, height), interpolation=cv2.INTER_AREA),
            cv2.resize(alpha, (w, height), interpolation=cv2.INTER_NEAREST).astype(bool))


def _view(big: np.ndarray, height: int, width: int, t: float, motion: str) -> np.ndarray:
    """The camera's view at time t in [0, 1] of a photograph resized to twice the frame: still,
    panning right over 40% of the frame width, or zooming in by 15%."""
    if motion == "pan":
        x0 = int(round(t * width * 0.4))
        return cv2.resize(big[:height * 3 // 2, x0:x0 + width * 3 // 2], (width, height), interpolation=cv2.INTER_AREA)
    z = 1.5 - (0.15 * 1.5 * t if motion == "zoom" else 0.0)
    ch, cw = int(round(height * z)), int(round(width * z))
    y0, x0 = (height * 2 - ch) // 2, (width * 2 - cw) // 2
    return cv2.resize(big[y0:y0 + ch, x0:x0 + cw], (width, height), interpolation=cv2.INTER_AREA)


def _shot(photo, subjects, height, width, frames, motion="still", still_until=0.0, phase=0.0):
    """frames_FHW3, clean backgrounds FHW3, and per subject its masks FHW (subjects: (rgb, alpha,
    row, speed)). A subject bounces across the frame; until `still_until` (share of the shot) the
    first one stands still where it starts."""
    out, clean, masks = [], [], [[] for _ in subjects]
    big = cv2.resize(photo, (width * 2, height * 2), interpolation=cv2.INTER_AREA)
    for f in range(frames):
        t = f / max(1, frames - 1)
        bg = _view(big, height, width, t, motion)
        frame = bg.copy()
        for k, (rgb, alpha, row, speed) in enumerate(subjects):
            sh, sw = alpha.shape
            moving_t = max(0.0, t - still_until) if k == 0 else t
            tri = abs(((moving_t * frames * speed / 30 + phase + 0.37 * k) % 2) - 1)
            x = int(tri * (width - sw))
            y = min(height - sh, row)
            frame[y:y + sh, x:x + sw][alpha] = rgb[alpha]
            m = np.zeros((height, width), bool)
            m[y:y + sh, x:x + sw] = alpha
            masks[k].append(m)
        out.append(frame)
        clean.append(bg)
    return np.stack(out), np.stack(clean), [np.stack(m) for m in masks]


def write_hard_footage(out: Path, height: int = 96, width: int = 160, fps: float = 16.0, shot_frames: int = 64,
                       only: tuple[str, ...] | None = None) -> dict:
    """Footage a preparer gets wrong in ways a user cannot see, made from scikit-image's photographs
    (nothing downloaded), with the truth to check it against:

    - pan_zoom.mp4: a pan over the coffee photo, a hard cut, a zoom into the cat photo;
    - still_then_moving.mp4: the subject stands still for the first half, then moves (still camera);
    - two_subjects.mp4: a large and a small subject (different photos) crossing one scene;
    - dissolve.mp4: two shots with different subjects joined by a 12-frame cross-fade;
    - similar_cut.mp4: a hard cut between two textures of similar colour statistics (grass, gravel),
      a different subject in each shot;
    - portrait.mp4: the still shot filmed upright (width and height swapped);
    - same_place.mp4: two shots of one place, a different subject in each (a cut only the subjects
      tell apart: missed, its shots become one whose references show two subjects);
    - large_subject.mp4: a still camera and a subject 90% of the frame high, slowly crossing it.

    Writes OUT/<name>.mp4, OUT/truth_hard.json (per video: cuts, dissolves as [first, last] frames,
    shots, orientation) and OUT/truth/<name>.npz (`only`: just the videos named): `subject` (the main subject's masks, FHW bool),
    `subject_id` (which subject it is, per frame: a shot's subject differs from the next's),
    `other` (every other subject's pixels, FHW bool) and `background` (the clean frames, FHW3)."""
    from skimage import data

    (out / "truth").mkdir(parents=True, exist_ok=True)
    astronaut = data.astronaut()[20:300, 120:360]
    cup = data.coffee()[60:330, 170:450]
    rocket = data.rocket()[40:420, 250:420]
    def grey(img, tint):
        return np.clip(np.repeat(img[..., None], 3, axis=2) * np.array(tint), 0, 255).astype(np.uint8)
    grass, gravel = grey(data.grass(), (1.0, 1.05, 0.9)), grey(data.gravel(), (1.0, 1.05, 0.9))
    big = int(height * 0.55)
    truth = {}

    def write(name, shots, dissolve=0, portrait=False):
        if only is not None and name not in only:
            return
        frames, clean, subj, sid, other, cuts, dissolves, ranges = [], [], [], [], [], [], [], []
        for k, (f, c, m, who) in enumerate(shots):
            if k and dissolve:  # a cross-fade: the last `dissolve` frames of the previous shot blend into this one
                a0 = len(frames) - dissolve
                w = np.linspace(0, 1, dissolve + 2)[1:-1, None, None, None]
                frames[a0:] = list((np.stack(frames[a0:]) * (1 - w) + f[:dissolve] * w).round().astype(np.uint8))
                clean[a0:] = list((np.stack(clean[a0:]) * (1 - w) + c[:dissolve] * w).round().astype(np.uint8))
                dissolves.append([a0, a0 + dissolve - 1])
                ranges[-1][1] = a0
                f, c, m = f[dissolve:], c[dissolve:], [x[dissolve:] for x in m]
            elif k:
                cuts.append(len(frames))
            start = len(frames)
            ranges.append([start, start + len(f)])
            frames += list(f)
            clean += list(c)
            subj += list(m[0])
            sid += [who] * len(f)
            other += list(np.logical_or.reduce(m[1:]) if len(m) > 1 else np.zeros_like(m[0]))
        frames, clean = np.stack(frames), np.stack(clean)
        subj, other = np.stack(subj), np.stack(other)
        if portrait:
            frames, clean = frames.transpose(0, 2, 1, 3)[:, ::-1], clean.transpose(0, 2, 1, 3)[:, ::-1]
            subj, other = subj.transpose(0, 2, 1)[:, ::-1], other.transpose(0, 2, 1)[:, ::-1]
        write_h264(out / f"{name}.mp4", np.ascontiguousarray(frames), fps, crf=12)
        np.savez(out / "truth" / f"{name}.npz", subject=subj, subject_id=np.array(sid), other=other,
                            background=clean)
        truth[name] = {"cuts": cuts, "dissolves": dissolves, "shots": ranges, "fps": fps,
                       "orientation": "portrait" if portrait else "landscape"}

    n = shot_frames
    a, b, r = _cutout(astronaut, big), _cutout(cup, big), _cutout(rocket, int(height * 0.3))
    top = height - big - 3  # the subject stands clear of the frame edge: an edge flag means a crop cut it
    f, c, m = _shot(data.coffee(), [(*a, top, 1.0)], height, width, n, "pan")
    f2, c2, m2 = _shot(data.chelsea(), [(*b, top, 1.0)], height, width, n, "zoom", phase=0.5)
    write("pan_zoom", [(f, c, m, 0), (f2, c2, m2, 1)])
    f, c, m = _shot(data.chelsea(), [(*a, top, 1.0)], height, width, 2 * n, still_until=0.5)
    write("still_then_moving", [(f, c, m, 0)])
    f, c, m = _shot(data.coffee(), [(*a, top, 1.0), (*r, 4, 1.6)], height, width, n + n // 2)
    write("two_subjects", [(f, c, m, 0)])
    f, c, m = _shot(data.chelsea(), [(*a, top, 1.0)], height, width, n + 6)
    f2, c2, m2 = _shot(data.coffee(), [(*b, top, 1.0)], height, width, n + 6, phase=0.7)
    write("dissolve", [(f, c, m, 0), (f2, c2, m2, 1)], dissolve=12)
    f, c, m = _shot(grass, [(*a, top, 1.0)], height, width, n)
    f2, c2, m2 = _shot(gravel, [(*b, top, 1.0)], height, width, n, phase=0.5)
    write("similar_cut", [(f, c, m, 0), (f2, c2, m2, 1)])
    f, c, m = _shot(data.chelsea(), [(*a, top, 1.0)], height, width, n, phase=0.2)
    write("portrait", [(f, c, m, 0)], portrait=True)
    f, c, m = _shot(data.coffee(), [(*a, top, 1.0)], height, width, n)
    f2, c2, m2 = _shot(data.coffee(), [(*b, top, 1.0)], height, width, n, phase=0.5)
    write("same_place", [(f, c, m, 0), (f2, c2, m2, 1)])
    large = _cutout(astronaut, height - 6)  # 90% of the frame's height, a third of its area
    f, c, m = _shot(data.chelsea(), [(*large, 3, 0.6)], height, width, n)
    write("large_subject", [(f, c, m, 0)])
    (out / "truth_hard.json").write_text(json.dumps(truth, indent=1))
    return truth


def generate(out: Path, videos: int = 4, shots: int = 3, shot_seconds: float = 4.5, height: int = 96,
             width: int = 128, fps: float = 16.0, seed: int = 0) -> dict:
    (out / "truth").mkdir(parents=True, exist_ok=True)
    truth = {}
    for i in range(videos):
        name = f"footage_{i:03d}"
        truth[name] = make_video(out, name, i, seed, shots, round(shot_seconds * fps), height, width, fps)
    (out / "truth.json").write_text(json.dumps(truth, indent=1))
    return truth


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--videos", type=int, default=4)
    p.add_argument("--shots", type=int, default=3)
    p.add_argument("--shot-seconds", type=float, default=4.5)
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--fps", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    truth = generate(a.out_dir, a.videos, a.shots, a.shot_seconds, a.height, a.width, a.fps, a.seed)
    print(f"wrote {len(truth)} videos of {a.shots} shots ({a.height}x{a.width}, {a.fps:g} fps) to {a.out_dir}")


if __name__ == "__main__":
    main()
