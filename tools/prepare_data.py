"""From raw footage to an E2V training set: shots, clips, captions, elements, check.

    python tools/prepare_data.py --config configs/prepare.yaml --input RAW_DIR --output DATASET_DIR
        [--set clips.num_frames=17 ...] [--no-caption]
    deepspeed --num_gpus N tools/prepare_data.py --config ... --input ... --output ...   # sharded

Each rank takes every world-th source video (no communication until the end). Resumable: a
finished video (its record under DATASET_DIR/.prepare/records/) is never redone; an interrupted
run redoes only the video it was in. docs/preparing_data.md explains the stages and the outputs.
Exit codes: 0 samples written and checked, 1 the dataset check failed, 2 a config or input error,
3 no sample was written (the summary says why, with the keys to change).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.data.prepare.config import PrepareConfigError, load_prepare_config
from e2v.runtime.slurm import launch_ranks


def _barrier(world: int):
    """A gloo barrier across the ranks, so rank 0 writes the manifest after every rank finished."""
    if world == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.barrier


def _check_dataset(argv: list[str]) -> int:
    """The dataset check (e2v/eval/dataset_check.py, tools/check_dataset.py's) in this process, imported when
    the check stage comes (not before: a run stopped sooner never pays for its imports)."""
    from e2v.eval.dataset_check import main

    return main(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="prepare config (default: configs/prepare.yaml's defaults)")
    p.add_argument("--input", required=True, type=Path, help="folder of raw videos (searched recursively)")
    p.add_argument("--output", required=True, type=Path, help="the e2v dataset folder to write")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-caption", action="store_true", help="caption every clip with its source file name's words")
    p.add_argument("--local_rank", type=int, default=launch_ranks()[2])
    args = p.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # non-UTF-8 file names print escaped, never crash
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        cfg = load_prepare_config(args.config, args.set)
    except PrepareConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not args.input.is_dir():
        print(f"error: --input {args.input} is not a folder", file=sys.stderr)
        return 2
    rank, world, _ = launch_ranks()  # deepspeed's or torchrun's variables, or srun's tasks
    import torch  # the stages once the config is good: torch, OpenCV, the backends take seconds to import

    from e2v.data.prepare.run import prepare

    device = f"cuda:{args.local_rank}" if torch.cuda.is_available() else "cpu"
    try:  # a model folder that cannot do what the config asks is found when the backend loads
        summary = prepare(cfg, args.input, args.output, no_caption=args.no_caption, rank=rank, world=world,
                          device=device, barrier=_barrier(world), check=_check_dataset)
    except PrepareConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if summary is not None and summary.get("no_samples"):
        print(f"error: {summary['no_samples']}", file=sys.stderr)
        return 3
    return 0 if summary is None or summary.get("check_exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
