"""Write a small synthetic E2V dataset: videos whose content is only knowable from the references.

Usage:
    python tools/make_demo_dataset.py OUT_DIR [--num-samples 64] [--size 64] [--frames 17]
                                              [--seed 0] [--force] [--write-meta] [--verify]
                                              [--real-size] [--video-format mp4|npz] [--dry-run]

    # the training shape (81 frames; the trainer center-crops 480 x 832 from 832 x 832), without
    # ffmpeg: uint8 frames in ID.npz (168 MB a sample), as bench/gpu_check.py builds its data
    python tools/make_demo_dataset.py OUT_DIR --real-size --size 832 --frames 81 --video-format npz

Layout (one id links everything, as `e2v.data.elements` discovers it):
    OUT_DIR/000.mp4 000.txt 000_person.png 000_object.png 000_background.png [000.json] 001.mp4 ...

Why the data looks like this.  Each clip shows a subject (a round shape) moving along a smooth
path in front of an object (a polygon, static or drifting) over a patterned background.  Every
colour, shape, size and pattern is drawn per sample, and the prompt is a generic sentence from
`PROMPTS` that names none of them.  So the prompt alone cannot say what the clip looks like; the
references can:
- `ID_person.png`  the subject alone, RGBA with a transparent surround, tall (40x56 at size 64),
                   so the trainer's alpha and pad_white paths are exercised; stored white under
                   its transparent pixels (its anti-aliased edge composited on white, opaque), so
                   both reading rules of `data.reference_read` see the same cut-out on white;
- `ID_object.png`  the object on white, RGB, square (48x48 at size 64);
- `ID_background.png`  the clean background, RGB, wider than the video (64x96 at size 64); the
                   video shows its centre crop, so `center_crop` recovers exactly what is seen.
A model that reads its references can denoise these clips better than one that ignores them,
which makes the dataset a quick end-to-end check that the conditioning paths carry information.

Everything is drawn from `numpy.random.default_rng([seed, index])`, so a sample depends only on
the seed and its index (not on --num-samples), and PNG / txt / json bytes repeat exactly.  Videos
are H.264 4:4:4 at CRF 12 from imageio-ffmpeg's bundled ffmpeg (single thread, bitexact), which
decord decodes to the same frames on every run, about 1 level (of 255) mean absolute error from
the rendered frames (`--verify` measures it).  4:2:0 chroma roughly triples that at 64 px (colour
edges bleed) and OpenCV's 'mp4v' quadruples it, so neither is used.

Sizes: 32-512 px and 5-33 frames by default (a demo trains in minutes); `--real-size` allows up
to 1280 px and 81 frames, the Wan training shapes (the videos stay square: the trainer's
center_crop takes 480 x 832 from 832 x 832). `--video-format npz` writes `ID.npz` (uint8 frames
[F, H, W, 3] under `frames`, read by e2v.data.media without a decoder) instead of H.264: no
ffmpeg needed, and the frames are exactly the rendered ones. `--dry-run` writes nothing: it
renders the first and last frame of sample 0 at the asked size and prints the files and bytes a
build would write.

Length: one generator read top to bottom (the sample's parameters, the renderers of subject,
object and background, the writers), about 530 lines; split across files it would need its drawing
order kept in step by hand, which is what makes a sample depend only on the seed and its index.

Idempotent: a `.generating` marker (the parameters) is written before the first sample and
`.complete` (the same parameters) after the last, each file is written to `.tmp/` and renamed into
place.  A complete dataset with the same parameters is left alone unless --force; a half-written
one (`.generating`), or a complete one with other parameters, is regenerated.  A folder with
files but no marker of ours is refused unless --force, so a real dataset is never overwritten.
`--write-meta` adds `ID.json` (colours, sizes, per-frame positions) for tests and evaluation;
the trainer only looks at video files, so the extra file is ignored by discovery.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import cv2
import imageio_ffmpeg
import numpy as np
from PIL import Image

PROMPTS = (
    "a shape moves across a patterned background",
    "an object glides over a textured scene",
    "something travels smoothly in front of a pattern",
    "a figure drifts past another object",
    "a small thing wanders across the frame",
    "one shape passes by another in a simple scene",
    "a simple animation of a moving shape",
    "an item slides along a curved path over a textured backdrop",
)
SUBJECT_KINDS = ("ellipse", "blob", "rounded_square")  # round, "person-like" subjects
OBJECT_SIDES = (3, 4, 5, 6)  # the object is a regular polygon with this many corners
PATTERNS = ("stripes", "checks", "noise")
SUFFIXES = ("_person.png", "_object.png", "_background.png")
FPS = 8
LIMITS = {"size": 512, "frames": 33}  # without --real-size: a demo's sizes
REAL_LIMITS = {"size": 1280, "frames": 81}  # with --real-size: Wan2.1's 720p width, A2's 81 frames
# 2: the person cut-out stored white under its transparent pixels (render_person); 1 (unmarked): its
# colour there, which Pillow's convert("RGB") reads as a solid box
PERSON_PNG = 2
CRF = 12  # H.264 quality: 0 is lossless, 23 is ffmpeg's default; 12 keeps flat colours within ~1 level
MARKER, IN_PROGRESS, TMP = ".complete", ".generating", ".tmp"
OWN_FILE = re.compile(r"^\d+(\.mp4|\.npz|\.txt|\.json|_person\.png|_object\.png|_background\.png)$")


# --- sizes -------------------------------------------------------------------------------------


def reference_sizes(size: int) -> dict[str, tuple[int, int]]:
    """(height, width) of each reference image: none matches the video's square frame."""
    return {
        "person": (round(size * 7 / 8), round(size * 5 / 8)),  # tall: 56 x 40 at size 64
        "object": (round(size * 3 / 4), round(size * 3 / 4)),  # 48 x 48
        "background": (size, round(size * 3 / 2)),  # wide: 64 x 96
    }


# --- drawing a sample --------------------------------------------------------------------------


def hsv_colour(rng: np.random.Generator, hue: float, sat: tuple, val: tuple) -> list[int]:
    """RGB 0..255 of `hue` with saturation and value drawn from the (low, high) ranges."""
    r, g, b = colorsys.hsv_to_rgb(hue % 1.0, rng.uniform(*sat), rng.uniform(*val))
    return [int(round(c * 255)) for c in (r, g, b)]


def draw_background(rng: np.random.Generator, size: int) -> dict:
    hue = rng.uniform()
    base = hsv_colour(rng, hue, (0.15, 0.5), (0.3, 0.6))
    second = hsv_colour(rng, hue + rng.uniform(-0.15, 0.15), (0.15, 0.5), (0.6, 0.85))
    return {
        "pattern": str(rng.choice(PATTERNS)),
        "colours": [base, second],
        "period": float(rng.uniform(0.2, 0.45) * size),
        "angle": float(rng.uniform(0, np.pi)),
        "phase": float(rng.uniform(0, 2 * np.pi)),
        "noise": rng.uniform(size=(4, 6)).round(4).tolist(),  # coarse grid, upsampled smoothly
    }


def draw_path(rng: np.random.Generator, size: int, frames: int, margin: float) -> list[list[float]]:
    """Cubic Bezier between two points far apart (so the subject visibly travels), bent by two
    random control points; every control point lies inside the margins, so the path does too."""
    lo, hi = margin, size - margin
    centre = rng.uniform(lo, hi, 2) * 0.4 + size / 2 * 0.6
    theta, half = rng.uniform(0, 2 * np.pi), rng.uniform(0.2, 0.35) * size
    offset = half * np.array([np.cos(theta), np.sin(theta)])
    p0, p3 = np.clip(centre - offset, lo, hi), np.clip(centre + offset, lo, hi)
    p1, p2 = rng.uniform(lo, hi, 2), rng.uniform(lo, hi, 2)
    t = np.linspace(0, 1, frames)[:, None]
    pts = (1 - t) ** 3 * p0 + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t**2 * p2 + t**3 * p3
    return pts.round(3).tolist()


def draw_subject(rng: np.random.Generator, size: int, frames: int) -> dict:
    ry = rng.uniform(0.12, 0.2) * size
    rx = ry * rng.uniform(0.55, 1.0)  # taller than wide, like the person reference
    return {
        "kind": str(rng.choice(SUBJECT_KINDS)),
        "colour": hsv_colour(rng, rng.uniform(), (0.65, 1.0), (0.75, 1.0)),
        "radii": [round(rx, 3), round(ry, 3)],
        "angle": round(float(rng.uniform(-0.4, 0.4)), 4),
        "harmonics": [[k, round(float(rng.uniform(0.05, 0.15)), 4), round(float(rng.uniform(0, 6.2832)), 4)]
                      for k in (2, 3, 5)],  # blob wobble: [frequency, amplitude, phase]; blobs only
        "path": draw_path(rng, size, frames, margin=ry + 2),
    }


def draw_object(rng: np.random.Generator, size: int, frames: int, subject_hue: float) -> dict:
    radius = rng.uniform(0.1, 0.16) * size
    start = rng.uniform(radius + 2, size - radius - 2, 2)
    drift = rng.uniform(-0.15, 0.15, 2) * size * (rng.uniform() < 0.5)  # half the objects stay put
    end = np.clip(start + drift, radius + 2, size - radius - 2)
    t = np.linspace(0, 1, frames)[:, None]
    return {
        "sides": int(rng.choice(OBJECT_SIDES)),
        "colour": hsv_colour(rng, subject_hue + rng.uniform(0.25, 0.75), (0.65, 1.0), (0.6, 0.95)),
        "radii": [round(radius, 3), round(radius, 3)],
        "angle": round(float(rng.uniform(0, np.pi)), 4),
        "path": ((1 - t) * start + t * end).round(3).tolist(),
    }


def draw_sample(seed: int, index: int, size: int, frames: int) -> dict:
    """Everything random about one sample, as JSON-ready data; rendering is deterministic after."""
    rng = np.random.default_rng([seed, index])
    subject = draw_subject(rng, size, frames)
    hue = colorsys.rgb_to_hsv(*(c / 255 for c in subject["colour"]))[0]
    return {
        "prompt": str(rng.choice(PROMPTS)),
        "size": size,
        "frames": frames,
        "background": draw_background(rng, size),
        "subject": subject,
        "object": draw_object(rng, size, frames, hue),
    }


# --- rendering ---------------------------------------------------------------------------------


def unit_outline(shape: dict, n: int = 96) -> np.ndarray:
    """Outline points [n, 2] of the shape at unit radius, before scaling and rotation."""
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    if "sides" in shape:
        t = np.linspace(0, 2 * np.pi, shape["sides"], endpoint=False)
        return np.stack([np.cos(t), np.sin(t)], 1)
    c, s = np.cos(t), np.sin(t)
    if shape["kind"] == "rounded_square":  # superellipse |x|^4 + |y|^4 = 1
        return np.stack([np.sign(c) * np.abs(c) ** 0.5, np.sign(s) * np.abs(s) ** 0.5], 1)
    r = np.ones_like(t)
    if shape["kind"] == "blob":
        for k, amp, phase in shape["harmonics"]:
            r = r + amp * np.cos(k * t + phase)
        r = r / r.max()
    return np.stack([r * c, r * s], 1)


def outline(shape: dict, scale: float = 1.0) -> np.ndarray:
    """Outline around (0, 0) in pixels at the video's scale times `scale`."""
    pts = unit_outline(shape) * np.array(shape["radii"]) * scale
    a = shape["angle"]
    rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    return pts @ rot.T


def alpha_mask(points: np.ndarray, height: int, width: int) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of the polygon `points` (x, y in pixels, centres at +0.5)."""
    canvas = np.zeros((height, width), np.uint8)
    shift = 4  # sub-pixel precision for cv2: coordinates in 1/16 px
    fixed = np.round((points - 0.5) * (1 << shift)).astype(np.int32)
    cv2.fillPoly(canvas, [fixed], 255, lineType=cv2.LINE_AA, shift=shift)
    return canvas.astype(np.float32) / 255.0


def paint(image: np.ndarray, alpha: np.ndarray, colour: list[int]) -> np.ndarray:
    """Composite a flat colour over a float image with coverage `alpha`."""
    a = alpha[..., None]
    return image * (1 - a) + np.array(colour, np.float32) * a


def render_background(bg: dict, height: int, width: int) -> np.ndarray:
    """Float RGB [height, width, 3]: base colour with a soft-edged pattern in the second colour."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    k = 2 * np.pi / bg["period"]
    if bg["pattern"] == "stripes":
        wave = np.sin(k * (x * np.cos(bg["angle"]) + y * np.sin(bg["angle"])) + bg["phase"])
    elif bg["pattern"] == "checks":
        wave = np.sin(k * x + bg["phase"]) * np.sin(k * y + bg["phase"])
    else:
        grid = np.array(bg["noise"], np.float32)
        wave = cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC) * 2 - 1
    mix = np.clip(0.5 + 1.5 * wave, 0, 1)[..., None]
    base, second = (np.array(c, np.float32) for c in bg["colours"])
    return base * (1 - mix) + second * mix


def crop_left(size: int) -> int:
    """Column where the video's window starts in the background (the `center_crop` offset)."""
    return (reference_sizes(size)["background"][1] - size) // 2


def render_video(spec: dict) -> np.ndarray:
    """uint8 frames [F, size, size, 3]: background crop, then the object, then the subject on top."""
    size = spec["size"]
    bg_h, bg_w = reference_sizes(size)["background"]
    left = crop_left(size)
    background = render_background(spec["background"], bg_h, bg_w)[:, left:left + size]
    subject, obj = spec["subject"], spec["object"]
    frames = []
    for i in range(spec["frames"]):
        frame = background
        for shape in (obj, subject):
            alpha = alpha_mask(outline(shape) + shape["path"][i], size, size)
            frame = paint(frame, alpha, shape["colour"])
        frames.append(frame)
    return to_uint8(np.stack(frames))


def fitted(shape: dict, height: int, width: int, margin: int = 2) -> np.ndarray:
    """Coverage of the shape scaled (aspect kept) to fill a height x width image, centred."""
    pts = outline(shape)
    extent = pts.max(0) - pts.min(0)
    scale = min((width - 2 * margin) / extent[0], (height - 2 * margin) / extent[1])
    pts = outline(shape, scale)
    centre = np.array([width, height]) / 2 - (pts.max(0) + pts.min(0)) / 2
    return alpha_mask(pts + centre, height, width)


def render_person(spec: dict) -> np.ndarray:
    """uint8 RGBA: the subject in its colour composited on white (Pillow's alpha_composite, what the
    white reading computes), opaque wherever it covers part of a pixel and transparent elsewhere,
    where it is white. A reader that drops alpha (Pillow's convert("RGB"), SkyReels-V3's) and one
    that composites on white then read the same pixels, those of the subject's coverage on white;
    a cut-out keeping its colour under alpha 0 would read as a box of that colour instead."""
    h, w = reference_sizes(spec["size"])["person"]
    coverage = fitted(spec["subject"], h, w)
    rgb = np.broadcast_to(np.array(spec["subject"]["colour"], np.float32), (h, w, 3))
    cutout = Image.fromarray(to_uint8(np.concatenate([rgb, coverage[..., None] * 255], axis=-1)), "RGBA")
    on_white = np.asarray(Image.alpha_composite(Image.new("RGBA", cutout.size, (255, 255, 255, 255)), cutout))
    opaque = np.where(np.asarray(cutout)[..., 3] > 0, 255, 0).astype(np.uint8)
    return np.dstack([on_white[..., :3], opaque])


def render_object(spec: dict) -> np.ndarray:
    """uint8 RGB: the object on white."""
    h, w = reference_sizes(spec["size"])["object"]
    white = np.full((h, w, 3), 255, np.float32)
    return to_uint8(paint(white, fitted(spec["object"], h, w), spec["object"]["colour"]))


def to_uint8(image: np.ndarray) -> np.ndarray:
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


# --- files -------------------------------------------------------------------------------------


def write_video(path: Path, frames: np.ndarray) -> None:
    """H.264 mp4 that decord reads: 4:4:4 chroma (colour edges at 64 px survive), CRF 12, one
    thread and bitexact flags so the bytes repeat."""
    _, h, w, _ = frames.shape
    writer = imageio_ffmpeg.write_frames(
        str(path), (w, h), fps=FPS, codec="libx264", pix_fmt_out="yuv444p", quality=None,
        macro_block_size=1, ffmpeg_log_level="error",
        output_params=["-crf", str(CRF), "-threads", "1", "-fflags", "+bitexact", "-flags:v", "+bitexact"],
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def write_png(path: Path, image: np.ndarray) -> None:
    Image.fromarray(image).save(path, format="PNG")


def write_npz(path: Path, frames: np.ndarray) -> None:
    """uint8 frames [F, H, W, 3] under `frames`, uncompressed (e2v.data.media reads only the header
    to probe). np.savez appends .npz to a name without it: the .tmp name keeps the suffix."""
    with path.open("wb") as f:
        np.savez(f, frames=frames)


def write_sample(out: Path, ident: str, spec: dict, write_meta: bool, video_format: str = "mp4") -> None:
    """All files of one sample, each written to `.tmp/` and renamed into place."""
    size = spec["size"]
    bg_h, bg_w = reference_sizes(size)["background"]
    background = to_uint8(render_background(spec["background"], bg_h, bg_w))
    write_clip = write_video if video_format == "mp4" else write_npz
    writers = {
        f".{video_format}": lambda p: write_clip(p, render_video(spec)),
        ".txt": lambda p: p.write_text(spec["prompt"] + "\n"),
        "_person.png": lambda p: write_png(p, render_person(spec)),
        "_object.png": lambda p: write_png(p, render_object(spec)),
        "_background.png": lambda p: write_png(p, background),
    }
    if write_meta:
        meta = dict(spec, id=ident, crop_left=crop_left(size), reference_sizes=reference_sizes(size))
        writers[".json"] = lambda p: p.write_text(json.dumps(meta, indent=1) + "\n")
    for suffix, write in writers.items():
        tmp = out / TMP / f"{ident}{suffix}"
        write(tmp)
        os.replace(tmp, out / f"{ident}{suffix}")


# --- the dataset folder ------------------------------------------------------------------------


def ids(num_samples: int) -> list[str]:
    width = max(3, len(str(num_samples - 1)))
    return [f"{i:0{width}d}" for i in range(num_samples)]


def expected_files(params: dict) -> list[str]:
    suffixes = (f".{params.get('video_format', 'mp4')}", ".txt") + SUFFIXES + ((".json",) if params["write_meta"] else ())
    return [i + s for i in ids(params["num_samples"]) for s in suffixes]


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reason_to_write(out: Path, params: dict, force: bool) -> str | None:
    """Why the folder must be (re)generated, or None when it already holds this dataset.
    Raises SystemExit for a folder that holds files this tool did not write."""
    if out.exists() and not out.is_dir():
        sys.exit(f"error: {out} is a file, not a folder")
    if not out.exists() or not any(out.iterdir()):
        return "new"
    if force:
        return "--force"
    complete, started = (out / MARKER).exists(), (out / IN_PROGRESS).exists()
    if not complete and not started:
        sys.exit(f"error: {out} holds files but no {MARKER} / {IN_PROGRESS} marker of this tool; "
                 "choose an empty folder, or pass --force to overwrite its numbered samples")
    if started:
        return f"half-written ({IN_PROGRESS} present)"
    done = read_marker(out / MARKER) or {}
    if done != params:
        changes = ", ".join(f"{k} {done.get(k)} -> {v}" for k, v in params.items() if done.get(k) != v)
        return f"parameters changed: {changes}"
    missing = [f for f in expected_files(params) if not (out / f).exists()]
    return f"{len(missing)} files missing, e.g. {missing[0]}" if missing else None


def clear(out: Path) -> None:
    """Remove what an earlier run of this tool wrote (numbered sample files, markers, .tmp)."""
    (out / MARKER).unlink(missing_ok=True)
    shutil.rmtree(out / TMP, ignore_errors=True)
    for p in out.iterdir():
        if p.is_file() and OWN_FILE.match(p.name):
            p.unlink()


def write_marker(out: Path, name: str, params: dict) -> None:
    tmp = out / TMP / name
    tmp.write_text(json.dumps(params, sort_keys=True) + "\n")
    os.replace(tmp, out / name)


def generate(out: Path, params: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    clear(out)
    (out / TMP).mkdir()
    write_marker(out, IN_PROGRESS, params)
    for index, ident in enumerate(ids(params["num_samples"])):
        spec = draw_sample(params["seed"], index, params["size"], params["frames"])
        write_sample(out, ident, spec, params["write_meta"], params.get("video_format", "mp4"))
    write_marker(out, MARKER, params)  # last: its presence means every sample is complete
    (out / IN_PROGRESS).unlink()
    shutil.rmtree(out / TMP)


def verify(out: Path, params: dict) -> str:
    """Decode every video with decord (as the trainer does) and compare with the rendered frames;
    the verdict as one line."""
    errors = []
    for index, ident in enumerate(ids(params["num_samples"])):
        spec = draw_sample(params["seed"], index, params["size"], params["frames"])
        rendered = render_video(spec)
        if params.get("video_format") == "npz":  # the rendered frames themselves: exact or wrong
            with np.load(out / f"{ident}.npz") as z:
                errors.append(np.abs(z["frames"].astype(np.int16) - rendered).mean())
            continue
        import decord  # only here: generating needs no decoder

        reader = decord.VideoReader(str(out / f"{ident}.mp4"), ctx=decord.cpu(0), num_threads=1)
        decoded = reader.get_batch(list(range(len(reader)))).asnumpy()
        if decoded.shape != rendered.shape:
            sys.exit(f"error: {ident}.mp4 decodes to {decoded.shape}, wrote {rendered.shape}")
        errors.append(np.abs(decoded.astype(np.int16) - rendered).mean())
    return (f"decode check: {len(errors)} videos round-trip in shape; mean abs colour error "
            f"{np.mean(errors):.2f} / 255 (worst video {np.max(errors):.2f})")


# --- command line ------------------------------------------------------------------------------


def frame_count(text: str) -> int:
    n = int(text)
    if n % 4 != 1 or not 5 <= n:
        raise argparse.ArgumentTypeError(f"{n}: frames must be 4k+1 from 5 (5, 9, ..., 33; up to 81 with --real-size)")
    return n


def frame_size(text: str) -> int:
    n = int(text)
    if n % 16 or not 32 <= n:
        raise argparse.ArgumentTypeError(f"{n}: size must be a multiple of 16 from 32 (up to 512; 1280 with --real-size)")
    if n == 48:  # decord 0.6.0 returns 4 channels for 48-px-wide videos and get_batch fails
        raise argparse.ArgumentTypeError("48: decord 0.6.0 cannot decode 48-px-wide videos; use 32 or 64")
    return n


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: need at least 1")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="dataset folder (created if missing)")
    p.add_argument("--num-samples", type=positive, default=64)
    p.add_argument("--size", type=frame_size, default=64, help="video height = width in pixels")
    p.add_argument("--frames", type=frame_count, default=17, help="frames per video, 4k+1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="regenerate even if the dataset is complete")
    p.add_argument("--write-meta", action="store_true", help="also write ID.json (colours, positions)")
    p.add_argument("--verify", action="store_true",
                   help="decode every mp4 with decord; report the colour error against the rendered frames")
    p.add_argument("--real-size", action="store_true",
                   help=f"allow up to {REAL_LIMITS['size']} px and {REAL_LIMITS['frames']} frames (training shapes)")
    p.add_argument("--video-format", choices=["mp4", "npz"], default="mp4",
                   help="npz: uint8 frames, no ffmpeg needed (machines without one)")
    p.add_argument("--dry-run", action="store_true",
                   help="write nothing: render sample 0's first and last frame, print what a build would write")
    args = p.parse_args(argv)
    limits = REAL_LIMITS if args.real_size else LIMITS
    for key, flag in (("size", "--size"), ("frames", "--frames")):
        if getattr(args, key) > limits[key]:
            more = "" if args.real_size else f"; pass --real-size for up to {REAL_LIMITS[key]}"
            p.error(f"{flag} {getattr(args, key)}: at most {limits[key]}{more}")
    return args


def dry_run(args) -> tuple[dict, str]:
    """Sample 0 drawn at the asked size, its first and last frame rendered (the drawing works at
    that size), and the plan: files per sample, bytes of one raw clip; with the plan in one line."""
    spec = draw_sample(args.seed, 0, args.size, args.frames)
    ends = render_video({**spec, "frames": 2, "subject": {**spec["subject"], "path": spec["subject"]["path"][::args.frames - 1]},
                         "object": {**spec["object"], "path": spec["object"]["path"][::args.frames - 1]}})
    clip_bytes = args.frames * args.size * args.size * 3
    plan = {"samples": args.num_samples, "frames": args.frames, "size": args.size, "video_format": args.video_format,
            "files_per_sample": len(expected_files({**vars(args), "num_samples": 1})),
            "rendered_frames_shape": list(ends.shape), "raw_clip_bytes": clip_bytes,
            "npz_bytes_total": clip_bytes * args.num_samples if args.video_format == "npz" else None}
    return plan, (f"dry run: would write {args.num_samples} samples x {plan['files_per_sample']} files to "
                  f"{args.out_dir}, {args.frames} x {args.size} x {args.size} .{args.video_format} (raw clip "
                  f"{clip_bytes / 2**20:.0f} MiB); frames 0 and {args.frames - 1} of sample 0 rendered: "
                  f"{tuple(ends.shape)}")


def main(argv: list[str] | None = None) -> None:
    """The command (tools/make_demo_dataset.py): its report goes to stdout."""
    args = parse_args(argv)
    if args.dry_run:
        print(dry_run(args)[1])
        return
    params = {k: getattr(args, k) for k in ("num_samples", "size", "frames", "seed", "write_meta")}
    params["person_png"] = PERSON_PNG  # a folder of the older cut-outs is written again
    if args.video_format != "mp4":  # mp4 folders keep their marker (and so stay complete) as before
        params["video_format"] = args.video_format
    start = time.perf_counter()
    reason = reason_to_write(args.out_dir, params, args.force)
    if reason is not None:
        generate(args.out_dir, params)
    status = "kept complete dataset" if reason is None else f"wrote ({reason})"
    seconds = time.perf_counter() - start
    if args.verify:
        print(verify(args.out_dir, params))
    print(f"{status}: {args.num_samples} samples, {args.size}x{args.size}, {args.frames} frames, "
          f"{args.out_dir}, {seconds:.2f}s")


if __name__ == "__main__":
    main()
