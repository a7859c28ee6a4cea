"""Every collective and process-wide hook in one place: the process group (NCCL on CUDA, gloo
elsewhere), the small collectives the loop, the logs and the checkpoints use, and the stop
signals. Each collective must be called by every rank, in the same order."""

from __future__ import annotations

import os
import signal

import torch

from e2v.runtime import slurm
from e2v.runtime.log import get_logger
from e2v.runtime.ports import free_port

log = get_logger("e2v")


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()


def this_rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def init_distributed() -> None:
    """`deepspeed.init_distributed` with NCCL on CUDA, gloo elsewhere.

    On the CPU accelerator DeepSpeed JIT-compiles a shared-memory op (`deepspeed_shm_comm`) at
    every first init. Only `inference_all_reduce` uses it, never training; the compile costs tens of
    seconds (bench/RESULTS.md, section 7: `ds_shm_comm_build`), and torch's build lock (`~/.cache/torch_extensions/*/lock`) is never
    cleared when a build is killed, after which every later run waits on it forever, printing
    nothing. So CPU runs opt out of the op (set E2V_DS_SHM_COMM=1 to keep it)."""
    import deepspeed
    import deepspeed.ops

    alone = resolve_launch()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("E2V_DS_SHM_COMM", "0") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # read before the backend builds it
    backend = "nccl" if cuda else "gloo"
    if alone and not torch.distributed.is_initialized():
        # One process needs no rendezvous: an in-process store, so no port can be taken by another
        # program between choosing it and binding it. DeepSpeed keeps a group that already exists.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    except RuntimeError as e:  # torch's DistNetworkError: rank 0 could not listen on MASTER_PORT
        if "EADDRINUSE" not in str(e):
            raise
        raise SystemExit(port_in_use(os.environ.get("MASTER_PORT", "?"))) from None


def port_in_use(port: str) -> str:
    """The one line for a rendezvous port another program holds (most often a second run on this
    machine: the deepspeed launcher's default and torchrun's are both 29500), with a port free now,
    in each launcher's spelling."""
    free = free_port()
    return (f"distributed: port {port} (MASTER_PORT) is already in use on this machine, by another run or "
            f"program; start with another: deepspeed --master_port {free} ..., torchrun --master_port {free} ..., "
            f"MASTER_PORT={free} srun ... (SLURM), or make ... MASTER_PORT={free} "
            "(the Makefile finds a free port when none is given)")


def resolve_launch() -> bool:
    """The launch this process belongs to, as the variables torch's env:// rendezvous reads, set
    before any process group: a launcher's (deepspeed, torchrun) as it is; SLURM's tasks
    (`srun python train_e2v.py`: e2v/runtime/slurm.py) mapped; else one process (single_process_env).
    True for the last. Stops in one line when SLURM started several tasks and this one would be a
    run of its own (N unsynchronised copies). A second call changes nothing."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        try:
            tasks = slurm.launch_env()
        except ValueError as e:
            raise SystemExit(f"distributed: {e}") from None
        if tasks:
            os.environ.update(tasks)
            log.info(f"SLURM: {tasks['WORLD_SIZE']} tasks (srun); rendezvous at {tasks['MASTER_ADDR']}:"
                     f"{tasks['MASTER_PORT']} (MASTER_ADDR / MASTER_PORT choose another)")
    alone = single_process_env()
    split = slurm.split_runs(int(os.environ["WORLD_SIZE"]))
    if split:
        raise SystemExit(split)
    return alone


def single_process_env() -> bool:
    """`python train_e2v.py` without the launcher: the environment a one-process group needs
    (rank 0 of 1 on this machine, a free port), set before deepspeed.init_distributed, which would
    otherwise look for MPI (mpi4py) to find its rank. True when it was set here; a launcher's
    (deepspeed, torchrun, SLURM's tasks mapped by resolve_launch) is left as it is."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))  # the group binds it at once
    log.info("no launcher: one process (rank 0 of 1); use `deepspeed --num_gpus N train_e2v.py` (or torchrun, "
             "or srun on SLURM) for several GPUs")
    return True


def next_agreed(iterator):
    """next(iterator) on every rank, agreed: when it fails on any rank (a sample that broke after
    the start-up check, under on_bad_sample: error), every rank stops, instead of the others
    waiting in the step's collectives forever. One small all-reduce per micro-batch with several
    ranks; nothing with one."""
    error = None
    try:
        item = next(iterator)
    except Exception as e:  # the loader's iterator is infinite: StopIteration is an error too
        error = e
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise SystemExit(f"[rank {this_rank()}] stopping: another rank's data failed (its message names the sample)")
    return item


def context_parallel_mesh(data_parallel: int, ring: int, ulysses: int):
    """The process groups of context parallelism (e2v/models/context_parallel.py): a device mesh with
    dimensions (dp, ring, ulysses), so that rank = (dp * ring + r) * ulysses + u and the ranks of
    one context-parallel group are consecutive, plus a group of every rank (DeepSpeed reduces and
    partitions over it). A collective: every rank calls it, once."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (data_parallel, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
    return mesh, torch.distributed.new_group(list(range(torch.distributed.get_world_size())))


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a collective: all ranks must call it)."""
    if not is_distributed():
        return bool(flag)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"  # NCCL: CUDA only
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def broadcast(obj, rank: int):
    if torch.distributed.is_initialized():
        box = [obj if rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def gather_all(obj) -> list:
    """Every rank's `obj` in rank order ([obj] in one process): a collective. How one rank's local
    finding (a failed build, a missing file) reaches every rank, so all decide alike."""
    if not is_distributed():
        return [obj]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, obj)
    return parts


def share_of_work(items: list) -> list:
    """This rank's share of a list every rank holds in the same order."""
    if not is_distributed():
        return items
    return items[torch.distributed.get_rank()::torch.distributed.get_world_size()]


def merge_over_ranks(part: dict) -> dict:
    """The union of every rank's dict (a collective when distributed)."""
    if not is_distributed():
        return part
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def mean_over_ranks(stats: dict[str, list[float]], world: int) -> dict[str, float]:
    """Each logged value averaged over every rank's micro-batches of the step (rank 0's alone
    describe 1/world of the global batch); `*_ids` keys become the number of distinct ids over all
    ranks instead (a bad sample met by two ranks or workers counts once). A collective."""
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, stats)
        stats = {}
        for part in gathered:
            for k, v in part.items():
                stats.setdefault(k, []).extend(v)
    return {k: len(set(v)) if k.endswith("_ids") else sum(v) / len(v) for k, v in stats.items()}


def distinct_over_ranks(ids: set[str]) -> int:
    """How many distinct ids all ranks hold together (a collective: every rank must call it). A bad
    sample met by two ranks, or by two workers of one rank, counts once."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return len(ids)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, sorted(ids))
    return len(set().union(*gathered))


class TimedGroup:
    """Every rank in a gloo group of its own, with its own timeout, for an exchange that waits on
    work whose length is known only at run time (the start-up data check: the default group's
    timeout, DeepSpeed's 10 minutes, would cut it short). Object collectives on the CPU; nothing
    with one process. Created and closed by every rank together."""

    def __init__(self, timeout_s: float):
        from datetime import timedelta

        self.world = torch.distributed.get_world_size() if is_distributed() else 1
        self.group = (torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if self.world > 1 else None)

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        if self.group is None:
            return [obj]
        parts = [None] * self.world
        torch.distributed.all_gather_object(parts, obj, group=self.group)
        return parts

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)


def install_stop_handlers() -> dict:
    """SIGTERM/SIGINT ask the loop to save and exit after the current step. Repeated signals
    change nothing: the deepspeed launcher forwards the signal it gets to every rank (which
    usually got it already from the scheduler or the terminal) and kills the ranks 30 s later,
    so a save that takes longer is cut short and the atomic protocol falls back to the previous
    checkpoint."""
    stop = {"signal": None}

    def handler(sig, _frame):
        stop["signal"] = sig

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop
