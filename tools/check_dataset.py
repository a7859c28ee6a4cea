"""Check every sample of a dataset before training on it.

    python tools/check_dataset.py --config configs/e2v.yaml [--set ...] [--world_size 8]
    python tools/check_dataset.py --data_root path/to/e2v_folder        # elements of configs/e2v.yaml
        [--json report.json] [--contact-sheet DIR] [--workers N]

Per sample: the video decodes (first, middle and last frame), its frame count fits a frame bucket
(too short = error; with data.fps, counted at that rate), its fps is near the dataset's median
and constant (variable frame rate: a warning; with data.fps, not below that rate instead); its
size and aspect against the target (upscaling, heavy cropping: warnings); a source's valid frame
range and crop box inside the clip (OpenS2V: `frame_range_outside_video`, `crop_outside_video`;
its JSON-level problems, such as `bad_rle`, `mask_outside_frame`, `video_missing`, come from
indexing); required
elements present and loadable, element image size (over data.max_image_pixels: error) and mode;
empty captions and captions that are not UTF-8 (errors), duplicate captions and captions over the
text encoder's 512 tokens (warnings: the rest is cut off); paths outside the dataset root (error
unless data.allow_outside_root). Per dataset: a
missing or unreadable CSV / JSONL file (error), orphan files that belong to no sample, duplicate
ids (two videos of one id: error; a repeated CSV / JSONL row: warning, it trains twice), and
bucket occupancy per epoch (after repeat and weight, as training counts it) against
micro_batch_size x world size. Prints a summary table and one line per problem (file: problem ->
fix), writes a JSON report, and exits 1 when a sample would fail training (0 otherwise; 2 for a
config error). It never stops on a bad file: whatever a sample holds, it becomes a named problem
and the report is written. `--contact-sheet DIR` writes one PNG per sample: references, then the first,
middle and last frames, for a person to look at. Workers run in parallel processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2v.config.shapes import TEXT_LEN  # noqa: E402
from e2v.config.schema import ConfigError
from e2v.config.load import load_config  # noqa: E402
from e2v.data.buckets import bucket_counts, bucket_name, bucket_table, choose_bucket, with_repeats  # noqa: E402
from e2v.data.elements import discover, orphan_files  # noqa: E402
from e2v.data.sample import MetadataError, Problem, Sample, element_paths
from e2v.data.media import (ImageTooLargeError, MediaError, NoClockError, TooShortError, WindowError, clip_window,
    frame_intervals, load_image, probe_video, supported_frames)
from e2v.models.load import load_tokenizer  # noqa: E402
from e2v.data.preflight import quiet_decoder, quiet_worker, summarize  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs/e2v.yaml"
# modes load_image turns into 8-bit RGB by a fixed rule (media.to_rgb8); I and F guess their scale: a warning
ELEMENT_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "I;16", "I;16B", "I;16L")
FPS_RATIO = 1.5  # fps further than this factor from the dataset median: motion speed differs
VFR_RATIO = 1.25  # longest / shortest frame interval of one clip above this: variable frame rate
# Without the configured tokenizer (offline, not downloaded) prompt length is estimated from words:
# UMT5's sentencepiece gives about 1.3 tokens per English word (more for rare words, digits, CJK).
TOKENS_PER_WORD = 1.3
MAX_CROP = 0.25  # center_crop cutting more than this share of the frame: a warning
THUMB = 96  # contact sheet row height (px)


def _frames(path: Path, info) -> np.ndarray:
    """First, middle and last frame, uint8 [3,H,W,3] (decoding the tail catches truncated files)."""
    idx = [0, info.frames // 2, info.frames - 1]
    if path.suffix == ".npz":
        with np.load(path) as z:
            return z["frames"][idx]
    import decord

    return decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1).get_batch(idx).asnumpy()


def _thumb(img: Image.Image) -> np.ndarray:
    w = max(1, round(img.width * THUMB / img.height))
    return np.asarray(img.convert("RGB").resize((w, THUMB), Image.BILINEAR))


def check_sample(job: tuple) -> dict:
    """One sample -> {id, dataset, info..., problems: [Problem as dict]}; runs in a worker process.
    A failure no check foresaw is the sample's problem too, so one odd file never stops the run."""
    s = job[0]
    try:
        return _check_sample(job)
    except Exception as e:
        problem = Problem(s.id, str(s.video), f"could not be checked: {type(e).__name__}: {str(e)[:300]}",
                          "inspect the sample's files (video, prompt, references) or remove the sample",
                          "check_failed")
        return {"id": s.id, "dataset": s.dataset, "video": str(s.video), "problems": [asdict(problem)]}


def _check_sample(job: tuple) -> dict:
    s, cfg, sheet_dir = job
    problems: list[Problem] = []

    def add(file, problem, fix, kind, severity="error"):
        problems.append(Problem(s.id, str(file), problem, fix, kind, severity))

    out = {"id": s.id, "dataset": s.dataset, "video": str(s.video)}
    if not s.prompt.strip():
        add(s.prompt_source, "empty caption", "write the prompt (one line of text)", "empty_caption")
    tiles, frames = [], None
    info = None
    try:
        info = probe_video(s.video)
        frames = _frames(s.video, info)
        out.update(frames=info.frames, height=info.height, width=info.width, fps=info.fps)
    except MediaError as e:
        add(s.video, str(e).replace(f"{s.video}: ", ""), "re-encode or replace the clip, or remove the sample",
            "video_unreadable")
    except Exception as e:  # decord raises its own types on truncated streams
        add(s.video, f"cannot decode frames: {str(e).splitlines()[0][:200]}", "re-encode or replace the clip",
            "video_unreadable")
    # with data.fps frames are taken by time, so a variable rate keeps its motion speed: nothing to warn
    if frames is not None and s.video.suffix != ".npz" and cfg.data.fps is None:
        try:
            gaps = frame_intervals(s.video)
        except MediaError as e:
            gaps = np.zeros(0)
            add(s.video, str(e), "re-encode the clip", "video_unreadable", "warning")
        if len(gaps) and gaps.min() > 0 and gaps.max() / gaps.min() > VFR_RATIO:
            add(s.video, f"variable frame rate: frames {gaps.min():.3f} to {gaps.max():.3f} s apart, so motion "
                "speed changes within the clip (frames are taken by index)", "set data.fps (frames by time), or "
                "re-encode at a constant rate, e.g. ffmpeg -i IN -fps_mode cfr -r 16 OUT", "variable_fps", "warning")
    window_ok = True
    if info is not None and (s.frame_range is not None or s.crop is not None):
        try:  # a source's valid frame range and crop box (OpenS2V): the part of the clip that trains
            info.frames, info.height, info.width = clip_window(s.video, info.frames, info.height, info.width,
                                                               s.frame_range, s.crop)
        except WindowError as e:
            add(s.video, str(e).replace(f"{s.video}: ", ""), "fix the entry's frame range / crop box in its "
                "metadata, or remove the entry", e.kind)
            info, window_ok = None, False
    if info is not None:
        try:
            available = supported_frames(s.video, out["frames"], cfg.data.fps, s.frame_range)
            f, h, w = choose_bucket(available, info.height, info.width, cfg)
            out["bucket"] = [f, h, w]
            if info.height < h or info.width < w:
                add(s.video, f"{info.width}x{info.height} is upscaled to its {w}x{h} bucket (blurry target)",
                    "use a larger source, or a smaller data.resolution", "upscaled", "warning")
            crop = 1 - min(info.width / info.height / (w / h), (w / h) / (info.width / info.height))
            if cfg.data.video_resize == "center_crop" and crop > MAX_CROP:
                add(s.video, f"aspect {info.width}x{info.height} vs target {w}x{h}: center_crop cuts {crop:.0%} "
                    "of each frame", "add a data.resolution_buckets entry of this aspect", "aspect", "warning")
        except TooShortError as e:
            add(s.video, str(e), "use a longer clip, or allow shorter data.frame_buckets", "too_short")
        except NoClockError as e:
            problem, fix = str(e).replace(f"{s.video}: ", "").split("; ", 1)
            add(s.video, problem, fix, "no_clock")
        except MediaError as e:  # unreadable timestamps
            add(s.video, str(e).replace(f"{s.video}: ", ""), "re-encode the clip", "video_unreadable")
    if s.make_elements is not None and window_ok:  # (outside the window: the cut fails for the same reason)
        try:  # references the source cuts from its masks: built here as training builds them
            element_paths(s)
        except (MediaError, OSError, ValueError) as e:
            add(s.video, f"references cannot be cut: {e}", "fix the entry's masks / crop box, or remove the entry",
                "reference_unbuildable")
    for name, path in s.elements.items():
        if s.make_elements is not None and not path.exists():
            continue  # its cut failed: named once above
        try:
            with Image.open(path) as raw:
                mode, size = raw.mode, raw.size
            img = load_image(path, cfg.data.max_image_pixels)
        except ImageTooLargeError as e:
            problem, fix = str(e).replace(f"{path}: ", "").split("; ", 1)
            add(path, f"element '{name}' {problem}", fix, "element_too_large")
            continue
        except (MediaError, OSError) as e:
            add(path, f"element '{name}' unreadable ({e})",
                "replace the image (PNG or JPEG, RGB or RGBA)", "element_unreadable")
            continue
        tiles.append(_thumb(img))
        if mode not in ELEMENT_MODES:
            add(path, f"element '{name}' has image mode {mode}", "save it as RGB or RGBA PNG", "element_mode", "warning")
        th, tw = cfg.data.resolution
        if max(size) * 4 < max(th, tw):
            add(path, f"element '{name}' is {size[0]}x{size[1]}, tiny against the {tw}x{th} target",
                "use a larger reference image", "element_small", "warning")
    if sheet_dir is not None and frames is not None:
        tiles += [_thumb(Image.fromarray(fr)) for fr in frames]
        gap = np.full((THUMB, 4, 3), 255, np.uint8)
        row = np.concatenate([t for tile in tiles for t in (tile, gap)][:-1], axis=1)
        Image.fromarray(row).save(Path(sheet_dir) / f"{s.dataset}_{s.id}.png")
    out["problems"] = [asdict(p) for p in problems]
    return out


def long_prompts(cfg, samples: list[Sample]) -> list[Problem]:
    """Prompts over the text encoder's TEXT_LEN tokens (encode_text cuts the rest off), counted
    with the configured tokenizer, or estimated from words when it cannot be loaded offline."""
    tokenizer = load_tokenizer(cfg) if samples else None
    prompts = [s.prompt for s in samples]
    if tokenizer is not None:
        counts = [len(ids) for ids in tokenizer(prompts)["input_ids"]] if prompts else []
        how = "counted with the configured tokenizer"
    else:
        counts = [round(len(p.split()) * TOKENS_PER_WORD) for p in prompts]
        how = (f"estimated as {TOKENS_PER_WORD} tokens per word: the configured tokenizer could not be loaded "
               "offline")
    return [Problem(s.id, s.prompt_source, f"prompt is {n} tokens ({how}); the text encoder keeps the first "
                    f"{TEXT_LEN}, the rest is cut off", f"shorten the prompt to under {TEXT_LEN} tokens",
                    "prompt_too_long", "warning")
            for s, n in zip(samples, counts) if n > TEXT_LEN]


def dataset_problems(cfg, samples: list[Sample], results: list[dict], world: int) -> tuple[list[Problem], str]:
    """Checks across samples: duplicate captions, long prompts, fps outliers, bucket occupancy (+ the
    bucket table)."""
    problems = long_prompts(cfg, samples)
    by_prompt: dict[tuple, list[Sample]] = {}
    for s in samples:
        if s.prompt.strip():
            by_prompt.setdefault((s.dataset, s.prompt.strip().lower()), []).append(s)
    for group in by_prompt.values():
        for s in group[1:]:
            problems.append(Problem(s.id, s.prompt_source, f"duplicate caption (same as {group[0].id})",
                                    "describe what differs between the clips", "duplicate_caption", "warning"))
    fps = [r["fps"] for r in results if r.get("fps")]
    if cfg.data.fps is not None:  # frames by time: a faster clip loses frames evenly, a slower one repeats them
        for r in results:
            if r.get("fps") and cfg.data.fps / r["fps"] > FPS_RATIO:
                problems.append(Problem(r["id"], r["video"], f"{r['fps']:.1f} fps, below data.fps {cfg.data.fps:g}: "
                                        "frames repeat, so motion stutters", "use a clip of at least data.fps, or "
                                        "lower data.fps", "fps_below_rate", "warning"))
    elif fps:
        median = statistics.median(fps)
        for r in results:
            if r.get("fps") and max(r["fps"] / median, median / r["fps"]) > FPS_RATIO:
                problems.append(Problem(r["id"], r["video"], f"{r['fps']:.1f} fps against the dataset's {median:.1f}: "
                                        "motion plays at a different speed", "resample to the common fps, or set "
                                        "data.fps (frames by time)", "fps_outlier", "warning"))
    trainable = [s for s, r in zip(samples, results) if not any(p["severity"] == "error" for p in r["problems"])]
    for s, r in zip(samples, results):
        s.bucket = tuple(r["bucket"]) if "bucket" in r else None
    epoch = with_repeats(trainable, cfg)  # the list training indexes: the same counts as its table
    table, small = bucket_table(epoch, cfg, world)
    severity = "error" if cfg.data.small_bucket == "error" else "warning"
    counts = bucket_counts(epoch, cfg)
    for b in small:
        problems.append(Problem(f"bucket {bucket_name(b)}", "-", f"{counts[b]} sample(s) per epoch, fewer than micro_batch_size "
                                f"{cfg.train.micro_batch_size} x world {world}", "add clips of that size, change the "
                                "buckets, or set data.small_bucket: repeat / drop", "small_bucket", severity))
    return problems, table


def load(args):
    sets = list(args.set)
    if args.data_root:
        sets.insert(0, f"data.datasets=[{{data_root: {json.dumps(args.data_root)}}}]")
    return load_config(args.config or DEFAULT_CONFIG, sets)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="training config (default: configs/e2v.yaml with --data_root)")
    p.add_argument("--data_root", default=None, help="an e2v folder, checked with the config's elements")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--world_size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="GPUs of the training run (bucket occupancy against micro_batch_size x this)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default="check_dataset_report.json", help="report path")
    p.add_argument("--contact-sheet", dest="contact_sheet", default=None, metavar="DIR",
                   help="write a PNG per sample: references | first, middle, last frame")
    args = p.parse_args(argv)
    # file names need not be UTF-8 (bytes become surrogates): print them escaped rather than crash
    if hasattr(sys.stdout, "reconfigure"):  # a real stream (not a test's StringIO)
        sys.stdout.reconfigure(errors="backslashreplace")
    if not args.config and not args.data_root:
        p.error("give --config or --data_root")
    try:
        cfg = load(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    samples, problems = [], []
    for i, ds in enumerate(cfg.data.datasets):
        try:
            found, probs = discover(ds, cfg.data.elements, cfg.data.remove_common_llm_caption_prefixes, i,
                                    cfg.data.allow_outside_root)
        except MetadataError as e:  # the whole dataset is unusable: one problem, the others are still checked
            problems.append(Problem(f"dataset {i}", e.file, e.problem, e.fix, "metadata_unreadable"))
            continue
        except Exception as e:  # unforeseen (an unreadable folder, ...): the same, never a traceback
            problems.append(Problem(f"dataset {i}", ds.metadata_path or ds.data_root,
                                    f"cannot be indexed: {type(e).__name__}: {str(e)[:300]}",
                                    "check the folder and metadata file are readable", "metadata_unreadable"))
            continue
        samples += found
        problems += probs
        if ds.dataset_type == "e2v":
            problems += [Problem("-", str(f), "orphan file: belongs to no sample id", "rename it to ID<suffix> of an "
                                 "existing video, or remove it", "orphan_file", "warning")
                         for f in orphan_files(ds, cfg.data.elements)]
        else:
            seen: dict[Path, str] = {}
            for s in found:
                if s.video in seen:
                    # it trains twice per epoch, nothing fails: a warning
                    problems.append(Problem(s.id, s.prompt_source, f"duplicate: the same video as {seen[s.video]}",
                                            "remove the repeated row (use data.datasets[].repeat)", "duplicate_id",
                                            "warning"))
                seen.setdefault(s.video, s.id)
    if args.contact_sheet:
        Path(args.contact_sheet).mkdir(parents=True, exist_ok=True)
    jobs = [(s, cfg, args.contact_sheet) for s in samples]
    if args.workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(args.workers, initializer=quiet_worker) as pool:  # decoder lines: the problem says it
            results = list(pool.map(check_sample, jobs, chunksize=max(1, min(32, len(jobs) // (4 * args.workers)))))
    else:
        quiet_decoder()
        results = [check_sample(j) for j in jobs]
    problems += [Problem(**d) for r in results for d in r["problems"]]
    cross, table = dataset_problems(cfg, samples, results, args.world_size)
    problems += cross
    dt = time.perf_counter() - t0

    errors = [q for q in problems if q.severity == "error"]
    bad_ids = {q.sample for q in errors}
    rate = len(samples) / max(dt, 1e-9)
    summary = {"samples": len(samples), "samples_ok": sum(1 for s in samples if s.id not in bad_ids),
               "errors": len(errors), "warnings": len(problems) - len(errors), "seconds": round(dt, 3),
               "samples_per_s": round(rate, 1), "workers": args.workers, "world_size": args.world_size,
               "by_kind": dict(Counter(q.kind for q in problems))}
    print(f"{'datasets':<16} {', '.join(d.data_root for d in cfg.data.datasets)}")
    for k in ("samples", "samples_ok", "errors", "warnings"):
        print(f"{k:<16} {summary[k]}")
    held = min(cfg.validation.num_samples, summary["samples_ok"]) if cfg.validation.every_n_steps > 0 else 0
    if held:  # training holds these out (split_held_out): its "N training samples" is samples_ok - held
        print(f"{'held out':<16} {held} of the samples_ok, for validation (validation.num_samples): training "
              f"trains on {summary['samples_ok'] - held}")
    print(f"{'speed':<16} {rate:.1f} samples/s ({args.workers} workers, {dt:.2f} s)")
    print(f"buckets (micro_batch_size {cfg.train.micro_batch_size} x world {args.world_size}):\n{table}")
    for line in summarize([q for q in problems if q.severity == "error"], first=10**9) + \
            summarize([q for q in problems if q.severity != "error"]):  # errors in full, a warning kind met often counted
        print(line)
    report = {"summary": summary, "problems": [asdict(q) for q in problems],
              "samples": [{k: v for k, v in r.items() if k != "problems"} for r in results]}
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"report: {args.json}" + (f"; contact sheets: {args.contact_sheet}" if args.contact_sheet else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
