"""Check every sample of a dataset before training on it.

    python tools/check_dataset.py --config configs/e2v.yaml [--set ...] [--world_size 8]
    python tools/check_dataset.py --data_root path/to/e2v_folder        # elements of configs/e2v.yaml
        [--report report.json] [--contact-sheet DIR] [--workers N]

Per sample, the rules training applies before its first step, from the same code
(e2v/data/preflight.py: `sample_facts`, `sample_problems`), so what this reports as an error is
what training refuses: the video decodes (first and last frame), a source's valid frame range and
crop box lie inside the clip (OpenS2V: `frame_range_outside_video`, `crop_outside_video`; its
JSON-level problems, such as `bad_rle`, `mask_outside_frame`, `video_missing`, come from
indexing), its frame count fits a frame bucket (too short = error; with data.fps, counted at that
rate), references a source cuts can be cut, required elements present and loadable (over
data.max_image_pixels: error), tiny references (a warning), empty captions and captions that are
not UTF-8 (errors), paths outside the dataset root (error unless data.allow_outside_root), a
missing optional reference (a warning, as training prints it: preflight.missing_optional). Then
this tool's own warnings: fps near the dataset's median and constant (variable frame rate; with
data.fps, not below that rate instead), size and aspect against the target (upscaling, heavy
cropping), element image mode (in the sequence layout also a reference the two reading rules of
data.reference_read read differently, such as a cut-out with colour under its transparent
pixels), duplicate captions (one warning per shared caption) and captions over the text
encoder's 512 tokens (the rest is cut off). Per dataset: a missing or unreadable CSV / JSONL file (error),
orphan files that belong to no sample (tools/prepare_data.py's manifest and summary
aside), duplicate ids (two videos of one id: error; a repeated
CSV / JSONL row: warning, it trains twice), and bucket occupancy per epoch (after repeat and
weight, as training counts it) against micro_batch_size x world size. Prints a summary table
whose counts add up (samples = samples_ok + unusable; a sample with several errors is one
unusable sample, each error a line: preflight.unusable, the count training prints) and one line
per problem (file: problem -> fix), writes a JSON report (`--report PATH`; by default
check_dataset_report.json in the first dataset's folder, beside the data it describes), and exits 1
when a sample would fail training (0 otherwise; 2 for a config error). It never stops on a bad file: whatever a
sample holds, it becomes a named problem and the report is written. `--contact-sheet DIR` writes
one PNG per sample: references, then the first, middle and last frames, for a person to look at.
Workers run in parallel processes (training's pool). The facts it reads go into the cache training's
start-up check reads (e2v/data/preflight.py), so on a huge set running it first saves that check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
from PIL import Image

# The data stage (e2v/data/: torch, decord) and validation's rule (diffusers) are imported in the
# functions that use them, after the command line and the config are checked: --help and a config
# error answer in a second (bench/RESULTS.md, section 9).
from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.config.shapes import TEXT_LEN
from e2v.data.prepare.manifest import PREPARE_FILES
from e2v.data.sample import MetadataError, Problem, Sample
from e2v.models.weights import missing_weights
from e2v.runtime.log import get_logger

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs/e2v.yaml"
# modes load_image turns into 8-bit RGB by a fixed rule (media.to_rgb8); I and F guess their scale: a warning
ELEMENT_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "I;16", "I;16B", "I;16L")
FPS_RATIO = 1.5  # fps further than this factor from the dataset median: motion speed differs
# Without the configured tokenizer (offline, not downloaded) prompt length is estimated from words:
# UMT5's sentencepiece gives about 1.3 tokens per English word (more for rare words, digits, CJK).
TOKENS_PER_WORD = 1.3
MAX_CROP = 0.25  # center_crop cutting more than this share of the frame: a warning
THUMB = 96  # contact sheet row height (px)
REPORT = "check_dataset_report.json"  # the report's default name (report_path: in the dataset's folder)


def _frames(path: Path, frames: int) -> np.ndarray:
    """First, middle and last frame of a clip of `frames` frames, uint8 [3,H,W,3]."""
    idx = [0, frames // 2, frames - 1]
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
                          "check_failed", dataset=s.dataset)
        return {"id": s.id, "dataset": s.dataset, "video": str(s.video), "problems": [asdict(problem)]}


def _check_sample(job: tuple) -> dict:
    """Training's own read and rules (e2v/data/preflight.py: what refuses a sample), then the
    validator's warnings and the contact sheet."""
    from e2v.data.preflight import cut_references, fingerprint, read_job, sample_facts, sample_problems

    s, cfg, sheet_dir = job
    cut_error = cut_references(s)  # before the read: it writes the element files
    facts = {**sample_facts(read_job(s, cfg)), "cut_error": cut_error}
    problems = sample_problems(s, facts, cfg) + frame_rate_warnings(s, facts, cfg) + fit_warnings(s, facts, cfg) + \
        mode_warnings(s, facts, cfg)
    out = {"id": s.id, "dataset": s.dataset, "video": str(s.video),
           "cache": {fingerprint(s, cfg): {k: v for k, v in facts.items() if k != "cut_error"}}}  # training's cache
    if "probe" in facts:
        out.update(zip(("frames", "height", "width", "fps"), facts["probe"]))
    if s.bucket is not None:
        out["bucket"] = list(s.bucket)
    if sheet_dir is not None and "probe" in facts:
        contact_sheet(s, facts, cfg, Path(sheet_dir) / f"{s.dataset}_{s.id}.png")
    out["problems"] = [asdict(p) for p in problems]
    return out


def frame_rate_warnings(s: Sample, facts: dict, cfg) -> list[Problem]:
    """A clip whose frames are unevenly spaced (variable frame rate). With data.fps frames are
    taken by time, so a variable rate keeps its motion speed: nothing to warn."""
    from e2v.data.media import MediaError, frame_intervals, variable_rate

    if "probe" not in facts or s.video.suffix == ".npz" or cfg.data.fps is not None:
        return []
    try:
        gaps = frame_intervals(s.video)
    except MediaError as e:
        return [Problem(s.id, str(s.video), str(e), "re-encode the clip", "video_unreadable", "warning")]
    if not variable_rate(gaps):
        return []
    return [Problem(s.id, str(s.video), f"variable frame rate: frames {gaps.min():.3f} to {gaps.max():.3f} s apart, so "
                    "motion speed changes within the clip (frames are taken by index)", "set data.fps (frames by "
                    "time), or re-encode at a constant rate, e.g. ffmpeg -i IN -fps_mode cfr -r 16 OUT",
                    "variable_fps", "warning")]


def fit_warnings(s: Sample, facts: dict, cfg) -> list[Problem]:
    """The usable part of the clip against its bucket: upscaled (a blurry target), or an aspect
    that center_crop cuts heavily."""
    if s.bucket is None:
        return []
    _, h, w = s.bucket
    height, width = facts["height"], facts["width"]
    out = []
    if height < h or width < w:
        out.append(Problem(s.id, str(s.video), f"{width}x{height} is upscaled to its {w}x{h} bucket (blurry target)",
                           "use a larger source, or a smaller data.resolution", "upscaled", "warning"))
    crop = 1 - min(width / height / (w / h), (w / h) / (width / height))
    if cfg.data.video_resize == "center_crop" and crop > MAX_CROP:
        out.append(Problem(s.id, str(s.video), f"aspect {width}x{height} vs target {w}x{h}: center_crop cuts "
                           f"{crop:.0%} of each frame", "add a data.resolution_buckets entry of this aspect", "aspect",
                           "warning"))
    return out


def mode_warnings(s: Sample, facts: dict, cfg) -> list[Problem]:
    """References in a mode whose 8-bit scale the white reading has to guess (I, F); in the
    sequence layout, references that the two readings of data.reference_read read differently
    (media.reading_difference): what SkyReels-V3's pipeline sees (convert) then differs from a
    cut-out on white, or (white) from what training saw."""
    from e2v.data.media import reading_difference

    out = []
    reading = cfg.reference_reading
    for name, e in facts["elements"].items():
        if "size" not in e:
            continue
        path = s.elements[name]
        with Image.open(path) as raw:
            mode = raw.mode
            differs = reading_difference(raw) if cfg.conditioning.target_layout == "sequence" else None
        if reading == "white" and mode not in ELEMENT_MODES:
            out.append(Problem(s.id, str(path), f"element '{name}' has image mode {mode}",
                               "save it as RGB or RGBA PNG", "element_mode", "warning", s.dataset))
        if differs:
            out.append(Problem(s.id, str(path), f"element '{name}' ({mode}): {differs}; read with data.reference_read "
                               f"{reading} ({READ_MEANS[reading]})", "store the reference as 8-bit RGB, or a cut-out "
                               "white under its transparent pixels (tools/prepare_data.py writes them so), and both "
                               "readings agree", "element_reading", "warning", s.dataset))
    return out


READ_MEANS = {"convert": "as SkyReels-V3's pipeline reads it: the model trains on what the convert reading shows",
              "white": "which SkyReels-V3's pipeline does not: its inference sees the convert reading"}


def contact_sheet(s: Sample, facts: dict, cfg, path: Path) -> None:
    """One PNG row: the readable references, then the clip's first, middle and last frame."""
    from e2v.data.media import load_image

    tiles = [_thumb(load_image(s.elements[name], cfg.data.max_image_pixels, cfg.reference_reading))
             for name, e in facts["elements"].items() if "size" in e]
    tiles += [_thumb(Image.fromarray(fr)) for fr in _frames(s.video, facts["probe"][0])]
    gap = np.full((THUMB, 4, 3), 255, np.uint8)
    Image.fromarray(np.concatenate([t for tile in tiles for t in (tile, gap)][:-1], axis=1)).save(path)


def long_prompts(cfg, samples: list[Sample]) -> list[Problem]:
    """Prompts over the text encoder's TEXT_LEN tokens (encode_text cuts the rest off), counted
    with the configured tokenizer, or estimated from words when it cannot be loaded offline."""
    from e2v.models.load import load_tokenizer  # diffusers and transformers: only when there are prompts to count

    error, _ = missing_weights(cfg) if samples else (None, [])  # the tokenizer is model.pretrained's
    if error:
        get_logger("e2v.data").info(f"note: weights: {error}; prompt lengths are estimated "
                                    f"({TOKENS_PER_WORD} tokens per word)")
    tokenizer = load_tokenizer(cfg) if samples and not error else None
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
    from e2v.data.buckets import bucket_counts, bucket_name, bucket_table, with_repeats

    problems = long_prompts(cfg, samples)
    by_prompt: dict[tuple, list[Sample]] = {}
    for s in samples:
        if s.prompt.strip():
            by_prompt.setdefault((s.dataset, s.prompt.strip().lower()), []).append(s)
    for group in by_prompt.values():  # one warning per shared caption: clips cut from one video share theirs
        if len(group) > 1:
            ids = ", ".join(s.id for s in group[:3]) + (", ..." if len(group) > 3 else "")
            problems.append(Problem(group[1].id, group[1].prompt_source, f"duplicate caption: {len(group)} samples "
                                    f"share it ({ids})", "describe what differs between the clips",
                                    "duplicate_caption", "warning"))
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


def report_path(cfg) -> Path:
    """Where the report goes by default: beside the data it describes (the first dataset's folder,
    as tools/prepare_data.py keeps its own outputs there), not wherever the command was started."""
    root = Path(cfg.data.datasets[0].data_root) if cfg.data.datasets else Path(".")
    return (root if root.is_dir() else Path(".")) / REPORT


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
    p.add_argument("--report", "--json", dest="report", default=None, metavar="PATH",
                   help=f"the JSON report (default: {REPORT} in the first dataset's folder, the data_root it "
                        "describes; the working directory when that folder does not exist)")
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
    from e2v.data.elements import discover, orphan_files
    from e2v.data.preflight import map_samples, missing_optional, store_facts, summarize, unusable
    from e2v.eval.validation import hold_out_problem

    t0 = time.perf_counter()
    samples, problems = [], []
    refused: list[Problem] = []  # the samples discovery refused (a missing required reference, a clip not found)
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
        refused += [q for q in probs if q.severity == "error"]
        if ds.dataset_type == "e2v":
            problems += [Problem("-", str(f), "orphan file: belongs to no sample id", "rename it to ID<suffix> of an "
                                 "existing video, or remove it", "orphan_file", "warning", i)
                         for f in orphan_files(ds, cfg.data.elements) if f.name not in (*PREPARE_FILES, REPORT)]
        else:
            seen: dict[Path, str] = {}
            for s in found:
                if s.video in seen:
                    # it trains twice per epoch, nothing fails: a warning
                    problems.append(Problem(s.id, s.prompt_source, f"duplicate: the same video as {seen[s.video]}",
                                            "remove the repeated row (use data.datasets[].repeat)", "duplicate_id",
                                            "warning", i))
                seen.setdefault(s.video, s.id)
    if args.contact_sheet:
        Path(args.contact_sheet).mkdir(parents=True, exist_ok=True)
    results = list(map_samples(check_sample, [(s, cfg, args.contact_sheet) for s in samples], args.workers))
    checked = [Problem(**d) for r in results for d in r["problems"]]
    problems += checked + missing_optional(samples, cfg)  # the optional-reference warning training prints
    store_facts(cfg, samples, {k: v for r in results for k, v in r.get("cache", {}).items()})  # pre-fills training's check
    cross, table = dataset_problems(cfg, samples, results, args.world_size)
    problems += cross
    dt = time.perf_counter() - t0

    errors = [q for q in problems if q.severity == "error"]
    # every sample the data names: those found and those discovery refused; unusable: with an error
    # of its own (training's count: preflight.unusable), each once however many problems it has
    sample_errors = refused + [q for q in checked if q.severity == "error"]
    named = dict.fromkeys([(s.dataset, s.id) for s in samples] + [(q.dataset, q.sample) for q in refused])
    bad = unusable(sample_errors)
    rate = len(samples) / max(dt, 1e-9)
    summary = {"samples": len(named), "samples_ok": len(named) - len(bad), "unusable": len(bad),
               "sample_errors": len(sample_errors),
               "errors": len(errors), "warnings": len(problems) - len(errors), "seconds": round(dt, 3),
               "samples_per_s": round(rate, 1), "workers": args.workers, "world_size": args.world_size,
               "by_kind": dict(Counter(q.kind for q in problems))}
    held_out = hold_out_problem(cfg, summary["samples_ok"]) if summary["samples_ok"] else None
    if held_out:  # training would stop at its start (split_held_out): an error here too
        problems.append(Problem("-", "config", *held_out, "held_out_all", "error"))
        errors.append(problems[-1])
        summary["errors"] += 1
        summary["by_kind"]["held_out_all"] = 1
    print(f"{'datasets':<16} {', '.join(d.data_root for d in cfg.data.datasets)}")
    whole = summary["errors"] - summary["sample_errors"]
    lines = {"samples": f"{summary['samples']} = {summary['samples_ok']} ok + {summary['unusable']} unusable",
             "samples_ok": f"{summary['samples_ok']}",
             "unusable": f"{summary['unusable']} (samples with an error, each counted once; their "
                         f"{summary['sample_errors']} error(s) listed below)",
             "errors": f"{summary['errors']}" + (f" ({summary['sample_errors']} on samples, {whole} on the set as a "
                                                 "whole)" if whole else ""),
             "warnings": f"{summary['warnings']}"}
    for k, line in lines.items():
        print(f"{k:<16} {line}")
    held = min(cfg.validation.num_samples, summary["samples_ok"]) if cfg.validation.every_n_steps > 0 else 0
    if held and not held_out:  # training holds these out (split_held_out): its "N training samples" is samples_ok - held
        print(f"{'held out':<16} {held} of the samples_ok, for validation (validation.num_samples): training "
              f"trains on {summary['samples_ok'] - held}")
    print(f"{'speed':<16} {rate:.1f} samples/s ({args.workers} workers, {dt:.2f} s)")
    print(f"buckets (micro_batch_size {cfg.train.micro_batch_size} x world {args.world_size}):\n{table}")
    for line in summarize([q for q in problems if q.severity == "error"], first=10**9) + \
            summarize([q for q in problems if q.severity != "error"]):  # errors in full, a warning kind met often counted
        print(line)
    report = {"summary": summary, "problems": [asdict(q) for q in problems],
              "samples": [{k: v for k, v in r.items() if k != "problems"} for r in results]}
    path = Path(args.report) if args.report else report_path(cfg)
    try:
        path.write_text(json.dumps(report, indent=2))
    except OSError as e:  # a read-only dataset folder: the check's verdict above still stands
        print(f"report not written: {e}; give --report PATH", file=sys.stderr)
    else:
        print(f"report: {path}" + (f"; contact sheets: {args.contact_sheet}" if args.contact_sheet else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
