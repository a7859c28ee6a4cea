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
import sys
from pathlib import Path

import cv2
import imageio_ffmpeg
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2v.data.prepare.clips import write_h264  # noqa: E402

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
