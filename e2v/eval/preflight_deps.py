"""What the later phases of a run need from this machine, checked before the first weight is read.

A run that validates writes mp4s minutes or hours in, on rank 0 only; a missing writer there used
to crash rank 0 alone while the other ranks waited in the next collective. Each check below runs
the thing the later phase runs (the mp4 writer writes a two-frame clip, the tokenizer loads, each
rank writes a file in the folders it will write), on every rank, and the ranks compare notes
(`distributed.gather_all`): one rank's problem stops every rank, each with the same line naming
the rank(s), the problem and the fix.

Checked: the mp4 writer (validation videos, `visualization` processors with `video: true`), the
prompt tokenizer (a run that encodes prompts at run time: no cache, or validation prompts the
cache does not hold), that the run folder (and the visualization folder) can be written, and on
rank 0 (the one that logs) the wandb package when `train.log_to` names Weights & Biases.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from e2v.eval.validation import reads_cache
from e2v.runtime import distributed

FFMPEG_FIX = "pip install imageio imageio-ffmpeg (the wheel ships its own ffmpeg with libx264)"


def writes_mp4(cfg) -> bool:
    """Whether the run writes mp4s: validation with videos to generate, or a visualization
    processor that writes videos."""
    v = cfg.validation
    videos = v.every_n_steps > 0 and (bool(v.sets) or (v.num_samples > 0 and v.num_videos > 0))
    vis = cfg.visualization
    return videos or (vis.enabled and any(getattr(p, "video", False) for p in vis.processors))


def encodes_prompts(cfg) -> bool:
    """Whether the run needs the prompt tokenizer at run time: it encodes online, or it validates
    with prompts the cache does not hold (`validation.sets`, a non-empty negative prompt under CFG)."""
    return not cfg.cache.enabled or (cfg.validation.every_n_steps > 0 and not reads_cache(cfg))


def mp4_writer_problem(folder: Path) -> str | None:
    """None if the writer validation uses (viz.write_mp4) writes a two-frame clip into `folder`."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:  # ImportError, or the wheel without its binary (RuntimeError)
        return f"the mp4 writer is missing ({type(e).__name__}: {e}); fix: {FFMPEG_FIX}"
    from e2v.eval.viz import write_mp4

    with tempfile.TemporaryDirectory(dir=folder, prefix=".e2v-mp4-check-") as tmp:
        path = Path(tmp) / "check.mp4"
        try:
            write_mp4(path, np.zeros((2, 16, 16, 3), np.uint8))
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            return (f"the mp4 writer cannot write H.264 ({type(e).__name__}: {first}); "
                    f"fix: {FFMPEG_FIX}")
        if not path.is_file() or path.stat().st_size == 0:
            return f"the mp4 writer wrote nothing to {path}; fix: {FFMPEG_FIX}"
    return None


def tokenizer_problem(cfg) -> str | None:
    """None if the prompt tokenizer loads offline (what the encoders' load and validation read)."""
    from e2v.models.load import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg, offline=True, raise_errors=True)
        tokenizer(["a check"], max_length=8, truncation=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"the prompt tokenizer of {cfg.model.pretrained} does not load ({type(e).__name__}: {first}); fix: "
                f"put its tokenizer/ folder beside transformer/ (hf download {cfg.model.pretrained} "
                f"--include 'tokenizer/*' --local-dir DIR), or `pip install sentencepiece` if that is what it names")
    return None


def wandb_problem(cfg) -> str | None:
    """None unless train.log_to asks for Weights & Biases and the wandb package is not installed
    (looked up, not imported: its import costs a second)."""
    import importlib.util

    from e2v.train.runlog import WANDB_FIX, boards_of

    if "wandb" in boards_of(cfg) and importlib.util.find_spec("wandb") is None:
        return f"train.log_to: {cfg.train.log_to} needs the wandb package, which is not installed; fix: {WANDB_FIX}"
    return None


def writable_problem(folder: Path, rank: int) -> str | None:
    """None if this rank can create, write and remove a file in `folder` (made if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".e2v-write-check-rank{rank}-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        return (f"{folder} is not writable ({e.strerror or e}); fix: set output_dir to a folder this user can "
                f"write on every node (--set output_dir=...)")
    return None


def local_problems(cfg, run_dir: Path, rank: int) -> list[str]:
    """This rank's problems with the later phases (see the module docstring), each with its fix."""
    folders = [run_dir]
    if cfg.visualization.enabled:  # relative to the run folder, or anywhere (viz.Visualizer's rule)
        folders.append(run_dir / cfg.visualization.output_dir.format(run_id=run_dir.name))
    problems = [p for p in (writable_problem(f, rank) for f in folders) if p][:1]  # the run folder's says it all
    if writes_mp4(cfg) and not problems:
        problems.append(mp4_writer_problem(run_dir))
    if encodes_prompts(cfg):
        problems.append(tokenizer_problem(cfg))
    if rank == 0:
        problems.append(wandb_problem(cfg))
    return [p for p in problems if p]


def check_later_phases(cfg, run_dir: Path, rank: int) -> None:
    """Every rank checks itself, the ranks compare (a collective), and any problem on any rank
    stops every rank here, before a weight is read, with one line per problem naming the ranks."""
    found = distributed.gather_all(local_problems(cfg, Path(run_dir), rank))
    ranks_of: dict[str, list[int]] = {}
    for r, problems in enumerate(found):
        for p in problems:
            ranks_of.setdefault(p, []).append(r)
    if ranks_of:
        lines = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {p}" for p, rs in ranks_of.items()]
        raise SystemExit("start-up check: " + "\nstart-up check: ".join(lines))
