"""CPU threads per process. With several ranks on one node, torch's default (every core, per
process) oversubscribes the CPU: 8 ranks x 64 threads on 64 cores, which the optimizer-offload
step (the Adam update of the whole fp32 partition on the CPU, e2v/runtime/adam.py) and the
DataLoader then share badly. So each rank takes its share of the cores it may run on, and each
DataLoader worker one thread (it decodes one clip; the parallelism is the workers)."""

from __future__ import annotations

import os

import torch


def local_ranks() -> int:
    """The processes of this run on this node: the launcher's count (torchrun's LOCAL_WORLD_SIZE,
    DeepSpeed's LOCAL_SIZE), else one per visible GPU, else 1."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return max(1, int(os.environ[key]))
    return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, cgroups, numactl), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_threads() -> tuple[int, str]:
    """(intra-op threads of this rank, why): OMP_NUM_THREADS when set (the user's or the
    launcher's --bind_cores_to_rank), else the usable cores / the local ranks (at least 1)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    n, ranks = usable_cores(), local_ranks()
    return max(1, n // ranks), f"{n} cores / {ranks} local rank(s)"


def set_rank_threads() -> str:
    """Set this rank's intra-op threads (rank_threads); returns the line that says so."""
    threads, why = rank_threads()
    torch.set_num_threads(threads)
    return f"CPU threads per rank: {threads} ({why})"


def one_thread_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: one intra-op thread per worker (torch sets it for its own worker
    loop; this also holds OpenCV's pool, which each worker would otherwise size to every core)."""
    torch.set_num_threads(1)
    import sys

    if "cv2" in sys.modules:
        sys.modules["cv2"].setNumThreads(1)
