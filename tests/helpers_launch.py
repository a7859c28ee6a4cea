"""Starting the real entry point from a test in tests/launch/: `launch_train` (`deepspeed
--num_gpus N train_e2v.py ...` as a user types it, returned at once), `run_train` (to the end),
`launch_python`, `wait_all` (launches started side by side, collected), through the warm server
(tests/warm.py) or the real launcher (tests/conftest.py explains when each is used). A test in
tests/unit/ that calls them fails at once, naming the fix. One module object per session: it holds
the warm server, so it is imported under this name only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import ROOT, train_command

if __name__ != "helpers_launch":  # a second copy would run a second warm server with state of its own
    raise ImportError(f"tests/helpers_launch.py imported as {__name__}: import it as `from helpers_launch import ...`")

_running: dict = {"item": None}  # the test being set up or run (tests/conftest.py sets it)


def _only_in_launch_tests() -> None:
    """The folder decides the suite (tests/conftest.py): a test in tests/unit/ that starts a training
    process would run in `make test-fast`, so it fails here, naming the fix."""
    item = _running["item"]
    if item is not None and item.get_closest_marker("launch") is None:
        pytest.fail(f"{item.nodeid} starts a training process (or a script running engine steps), so it is not "
                    f"a unit test: move it to tests/launch/ (tests/conftest.py explains the two folders)",
                    pytrace=False)


class WarmProcess:
    """A launch's leader in the warm server (tests/warm.py): poll / wait / pid like a Popen. The
    leader is not our child, so its exit code comes from the status file it writes."""

    def __init__(self, pid: int, status: Path):
        self.pid, self.status, self.returncode = pid, status, None

    def _status(self) -> int | None:
        return int(self.status.read_text()) if self.status.exists() else None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._status()
            if code is None and not _alive(self.pid):
                code = self._status()
                code = -signal.SIGKILL if code is None else code  # stopped before it could write one
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"warm launch {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _WarmServer:
    """tests/warm.py, started once per session (with the session when a selected test trains) and
    stopped at its end."""

    proc: subprocess.Popen | None = None
    wanted = False  # the session trains: the server is started with it

    @classmethod
    def ensure(cls) -> subprocess.Popen:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/warm.py")], cwd=ROOT, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return cls.proc

    @classmethod
    def start(cls, req: dict) -> int:
        proc = cls.ensure()
        if not getattr(cls, "ready", False):
            hello = json.loads(proc.stdout.readline() or '{"error": "the warm server exited at start"}')
            if "ready" not in hello:
                raise RuntimeError(f"tests/warm.py: {hello.get('error')}")
            cls.ready = True
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())["pid"]

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                cls.proc.kill()


# One intra-op thread per process. The suite's launches run beside each other and beside the
# in-process tests on a 2-core machine, and the tiny models gain nothing from a second thread:
# with the default (a thread per core in every rank) OpenMP's spinning workers take the cores
# from each other.
LAUNCH_ENV = {"OMP_NUM_THREADS": "1"}


class Launch:
    """A subprocess (in the repository root) started now and collected by wait(): output goes to
    temporary files, so a process that prints a lot never blocks on a full pipe while nobody reads it.

    `warm=True` runs a `deepspeed --num_gpus N script args` command through the warm server
    (tests/warm.py: the same ranks, environment and argv as the launcher gives them, without
    importing torch and friends again in every process)."""

    def __init__(self, cmd: list[str], env: dict | None = None, warm: bool = False):
        self.cmd, self.warm = cmd, warm
        self.result: subprocess.CompletedProcess | None = None
        env = {k: v for k, v in {**os.environ, **LAUNCH_ENV, **(env or {})}.items() if v is not None}  # None: unset
        self._dir = Path(tempfile.mkdtemp(prefix="launch-"))
        self._outp, self._errp = self._dir / "stdout", self._dir / "stderr"
        self._outp.touch(), self._errp.touch()
        if warm:  # `deepspeed --num_gpus N --master_port P script args`, or `python script args`
            nprocs, port, script, args = ((None, 0, cmd[1], cmd[2:]) if cmd[0] == sys.executable
                                          else (int(cmd[2]), int(cmd[4]), cmd[5], cmd[6:]))
            req = dict(script=script, args=args, nprocs=nprocs, port=port, cwd=str(ROOT), env=env,
                       stdout=str(self._outp), stderr=str(self._errp), status=str(self._dir / "status"),
                       ranks=str(self._dir / "ranks.json"))
            self.proc = WarmProcess(_WarmServer.start(req), self._dir / "status")
        else:
            with open(self._outp, "w") as out, open(self._errp, "w") as err:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True,
                                             env=env)

    def wait(self, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
        if self.result is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            self.result = subprocess.CompletedProcess(self.cmd, self.proc.returncode, self._outp.read_text(),
                                                      self._errp.read_text())
            shutil.rmtree(self._dir, ignore_errors=True)
        if check and self.result.returncode != 0:
            raise AssertionError(f"{self.cmd[:4]} failed ({self.result.returncode}):\n{self.result.stdout[-4000:]}\n"
                                 f"{self.result.stderr[-6000:]}")
        return self.result

    def ranks(self) -> dict[int, list]:
        """Each rank's processes (the rank and its data workers, not the launcher's): local rank ->
        psutil processes."""
        import psutil

        if self.warm:
            found: dict[int, list] = {}
            for rank, pid in json.loads((self._dir / "ranks.json").read_text()).items():
                try:
                    found[int(rank)] = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            return found
        found = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                flags = [a for a in p.cmdline() if a.startswith("--local_rank=")]
            except psutil.NoSuchProcess:
                continue
            if flags:
                found.setdefault(int(flags[0].split("=")[1]), []).append(p)
        return found

    def kill(self) -> None:
        """The launcher and every process under it (the ranks, their data workers)."""
        import psutil

        if self.proc.poll() is not None:
            return
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True) + [psutil.Process(self.proc.pid)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


# Launches go through the warm server unless they need a fresh interpreter (a sitecustomize on
# PYTHONPATH) or name the real launcher: the session's shared 2-process run does, so every suite runs
# `deepspeed` itself. E2V_TEST_LAUNCHER=deepspeed sends every launch through it.
def _warm_ok(env: dict | None, launcher: str) -> bool:
    return launcher == "warm" and os.environ.get("E2V_TEST_LAUNCHER", "warm") == "warm" and "PYTHONPATH" not in (env or {})


def launch_train(config: str, *sets: str, num_gpus: int = 1, extra: tuple = (), env: dict | None = None,
                 script: Path | None = None, launcher: str = "warm") -> Launch:
    """Start `deepspeed --num_gpus N train_e2v.py --config ... --set ...` (as a user runs it) and
    return at once; `script` runs a wrapper of train_e2v.py instead (a test-only hook)."""
    _only_in_launch_tests()
    cmd = train_command(config, *sets, num_gpus=num_gpus, extra=extra)
    if script is not None:
        cmd = [str(script) if c == str(ROOT / "train_e2v.py") else c for c in cmd]
    return Launch(cmd, env, warm=_warm_ok(env, launcher))


def launch_python(script: str | Path, *args: str, env: dict | None = None) -> Launch:
    """`python script args` in the repository root, started now: a fork of the warm server when
    this session trains (it runs anyway), else a fresh interpreter. Not for what must start from
    nothing (a sitecustomize, variables read at import: HF_HUB_CACHE)."""
    _only_in_launch_tests()
    return Launch([sys.executable, str(script), *args], env, warm=_WarmServer.wanted and _warm_ok(env, "warm"))


def wait_all(*launches: Launch, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Collect launches started side by side; if one fails, the others are stopped, not orphaned."""
    try:
        return [launch.wait(check=check) for launch in launches]
    finally:
        for launch in launches:
            launch.kill()


def run_train(config: str, *sets: str, num_gpus: int = 1, extra: tuple = (), timeout: int = 900,
              check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train_e2v.py --config ... --set ...`, as a user runs it, to the end."""
    return launch_train(config, *sets, num_gpus=num_gpus, extra=extra, env=env).wait(timeout, check)
