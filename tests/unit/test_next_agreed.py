"""A data failure mid-run stops every rank at the same step (e2v.runtime.distributed.next_agreed,
the loop's fetch of each micro-batch): two gloo ranks on this CPU, rank 1's iterator failing on
its third item. Rank 1 raises its own error (the one that names the sample), rank 0 exits saying
another rank's data failed, neither waits in a collective for the other; with no failure both
get every item. The processes are time-limited, and the group's own timeout turns a rank left
waiting into an error well within that limit."""

from __future__ import annotations

from helpers_agree import two_ranks

import e2v.runtime.distributed  # noqa: F401  (the ranks fork from here: imported once)

RANK_SCRIPT = """
import datetime, sys
import torch.distributed as dist
from e2v.runtime.distributed import next_agreed
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, steps = dist.get_rank(), 5

def items(fail_at):
    for i in range(steps):
        if rank == 1 and i == fail_at:
            raise RuntimeError(f"bad sample 00{i}: data/00{i}.mp4 cannot be decoded")
        yield f"r{rank}-{i}"

for fail_at in (None, 2):  # first nothing fails, then rank 1's third item does
    it, got = items(fail_at), []
    try:
        while len(got) < steps:
            got.append(next_agreed(it))
        print(f"GOT {got}", flush=True)
    except SystemExit as e:
        print(f"STOPPED at step {len(got)}: {e}", flush=True)
    except RuntimeError as e:
        print(f"RAISED at step {len(got)}: {e}", flush=True)
dist.barrier()  # both ranks left the loop together: the group is still in step
print("DONE", flush=True)
dist.destroy_process_group()
"""


def test_one_ranks_data_failure_stops_both_ranks_at_the_same_step():
    rank0, rank1 = two_ranks(RANK_SCRIPT, "", marks=("GOT", "STOPPED", "RAISED", "DONE"), timeout=120)
    assert rank0 == [f"GOT {[f'r0-{i}' for i in range(5)]}",
                     "STOPPED at step 2: [rank 0] stopping: another rank's data failed (its message names the sample)",
                     "DONE"], rank0
    assert rank1 == [f"GOT {[f'r1-{i}' for i in range(5)]}",
                     "RAISED at step 2: bad sample 002: data/002.mp4 cannot be decoded", "DONE"], rank1
