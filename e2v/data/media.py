"""Pixels in: video decoding (decord), frame sampling, image loading, and the resize / crop / pad
modes of both conditioning pathways, with A2's arithmetic to the pixel.

Legend: F frames, H/W height/width, C=3 channels. Videos leave this module as uint8 video_CFHW
(the per-sample slice of the diffusers [B,C,F,H,W] layout; pixels in [-1, 1] are made on the
device, e2v/runtime/device.py), images as float32 image_CHW in [-1, 1].

About 570 lines, one concern: every read of a pixel goes through here (the loader, the start-up
check, the validator, the cache, OpenS2V's frame ranges and crops), so the frame-index and
resize arithmetic that must agree across them has one home.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from e2v.config.schema import MAX_IMAGE_PIXELS

RESAMPLE = {
    "bicubic": Image.BICUBIC,
    "bilinear": Image.BILINEAR,
    "area": Image.BOX,
    "nearest": Image.NEAREST,
}


class MediaError(RuntimeError):
    """A file that cannot be used, with its path in the message."""


class VideoNotFoundError(MediaError):
    """A clip that is not there (the path names no file)."""


def require_file(path: str | Path) -> Path:
    """The clip's path, or VideoNotFoundError: decord says only "Error reading PATH..." for a file
    that is not there, as for a damaged one."""
    path = Path(path)
    if not path.is_file():
        raise VideoNotFoundError(f"video {path} not found")
    return path


class TooShortError(MediaError):
    """A clip with fewer frames than the frame count (or every frame bucket) needs."""


# --- images ------------------------------------------------------------------------------------


class ImageTooLargeError(MediaError):
    """An image over data.max_image_pixels, refused before its pixels are decoded."""


# data.max_image_pixels replaces Pillow's own bomb limit: Pillow's raises DecompressionBombError
# without the file name (and only above 2 x 89 MP, warning below). Every image the trainer reads
# goes through load_image, which checks the size from the header before decoding anything.
Image.MAX_IMAGE_PIXELS = None


def load_image(path: str | Path, max_pixels: int = MAX_IMAGE_PIXELS, read: str = "white") -> Image.Image:
    """8-bit RGB image, upright, from any Pillow mode a reference may come in, by the rule `read`
    names (data.reference_read as Config.reference_reading resolves it; docs/data.md, "How a
    reference is read"): READERS below. Either way the EXIF orientation is applied first
    (ImageOps.exif_transpose, as diffusers' load_image does in A2's and SkyReels-V3's inference),
    so a phone photo trains the way it is shown."""
    try:
        img = Image.open(path)
    except Exception as e:  # PIL raises many types; the user needs the path either way
        raise MediaError(f"cannot read image {path}: {e}") from e
    w, h = img.size
    if w * h > max_pixels:
        img.close()
        raise ImageTooLargeError(f"{path}: {w}x{h} = {w * h / 1e6:.1f} MP is over data.max_image_pixels "
                                 f"({max_pixels / 1e6:g} MP); downscale the image (references are resized to "
                                 "the video size anyway) or raise data.max_image_pixels")
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
    except Exception as e:
        raise MediaError(f"cannot read image {path}: {e}") from e
    return READERS[read](img, path)


TRANSPARENT_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def to_rgb8(img: Image.Image, path: str | Path = "image") -> Image.Image:
    """The `white` reading (A2's: its subjects are segmented and placed on white). Any Pillow mode
    -> 8-bit RGB. `img.convert("RGB")` alone clips high-bit-depth images: a 16-bit grey PNG (I;16,
    levels 0..65535) comes out nearly all white. So:
    - I;16*: 16-bit levels, / 257 (65535 -> 255);
    - I (32-bit integer): levels within 0..255 are taken as 8-bit, within 0..65535 as 16-bit
      (/ 257; an image darker than 256/65536 everywhere is then read as 8-bit), else an error;
    - F (float): values within [0, 1] are scaled by 255, within [0, 255] taken as 8-bit, else
      an error (no scale can be guessed);
    - transparent modes (and a palette with a transparent colour): composited on white;
    - everything else: Pillow's conversion (pillow_rgb)."""
    mode = img.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        return Image.fromarray(_gray_levels_u8(np.asarray(img), mode, path)).convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img, mode = img.convert("RGBA"), "RGBA"
    if mode in TRANSPARENT_MODES:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return pillow_rgb(img, path)


def pillow_rgb(img: Image.Image, path: str | Path = "image") -> Image.Image:
    """The `convert` reading: Pillow's `img.convert("RGB")` and nothing else, as diffusers'
    load_image calls it in SkyReels-V3's pipeline (its resize_ref_images converts again, a no-op).
    What that means, Pillow's rule: alpha is dropped and the colour stored under it kept (a
    cut-out whose transparent pixels hold colour reads as a box of that colour); a palette's
    transparent entry keeps its palette colour; I;16 / I levels are clipped to 0..255 (a 16-bit
    grey above level 255 reads white), F values truncated and clipped. A mode Pillow cannot
    convert (HSV, LAB) is a MediaError naming the file."""
    try:
        return img.convert("RGB")
    except ValueError as e:  # e.g. HSV, LAB: no conversion in Pillow
        raise MediaError(f"{path}: image mode {img.mode} cannot be converted to RGB ({e}); save it as an RGB PNG") from e


READERS = {"white": to_rgb8, "convert": pillow_rgb}  # data.reference_read's rules (auto: Config.reference_reading)


def reading_difference(img: Image.Image) -> str | None:
    """What the two readings (READERS) give differently for this image, in words, or None when
    they give the same pixels (every opaque, 8-bit image; a cut-out stored white under its
    transparent pixels, as tools/prepare_data.py and the demo write them)."""
    if img.mode not in TRANSPARENT_MODES + HIGH_DEPTH_MODES and not (img.mode == "P" and "transparency" in img.info):
        return None
    converted = np.asarray(pillow_rgb(img), np.int16)
    try:
        white = np.asarray(to_rgb8(img), np.int16)
    except MediaError:  # an I / F image with no 8-bit scale: only Pillow's clipping reads it
        return f"{img.mode} levels outside any 8-bit scale: the white reading refuses the image, convert clips it"
    levels = int(np.abs(converted - white).max()) if converted.size else 0
    if levels == 0:
        return None
    if img.mode in HIGH_DEPTH_MODES:
        return (f"{img.mode} levels: the white reading scales them to 8 bits, convert clips them at 255 "
                f"(up to {levels} levels apart)")
    return (f"colour stored under its transparent pixels: the white reading composites them on white, convert "
            f"keeps that colour (up to {levels} levels apart)")


def _gray_levels_u8(arr, mode: str, path) -> np.ndarray:
    """One grey channel of a high-bit-depth mode -> uint8 levels (the rules in to_rgb8)."""
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise MediaError(f"{path}: {mode} image holds NaN or infinite values; save it as an 8-bit RGB PNG")
    lo, hi = (arr.min(), arr.max()) if arr.size else (0.0, 0.0)
    if mode.startswith("I;16"):
        scale = 257.0
    elif mode == "I" and lo >= 0 and hi <= 255:
        scale = 1.0
    elif mode == "I" and lo >= 0 and hi <= 65535:
        scale = 257.0
    elif mode == "F" and lo >= 0 and hi <= 1:
        scale = 1 / 255
    elif mode == "F" and lo >= 0 and hi <= 255:
        scale = 1.0
    else:
        raise MediaError(f"{path}: {mode} image with values {lo:g}..{hi:g}: no 8-bit scale can be inferred "
                         "(expected 0..255 or 0..65535, or 0..1 for floats); save it as an 8-bit RGB PNG")
    return np.round(arr / scale).clip(0, 255).astype(np.uint8)


def pad_white(img: Image.Image, height: int, width: int, resample=Image.BICUBIC) -> Image.Image:
    """Pad with white, centred, to the target aspect ratio, then resize (A2's infer script).
    The pad is `int(((H/W)*w - h)/2)` rows when the image is too wide, else `int(((W/H)*h - w)/2)`
    columns; int() truncates, and we keep that so our tensors equal A2's to the pixel."""
    return _pad(img, height, width, (255, 255, 255), resample)


def letterbox(img: Image.Image, height: int, width: int, resample=Image.BICUBIC) -> Image.Image:
    """Like pad_white with black bars."""
    return _pad(img, height, width, (0, 0, 0), resample)


def _pad(img: Image.Image, height: int, width: int, fill, resample) -> Image.Image:
    w, h = img.size
    arr = np.asarray(img)
    if w / h > width / height:  # too wide: pad rows top and bottom
        pad = int(((height / width) * w - h) / 2)
        arr = np.pad(arr, ((pad, pad), (0, 0), (0, 0)), constant_values=0)
        if pad:
            arr[:pad] = fill
            arr[-pad:] = fill
    else:  # too tall: pad columns left and right
        pad = int(((width / height) * h - w) / 2)
        arr = np.pad(arr, ((0, 0), (pad, pad), (0, 0)), constant_values=0)
        if pad:
            arr[:, :pad] = fill
            arr[:, -pad:] = fill
    return Image.fromarray(arr).resize((width, height), resample)


def center_crop(img: Image.Image, height: int, width: int, resample=Image.BICUBIC) -> Image.Image:
    """Centre-crop to the target aspect, then resize (A2's background path): crop size
    int(h/H*W) or int(w/W*H), offset (size difference)//2."""
    w, h = img.size
    if w / h > width / height:
        cw = int(h / height * width)
        left = (w - cw) // 2
        img = img.crop((left, 0, left + cw, h))
    else:
        ch = int(w / width * height)
        top = (h - ch) // 2
        img = img.crop((0, top, w, top + ch))
    return img.resize((width, height), resample)


def resize(img: Image.Image, height: int, width: int, resample=Image.BICUBIC) -> Image.Image:
    return img.resize((width, height), resample)


class DegenerateImageError(MediaError):
    """A reference that fitted inside the video size keeps no pixel on one side (fit_size)."""


def fit_size(image_w: int, image_h: int, height: int, width: int) -> tuple[int, int]:
    """(w, h) of an image fitted inside width x height keeping its aspect, SkyReels-V3's
    resize_ref_images arithmetic: the side that binds exact, the other `int()`-truncated. Where that
    truncates to 0 px (a 1000 x 2 strip inside 64 x 64), V3's loader fails (Pillow refuses a
    0-px resize) and so does this: a DegenerateImageError ("problem; fix")."""
    ratio = image_w / image_h
    size = (width, int(width / ratio)) if ratio > width / height else (int(height * ratio), height)
    if min(size) < 1:
        raise DegenerateImageError(f"{image_w}x{image_h} fitted inside the {width}x{height} video keeping its aspect "
                                   f"is {size[0]}x{size[1]} px (SkyReels-V3's loader fails on it too); crop the "
                                   "reference nearer the video's aspect")
    return size


def fit_pad_white(img: Image.Image, height: int, width: int, resample=None) -> Image.Image:
    """SkyReels-V3 R2V's and Phantom-Wan's reference loader: keep the aspect, fit inside width x
    height (fit_size: a side that would be 0 px is refused as V3 fails there), always LANCZOS
    (whatever data.reshape_mode says: their choice), centred on white, the odd pixel of the
    margin right / bottom."""
    size = fit_size(img.width, img.height, height, width)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    canvas.paste(img.resize(size, Image.Resampling.LANCZOS), ((width - size[0]) // 2, (height - size[1]) // 2))
    return canvas


def crop_bilinear_tensor(img: Image.Image, height: int, width: int) -> torch.Tensor:
    """ComfyUI's reference path (WanPhantomSubjectToVideo -> comfy.utils.common_upscale, "bilinear",
    "center"): pixels / 255 in float, the centre crop to the target aspect (its margin
    `round((old - old * aspect_ratio) / 2)` on each side), torch's bilinear resize (no antialias),
    x * 2 - 1 as its VAE takes it: image_CHW float32 in [-1, 1], never rounded to 8 bits."""
    x = torch.from_numpy(np.array(img, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    old_h, old_w = x.shape[-2:]
    old_aspect, new_aspect = old_w / old_h, width / height
    dx = round((old_w - old_w * (new_aspect / old_aspect)) / 2) if old_aspect > new_aspect else 0
    dy = round((old_h - old_h * (old_aspect / new_aspect)) / 2) if old_aspect < new_aspect else 0
    x = x[:, :, dy: old_h - dy, dx: old_w - dx]
    return torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear")[0] * 2 - 1


def crop_bilinear(img: Image.Image, height: int, width: int, resample=None) -> Image.Image:
    """crop_bilinear_tensor as an 8-bit image (for the CLIP stream and previews)."""
    arr = ((crop_bilinear_tensor(img, height, width) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(arr.permute(1, 2, 0).numpy())


PREPROCESS = {"pad_white": pad_white, "letterbox": letterbox, "center_crop": center_crop, "resize": resize,
              "fit_pad_white": fit_pad_white, "crop_bilinear": crop_bilinear}


def preprocess_image(img: Image.Image, height: int, width: int, mode: str, reshape_mode: str = "bicubic") -> Image.Image:
    return PREPROCESS[mode](img, height, width, RESAMPLE[reshape_mode])


def reference_tensor(img: Image.Image, height: int, width: int, mode: str, reshape_mode: str = "bicubic") -> torch.Tensor:
    """A VAE reference at the video size: image_CHW float32 in [-1, 1]. crop_bilinear stays in float
    as ComfyUI keeps it; every other mode is an 8-bit image first."""
    if mode == "crop_bilinear":
        return crop_bilinear_tensor(img, height, width)
    return image_to_tensor(preprocess_image(img, height, width, mode, reshape_mode))


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> image_CHW float32 in [-1, 1] (uint8 / 127.5 - 1, the diffusers VaeImageProcessor value)."""
    arr = torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return arr.float() / 127.5 - 1.0


# --- video -------------------------------------------------------------------------------------


@dataclass
class VideoInfo:
    frames: int
    height: int
    width: int
    fps: float  # 0.0 for .npz frames (no clock)


def probe_video(path: str | Path) -> VideoInfo:
    """Frame count, size and fps without decoding the clip: decord decodes one frame (also the
    check for its width bug below); for `.npz` only the array header is read."""
    path = require_file(path)
    if path.suffix == ".npz":
        return _probe_npz(path)
    vr = _reader(path)
    try:
        first = vr[0].shape
    except Exception as e:
        raise MediaError(f"cannot decode the first frame of {path} (truncated or damaged): {e}") from e
    _check_channels(first, path)
    return VideoInfo(len(vr), first[0], first[1], float(vr.get_avg_fps()))


class NoClockError(MediaError):
    """data.fps asks for a clip's timestamps, and the clip (.npz frames) has none."""


def check_clock(path: str | Path) -> None:
    """NoClockError, naming the file and the fix, for a clip without timestamps (`.npz` frames)."""
    if Path(path).suffix == ".npz":
        raise NoClockError(f"{path}: .npz frames have no timestamps, so data.fps cannot sample them by time; "
                           "remove data.fps (frames are then taken by index) or give the clip as a video file (mp4)")


def frame_times(path: str | Path) -> np.ndarray:
    """Presentation time (seconds) of every frame, from the container's timestamps (read from the
    index: nothing is decoded). `.npz` frames have no clock: check_clock's error."""
    check_clock(path)
    return _frame_times(_reader(path), path)


def _frame_times(vr, path) -> np.ndarray:
    try:
        # [F, 2] (start, end); only the start is the container's: decord writes end as start + the
        # stream's nominal frame duration, which a variable-rate clip does not keep
        starts = vr.get_frame_timestamp(list(range(len(vr))))[:, 0]
    except Exception as e:
        raise MediaError(f"cannot read the frame timestamps of {path}: {e}") from e
    if np.any(np.diff(starts) < 0) or not np.isfinite(starts).all():
        raise MediaError(f"{path}: frame timestamps are not increasing; re-encode the clip, e.g. "
                         "ffmpeg -i IN -fps_mode cfr -r 16 OUT")
    return starts


VFR_RATIO = 1.25  # longest / shortest frame interval of one clip above this: a variable frame rate


def variable_rate(intervals: np.ndarray) -> bool:
    """Whether frame intervals (frame_intervals) vary enough to call the rate variable."""
    return bool(len(intervals) and intervals.min() > 0 and intervals.max() / intervals.min() > VFR_RATIO)


def frame_intervals(path: str | Path) -> np.ndarray:
    """Seconds between consecutive frames; empty for `.npz` (no clock) and one-frame clips. A
    constant-rate clip has one value throughout."""
    if Path(path).suffix == ".npz":
        return np.zeros(0)
    return np.diff(frame_times(path))


def frames_at_rate(times: np.ndarray, fps: float) -> int:
    """Frames a clip with these frame times gives when sampled every 1/fps seconds from its first
    frame: the target times t_0 + k / fps up to the last frame's time plus half a period (its frame
    is then the nearest, at most half a period off). A constant-rate clip at its own rate gives
    all its frames; at half its rate, about half. The frame-count rule of by-time sampling, for the
    buckets (supported_frames) and for loading (time_indices) alike."""
    if len(times) == 0:
        return 0
    return int(np.floor((times[-1] - times[0]) * fps + 0.5 + 1e-9)) + 1  # 1e-9: float noise at a whole count


def time_indices(times: np.ndarray, fps: float, num_frames: int, stride: int = 1) -> list[int]:
    """By-time sampling: for t_k = t_0 + k * stride / fps (k < num_frames) the index of the frame
    whose time is nearest t_k (a tie takes the earlier frame). The clip is first sampled at fps,
    then every stride-th sample is taken, as frame_indices does by index. Frames repeat when fps is
    above the clip's rate and are skipped when below; too short is TooShortError as by index."""
    need = (num_frames - 1) * stride + 1
    have = frames_at_rate(times, fps)
    if need > have:
        raise TooShortError(f"too short: needs {need} frames at data.fps {fps:g} (num_frames {num_frames}, stride "
                            f"{stride}) but its {times[-1] - times[0]:.3f} s give {have}")
    targets = times[0] + np.arange(0, need, stride) / fps
    after = np.clip(np.searchsorted(times, targets, side="left"), 0, len(times) - 1)  # first frame at or after
    before = np.clip(after - 1, 0, len(times) - 1)
    return np.where(targets - times[before] <= times[after] - targets, before, after).tolist()


def supported_frames(path: str | Path, frames: int, fps: float | None,
                     frame_range: tuple[int, int] | None = None) -> int:
    """Frames a clip of `frames` frames gives the frame-count and bucket rules (e2v/data/dataset.py's
    choose_bucket, tools/check_dataset.py): all of them by index (data.fps null), else
    frames_at_rate of its timestamps; only those of `frame_range` [start, end) when a source
    restricts it (OpenS2V's cut: the frames outside hold a jump cut)."""
    start, end = frame_range or (0, frames)
    return end - start if fps is None else frames_at_rate(frame_times(path)[start:end], fps)


class WindowError(MediaError):
    """A sample's valid frame range or crop box lies outside its clip; `kind` names which."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def clip_window(path, frames: int, height: int, width: int, frame_range: tuple[int, int] | None = None,
                crop: tuple[int, int, int, int] | None = None) -> tuple[int, int, int]:
    """(frames, height, width) of the part of a clip a sample may use: its frame_range [start, end)
    and crop box (x1, y1, x2, y2), both in the clip's own frames and pixels. WindowError naming the
    clip when either lies outside it: the one rule loading, bucketing and the validator apply."""
    if frame_range is not None:
        start, end = frame_range
        if not 0 <= start < end <= frames:
            raise WindowError(f"{path}: valid frame range [{start}, {end}) lies outside the clip's {frames} frames",
                              "frame_range_outside_video")
        frames = end - start
    if crop is not None:
        x1, y1, x2, y2 = crop
        if not (0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height):
            raise WindowError(f"{path}: crop box (x1, y1, x2, y2) {tuple(crop)} lies outside the {width}x{height} "
                              "frame", "crop_outside_video")
        height, width = y2 - y1, x2 - x1
    return frames, height, width


def read_frame(path: str | Path, index: int) -> np.ndarray:
    """One decoded frame, uint8 frame_HW3 (a reference cut from an annotated frame)."""
    vr = _reader(path)
    if not 0 <= index < len(vr):
        raise MediaError(f"{path}: frame {index} asked for, the clip has {len(vr)} frames")
    try:
        frame_HW3 = vr[index].asnumpy()
    except Exception as e:
        raise MediaError(f"cannot decode frame {index} of {path}: {e}") from e
    _check_channels(frame_HW3.shape, path)
    return frame_HW3


def _check_channels(frame_shape, path) -> None:
    # decord 0.6.0 mis-strides some widths (16, 24, 48, 72 px seen): the frame comes back with 4 or
    # 6 "channels" and get_batch fails with "DECORDArrayCopyFromTo: The size must exactly match".
    if frame_shape[-1] != 3:
        raise MediaError(f"{path}: decord 0.6.0 cannot decode this {frame_shape[1]}-px-wide video (a known decord "
                         f"bug at some widths, e.g. 16, 24, 48, 72 px); re-encode it to another width, e.g. "
                         f"ffmpeg -i IN -vf scale=64:-2 OUT")


def _probe_npz(path: Path) -> VideoInfo:
    try:
        with zipfile.ZipFile(path) as z, z.open("frames.npy") as f:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            shape, _, dtype = read_header[np.lib.format.read_magic(f)](f)
    except Exception as e:
        raise MediaError(f"cannot read frames from {path}: {e} (expected uint8 [F,H,W,3] under 'frames')") from e
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3:
        raise MediaError(f"{path}: 'frames' must be uint8 [F,H,W,3], got {dtype} {shape}")
    return VideoInfo(shape[0], shape[1], shape[2], 0.0)


def _reader(path):
    try:
        import decord  # imported here: the tiny tests that never touch video should not pay for it
    except ImportError as e:  # no aarch64 wheel on PyPI (GH200 / GB200): built from source there
        raise MediaError(f"cannot decode video {path}: decord is not installed ({e}); on aarch64 build it from "
                         "source (docs/gpu_runs.md, 'aarch64')") from e

    require_file(path)
    try:
        return decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    except Exception as e:
        said = "" if str(e).startswith("Error reading") else f": {e}"  # decord's own text names no cause
        raise MediaError(f"cannot open video {path} (not a video, or its container is truncated or damaged){said}") from e


def frame_indices(available: int, num_frames: int, stride: int = 1, start: int = 0) -> list[int]:
    """`num_frames` indices `stride` apart from `start`; fewer available is an error the caller
    reports (the clip is too short for this frame count)."""
    need = (num_frames - 1) * stride + 1
    if start + need > available:
        raise TooShortError(f"too short: needs {need} frames (num_frames {num_frames}, stride {stride}) but has {available}")
    return list(range(start, start + need, stride))


def frames_to_video(frames_FHWC: np.ndarray, height: int, width: int, resize_mode: str = "center_crop",
                    reshape_mode: str = "bicubic") -> torch.Tensor:
    """uint8 frames [F,H,W,3] -> uint8 video_CFHW at height x width (e2v/runtime/device.py's `as_pixels`
    makes it [-1, 1] on the device: a quarter of the float bytes through the loader).

    The crop box is center_crop's arithmetic. Bicubic and bilinear resize the whole clip at once
    with torch's antialiased filter on uint8 (PIL's filter family: pixels within 2 levels of a
    per-frame PIL resize, several times faster at 81 x 480 x 832: bench/RESULTS.md, section 3); area and nearest go
    through PIL frame by frame."""
    if frames_FHWC.dtype != np.uint8 or frames_FHWC.ndim != 4 or frames_FHWC.shape[-1] != 3:
        raise MediaError(f"frames must be uint8 [F,H,W,3], got {frames_FHWC.dtype} {frames_FHWC.shape}")
    if frames_FHWC.shape[1:3] != (height, width):
        if resize_mode == "center_crop":
            frames_FHWC = frames_FHWC[(slice(None), *_crop_box(frames_FHWC.shape[1:3], height, width))]
        if reshape_mode in ("bicubic", "bilinear"):
            u8_FCHW = torch.from_numpy(np.ascontiguousarray(frames_FHWC)).permute(0, 3, 1, 2)
            u8_FCHW = torch.nn.functional.interpolate(u8_FCHW, size=(height, width), mode=reshape_mode,
                                                      antialias=True)
            return u8_FCHW.permute(1, 0, 2, 3).contiguous()
        frames_FHWC = np.stack(
            [np.asarray(resize(Image.fromarray(f), height, width, RESAMPLE[reshape_mode])) for f in frames_FHWC])
    return torch.from_numpy(np.ascontiguousarray(frames_FHWC)).permute(3, 0, 1, 2).contiguous()


def _crop_box(hw: tuple[int, int], height: int, width: int) -> tuple[slice, slice]:
    """center_crop's box (rows, cols) for an h x w frame and a height x width target."""
    h, w = hw
    if w / h > width / height:
        cw = int(h / height * width)
        return slice(None), slice((w - cw) // 2, (w - cw) // 2 + cw)
    ch = int(w / width * height)
    return slice((h - ch) // 2, (h - ch) // 2 + ch), slice(None)


def load_video(path: str | Path, num_frames: int, height: int, width: int, *, stride: int = 1,
               fps: float | None = None, resize_mode: str = "center_crop", reshape_mode: str = "bicubic",
               frame_range: tuple[int, int] | None = None,
               crop: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Decode `num_frames` frames (from the first, `stride` apart; with `fps`, by time:
    time_indices) -> uint8 video_CFHW. A source may restrict the frames to `frame_range` [start,
    end) (sampling starts at `start`, never reads past `end`) and cut every frame to `crop`
    (x1, y1, x2, y2) before the resize: clip_window checks both. `.npz` files hold uint8 frames
    [F,H,W,3] under `frames` (the T2V seed format) and have no clock: `fps` with one is NoClockError."""
    path = Path(path)
    if path.suffix == ".npz":
        if fps is not None:
            check_clock(path)
        try:
            with np.load(path) as z:
                frames = z["frames"]
        except Exception as e:
            raise MediaError(f"cannot read frames from {path}: {e} (expected uint8 [F,H,W,3] under 'frames')") from e
        available = clip_window(path, len(frames), *frames.shape[1:3], frame_range, crop)[0]
        start = frame_range[0] if frame_range else 0
        try:
            idx = [start + i for i in frame_indices(available, num_frames, stride)]
        except MediaError as e:
            raise type(e)(f"{path}: {e}") from None
        return frames_to_video(_crop(frames[idx], crop), height, width, resize_mode, reshape_mode)
    vr = _reader(path)
    if frame_range is not None or crop is not None:
        clip_window(path, len(vr), *vr[0].shape[:2], frame_range, crop)
    start, end = frame_range or (0, len(vr))
    times = None if fps is None else _frame_times(vr, path)[start:end]
    try:
        idx = frame_indices(end - start, num_frames, stride) if times is None else time_indices(times, fps, num_frames,
                                                                                                stride)
        frames = vr.get_batch([start + i for i in idx]).asnumpy()
    except MediaError as e:
        raise type(e)(f"{path}: {e}") from None
    except Exception as e:
        _check_channels(vr[0].shape, path)
        raise MediaError(f"cannot decode frames of {path}: {e}") from e
    return frames_to_video(_crop(frames, crop), height, width, resize_mode, reshape_mode)


def _crop(frames_FHWC: np.ndarray, crop: tuple[int, int, int, int] | None) -> np.ndarray:
    if crop is None:
        return frames_FHWC
    x1, y1, x2, y2 = crop
    return np.ascontiguousarray(frames_FHWC[:, y1:y2, x1:x2])
