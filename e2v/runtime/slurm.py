"""SLURM's tasks as a launch. `srun python train_e2v.py` starts one process per task with SLURM's
variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the step's node list) and none of
the ones torch's env:// rendezvous reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Neither torch nor DeepSpeed (0.19.8) reads SLURM's: DeepSpeed's SLURM runner relies on MPI discovery
(mpi4py), and maps AzureML's and SageMaker's MPI variables onto torch's the same way this module
maps SLURM's (deepspeed.comm's patch_aml_env_for_torch_nccl_backend), so DeepSpeed's own
init_distributed and torch's rendezvous then take the launch as any launcher's.

The task count is the step's (the processes srun started together), never the allocation's: a
batch script's own process is one process even when the job asked for 8 tasks. No torch here:
the tools' rank variables come from this before any heavy import (docs/training.md, "SLURM").
"""

from __future__ import annotations

import os
import re

# A port every task of a job computes alike without talking (the job id's last four digits above
# this base, as Lightning's SLURM environment does), and one that two jobs sharing a node do not
# share unless their ids end alike; torch's and DeepSpeed's default 29500 would be shared by all.
PORT_BASE = 15000


def step_tasks(environ=os.environ) -> int | None:
    """How many tasks SLURM started for this step (srun's SLURM_STEP_NUM_TASKS; SLURM_NTASKS in a
    batch script, the allocation's), None outside SLURM."""
    for key in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: `gpu[003-004,007],login1` -> `gpu003`, `rack[1-2]-n[01-02]`
    -> `rack1-n01` (each bracket's first number, zero padding kept). Task 0 runs on the step's
    first node, so its rendezvous listens there."""
    head = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if head is None:
        raise ValueError(f"not a SLURM hostlist: {nodelist!r}")
    return re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", head.group(0))


def tasks_on_node(spec: str, node: int) -> int:
    """This node's count in SLURM_STEP_TASKS_PER_NODE (`4(x2),2`: 4 on nodes 0 and 1, 2 on node 2)."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"not a SLURM tasks-per-node list: {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node, len(counts) - 1)]


def launch_env(environ=os.environ) -> dict[str, str] | None:
    """The launcher variables of this srun task (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; a MASTER_ADDR / MASTER_PORT already set is kept), or None when this
    process is not one of several tasks of an srun step."""
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    if not (tasks.isdigit() and int(tasks) > 1 and environ.get("SLURM_PROCID", "").isdigit()):
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else environ.get("SLURM_LAUNCH_NODE_IPADDR"))
    if not addr:
        raise ValueError("SLURM started several tasks but names no node (SLURM_STEP_NODELIST, SLURM_NODELIST): "
                         "set MASTER_ADDR to the first node's address")
    job = environ.get("SLURM_JOB_ID", "0")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE")
    local = tasks_on_node(per_node, int(environ.get("SLURM_NODEID", "0") or 0)) if per_node else int(tasks)
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": tasks, "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": addr,
            "MASTER_PORT": environ.get("MASTER_PORT") or str(PORT_BASE + int(job[-4:] if job[-4:].isdigit() else 0))}


def split_runs(world: int, environ=os.environ) -> str | None:
    """The one line when SLURM started N tasks and each is a run of its own (a process group of
    1: a launcher per task that sets WORLD_SIZE=1, or a batch script's own process on an allocation
    of N tasks), which would train N unsynchronised copies; None when the two agree."""
    tasks = step_tasks(environ)
    if world != 1 or not tasks or tasks <= 1:
        return None
    in_step = "SLURM_STEP_NUM_TASKS" in environ
    return (f"distributed: SLURM started {tasks} tasks ({'SLURM_STEP_NUM_TASKS' if in_step else 'SLURM_NTASKS'}"
            f"={tasks}) but this process is a run of 1 (WORLD_SIZE 1), so {tasks} copies would train unsynchronised: "
            + ("start one launcher per node (srun --ntasks-per-node=1 torchrun --nnodes ... or deepspeed "
               "--hostfile), or drop the launcher: srun python train_e2v.py ..." if in_step else
               "start the ranks with srun (srun python train_e2v.py ..., one task per GPU), or ask for "
               "--ntasks=1 for a one-process run")
            + " (docs/training.md, \"SLURM\")")


def launch_ranks(environ=os.environ) -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process for a command that shards its work over the
    launched processes (tools/precompute.py, tools/prepare_data.py): a launcher's RANK / WORLD_SIZE /
    LOCAL_RANK, else an srun task's (then set in `environ` too, so a process group made later, a
    gloo barrier, finds its rendezvous), else (0, 1, 0)."""
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        environ.update(launch_env(environ) or {})
    return int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1)), int(environ.get("LOCAL_RANK", 0))
