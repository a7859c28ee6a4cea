"""A run's logged scalars: TensorBoard on rank 0 plus `scalars.jsonl` (the exact values per step,
which resume checks and scripts read). Used by train_e2v.py's loop and by bench/bench.py, which
measures the loop's logging with it."""

from __future__ import annotations

import json
from pathlib import Path

from e2v.runtime.runlock import cut_scalars


class Log:
    """TensorBoard scalars on rank 0, plus the window averages the progress bar shows. What an
    earlier run in the folder logged from `first_step` on (past the checkpoint this run resumes
    from; everything for a fresh start) is dropped first (TensorBoard's purge_step, scalars.jsonl
    cut), so each step is logged once."""

    def __init__(self, run_dir: Path, rank: int, first_step: int = 0):
        self.tb = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=first_step)
            cut_scalars(run_dir / "scalars.jsonl", first_step)
            self.jsonl = open(run_dir / "scalars.jsonl", "a")  # exact values per step (resume checks, scripts)
        self.first_losses: list[float] = []
        self.losses: list[float] = []

    def scalars(self, step: int, values: dict) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            if values:
                self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
                self.jsonl.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.jsonl.close()
