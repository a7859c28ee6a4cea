"""The data check before the first step: every sample's files opened once, in parallel, so a bad
clip, caption or reference stops (or leaves) the run at start instead of hours in. The one home of
the rules that decide whether a sample can train: training (dataset.index_samples), `--dry_run`
and tools/check_dataset.py (which adds warnings of its own) all read a sample with `sample_facts`
and judge it with `sample_problems`.

Per sample: the references a source cuts on first use are cut (`cut_references`); the clip is
opened and decoded at its first and last frame (a truncated mp4 keeps a header that claims every
frame; only decoding the tail finds it), its valid frame range and crop box are checked against it
and its usable frame count is known (media.supported_frames: at data.fps when set); the caption is
read (discovery reads it; an empty one is a problem here); and every element file is opened and
decoded (media.load_image, the loader's own reader, by the run's reading rule).

Facts are cached by file fingerprint (path, size, mtime of the clip and of each element file, plus
the settings that change them: data.fps, data.max_image_pixels, the reading rule), so a restart
re-reads only what changed. The cache is one JSON file per data root under $E2V_CACHE_DIR (default
~/.cache/e2v), written atomically by rank 0; it holds facts about files, never anything that is
executed.

The count of a check is one rule (`unusable`): a sample with at least one error is one unusable
sample, however many problems it has (each is listed), whether discovery refused it (a missing
required reference, a CSV line whose clip is not found) or its files did; the start-up message,
the dry run, the end-of-run line and tools/check_dataset.py's summary all count with it.

The check is spread over the ranks (`facts_over_ranks`): rank 0 looks the samples up in its cache,
each rank reads its share of the rest, the facts are gathered and rank 0's full list is broadcast,
so every rank decides the same samples bad (the same answer as one rank's check) and a run with bad
data stops on every rank together. The gather waits in a group of its own whose timeout is sized to
the shard (DeepSpeed's default group gives up after 10 minutes); a set whose check would take long
is told to fill the cache beforehand with tools/check_dataset.py.

Length (about 480 lines): one concern, the per-sample rules and the parallel pass that applies
them; the rules are what training, the dry run and the validator must share, so they stay together.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from e2v.config.schema import Config
from e2v.data.buckets import choose_bucket
from e2v.data.media import (
    DegenerateImageError,
    ImageTooLargeError,
    MediaError,
    NoClockError,
    TooShortError,
    VideoNotFoundError,
    WindowError,
    clip_window,
    fit_size,
    load_image,
    probe_video,
    supported_frames,
)
from e2v.data.sample import Problem, Sample, element_paths
from e2v.runtime.log import get_logger

log = get_logger("e2v.data")

CACHE_VERSION = 3  # 3: the reading rule joined the fingerprint
SMALL_REFERENCE = 4  # a reference whose longer side is under 1/4 of the target's: a warning
WINDOW_KINDS = ("frame_range_outside_video", "crop_outside_video")  # media.WindowError's kinds
FIXES = {  # problem kind -> what the user does about it (a problem whose error names its own fix: that one)
    "empty_caption": "write the prompt (one line of text)",
    "video_unreadable": "re-encode or replace the clip, or remove the sample",
    "video_missing": "add the clip, or fix the path that names it (or remove the sample)",
    **dict.fromkeys(WINDOW_KINDS, "fix the entry's frame range / crop box in its metadata, or remove the entry"),
    "too_short": "use a longer clip, or lower data.num_frames / allow shorter data.frame_buckets",
    "reference_unbuildable": "fix the entry's masks / crop box, or remove the entry",
    "element_unreadable": "replace the image (PNG or JPEG, RGB or RGBA)",
    "element_not_found": "add the image, or fix the path that names it",
}


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
    parts = [CACHE_VERSION, _stat(Path(s.video)), cfg.data.fps, cfg.data.max_image_pixels, cfg.reference_reading,
             s.frame_range, s.crop, sorted((name, _stat(Path(p))) for name, p in s.elements.items())]
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


def cut_references(s: Sample) -> str | None:
    """Write the references a source cuts from its clips on first use (OpenS2V: element_paths),
    before anything reads or fingerprints them; why they cannot be cut, or None."""
    if getattr(s, "make_elements", None) is None:
        return None
    try:
        element_paths(s)
    except Exception as e:  # noqa: BLE001 - a mask or crop that does not fit: the sample's problem
        return str(e)[:300]
    return None


def read_job(s: Sample, cfg: Config) -> tuple:
    """What sample_facts reads for one sample (plain values: it goes to a worker process)."""
    return (str(s.video), {n: str(p) for n, p in s.elements.items()}, cfg.data.fps, cfg.data.max_image_pixels,
            cfg.reference_reading, s.frame_range, s.crop)


def _error(problem: str, kind: str, fix: str | None = None) -> dict:
    return {"problem": problem, "kind": kind, "fix": fix or FIXES[kind]}


def _unpathed(e: Exception, path) -> str:
    """An error's first line without the file's path (the problem line names the file)."""
    return (str(e).splitlines() or [type(e).__name__])[0][:300].replace(f" {path}", "").replace(f"{path}: ", "")


def _error_naming_its_fix(e: Exception, path, kind: str, what: str = "") -> dict:
    """An error whose message names its own fix ("PATH: problem; fix")."""
    problem, fix = str(e).replace(f"{path}: ", "").split("; ", 1)
    return _error(what + problem, kind, fix)


def sample_facts(job: tuple) -> dict:
    """read_job's tuple -> the facts of one sample's files: the clip as probed when it decodes at
    both ends (probe: frames, height, width, fps), what of it the sample may use (frames: usable
    at fps within its frame range; height, width: of its crop box), video_error, and per element
    its size or its error. Runs in a worker; never raises (an unforeseen failure is the sample's
    error)."""
    video, elements, fps, max_pixels, read, frame_range, crop = job
    out: dict = {"video_error": None, "elements": {}}
    try:
        info = probe_video(video)
        if Path(video).suffix != ".npz":  # npz: the header was read; its frames load whole
            _decode_last(video)
        out["probe"] = [info.frames, info.height, info.width, info.fps]  # the clip decodes at both ends
        _, height, width = clip_window(video, info.frames, info.height, info.width, frame_range, crop)
        out.update(frames=supported_frames(video, info.frames, fps, frame_range), height=height, width=width,
                   fps=info.fps)
    except WindowError as e:  # the source's frame range or crop box does not fit the clip
        out["video_error"] = _error(_unpathed(e, video), e.kind)
    except VideoNotFoundError:  # listed, then gone (CSV / JSONL rows are named with their line at discovery)
        out["video_error"] = _error("not found", "video_missing")
    except NoClockError as e:  # data.fps asks an .npz clip for timestamps it does not have
        out["video_error"] = _error_naming_its_fix(e, video, "no_clock")
    except MediaError as e:  # ours: it says what is wrong (damaged, truncated, a decord width bug, ...)
        out["video_error"] = _error(_unpathed(e, video), "video_unreadable")
    except Exception as e:  # decord raises its own types on damaged streams
        out["video_error"] = _error(f"cannot open the clip (truncated, damaged or not a video: {_unpathed(e, video)})",
                                    "video_unreadable")
    for name, path in elements.items():
        out["elements"][name] = _element_facts(name, path, max_pixels, read)
    return out


def _element_facts(name: str, path: str, max_pixels: int, read: str) -> dict:
    """{"size": [w, h]} of a reference the loader can read, else {"error": ..., "absent": ...}."""
    if not Path(path).exists():
        return {"error": _error(f"element '{name}' not found", "element_not_found"), "absent": True}
    try:
        return {"size": list(load_image(path, max_pixels, read).size)}
    except ImageTooLargeError as e:
        return {"error": _error_naming_its_fix(e, path, "element_too_large", f"element '{name}' "), "absent": False}
    except Exception as e:  # noqa: BLE001 - PIL raises many types; the file is named either way
        return {"error": _error(f"element '{name}' unreadable ({_unpathed(e, path)})", "element_unreadable"),
                "absent": False}


def _decode_last(video: str) -> None:
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
        log.warning(f"note: data check cache not written ({e})")


def _pool(workers: int):
    """Worker processes (forked: nothing to import again) unless CUDA is already up in this
    process (a forked child must not touch it), then threads (decord and Pillow release the GIL
    while decoding)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ThreadPoolExecutor(workers, initializer=quiet_decoder)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=quiet_worker)


def map_samples(fn, jobs: list, workers: int):
    """fn(job) for every job, yielded in order as they finish, in `workers` parallel workers (in
    this process when one is enough); decoder log lines silenced (every failure is a sample's
    problem instead). Consume it to the end: the pool closes then."""
    if workers > 1 and len(jobs) > 1:
        with _pool(workers) as pool:
            # The workers fork when map submits the jobs. Frozen, what this process holds (its
            # unreachable cycles included) is not theirs to collect: a forked child that runs the
            # finaliser of a parent's object (a process group, a C++ handle) can abort. Unfrozen
            # after, unless something had frozen objects before (unfreeze would thaw those too).
            thaw = gc.get_freeze_count() == 0
            gc.freeze()
            try:
                results = pool.map(fn, jobs, chunksize=max(1, min(16, len(jobs) // (4 * workers))))
            finally:
                if thaw:
                    gc.unfreeze()
            yield from results
    else:
        quiet_decoder()
        yield from map(fn, jobs)


def default_workers() -> int:
    """Worker processes per rank: the node's cores shared by its ranks (LOCAL_WORLD_SIZE, set by
    the launchers), at most 8."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, (os.cpu_count() or 1) // local))


def sample_problems(s: Sample, f: dict, cfg: Config) -> list[Problem]:
    """The problems of one sample given its facts (sample_facts plus `cut_error`): errors (the
    sample would fail training) and warnings (it trains, maybe badly). The bucket is set on the
    sample when the clip is usable."""
    out = []

    def add(file, e: dict, severity: str = "error"):
        out.append(Problem(s.id, str(file), e["problem"], e["fix"], e["kind"], severity, s.dataset))

    if not s.prompt.strip():
        add(s.prompt_source or s.video, _error("empty caption", "empty_caption"))
    video_error = f["video_error"]
    if video_error is not None:
        add(s.video, video_error)
    else:
        try:
            s.bucket = choose_bucket(f["frames"], f["height"], f["width"], cfg)
        except TooShortError as e:
            add(s.video, _error(str(e), "too_short"))
    outside = video_error is not None and video_error["kind"] in WINDOW_KINDS  # the cut fails for that reason
    if f["cut_error"] is not None and not outside:
        add(s.video, _error(f"references cannot be cut: {f['cut_error']}", "reference_unbuildable"))
    th, tw = cfg.data.resolution
    for name, e in f["elements"].items():
        if "error" in e:
            if not (e["absent"] and s.make_elements is not None):  # a reference never cut: named above
                add(s.elements[name], e["error"])
            continue
        degenerate = _degenerate(name, e["size"], s.bucket or (cfg.data.num_frames, th, tw), cfg)
        if degenerate is not None:
            add(s.elements[name], degenerate)
        elif max(e["size"]) * SMALL_REFERENCE < max(th, tw):
            add(s.elements[name], _error(f"element '{name}' is {e['size'][0]}x{e['size'][1]}, tiny against the "
                                         f"{tw}x{th} target", "element_small", "use a larger reference image"),
                "warning")
    return out


def _degenerate(name: str, size: list[int], bucket: tuple[int, int, int], cfg: Config) -> dict | None:
    """The error of a reference that a pathway fitting it inside its size (fit_pad_white, V3's
    loader) would shrink to 0 px on one side, else None: element_inputs would raise it mid-run."""
    el = next((el for el in cfg.data.elements if el.name == name), None)
    if el is None or cfg.e2v_type == "none":
        return None
    sizes = ([(cfg.vae_preprocess(el), bucket[1:])] if el.vae is not None else []) + \
        ([(cfg.clip_preprocess(el), cfg.processors.clip.resolution)] if el.clip is not None else [])
    for mode, (height, width) in sizes:
        if mode == "fit_pad_white":
            try:
                fit_size(*size, height, width)
            except DegenerateImageError as e:
                problem, fix = str(e).split("; ", 1)
                return _error(f"element '{name}' is {problem}", "element_degenerate", fix)
    return None


def missing_optional(samples: list[Sample], cfg: Config) -> list[Problem]:
    """One warning per sample without an optional element: it trains with fewer references."""
    if cfg.e2v_type == "none":
        return []
    out = []
    for s in {id(s): s for s in samples}.values():
        for el in cfg.data.elements:
            if not el.required and el.name not in s.elements:
                out.append(Problem(s.id, str(s.video), f"no '{el.name}' reference (optional)",
                                   f"add {s.id}{el.suffixes[0]} if the clip has one", "element_absent", "warning",
                                   s.dataset))
    return out


def check_samples(cfg: Config, samples: list[Sample], *, workers: int | None = None,
                  progress: bool = True) -> list[Problem]:
    """Every problem of these samples (errors and warnings), buckets set on the usable ones.
    The ranks share the reading (facts_over_ranks); rank 0's facts are broadcast, so every rank agrees."""
    unique = list({id(s): s for s in samples}.values())  # the same list on every rank (same discovery)
    facts = facts_over_ranks(cfg, unique, workers=workers, progress=progress)
    out = []
    for s, f in zip(unique, facts):
        out += sample_problems(s, f, cfg)
    return out + missing_optional(samples, cfg)


def unusable(problems: list[Problem]) -> list[tuple[int, str]]:
    """The samples these problems leave out, (dataset, sample id), each once in the order first
    named: a sample with several errors is one unusable sample (every error still listed). The
    one count of the start-up check, the dry run, the end-of-run line and tools/check_dataset.py;
    pass per-sample problems (a small bucket or a config error is no sample)."""
    return list(dict.fromkeys((p.dataset, p.sample) for p in problems if p.severity == "error"))


# --- the check spread over the ranks ----------------------------------------------------------------

# A generous cost of one sample's read on one worker: a 64x64 demo clip takes a small fraction of
# it (bench/RESULTS.md, section 8); a 480p clip decodes its tail from the last keyframe and its
# references at full size, so several times that, and the timeout adds 4x on top.
CHECK_S_PER_SAMPLE = 2.0
LONG_CHECK_S = 600  # a check expected to take longer is told to pre-fill the cache (tools/check_dataset.py)
MIN_TIMEOUT_S = 1800  # the gather's group never waits less than this


def _cache_path(cfg: Config, samples: list[Sample]) -> Path:
    roots = sorted({str(Path(cfg.data.datasets[s.dataset].data_root).resolve()) for s in samples})
    return cache_dir() / f"{hashlib.sha1('|'.join(roots).encode()).hexdigest()[:16]}.json"


def check_seconds(todo: int, world: int, workers: int) -> float:
    """The expected wall time of reading `todo` samples over `world` ranks of `workers` each."""
    return CHECK_S_PER_SAMPLE * -(-todo // max(1, world)) / max(1, workers)


def gather_timeout_s(todo: int, world: int, workers: int) -> float:
    """How long the gather waits for the slowest rank: four times the expected check, never under
    MIN_TIMEOUT_S (a slow disk or a rank with the heavy clips must not turn into a timeout)."""
    return max(MIN_TIMEOUT_S, 4 * check_seconds(todo, world, workers))


def long_check_note(todo: int, cached: int, world: int, workers: int) -> str | None:
    """The line rank 0 prints before a check expected to take over LONG_CHECK_S, or None."""
    expected = check_seconds(todo, world, workers)
    if expected <= LONG_CHECK_S:
        return None
    return (f"checking {todo} samples ({cached} cached) over {world} rank(s) x {workers} worker(s): "
            f"~{expected / 60:.0f} min before step 1 (the ranks wait up to "
            f"{gather_timeout_s(todo, world, workers) / 60:.0f} min for it). On a set this large, fill the "
            f"check's cache once beforehand: `python tools/check_dataset.py --config <this run's config>` on "
            f"rank 0's node (or with E2V_CACHE_DIR={cache_dir().parent} on a disk every node sees); training "
            "then re-reads only the files that changed")


def store_facts(cfg: Config, samples: list[Sample], facts_by_key: dict[str, dict]) -> None:
    """Add facts read elsewhere (tools/check_dataset.py: fingerprint -> sample_facts) to the cache
    training reads, so a huge set's start-up check finds them there."""
    if samples and facts_by_key:
        path = _cache_path(cfg, samples)
        _save_cache(path, {**_load_cache(path), **facts_by_key})


def facts_over_ranks(cfg: Config, unique: list[Sample], *, workers: int | None = None,
                     progress: bool = True) -> list[dict]:
    """sample_facts plus `cut_error` for every sample of `unique` (the same list on every rank), by
    position, the reading spread over the ranks. A collective: every rank calls it. Rank 0's cache
    answers what it holds (by rank 0's fingerprints: another node's file stats may differ); each
    rank reads every world-th of the rest; rank 0 stores and broadcasts the whole. Every exchange
    runs in one gloo group whose timeout is sized to a check of the whole set (rank 0's stat of
    every file, the slowest shard), not in the default group, which gives up after 10 minutes."""
    import torch

    from e2v.runtime import distributed

    rank = distributed.this_rank()
    world = torch.distributed.get_world_size() if distributed.is_distributed() else 1
    workers = default_workers() if workers is None else workers
    share = distributed.TimedGroup(gather_timeout_s(len(unique), world, workers))
    positions = list(range(len(unique)))
    # the references a source cuts: before anything fingerprints the files they write
    cut = {}
    for part in share.gather({i: cut_references(unique[i]) for i in positions[rank::world]}):
        cut.update(part)
    plan = None
    if rank == 0:
        path = _cache_path(cfg, unique) if unique else None
        keys = [fingerprint(s, cfg) for s in unique]
        stored = _load_cache(path) if path else {}
        todo = [i for i, k in enumerate(keys) if k not in stored]
        plan = {"todo": todo, "cached": len(unique) - len(todo)}
        note = long_check_note(len(todo), plan["cached"], world, workers)
        if note:
            log.info(note)
    plan = share.broadcast(plan)
    todo = plan["todo"]
    mine = todo[rank::world]
    t0 = time.monotonic()
    read = {}
    if mine:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc=f"checking data ({plan['cached']} cached, {world} rank(s))",
                   disable=not (progress and rank == 0), mininterval=1 if sys.stderr.isatty() else 30,
                   dynamic_ncols=True)
        for i, f in zip(mine, map_samples(sample_facts, [read_job(unique[i], cfg) for i in mine], workers)):
            read[i] = f
            bar.update(1)
        bar.close()
    parts = share.gather((read, time.monotonic() - t0))
    facts = None
    if rank == 0:
        for part, _ in parts:
            read.update(part)
        if todo:
            _save_cache(path, {**stored, **{keys[i]: read[i] for i in todo}})
            if progress:
                log.info(f"checked {len(todo)} sample(s) over {world} rank(s) in "
                         f"{max(s for _, s in parts):.0f} s ({plan['cached']} cached)")
        facts = [{**(read[i] if i in read else stored[keys[i]]), "cut_error": cut[i]} for i in positions]
    facts = share.broadcast(facts)
    share.close()
    return facts


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
