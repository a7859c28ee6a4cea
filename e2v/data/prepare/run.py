"""The driver of tools/prepare_data.py: for every source video (each rank takes every world-th),
probe (orientation) -> shots (cuts, dissolves) -> clips (cover size, the crop that keeps the
subject) -> elements -> references checked against their window (identity.py) -> quality gates
(quality.py) -> captions -> write, then a record; at the end (rank 0) the manifest, the summary
(summary.py) and the dataset check.

Resumable per video: a video with a record is never redone; one without (a killed run's) has its
partial samples removed and is redone. A sample's files are written each to a temp name and
renamed, the video last, so the trainer never discovers a sample whose references are missing.
A bad input (unreadable, no video stream, too small, ...) gets a record saying what happened and
never stops the run.

Length (about 490 lines): every stage is a call into its own module (shots, clips, the backends,
references, identity, quality, captions, manifest, summary, sheet); what stays here is their order
and the per-video bookkeeping that resumption needs (counts, reasons, the record), which split
across files would have to be threaded through every stage by hand.

Legend: F frames, H/W target height/width; frames_FHW3 uint8 RGB, masks_FHW bool.

Length (about 490 lines): the driver's stages in their order, each a short function calling the
stage modules of e2v/data/prepare/; split, the order would have to be read across files.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from e2v.data.media import variable_rate
from e2v.runtime.log import EVERY_RANK, get_logger

from . import captions as cap, shots
from .classical import warp
from .clips import (
    best_crop,
    choose_target,
    cover_size,
    orientation_sizes,
    size_problem,
    to_cover,
    track,
    windows,
    write_h264,
)
from .config import PrepareConfig, as_dict, config_key
from .identity import make_identity, window_score
from .manifest import (
    MANIFEST,
    STATE,
    SUMMARY,
    all_records,
    read_record,
    record_path,
    remove_partial,
    sample_prefix,
    write_json_atomic,
    write_manifest,
)
from .masks import bbox
from .quality import gate_failures, quality
from .references import Choice, choose, crop_on_white, cutout_rgba, outside_positions
from .sheet import write_sheet
from .summary import describe, summarize

log = get_logger("e2v.prepare")

# Files in the input folder that are never sources: sidecars, tables, images, our own state.
NOT_VIDEO = {".txt", ".csv", ".jsonl", ".json", ".png", ".jpg", ".jpeg", ".npz", ".npy", ".md", ".part", ".yaml"}
MIN_MEDIAN_FRAMES = 8  # a background median from fewer outside-window frames keeps too much foreground
MAX_IDENTITY_TRIES = 6  # reference candidates the identity check tries, best first, before the sample is dropped
DECODE_CHUNK_PIXELS = 64 * 1920 * 1080  # frames decoded at once: bounds memory on 4K sources


class BadInput(Exception):
    """A source that gives no clips, with the summary's word for it."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def list_sources(input_dir: Path, output_dir: Path) -> list[Path]:
    out = output_dir.resolve()
    found = []
    for p in sorted(input_dir.rglob("*")):
        rel_parts = p.relative_to(input_dir).parts
        if any(part.startswith(".") for part in rel_parts) or not p.is_file() or p.suffix.lower() in NOT_VIDEO:
            continue
        if out == p.resolve().parent or out in p.resolve().parents:
            continue
        found.append(p)
    return found


def probe(path: Path):
    """(decord reader, frame times in seconds, height, width) or BadInput naming the problem."""
    import decord

    if path.stat().st_size == 0:
        raise BadInput("empty_file", "zero-length file")
    try:
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    except Exception as e:
        if "video stream" in str(e):
            raise BadInput("no_video_stream", "no video stream (an audio-only or data file)") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput("unreadable", f"cannot decode: {first[:200]}") from None
    if len(vr) == 0:
        raise BadInput("no_frames", "the video stream has no frames")
    try:
        shape = vr[0].shape
        times = vr.get_frame_timestamp(list(range(len(vr))))[:, 0].astype(np.float64)
    except Exception as e:
        raise BadInput("unreadable", f"cannot decode the first frame or the timestamps: {str(e)[:200]}") from None
    if shape[-1] != 3:
        raise BadInput("unreadable", f"decord returns {shape[-1]} channels at width {shape[1]} (a decord bug); "
                       "re-encode it to another width")
    if not np.isfinite(times).all() or np.any(np.diff(times) < 0):
        raise BadInput("bad_timestamps", "frame timestamps are not increasing; re-encode with ffmpeg -fps_mode cfr")
    return vr, times, shape[0], shape[1]


def decode(vr, indices: list[int], target_hw: tuple[int, int]) -> np.ndarray:
    """The source frames at `indices`, resized (aspect kept) to cover the target: frames_FHW3; the
    crop inside them is chosen per shot (clips.best_crop)."""
    h, w = vr[0].shape[:2]
    chunk = max(1, DECODE_CHUNK_PIXELS // (h * w))
    parts = [to_cover(vr.get_batch(indices[i:i + chunk]).asnumpy(), target_hw) for i in range(0, len(indices), chunk)]
    return np.concatenate(parts) if parts else np.zeros((0, *cover_size(h, w, target_hw), 3), np.uint8)


def make_backend(cfg: PrepareConfig, device: str):
    e = cfg.elements
    if e.backend == "learned" or (e.backend == "auto" and e.sam_model):
        from .learned import LearnedBackend  # transformers' SAM classes: only when asked for

        return LearnedBackend(e, device)
    from .classical import ClassicalBackend

    return ClassicalBackend(e)


def _save_png(path: Path, image: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".part")
    Image.fromarray(image).save(tmp, format="PNG")
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Preparer:
    """Everything loaded once per run (backend, captioner, caption table) and the per-video work."""

    def __init__(self, cfg: PrepareConfig, input_dir: Path, out: Path, device: str = "cpu"):
        self.cfg, self.input_dir, self.out = cfg, input_dir, out
        self.sizes = orientation_sizes(cfg.clips.resolution, cfg.clips.orientations)
        self.backend = make_backend(cfg, device)
        self.identity, self.identity_threshold = make_identity(cfg.identity, device)
        mode = self.caption_mode = cfg.captions.mode
        self.table = cap.load_table(input_dir, cfg.captions) if mode in ("auto", "sidecar") else {}
        want_model = mode == "model" or (mode == "auto" and cfg.captions.model)
        self.captioner = cap.ModelCaptioner(cfg.captions, device) if want_model else None
        items = cfg.elements.items
        self.subject = next(it.name for it in items if it.role == "subject")
        self.objects = [it.name for it in items if it.role == "object"]
        self.background = next((it.name for it in items if it.role == "background"), None)
        self.config_dict = as_dict(cfg)

    def caption(self, source: Path, clip_FHW3: np.ndarray, counts: Counter) -> tuple[str, str]:
        """(caption, where it came from)."""
        if self.caption_mode in ("auto", "sidecar"):
            text = cap.sidecar(source, self.input_dir, self.table)
            if text:
                return text, "sidecar"
        if self.captioner is not None:
            t0 = time.perf_counter()
            text = self.captioner(clip_FHW3)
            counts["seconds_captions"] += time.perf_counter() - t0
            if text:
                return text, f"model:{self.captioner.name}"
        return cap.filename_words(source), "filename"

    def video(self, source: Path) -> dict:
        rel = str(source.relative_to(self.input_dir))
        record = {"source": rel, "status": "done", "notes": [], "samples": [], "counts": {}}
        counts: Counter = Counter()
        t0 = time.perf_counter()
        try:
            vr, times, h, w = probe(source)
        except BadInput as e:
            record.update(status="bad", kind=e.kind, what=str(e))
            return record
        except OSError as e:
            record.update(status="bad", kind="unreadable", what=str(e))
            return record
        duration = float(times[-1] - times[0]) + (float(np.median(np.diff(times))) if len(times) > 1 else 0.0)
        record.update(frames=len(times), height=h, width=w, seconds=round(duration, 3))
        counts["videos"] += 1
        counts["footage_seconds"] += duration
        intervals = np.diff(times)
        if len(intervals) > 2 and variable_rate(intervals):
            record["notes"].append(f"variable frame rate (frame intervals {intervals.min() * 1000:.0f}-"
                                   f"{intervals.max() * 1000:.0f} ms): sampled by time at {self.cfg.clips.fps:g} fps")
        orientation, target_hw = choose_target(h, w, self.sizes)
        record["orientation"], record["target_hw"] = orientation, list(target_hw)
        if h > w and orientation != "landscape":
            record["notes"].append(f"portrait {w}x{h}: kept {orientation} at {target_hw[1]}x{target_hw[0]}")
        if max(h, w) >= 2160:
            record["notes"].append(f"{w}x{h}: decoded in chunks and downscaled to {target_hw[1]}x{target_hw[0]}")
        prefix = sample_prefix(rel)
        if not prefix.startswith(Path(rel).stem + "_"):
            record["notes"].append(f"sample ids use the ASCII name {prefix}")
        problem = size_problem(h, w, target_hw, self.cfg.clips.min_scale, self.cfg.clips.max_crop)
        counts["seconds_probe"] += time.perf_counter() - t0
        if problem:
            what = {"too_small": f"{w}x{h} is smaller than the target {target_hw[1]}x{target_hw[0]} "
                                 f"(clips.min_scale {self.cfg.clips.min_scale:g})",
                    "aspect": f"{w}x{h}: the crop to {target_hw[1]}x{target_hw[0]} would cut more than clips.max_crop "
                              f"{self.cfg.clips.max_crop:g} of the frame; allow another shape in clips.orientations"}[problem]
            counts[f"videos_dropped_{problem}"] += 1
            record.update(status="skipped", kind=problem, what=what, counts=dict(counts))
            return record
        t0 = time.perf_counter()
        try:
            found = shots.detect(vr, float(vr.get_avg_fps()) or self.cfg.clips.fps, self.cfg.shots)
        except Exception as e:  # a decoder failure mid-video: the video is named, the run goes on
            record.update(status="bad", kind="shot_detection", what=f"{type(e).__name__}: {str(e)[:200]}",
                          counts=dict(counts))
            return record
        ranges = found.shot_ranges(len(times))
        record["cuts"] = [c["frame"] for c in found.cuts]
        record["boundaries"] = {"cuts": found.cuts, "dissolves": found.dissolves}
        counts["seconds_shots"] += time.perf_counter() - t0
        counts["shots"] += len(ranges)
        counts["dissolves"] += len(found.dissolves)
        record["shot_seconds"] = [round(float(times[b - 1] - times[a]), 3) for a, b in ranges]
        for k, (first, last) in enumerate(ranges):
            t0 = time.perf_counter()
            positions = track(times, first, last, self.cfg.clips.fps, self.cfg.clips.max_shot_seconds)
            wins = windows(len(positions), self.cfg.clips.num_frames, self.cfg.clips.windows_per_shot)
            if not wins:
                counts["shots_too_short"] += 1
                record.setdefault("track_frames_short", []).append(len(positions))
                continue
            try:
                frames_FHW3 = decode(vr, positions, target_hw)
            except Exception as e:  # a corrupt stretch: the shot is lost, the video goes on
                record["notes"].append(f"shot {k}: cannot decode ({str(e)[:120]}); shot skipped")
                counts["shots_undecodable"] += 1
                continue
            counts["seconds_decode"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            masks = self.backend.analyse(frames_FHW3, self.subject, self.objects)
            counts["seconds_elements"] += time.perf_counter() - t0
            if masks.problem:
                counts[f"shots_{masks.problem}"] += 1
                continue
            if masks.camera.get("camera") == "registered":
                counts["shots_registered"] += 1
            # clips.crop centre: nothing to keep, and best_crop's answer is the centre
            subject = self.cfg.clips.crop == "subject"
            keep_FHW = masks.foreground() if subject else np.zeros((1, *frames_FHW3.shape[1:3]), bool)
            crop = best_crop(keep_FHW, target_hw)
            shot = Shot(k, positions, frames_FHW3, masks, crop, target_hw, orientation)
            for j, window in enumerate(wins):
                sample = self.sample(source, rel, f"{prefix}_s{k}w{j}", shot, window, times, counts)
                if sample:
                    record["samples"].append(sample)
        record["counts"] = dict(counts)
        return record

    def sample(self, source, rel, sid, shot: "Shot", window, times, counts) -> dict | None:
        """One window's sample: references checked against the window, gates, then the files."""
        cfg = self.cfg.elements
        t0 = time.perf_counter()
        frames_FHW3, masks, positions = shot.frames, shot.masks, shot.positions
        gap = int(np.ceil(cfg.reference_gap_seconds * self.cfg.clips.fps))

        def time_of(p: int) -> float:  # seconds into the source video
            return round(float(times[positions[p]]), 4)

        def done(reason: str | None) -> None:
            counts["seconds_elements"] += time.perf_counter() - t0
            if reason:
                counts[reason] += 1

        subject = self.checked(choose(frames_FHW3, masks.masks[self.subject], masks.scores[self.subject], window, gap, cfg),
                               frames_FHW3, masks.masks[self.subject], window)
        if subject.position is None:
            return done(f"clips_dropped_subject_{subject.dropped_by}")
        refs: dict[str, np.ndarray] = {}
        info: dict[str, dict] = {}
        flags = []

        def describe(c, m) -> dict:
            return {"time_s": time_of(c.position), "source_frame": positions[c.position],
                    "box": [int(v) for v in bbox(m, cfg.margin_px)], "outside_window": c.outside,
                    "at_edge": c.at_edge, "area_share": round(c.area_share, 4), "score": round(c.score, 4),
                    "sharpness": round(c.sharpness, 1), "identity": c.identity}

        m = masks.masks[self.subject][subject.position]
        refs[self.subject] = cutout_rgba(frames_FHW3[subject.position], m, cfg.margin_px)
        info[self.subject] = describe(subject, m)
        emitted = [self.subject]
        for name in self.objects:
            # what the subject hides of the object is not the object: the least hidden frame wins
            visible_FHW = masks.masks[name] & ~masks.masks[self.subject]
            if not visible_FHW.any():
                counts[f"elements_none_{name}"] += 1  # no evidence of one: the sample has no object
                continue
            c = self.checked(choose(frames_FHW3, visible_FHW, masks.scores[name], window, gap, cfg), frames_FHW3,
                             visible_FHW, window)
            if c.position is None:
                counts[f"elements_dropped_{name}_{c.dropped_by}"] += 1
                continue
            refs[name] = crop_on_white(frames_FHW3[c.position], visible_FHW[c.position], cfg.margin_px)
            info[name] = describe(c, visible_FHW[c.position])
            emitted.append(name)
        crop = shot.crop_slices()
        background_HW3 = None
        if self.background:
            outside = outside_positions(len(frames_FHW3), window, gap)
            pool = outside if len(outside) >= MIN_MEDIAN_FRAMES else list(range(len(frames_FHW3)))
            view = (window[0] + window[1]) // 2
            plate_HW3, share, filled = self.backend.background(frames_FHW3, masks, pool, emitted, view)
            if share > cfg.max_foreground_share:
                counts[f"elements_dropped_{self.background}_foreground_share"] += 1
            else:
                background_HW3 = refs[self.background] = np.ascontiguousarray(plate_HW3[crop])
                info[self.background] = {"times_s": [time_of(pool[0]), time_of(pool[-1])], "view_frame": positions[view],
                                         "outside_window": pool is outside, "foreground_share": round(share, 4),
                                         "filled_share": round(filled, 4)}
        clip_FHW3 = frames_FHW3[window[0]:window[1]][(slice(None), *crop)]
        fg_FHW = np.logical_or.reduce([masks.masks[n] for n in emitted])[window[0]:window[1]][(slice(None), *crop)]
        subject_FHW = masks.masks[self.subject][window[0]:window[1]][(slice(None), *crop)]
        plates_FHW3 = None
        if background_HW3 is not None:
            plates_FHW3, uncovered_FHW = views_of(plate_HW3, masks.to_reference, view, window)
            plates_FHW3, fg_FHW = plates_FHW3[(slice(None), *crop)], fg_FHW | uncovered_FHW[(slice(None), *crop)]
        q = quality(clip_FHW3, subject_FHW, fg_FHW, plates_FHW3, cfg.min_area_share, cfg.classical.diff_threshold)
        q["background_filled"] = round(filled, 4) if background_HW3 is not None else None
        failed = gate_failures(q, self.cfg.gates)
        if failed and self.cfg.gates.action == "drop":
            return done(f"clips_dropped_gate_{failed[0]}")
        flags += [f"gate_{g}" for g in failed]
        flags += [f"{n}_reference_inside_window" for n, v in info.items() if v.get("outside_window") is False]
        flags += [f"{n}_reference_at_edge" for n, v in info.items() if v.get("at_edge")]
        if q["subject_at_edge"] > 0.5:
            flags.append("subject_clipped_at_frame_edge")
        for f in flags:
            counts[f"flagged_{f}"] += 1
        done(None)
        caption, caption_from = self.caption(source, clip_FHW3, counts)
        counts[f"captions_{caption_from.split(':')[0]}"] += 1
        t0 = time.perf_counter()
        for name, image in refs.items():
            _save_png(self.out / f"{sid}_{name}.png", image)
            counts[f"elements_{name}"] += 1
        _write_text(self.out / f"{sid}.txt", caption)
        if self.cfg.check.contact_sheets:
            write_sheet(self.out / "contact_sheets" / f"{sid}.png", clip_FHW3, refs,
                        title=f"{sid}  {rel} shot {shot.index} {time_of(window[0]):.2f}-{time_of(window[1] - 1):.2f} s"
                              + (f"  FLAGS: {', '.join(flags)}" if flags else ""))
        write_h264(self.out / f"{sid}.mp4", clip_FHW3, self.cfg.clips.fps, self.cfg.clips.crf)  # last: the sample exists
        counts["seconds_write"] += time.perf_counter() - t0
        counts["clips"] += 1
        src = [positions[p] for p in range(*window)]
        return {"id": sid, "source": rel, "shot": shot.index, "window": {
                    "start_s": round(float(times[src[0]]), 4), "end_s": round(float(times[src[-1]]), 4),
                    "source_frames": src},
                "crop": {"orientation": shot.orientation, "cover_hw": list(frames_FHW3.shape[1:3]),
                         "y0": shot.crop[0], "x0": shot.crop[1], "hw": list(shot.target_hw)},
                "camera": masks.camera, "references": info, "quality": q, "flags": flags,
                "mask_areas": {n: [round(float(a), 4) for a in masks.masks[n][window[0]:window[1]].mean(axis=(1, 2))]
                               for n in emitted},
                "caption": caption, "caption_from": caption_from, "backend": masks.backend, "models": masks.models,
                "identity_measure": getattr(self.identity, "name", None), "config": self.config_dict}

    def checked(self, choices: list[Choice], frames_FHW3, masks_FHW, window) -> Choice:
        """The first candidate whose cut-out shows the element the window shows (identity.py); a
        Choice with position None (dropped_by identity) when none does."""
        if choices[0].position is None or self.identity is None:
            return choices[0]
        for c in choices[:MAX_IDENTITY_TRIES]:
            score = window_score(self.identity, frames_FHW3, masks_FHW, window,
                                 (frames_FHW3[c.position], masks_FHW[c.position]))
            if score is None or score >= self.identity_threshold:  # None: the window never shows it
                c.identity = None if score is None else round(score, 4)
                return c
        return Choice(None, False, dropped_by="identity")


def views_of(plate_HW3: np.ndarray, to_ref_F33, view: int, window: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The background reference (seen from track frame `view`) as each window frame sees it, and
    the pixels it does not cover: (plates_FHW3, uncovered_FHW). A still camera: the plate itself."""
    n, (h, w) = window[1] - window[0], plate_HW3.shape[:2]
    if to_ref_F33 is None:
        return np.broadcast_to(plate_HW3, (n, h, w, 3)), np.zeros((n, h, w), bool)
    mats = [np.linalg.inv(to_ref_F33[f]) @ to_ref_F33[view] for f in range(*window)]  # view -> reference -> frame f
    plates = warp([plate_HW3] * n, mats, (h, w))
    uncovered = warp([np.ones((h, w), np.uint8)] * n, mats, (h, w), nearest=True)
    return np.stack(plates), np.stack(uncovered) == 0


@dataclass
class Shot:
    """One analysed shot: its track (source frame per position), frames at the cover size, the
    backend's masks, and the crop (y0, x0) every sample of it is cut to."""
    index: int
    positions: list[int]
    frames: np.ndarray
    masks: object
    crop: tuple[int, int]
    target_hw: tuple[int, int]
    orientation: str

    def crop_slices(self) -> tuple[slice, slice]:
        (y0, x0), (th, tw) = self.crop, self.target_hw
        return slice(y0, y0 + th), slice(x0, x0 + tw)


def check_argv(cfg: PrepareConfig, out: Path) -> list[str]:
    """tools/check_dataset.py's arguments for the output, with the clip shape it was cut to."""
    res = cfg.clips.resolution
    sizes = orientation_sizes(res, cfg.clips.orientations)
    buckets = ["--set", f"data.resolution_buckets={[list(v) for v in sizes.values()]}"] if len(sizes) > 1 else []
    return ["--config", cfg.check.config, "--data_root", str(out), "--workers", "1",
            "--json", str(out / STATE / "check_report.json"),
            "--set", f"data.num_frames={cfg.clips.num_frames}", "--set", f"data.resolution=[{res[0]}, {res[1]}]",
            "--set", f"data.fps={cfg.clips.fps}", *buckets,
            # the data is judged, not the trainer's hold-out: a small prepared set is not an error of
            # the preparer's (training names validation.num_samples itself when it would hold out all)
            "--set", "validation.every_n_steps=0"] + [a for extra in cfg.check.set for a in ("--set", extra)]


def prepare(cfg: PrepareConfig, input_dir: Path, out: Path, *, no_caption: bool = False, rank: int = 0,
            world: int = 1, device: str = "cpu", barrier=None, check=None) -> dict | None:
    """Prepare this rank's share of the sources; rank 0 then writes the manifest and summary and
    runs the check: `check(argv) -> exit code`, tools/check_dataset.py's main, passed in by the
    caller (tools/ import e2v, never the reverse). Returns the summary on rank 0."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    sources = list_sources(input_dir, out)[rank::world]
    if no_caption:
        cfg = dataclasses.replace(cfg, captions=dataclasses.replace(cfg.captions, mode="filename"))
    # a record made with other settings (the check's aside) is stale: its video is redone
    fingerprint = config_key(cfg)
    todo = []
    for s in sources:
        record = read_record(out, str(s.relative_to(input_dir)))
        if record is None or record.get("config_key") != fingerprint:
            todo.append(s)
    log.info(f"rank {rank}/{world}: {len(sources)} source files: {len(sources) - len(todo)} finished before, "
             f"{len(todo)} to do -> {out}", extra=EVERY_RANK)
    preparer = Preparer(cfg, input_dir, out, device) if todo else None
    for s in tqdm(todo, desc=f"prepare rank {rank}", position=rank, dynamic_ncols=True,
                  mininterval=1 if sys.stderr.isatty() else 30):
        rel = str(s.relative_to(input_dir))
        remove_partial(out, rel)  # a killed run's samples of this video
        try:
            record = preparer.video(s)
        except Exception as e:  # an input nobody foresaw: named in the summary, never the end of the run
            remove_partial(out, rel)
            record = {"source": rel, "status": "bad", "kind": "error", "what": f"{type(e).__name__}: {str(e)[:300]}",
                      "notes": [], "samples": [], "counts": {}}
        record["config_key"] = fingerprint
        write_json_atomic(record_path(out, rel), record)
    if barrier is not None:
        barrier()
    if rank != 0:
        return None
    records = all_records(out)
    n = write_manifest(out, records)
    summary = summarize(records, cfg)
    write_json_atomic(out / SUMMARY, summary)
    log.info(describe(summary))
    log.info(f"{n} samples -> {out}; manifest {out / MANIFEST}")
    if cfg.check.run and check is not None and not summary.get("no_samples"):
        argv = check_argv(cfg, out)
        log.info("check: tools/check_dataset.py " + " ".join(argv))
        summary["check_exit_code"] = check(argv)
        write_json_atomic(out / SUMMARY, summary)
    return summary
