"""Section 3, the data pipeline at 81 x 480 x 832: synthetic 720p clips (so the resize really
runs) through the real E2VDataset.load, decode and resize timed apart, decord against OpenCV, the
whole-clip torch resize against PIL per frame, and DataLoader scaling with 0 / 1 / 2 workers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from bench.benchlib.common import BENCH_DIR, Phases, make_config, stats
from bench.benchlib.memory import peak_rss_mb

DATA_CLIPS, DATA_FRAMES, DATA_SOURCE_HW, DATA_TARGET_HW = 4, 81, (720, 1280), (480, 832)


def make_data_clips(root: Path) -> Path:
    """DATA_CLIPS clips of 81 frames at 720p (so the resize to 480x832 really runs) with a subject
    (RGBA), an object and a background (wider than 16:9), like a real E2V sample."""
    import imageio_ffmpeg
    from PIL import Image

    out = root / "data81"
    marker = out / ".complete"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, w = DATA_SOURCE_HW
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(DATA_CLIPS):
        rng = np.random.default_rng(i)
        texture = rng.integers(0, 24, (h // 8, w // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
        writer = imageio_ffmpeg.write_frames(str(out / f"{i:03d}.mp4"), (w, h), fps=16, codec="libx264",
                                             quality=None, output_params=["-crf", "23"], macro_block_size=1,
                                             ffmpeg_log_level="error")
        writer.send(None)
        for f in range(DATA_FRAMES):  # a moving gradient, a textured floor and a moving disc
            base = np.stack([(xx + 9 * f) % 256, (yy + 5 * f) % 256, np.full_like(xx, 60 + 40 * i)], -1)
            frame = (base.astype(np.uint8) // 2 + texture)
            cy, cx = h // 2 + int(120 * np.sin(f / 9 + i)), int(w * (0.2 + 0.6 * f / DATA_FRAMES))
            frame[(yy - cy) ** 2 + (xx - cx) ** 2 < 90 ** 2] = (220, 60 + 30 * i, 40)
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        (out / f"{i:03d}.txt").write_text("a person walks past an object in front of a textured background")
        person = np.zeros((640, 400, 4), np.uint8)
        person[80:560, 60:340] = (200, 120, 90, 255)
        Image.fromarray(person, "RGBA").save(out / f"{i:03d}_person.png")
        Image.fromarray(rng.integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(out / f"{i:03d}_object.png")
        Image.fromarray(rng.integers(0, 255, (720, 1440, 3), dtype=np.uint8)).save(out / f"{i:03d}_background.png")
    marker.write_text("ok")
    return out


def decode_decord(path) -> np.ndarray:
    """What e2v.data.media.load_video does before resizing: decord, one thread, a batch of indices."""
    from e2v.data.media import _reader, frame_indices

    vr = _reader(path)
    return vr.get_batch(frame_indices(len(vr), DATA_FRAMES)).asnumpy()


def decode_opencv(path) -> np.ndarray:
    """The alternative: OpenCV's VideoCapture, sequential reads, BGR -> RGB."""
    import cv2

    from e2v.data.media import MediaError, frame_indices

    cap = cv2.VideoCapture(str(path))
    frames = []
    while len(frames) < DATA_FRAMES:
        ok, bgr = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    cap.release()
    if not frames:
        raise MediaError(f"cannot decode video {path} with OpenCV")
    return np.stack([frames[i] for i in frame_indices(len(frames), DATA_FRAMES)])


DECODERS = {"decord": decode_decord, "opencv": decode_opencv}


def timed_load_video(decode, phases: Phases):
    """e2v.data.media.load_video with a given decoder, decode and resize timed apart."""
    from e2v.data.media import frames_to_video

    def load_video(path, num_frames, height, width, *, stride=1, fps=None, resize_mode="center_crop",
                   reshape_mode="bicubic"):
        with phases("decode"):
            frames = decode(path)
        with phases("resize_to_tensor"):
            return frames_to_video(frames, height, width, resize_mode, reshape_mode)
    return load_video


def pil_frames_to_video(frames_FHWC, height: int, width: int):
    """The resize e2v.data.media.frames_to_video did before it resized whole clips in torch: PIL
    per frame (centre crop, bicubic), uint8 [3,F,H,W] out as the loader ships it. Kept here to
    measure the gain."""
    import torch
    from PIL import Image

    from e2v.data.media import center_crop

    frames = np.stack([np.asarray(center_crop(Image.fromarray(f), height, width)) for f in frames_FHWC])
    return torch.from_numpy(frames).permute(3, 0, 1, 2).contiguous()


def resize_alternative(samples, h: int, w: int, repeats: int) -> dict:
    """e2v.data.media.frames_to_video (torch, whole clip) against PIL per frame on the same decoded
    clips, interleaved."""
    from e2v.data.media import frames_to_video

    cur, pil, diffs = [], [], []
    for _ in range(repeats):
        for s in samples[:2]:
            frames = decode_decord(s.video)
            t0 = time.perf_counter()
            a_CFHW = frames_to_video(frames, h, w)
            t1 = time.perf_counter()
            b_CFHW = pil_frames_to_video(frames, h, w)
            t2 = time.perf_counter()
            cur.append(t1 - t0)
            pil.append(t2 - t1)
            d = (a_CFHW.float() - b_CFHW.float()).abs()  # in levels of 255
            diffs.append((d.mean().item(), d.max().item()))
            del a_CFHW, b_CFHW, d
    return {"current_ms": stats([1e3 * t for t in cur]), "pil_per_frame_ms": stats([1e3 * t for t in pil]),
            "speedup": round(statistics.median(pil) / statistics.median(cur), 2),
            "mean_abs_diff_levels": round(max(x[0] for x in diffs), 4),
            "max_abs_diff_levels": round(max(x[1] for x in diffs), 2)}


def child_data(a) -> dict:
    """Per sample (one core): decode, resize + to-tensor, and the element images (to 480x832 and
    to CLIP 512x512) inside the real E2VDataset.load, with decord and with OpenCV; then a
    DataLoader over the same dataset (decord, e2v's path) with 0, 1 and 2 workers."""
    import torch

    import e2v.data.dataset as data
    from e2v.data.dataset import E2VDataset, collate, index_samples

    torch.set_num_threads(1)  # a worker's view: one sample, one core
    root = make_data_clips(BENCH_DIR / "tmp")
    h, w = DATA_TARGET_HW
    cfg = make_config("tiny", root, None, [f"data.num_frames={DATA_FRAMES}", f"data.resolution=[{h},{w}]",
                                           "processors.clip.resolution=[512,512]", "train.micro_batch_size=1"])
    samples = index_samples(cfg, verbose=False)
    dataset = E2VDataset(cfg, samples)
    original = data.load_video
    per_decoder, first = {}, {}
    for r in range(a.data_repeats):
        for name in (DECODERS if r % 2 == 0 else list(DECODERS)[::-1]):
            for s in samples:
                ph = Phases(False)
                data.load_video = timed_load_video(DECODERS[name], ph)  # E2VDataset.load looks it up here
                try:
                    with ph("item"):
                        item = dataset.load(s)
                finally:
                    data.load_video = original
                ph.t["elements_and_rest"] = ph.t["item"] - ph.t["decode"] - ph.t["resize_to_tensor"]
                per_decoder.setdefault(name, []).append(ph.t)
                first.setdefault(name, item["video"])
    # Both decoders must hand over the same pixels, or this compares different work.
    diff = (first["decord"].float() - first["opencv"].float()).abs().mean().item()  # levels of 255
    decoders = {}
    for name, rows in per_decoder.items():
        decoders[name] = {k: stats([1e3 * t[k] for t in rows]) for k in ("decode", "resize_to_tensor",
                                                                          "elements_and_rest", "item")}
        decoders[name]["samples_per_s_one_core"] = round(1e3 / decoders[name]["item"]["median"], 3)

    scaling = {}
    for workers in (0, 1, 2):
        sub = torch.utils.data.Subset(dataset, [i % len(dataset) for i in range(a.loader_samples)])
        loader = torch.utils.data.DataLoader(sub, batch_size=1, collate_fn=collate, num_workers=workers,
                                             prefetch_factor=2 if workers else None)
        t0 = time.perf_counter()
        got = sum(1 for _ in loader)
        dt = time.perf_counter() - t0
        scaling[str(workers)] = {"samples": got, "seconds": round(dt, 3), "samples_per_s": round(got / dt, 3),
                                 "samples_per_s_per_worker": round(got / dt / max(1, workers), 3)}
    for v in scaling.values():
        v["speedup_vs_1_worker"] = round(v["samples_per_s"] / scaling["1"]["samples_per_s"], 3)
    return {"source_hw": list(DATA_SOURCE_HW), "target": [DATA_FRAMES, h, w], "clips": len(samples),
            "elements": "person RGBA 400x640 (pad_white), object 300x300 (pad_white), background 1440x720 "
                        "(center_crop); CLIP path 512x512",
            "decoders": decoders, "decoder_mean_abs_diff_levels": round(diff, 3), "dataloader_scaling": scaling,
            "resize_alternative": resize_alternative(samples, h, w, a.data_repeats),
            "video_tensor_mb": round(3 * DATA_FRAMES * h * w * 4 / 2**20, 1),
            "memory": {"peak_rss_mb": round(peak_rss_mb(), 1)}}
