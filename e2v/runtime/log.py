"""What a run says, from rank 0: one logger per stage, instead of `print` behind `if rank == 0`.

    from e2v.runtime.log import EVERY_RANK, get_logger
    log = get_logger("e2v.data")
    log.info("%d samples", n)                                          # [e2v data] 12 samples
    log.warning("...", extra=EVERY_RANK)                                 # said by each rank that sees it

Every line of a message gets the logger's tag (`e2v.data` -> `[e2v data] `), so a multi-line
message is built with plain newlines; leading newlines stay in front of the tag (they end a
progress bar's line). Records at WARNING and below go to stdout, ERROR and above to stderr, both
looked up when written (a test's captured streams see them). Rank: the process group's when it is
up, else the launcher's RANK variable (start-up, before the group exists), else 0.

The rule: code in e2v/ never prints, it logs here (and needs no `if rank == 0`: the handler asks);
the one exception is a command's own report, what the user ran the command to read (check_dataset's
table, make_demo_dataset's verdict), printed untagged by the command's `main(argv)` (tools/*.py, or
the e2v module a tools/ script is the thin front of). A function that makes such a report returns
its text, so a library caller can log it instead. A test (test_log_rule.py) holds e2v/ to this.
"""

from __future__ import annotations

import logging
import os
import sys

EVERY_RANK = {"every_rank": True}
_ROOT = "e2v"


def rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK (SLURM_PROCID for an srun
    task before its variables are mapped: e2v/runtime/slurm.py), else 0. No group can exist before
    torch.distributed is imported, and a command's first lines (its config errors) come before that
    import, so they do not pay for it."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0")


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "every_rank", False) or rank() == 0


class _Tagged(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        body = message.lstrip("\n")
        tag = f"[{record.name.replace('.', ' ')}] "
        return "\n" * (len(message) - len(body)) + "\n".join(tag + line for line in body.split("\n"))


class _Streams(logging.Handler):
    """stdout below ERROR, stderr from ERROR up; the streams as they are at each write."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.ERROR else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def get_logger(name: str = _ROOT) -> logging.Logger:
    """The logger `name` (under "e2v"), its tree set up once: INFO and up, rank 0's only unless
    `extra=EVERY_RANK`, tagged lines, not passed on to the root logger (a host program's handlers
    would print every line twice)."""
    root = logging.getLogger(_ROOT)
    if not any(isinstance(h, _Streams) for h in root.handlers):
        handler = _Streams()
        handler.addFilter(_RankZero())
        handler.setFormatter(_Tagged())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    if name != _ROOT and not name.startswith(_ROOT + "."):
        raise ValueError(f"logger {name!r}: e2v's loggers are named e2v or e2v.<stage>")
    return logging.getLogger(name)
