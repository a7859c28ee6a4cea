"""One live run per run folder, and each step logged once in it.

Two runs started in the same folder (the same run_id twice, or `--resume latest` while the first
still runs) would interleave scalars.jsonl and TensorBoard, overwrite each other's checkpoints,
and the second's stale-save cleanup would delete the first's save in progress. So the run's rank 0
holds an exclusive `fcntl.flock` on `<run>/run.lock` for its whole life. The kernel drops the lock
when the process ends, however it ends (a kill -9, an OOM kill), so a dead run never blocks the
folder: the next start takes the lock over and replaces the holder's details in the file. On
network filesystems flock works where the mount supports it (NFSv4 maps it to NFS locks; Lustre
needs the `flock` mount option); where it does not, the lock is refused for every run, which
`E2V_NO_RUN_LOCK=1` switches off.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from e2v.runtime.files import write_text_atomic
from e2v.runtime.log import get_logger

log = get_logger("e2v")

LOCK_FILE = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another live process holds the run folder's lock."""


class RunLock:
    """An exclusive lock on `<run_dir>/run.lock`, held until `release()` or the process ends."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the file)
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder()
            self.file.close()
            who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
                   if holder else "a process that has not written its details yet")
            raise RunFolderBusy(f"{self.path} is held by {who}: another run is using this run folder. Wait for it "
                                "to finish or stop it, or give this run another run_id / output_dir") from None
        self.previous = self.holder()  # a dead run's details, now taken over
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                    "started": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
        self.file.flush()

    def holder(self) -> dict:
        """The details the lock file holds ({} if none or unreadable)."""
        try:
            return json.loads(self.path.read_text() or "{}")
        except (ValueError, OSError):
            return {}

    def release(self) -> None:
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def lock_run_folder(run_dir: Path, rank: int) -> RunLock | None:
    """Rank 0 takes the run folder's lock; every rank stops (SystemExit naming the lock file and
    its holder) if it is held. A collective when distributed. Keep the returned object alive."""
    import torch.distributed as dist

    lock, error = None, None
    if rank == 0 and os.environ.get("E2V_NO_RUN_LOCK", "0") != "1":
        try:
            lock = RunLock(run_dir)
            if lock.previous.get("pid"):
                log.info(f"{lock.path}: taken over from pid {lock.previous['pid']} on "
                         f"{lock.previous.get('host')}, which has ended")
        except RunFolderBusy as e:
            error = str(e)
    if dist.is_available() and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise SystemExit(f"[e2v] {error}")
    return lock


def cut_scalars(path: Path, first_step: int) -> int:
    """Drop the records of steps from `first_step` on from a run's scalars.jsonl (what an earlier run
    logged past the checkpoint a resume starts from), by write-then-rename; a torn last line (a kill
    mid-write) goes too. Says how many lines it dropped, and returns that number."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            keep = int(json.loads(line)["step"]) < first_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
        log.info(f"{path}: dropped {dropped} line(s) of steps >= {first_step}, logged by an earlier run "
                 "past the point this run starts from")
    return dropped
