"""The data check before the first step: every sample's files opened once, in parallel, so a bad
clip, caption or reference stops (or leaves) the run at start instead of hours in.

Per sample: the clip is opened and decoded at its first and last frame (a truncated mp4 keeps a
header that claims every frame; only decoding the tail finds it), its usable frame count is
known (media.supported_frames: at data.fps when set), the caption is read (discovery reads it; an
empty one is a problem here), and every element file is opened and decoded (media.load_image, the
loader's own reader). Training (dataset.index_samples), `--dry_run` and tools/check_dataset.py all
call `sample_facts` / `check_samples`: one home for what makes a sample usable.

Facts are cached by file fingerprint (path, size, mtime of the clip and of each element file, plus
the settings that change them: data.fps, data.max_image_pixels), so a restart re-reads only what
changed. The cache is one JSON file per data root under $E2V_CACHE_DIR (default ~/.cache/e2v),
written atomically by rank 0; it holds facts about files, never anything that is executed.

Only rank 0 opens files; the facts are broadcast, so every rank decides the same samples bad and
a run with bad data stops on every rank together.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from e2v.config.schema import Config
from e2v.data.media import (MediaError, TooShortError, WindowError, clip_window, load_image, probe_video,
                            supported_frames)
from e2v.data.buckets import choose_bucket
from e2v.data.sample import Problem, Sample, element_paths

CACHE_VERSION = 1
FIX_VIDEO = "re-encode or replace the clip, or remove the sample"
SMALL_REFERENCE = 4  # a reference whose longer side is under 1/4 of the target's: a warning


def cache_dir() -> Path:
    return Path(os.environ.get("E2V_CACHE_DIR", Path.home() / ".cache" / "e2v")) / "data_check"


def _stat(path: Path) -> list:
    try:
        st = path.stat()
        return [str(path), st.st_size, st.st_mtime_ns]
    except OSError:
        return [str(path), None, None]


def fingerprint(s: Sample, cfg: Config) -> str:
    """Everything the facts depend on: the files (path, size, mtime) and the settings that read them."""
    parts = [CACHE_VERSION, _stat(Path(s.video)), cfg.data.fps, cfg.data.max_image_pixels, s.frame_range, s.crop,
             sorted((name, _stat(Path(p))) for name, p in s.elements.items())]
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()


def quiet_decoder() -> None:
    """Silence ffmpeg's own lines (decord's log level): they repeat what the problem line says,
    before it, and once per frame for a damaged stream."""
    try:
        import decord

        decord.logging.set_level(decord.logging.QUIET)
    except Exception:  # decord missing or older: nothing to silence
        pass


def quiet_worker() -> None:
    """A worker process's stderr goes nowhere: decord's own C++ log lines ("ERROR opening ...")
    ignore its log level. Nothing is lost: every failure comes back as the sample's problem."""
    quiet_decoder()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def sample_facts(job: tuple) -> dict:
    """(video path, {element: path}, data.fps, max_image_pixels, frame range, crop box) -> the facts
    of one sample's files: frames (usable at fps, within the sample's frame range), height, width
    (of its crop), fps, video_error or window_error, and per element its size or its error. Runs in
    a worker; never raises (an unforeseen failure is the sample's error)."""
    video, elements, fps, max_pixels, frame_range, crop = job
    out: dict = {"video_error": None, "window_error": None, "elements": {}}
    try:
        info = probe_video(video)
        if Path(video).suffix != ".npz":  # npz: the header was read; its frames load whole
            _decode_last(video, info.frames)
        _, height, width = clip_window(video, info.frames, info.height, info.width, frame_range, crop)
        out.update(frames=supported_frames(video, info.frames, fps, frame_range), height=height, width=width,
                   fps=info.fps)
    except WindowError as e:  # the source's frame range or crop box does not fit the clip
        out["window_error"] = [str(e).replace(f"{video}: ", ""), e.kind]
    except Exception as e:  # decord raises its own types on damaged streams
        text = (str(e).splitlines() or [type(e).__name__])[0][:300].replace(f"{video}: ", "").replace(f" {video}", "")
        out["video_error"] = text if "truncated" in text else f"cannot open the clip (truncated, damaged or not a video: {text})"
    for name, path in elements.items():
        try:
            img = load_image(path, max_pixels)
            out["elements"][name] = {"size": list(img.size)}
        except Exception as e:
            out["elements"][name] = {"error": str(e).replace(f"{path}: ", "")[:300]}
    return out


def _decode_last(video: str, frames: int) -> None:
    import decord

    vr = decord.VideoReader(str(video), ctx=decord.cpu(0), num_threads=1)
    try:
        vr[len(vr) - 1].asnumpy()
    except Exception as e:
        raise MediaError(f"cannot decode its last frame ({len(vr)} announced): the file is truncated or damaged "
                         f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from e


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, facts: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the check still ran, only the restart is slower
        print(f"[e2v data] note: data check cache not written ({e})", file=sys.stderr)


def _pool(workers: int, n: int):
    """Worker processes (forked: nothing to import again) unless CUDA is already up in this
    process (a forked child must not touch it), then threads (decord and Pillow release the GIL
    while decoding)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ThreadPoolExecutor(workers, initializer=quiet_decoder)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=quiet_worker)


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def collect_facts(cfg: Config, samples: list[Sample], *, workers: int | None = None, progress: bool = True,
                  cache: bool = True) -> dict[str, dict]:
    """fingerprint -> facts for every distinct sample, from the cache where the files are unchanged,
    else read now (in parallel, with a progress bar). The cache is one file per data root."""
    workers = default_workers() if workers is None else workers
    unique = list({id(s): s for s in samples}.values())
    for s in unique:  # references a source cuts on first use (OpenS2V) are written now, then read like files
        if getattr(s, "make_elements", None) is not None:
            try:
                element_paths(s)
            except Exception:  # noqa: BLE001 - the missing file is then the sample's problem, named below
                pass
    keys = {fingerprint(s, cfg): s for s in unique}
    roots = sorted({str(Path(cfg.data.datasets[s.dataset].data_root).resolve()) for s in samples})
    path = cache_dir() / f"{hashlib.sha1('|'.join(roots).encode()).hexdigest()[:16]}.json"
    stored = _load_cache(path) if cache else {}
    facts = {k: stored[k] for k in keys if k in stored}
    todo = [k for k in keys if k not in facts]
    if todo:
        from tqdm import tqdm

        jobs = [(str(keys[k].video), {n: str(p) for n, p in keys[k].elements.items()}, cfg.data.fps,
                 cfg.data.max_image_pixels, keys[k].frame_range, keys[k].crop) for k in todo]
        bar = tqdm(total=len(todo), desc=f"checking data ({len(facts)} cached)", disable=not progress,
                   mininterval=1 if sys.stderr.isatty() else 30, dynamic_ncols=True)
        if workers > 1 and len(todo) > 1:
            with _pool(workers, len(todo)) as pool:
                chunk = max(1, min(16, len(todo) // (4 * workers)))
                for k, f in zip(todo, pool.map(sample_facts, jobs, chunksize=chunk)):
                    facts[k] = f
                    bar.update(1)
        else:
            quiet_decoder()
            for k, job in zip(todo, jobs):
                facts[k] = sample_facts(job)
                bar.update(1)
        bar.close()
        if cache:
            _save_cache(path, {**{k: v for k, v in stored.items() if k not in keys}, **facts})
    return facts


def sample_problems(s: Sample, f: dict, cfg: Config) -> list[Problem]:
    """The problems of one sample given its facts: errors (the sample would fail training) and
    warnings (it trains, maybe badly). The bucket is set on the sample when the clip is usable."""
    out = []
    if not s.prompt.strip():
        out.append(Problem(s.id, s.prompt_source or str(s.video), "empty caption",
                           "write the prompt (one line of text)", "empty_caption"))
    if f["video_error"] is not None:
        out.append(Problem(s.id, str(s.video), f["video_error"], FIX_VIDEO, "video_unreadable"))
    elif f.get("window_error") is not None:
        text, kind = f["window_error"]
        out.append(Problem(s.id, str(s.video), text, "fix the sample's frame range / crop box in its metadata, or "
                           "remove the sample", kind))
    else:
        try:
            s.bucket = choose_bucket(f["frames"], f["height"], f["width"], cfg)
        except TooShortError as e:
            out.append(Problem(s.id, str(s.video), str(e), "use a longer clip, or lower data.num_frames / allow "
                               "shorter data.frame_buckets", "too_short"))
    th, tw = cfg.data.resolution
    for name, e in f["elements"].items():
        path = s.elements[name]
        if "error" in e:
            out.append(Problem(s.id, str(path), f"element '{name}' unreadable ({e['error']})",
                               "replace the image (PNG or JPEG, RGB or RGBA)", "element_unreadable"))
        elif max(e["size"]) * SMALL_REFERENCE < max(th, tw):
            out.append(Problem(s.id, str(path), f"element '{name}' is {e['size'][0]}x{e['size'][1]}, tiny against "
                               f"the {tw}x{th} target", "use a larger reference image", "element_small", "warning"))
    return out


def missing_optional(samples: list[Sample], cfg: Config) -> list[Problem]:
    """One warning per sample without an optional element: it trains with fewer references."""
    if cfg.e2v_type == "none":
        return []
    out = []
    for s in {id(s): s for s in samples}.values():
        for el in cfg.data.elements:
            if not el.required and el.name not in s.elements:
                out.append(Problem(s.id, str(s.video), f"no '{el.name}' reference (optional)",
                                   f"add {s.id}{el.suffixes[0]} if the clip has one", "element_absent", "warning"))
    return out


def check_samples(cfg: Config, samples: list[Sample], *, workers: int | None = None,
                  progress: bool = True) -> list[Problem]:
    """Every problem of these samples (errors and warnings), buckets set on the usable ones.
    Rank 0 reads the files (collect_facts); the facts are broadcast, so every rank agrees."""
    from e2v.runtime import distributed

    rank = distributed.this_rank()
    unique = list({id(s): s for s in samples}.values())  # the same list on every rank (same discovery)
    facts = None
    if rank == 0:  # by position, not by fingerprint: another node's file stats may differ
        by_key = collect_facts(cfg, samples, workers=workers, progress=progress)
        facts = [by_key[fingerprint(s, cfg)] for s in unique]
    facts = distributed.broadcast(facts, rank)
    out = []
    for s, f in zip(unique, facts):
        out += sample_problems(s, f, cfg)
    return out + missing_optional(samples, cfg)


def summarize(problems: list[Problem], first: int = 3) -> list[str]:
    """Lines for people: a kind met once or a few times is listed in full, a kind met more often is
    counted with its first `first` files (the full list goes to a report, not the terminal)."""
    by_kind: dict[str, list[Problem]] = defaultdict(list)
    for p in problems:
        by_kind[p.kind].append(p)
    lines = []
    for kind, group in by_kind.items():
        if len(group) <= first + 1:
            lines += [f"{p.severity.upper():<7} {p.kind:<18} {p.file}: {p.problem} -> {p.fix}" for p in group]
        else:
            shown = "; ".join(f"{p.file}: {p.problem}" for p in group[:first])
            lines.append(f"{group[0].severity.upper():<7} {kind:<18} {len(group)} samples, e.g. {shown}; ... "
                         f"-> {group[0].fix}")
    return lines
