"""A warm start for the suite's training launches.

A tiny training run here spends about half its CPU time importing torch, DeepSpeed, diffusers,
transformers and peft, twice more in the deepspeed launcher's own processes. This server imports
them once (with every e2v module and `train_e2v`), then, for each launch the suite asks for, forks
a leader that forks one process per rank, each of which runs the script as `__main__`
(`runpy.run_path`) exactly as `deepspeed --num_gpus N script args` would start it:

- the launcher's environment (its `launch.py`): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
  MASTER_ADDR, MASTER_PORT, CROSS_RANK, CROSS_SIZE, over the caller's environment;
- `--local_rank=<i>` first in argv, the working directory the caller gives, stdin from /dev/null,
  stdout and stderr to the caller's files;
- when a rank fails the leader stops the others and exits with that rank's code, 0 when all
  succeed; SIGTERM or SIGINT to the leader stops every rank, as they do to the launcher.

Each rank is a fork of a process that has imported, and run no tensor operation but the tiny
VAEs' measurement (on one thread, under its own seeds: `measure_tiny_vaes`), with no thread pool
started (the server checks that its imports add no thread to OpenBLAS's fork-safe pools), so its
torch, numpy and RNG state is what a fresh interpreter has after the same imports; Python's
`random` reseeds itself in a fork and the script seeds every stream it uses. A launch that needs a fresh interpreter (a `sitecustomize` on
PYTHONPATH) is not sent here: tests/conftest.py decides.

Protocol (the caller is tests/conftest.py): one JSON request per line on stdin, {"script",
"args", "nprocs", "port", "cwd", "env", "stdout", "stderr", "status", "ranks"}; the reply is one
line, {"pid": <leader>}; the leader writes {rank: pid} to the `ranks` file once it has started
them, and its exit code to the `status` file when every rank is done.
`nprocs` null runs the script as a plain `python script args` (no rank environment)."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def preload() -> None:
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import diffusers
    import peft  # noqa: F401  (diffusers' LoRA loader and e2v.models.trainable)
    import torch.utils.tensorboard  # noqa: F401

    for name in ("WanTransformer3DModel", "AutoencoderKLWan", "WanImageToVideoPipeline", "WanPipeline",
                 "UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"):
        getattr(diffusers, name)  # diffusers imports its models lazily, on first attribute access
    for path in sorted((ROOT / "e2v").rglob("*.py")):
        # data preparation and the demo generator never run in a training process, and they import
        # OpenCV, which starts a thread on import (a forked rank would inherit it without its thread)
        if "prepare" in path.parts or path == ROOT / "e2v/data/demo.py":
            continue
        importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
    importlib.import_module("train_e2v")
    import deepspeed.runtime.engine  # noqa: F401

    # DeepSpeed's optimizer check imports its Muon optimizer, which calls torch.compile at import
    # (loading inductor): seconds of every rank's start-up (bench/RESULTS.md, section 7: `muon_import`)
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    measure_tiny_vaes()


def measure_tiny_vaes() -> None:
    """The tiny VAEs' latent statistics (e2v/models/tiny_vae.py), measured once here, on one thread
    as the suite's ranks run, instead of in every rank (0.5 s each): ranks inherit the memo. The
    only tensor work the server does; one thread enters no OpenMP parallel region, so no pool
    starts (serve() checks)."""
    import torch

    from e2v.models.tiny_vae import build_tiny_vae
    from e2v.models.tiny_vae22 import build_tiny_vae22

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    build_tiny_vae(0)
    build_tiny_vae22(0)
    torch.set_num_threads(threads)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of `sys.exit(x)`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_rank(req: dict, rank: int | None) -> int:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = list(req["args"])
    if rank is not None:
        n = str(req["nprocs"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_SIZE=n, CROSS_RANK="0",
                          CROSS_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(req["port"]))
        argv = [f"--local_rank={rank}", *argv]
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what a fresh interpreter's torch reads at start
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout.reconfigure(line_buffering=True)  # `python -u`, as the launcher starts a rank
    sys.stderr.reconfigure(line_buffering=True)
    script = str(Path(req["script"]).resolve())
    sys.argv = [script, *argv]
    sys.path[0] = str(Path(script).parent)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to an interpreter
        traceback.print_exc()
        code = 1
    try:  # the interpreter's own shutdown: join threads, run atexit, flush
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def lead(req: dict) -> int:
    _replies.close()
    os.setsid()  # its own process group: the caller can stop the leader and every rank at once
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    ranks = [None] if req["nprocs"] is None else list(range(req["nprocs"]))
    pids = []
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            code = 1
            try:
                code = run_rank(req, rank)
            finally:
                os._exit(code)
        pids.append(pid)
    Path(req["ranks"]).write_text(json.dumps({str(r if r is not None else 0): p for r, p in zip(ranks, pids)}))

    def stop(signum, frame):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    alive, failed = set(pids), 0
    while alive:
        pid, status = os.wait()
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed == 0:
            failed = code
            stop(None, None)
    status = Path(req["status"])
    status.with_suffix(".tmp").write_text(str(failed))
    status.with_suffix(".tmp").replace(status)
    return failed if 0 <= failed < 256 else 1


def _reap(signum, frame) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


_replies = None  # the protocol's channel: the original stdout (libraries print to stdout as they import)


def _reply(obj: dict) -> None:
    _replies.write(json.dumps(obj) + "\n")
    _replies.flush()


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def serve() -> None:
    global _replies
    _replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # numpy's and scipy's OpenBLAS start their thread pools as they load; OpenBLAS stops them
    # around a fork (its own atfork handlers), so those are the only threads allowed here.
    import numpy  # noqa: F401
    import scipy.linalg  # noqa: F401

    blas = _threads()
    preload()
    if _threads() != blas:  # torch's OpenMP pool (or another library's thread) would not survive a fork
        _reply({"error": f"the warm server has {_threads() - blas} threads more after its imports"})
        return
    signal.signal(signal.SIGCHLD, _reap)
    _reply({"ready": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = lead(req)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                os._exit(code)
        _reply({"pid": pid})


if __name__ == "__main__":
    serve()
