"""A launch of `deepspeed --num_gpus N train_e2v.py` as a user types it, with the peak memory of
its whole process tree (the launcher, the ranks, their loader workers) sampled every 0.5 s:
RSS summed over the tree, and PSS (proportional set size: a page shared by two ranks, such as
a memory-mapped safetensors file, counts half in each), which is what the machine actually holds.
Summed RSS over-counts shared pages; the peak PSS is the figure compared with the estimate."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


class TreeSampler(threading.Thread):
    """Peak summed RSS and PSS of a process and all its descendants, sampled until stop()."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak_rss, self.peak_pss, self.peak_procs = pid, every, 0, 0, 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            rss = pss = 0
            try:
                root = psutil.Process(self.pid)
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    m = p.memory_full_info()
                    rss, pss = rss + m.rss, pss + m.pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_procs = max(self.peak_procs, len(procs))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_measured(name: str, cmd: list[str], log_dir: Path, timeout: float = 900, procs: int = 1) -> dict:
    """Run `cmd` in the repository root; its output goes to log_dir/<name>.log. Returns rc, wall
    time and peak memory (GiB)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if procs > 1:  # each rank's torch threads on its share of the cores: 2 x 2 threads on 2 cores thrash
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                p.kill()
            rc = proc.wait()
        finally:
            sampler.stop()
    return {"name": name, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gib": round(sampler.peak_rss / GIB, 2), "peak_pss_gib": round(sampler.peak_pss / GIB, 2),
            "log": str(log_path.relative_to(ROOT) if log_path.is_relative_to(ROOT) else log_path), "command": " ".join(cmd)}


def tail(path: Path, n: int = 25) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
