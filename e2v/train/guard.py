"""Fail fast on a non-finite loss or gradient norm, naming the step, the rank and the sample ids
(or skip such micro-batches, counted, with `train.skip_nonfinite`)."""

from __future__ import annotations

import numpy as np
import torch

from e2v.runtime.distributed import any_rank, is_distributed
from e2v.runtime.log import get_logger

log = get_logger()


class NonFiniteGuard:
    """A non-finite loss (checked before backward, so nothing is updated) or gradient norm
    (DeepSpeed's ZeRO optimizers already skip such a step) stops the run naming the step, the
    rank(s) and the sample ids, or, with train.skip_nonfinite, is skipped and counted. All ranks
    decide together, so no rank is left waiting in a collective. Too many skips in a row mean the
    weights themselves are broken: that stops the run even in skip mode."""

    MAX_CONSECUTIVE = 20

    def __init__(self, skip: bool, rank: int):
        self.skip, self.rank = skip, rank
        self.skipped, self.consecutive = 0, 0

    def bad(self, value: float, what: str, step: int, sample_ids: list) -> bool:
        """True (on every rank) if this micro-batch / step is to be skipped; raises to stop."""
        bad_here = not np.isfinite(value)
        if not any_rank(bad_here):
            self.consecutive = 0
            return False
        reports = [(self.rank, value, list(sample_ids))]
        if is_distributed():
            reports = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(reports, (self.rank, value, list(sample_ids)))
        where = "; ".join(f"rank {r}: {what} {v}, samples {ids}" for r, v, ids in reports if not np.isfinite(v))
        self.skipped, self.consecutive = self.skipped + 1, self.consecutive + 1
        if self.skip and self.consecutive <= self.MAX_CONSECUTIVE:
            log.info(f"\nstep {step}: non-finite {what} skipped ({where}); {self.skipped} skipped so far")
            return True
        why = (f"{self.consecutive} non-finite in a row with train.skip_nonfinite" if self.skip
               else "set train.skip_nonfinite: true to skip such steps")
        raise FloatingPointError(f"non-finite {what} at step {step} ({where}). Nothing was saved from this step; "
                                 f"resume from the last checkpoint with --resume latest, e.g. with a lower "
                                 f"train.lr ({why})")

    def grad_norm(self, value, step: int, sample_ids: list) -> float:
        """The step's global gradient norm as a float (nan when DeepSpeed does not compute it),
        checked like a loss: DeepSpeed skipped the update of a non-finite step, we stop or count it."""
        if value is None:
            return float("nan")
        self.bad(float(value), "gradient norm", step, sample_ids)
        return float(value)
