"""Two gloo ranks forked from the test process running a script (`two_ranks`): the multi-rank
agreement tests (tests/unit/test_agree.py, test_next_agreed.py, test_hw_ops_preflight.py,
test_hw_ops_checkpoint.py)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed  # noqa: F401  (the ranks fork from here: their imports are done once)

import e2v.models.agree  # noqa: F401


def two_ranks(script: str, arg: str, marks: tuple[str, ...] = ("AGREED", "STOPPED"),
              timeout: float = 120) -> list[list[str]]:
    """Each rank's lines that start with one of `marks`, from two gloo processes running `script`
    (as `python -c script arg` would) that must finish within `timeout` seconds. The ranks are
    forks of this process, so nothing is imported again."""
    import multiprocessing
    import tempfile

    from e2v.runtime.ports import free_port

    port = free_port()
    out = Path(tempfile.mkdtemp(prefix="two-ranks-"))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(script, arg, r, port, out / f"rank{r}")) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    for p in procs:
        p.kill()
    return [[line for line in (out / f"rank{r}").read_text().splitlines() if line.startswith(marks)] for r in (0, 1)]


def _rank(script: str, arg: str, rank: int, port: int, out: Path) -> None:
    """One rank: the launcher's environment, its output to `out`, the script as __main__."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    torch.set_num_threads(1)
    with open(out, "w", buffering=1) as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        sys.argv = ["-c", arg]
        code = 0
        try:
            exec(compile(script, "<rank script>", "exec"), {"__name__": "__main__"})
        except BaseException:  # noqa: BLE001 - the rank's traceback goes to its output, like a process's
            traceback.print_exc()
            code = 1
        f.flush()
    os._exit(code)
