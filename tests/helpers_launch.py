"""Starting the real entry point from a test: `launch_train` (`deepspeed --num_gpus N train_e2v.py
...` as a user types it, returned at once), `run_train` (to the end), `launch_python`, `wait_all`
(launches started side by side, collected), through the warm server (tests/warm.py) or the real
launcher; and the early starts (`starts_early`, `early`): long runs that need nothing from
earlier tests start with the session and are shared by the pytest-xdist workers (tests/conftest.py
explains both). One module object per session: it holds the warm server and the early runs'
state, so it is imported under this name only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, VIZ_RUN, ZERO3_OFFLOAD_RUN, shared_root, train_command

if __name__ != "helpers_launch":  # a second copy would run a second warm server with state of its own
    raise ImportError(f"tests/helpers_launch.py imported as {__name__}: import it as `from helpers_launch import ...`")

_running: dict = {"item": None}  # the test being set up or run (the launch guard reads it)


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
        self.shared, leader = _next_shared_result()  # an early run's: its result file, and who runs it
        self.proc = None
        if not leader:
            return  # another worker runs it; wait() reads what it publishes
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
        if self.shared is not None:
            threading.Thread(target=self._publish, daemon=True).start()

    def _publish(self) -> None:
        """When the process ends, its result into the shared file (written whole, then renamed)."""
        self.proc.wait()
        tmp = self.shared.with_suffix(".tmp")
        tmp.write_text(json.dumps({"returncode": self.proc.returncode, "stdout": self._outp.read_text(),
                                   "stderr": self._errp.read_text()}))
        tmp.rename(self.shared)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _read_shared(self, timeout: int) -> subprocess.CompletedProcess:
        deadline = time.time() + timeout
        failed = self.shared.parent.with_suffix(".failed")
        while not self.shared.exists():
            if failed.exists():
                raise AssertionError(f"the early start that runs {self.cmd[:4]} failed in another worker:\n"
                                     f"{failed.read_text()[-4000:]}")
            if time.time() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            time.sleep(0.1)
        r = json.loads(self.shared.read_text())
        return subprocess.CompletedProcess(self.cmd, r["returncode"], r["stdout"], r["stderr"])

    def wait(self, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
        if self.result is None and self.shared is not None:
            self.result = self._read_shared(timeout)
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

        if self.proc is None:
            raise RuntimeError("a run another worker started has no processes here")
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

        if self.proc is None or self.proc.poll() is not None:
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
    item = _running["item"]
    if item is not None and item.get_closest_marker("train") is None:
        pytest.fail(f"{item.nodeid} starts a training process but is not marked `train`, so `make test-fast` "
                    f"would run it: add @pytest.mark.train (tests/conftest.py explains the marker)", pytrace=False)
    cmd = train_command(config, *sets, num_gpus=num_gpus, extra=extra)
    if script is not None:
        cmd = [str(script) if c == str(ROOT / "train_e2v.py") else c for c in cmd]
    return Launch(cmd, env, warm=_warm_ok(env, launcher))


def launch_python(script: str | Path, *args: str, env: dict | None = None) -> Launch:
    """`python script args` in the repository root, started now: a fork of the warm server when
    this session trains (it runs anyway), else a fresh interpreter. Not for what must start from
    nothing (a sitecustomize, variables read at import: HF_HUB_CACHE)."""
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


# --- started with the session ---------------------------------------------------------------------
# A fixture whose subprocesses take long and need nothing from the tests before it registers a
# starter with `starts_early(fixture name)`: when the session starts and a selected test uses
# that fixture, the starter runs (it returns at once, its processes work in the background while
# the in-process tests run), and the fixture collects the result with `early(name, request)`,
# starting it then if it was not started yet.
#
# Every worker calls every starter (each collects the whole suite and cannot know which test
# files it will be given), but each early run runs once per session: the first worker to claim
# a starter leads it; in the others it builds the same handles without starting anything, and
# their Launch.wait() reads the result the leader's watcher publishes in the shared folder as
# soon as the process ends. Starters keep their outputs in `early_dir` (the same path in every
# worker) and do any work of their own only `if early_leader()`. A leader waits for its runs
# at the end of its session (another worker may still need them), or stops them after a failure.

_EARLY: dict = {}  # fixture name -> starter(request) -> handle (a Launch, a Popen, or a dict/tuple of them)


def starts_early(fixture_name: str):
    def register(starter):
        _EARLY[fixture_name] = starter
        return starter
    return register


_SHARING: dict = {"dir": None, "leader": True, "count": 0}  # the early start being built, if any


def _next_shared_result() -> tuple[Path | None, bool]:
    """(this Launch's result file, whether this worker runs it): (None, True) outside an early start."""
    if _SHARING["dir"] is None:
        return None, True
    _SHARING["count"] += 1
    return _SHARING["dir"] / f"launch-{_SHARING['count']}.json", _SHARING["leader"]


def early_leader() -> bool:
    """Inside a starter: whether this worker runs it (see above)."""
    return _SHARING["leader"]


def early_dir(request, name: str) -> Path:
    """A starter's output folder, the same in every worker."""
    out = shared_root(request.getfixturevalue("tmp_path_factory")) / "early-out" / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def _launches(handle) -> list[Launch]:
    if isinstance(handle, dict):
        handle = list(handle.values())
    if isinstance(handle, (list, tuple)):
        return [launch for h in handle for launch in _launches(h)]
    return [handle] if isinstance(handle, Launch) else []


def _finish(handles: dict, failed: bool) -> None:
    for launch in _launches(list(handles.values())):
        if launch.proc is not None and not failed:
            launch.wait(check=False)  # another worker may still need it
        launch.kill()


def _start(name: str, request, handles: dict):
    if name not in handles:
        results = shared_root(request.getfixturevalue("tmp_path_factory")) / "early" / name
        results.parent.mkdir(exist_ok=True)
        try:
            os.close(os.open(results.with_suffix(".leader"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            leader = True
        except FileExistsError:
            leader = False
        results.mkdir(exist_ok=True)
        item, _running["item"] = _running["item"], None  # a shared start, for the tests marked by their fixture
        _SHARING.update(dir=results, leader=leader, count=0)
        try:
            handles[name] = _EARLY[name](request)
        except BaseException as e:
            if leader:  # the other workers' waits stop with this, not at their time limit
                results.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}")
            raise
        finally:
            _running["item"] = item
            _SHARING.update(dir=None, leader=True, count=0)
    return handles[name]


def early(name: str, request):
    """The handle of fixture `name`'s early start (started now if it was not)."""
    return _start(name, request, request.getfixturevalue("_early_handles"))


def _shared_start(run_id: str, sets: tuple, gpus: int, launcher: str = "warm"):
    def start(request):
        out = early_dir(request, run_id)
        demo = request.getfixturevalue("demo_data")
        return launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo}", f"output_dir={out}",
                            f"run_id={run_id}", *sets, num_gpus=gpus, launcher=launcher), out / run_id
    return start


def _shared_run(name: str, request) -> Path:
    launch, run = early(name, request)
    launch.wait()
    return run


# One uninterrupted 2-process ZeRO-3 + CPU-offload run (fp32, 8 steps), shared by the resume,
# export, DeepSpeed and ZeRO-3 load tests. LoRA alpha != rank, so an export that loses the alpha shows.
starts_early("zero3_offload_run")(_shared_start("z3o", ("train.checkpoint_every=4", *ZERO3_OFFLOAD_RUN), 2,
                                                launcher="deepspeed"))

# One 4-step run of the demo config with validation at steps 0, 2, 4, visualizations at 2 and 4 and
# checkpoints at 2 and 4, shared by test_train_e2e (its losses are the golden ones: validation and
# visualization leave the training RNGs alone), test_viz, test_validation and test_sampling (6 of
# the 8 samples held out).
starts_early("viz_run")(_shared_start("viz", VIZ_RUN, 1))

