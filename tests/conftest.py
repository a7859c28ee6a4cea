"""Shared fixtures: tiny parts built in code, a small demo dataset made on the fly, and helpers to
run the real entry point (`deepspeed train_e2v.py`) in a subprocess.

Two suites. `make test` runs every test. `make test-fast` (`pytest -n 2 --dist loadfile -m "not
train"`) leaves out the tests that start a training process, for the edit loop, and shares the
rest between two pytest-xdist workers, a test file each at a time (so a module fixture is built
once); each worker builds the session fixtures it uses for itself. The `train` marker is set here, not
by hand: a test is marked when its body, any fixture it uses (directly or through other
fixtures) or the early starter of such a fixture (below) calls `run_train`, `launch_train` or
`train_command`, the only ways a test starts `deepspeed train_e2v.py`, or `launch_python` (a
plain start of train_e2v.py or of a script that runs engine steps). So a new test that trains
through these helpers is marked without anyone remembering to. A test that reaches them some
other way (through a helper function of its own) is not seen here, and fails at the launch, in
both suites, naming the test and the fix: mark it `@pytest.mark.train` (the explicit marker
works too).

What a launch costs here is mostly start-up (the launcher, imports, process groups). Imports are
paid once: launches go through a warm server (tests/warm.py) that has imported torch, DeepSpeed,
diffusers, peft and e2v and forks each rank with the environment and argv the deepspeed launcher
gives it; the session's shared 2-process run uses the real `deepspeed` launcher, so every suite runs it.
And launches are shared rather than repeated: one run serves every test that checks it (the session's
`zero3_offload_run` and `viz_run`, and module-scoped fixtures in the test files), and a fixture
that needs several independent runs starts them side by side (`launch_train` returns at once;
`wait_all` collects). Long subprocesses that need nothing from earlier tests (the two session
runs, a few others registered with `starts_early`) start in the background when the session
starts, if a selected test needs them, so they overlap the in-process tests before their first
user."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

if __name__ != "conftest":  # a second copy would run a second warm server with state of its own
    raise ImportError(f"tests/conftest.py imported as {__name__}: import it as `from conftest import ...`")
ROOT = Path(__file__).resolve().parent.parent
# The tests import e2v from this checkout (pyproject.toml: pythonpath), and so do the commands they
# start (tools/, bench/, the launcher's ranks), installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one intra-op thread each (set before torch is imported), or their
    # OpenMP threads spin against each other (bench/RESULTS.md, section 7: `test_fast_threads`).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# One home for the launch command, free ports and the run's scalars, shared with bench/
# (e2v/runtime/launch.py); `_free_port` is the name the tests use.
from e2v.runtime.launch import free_port as _free_port, read_scalars, train_command  # noqa: E402,F401

TRAIN_HELPERS = {"run_train", "launch_train", "train_command", "launch_python"}
_running: dict = {"item": None}  # the test being set up or run (the launch guard reads it)


def _calls_training(fn) -> bool:
    """Does fn's code (nested functions included) name one of the launch helpers?"""
    stack = [getattr(fn, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        if TRAIN_HELPERS & set(code.co_names):
            return True
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        funcs = [getattr(item, "function", None)] + [d.func for defs in fixtures.values() for d in defs]
        funcs += [_EARLY[name] for name in getattr(item, "fixturenames", ()) if name in _EARLY]
        if any(_calls_training(f) for f in funcs):
            item.add_marker(pytest.mark.train)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running["item"] = item


@pytest.fixture(scope="session")
def tiny_parts():
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process (what deepspeed.zero.Init needs), torn down after
    the test; an existing group is used as it is."""
    import torch.distributed as dist

    from e2v.runtime.distributed import init_distributed

    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        init_distributed()
    yield
    if created:
        close_process_group()


# What a launcher (or a one-process group made in a test) sets for the process group
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def close_process_group() -> None:
    """Destroy this process's group, its variables (a later launch must not take its rank and
    port) and the copies of it DeepSpeed keeps (its world clone and the groups made from it), so
    that the next test's group is the one DeepSpeed uses."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    dist.destroy_process_group()
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    groups._WORLD_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = groups.mesh_device = None
    for cache in (groups._ALL_TO_ALL_GROUP, groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP,
                  groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        cache.clear()


def shared_root(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session sees (the parent of the workers' own
    temporary folders), for what they share: the demo data and the early runs. Read-only to tests."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """8 demo samples, made once per session by whichever worker comes first."""
    from e2v.data.demo import main

    out = shared_root(tmp_path_factory) / "demo" / "data"
    out.parent.mkdir(exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out.parent / "done").exists():
            main([str(out), "--num-samples", "8"])
            (out.parent / "done").touch()
    return out


def save_t2v_and_clip_folders(root: Path, clip_layout: str = "pipeline") -> tuple[Path, Path, int]:
    """The tiny preset saved as a user's folders: root/t2v, a diffusers WanPipeline (no image
    encoder), and root/clip, the tiny CLIP vision model with its processor, in an I2V pipeline's
    subfolders (image_encoder/, image_processor/) or, "plain", at the folder's top. Returns both
    folders and the CLIP's width."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from e2v.models.tiny import build_tiny_parts

    t2v, clip = root / "t2v", root / "clip"
    p = build_tiny_parts(seed=0, base="t2v")
    WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True),
                ).save_pretrained(t2v)
    i2v = build_tiny_parts(seed=0)
    i2v.image_encoder.save_pretrained(clip / "image_encoder" if clip_layout == "pipeline" else clip)
    i2v.image_processor.save_pretrained(clip / "image_processor" if clip_layout == "pipeline" else clip)
    return t2v, clip, i2v.image_encoder.config.hidden_size


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


# --- one intra-op thread for a module of tiny tensors --------------------------------------------

@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_thread")`): a second
    intra-op thread gains nothing, and while another process holds a core it makes the many small
    ops wait on each other (the tiny VAE tests: 10x slower; building the tiny TI2V parts: 0.5 s on
    one thread, 6-7 s on two on a loaded machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- a model that ignores its references ----------------------------------------------------------

def blind(inner):
    """`inner` (an I2V-layout Wan transformer) with its condition channels and image tokens zeroed:
    what it makes cannot depend on the references."""
    import torch

    class _Blind(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, encoder_hidden_states_image=None, **kw):
            hidden_states = torch.cat([hidden_states[:, :16], torch.zeros_like(hidden_states[:, 16:])], 1)
            return self.inner(hidden_states, encoder_hidden_states_image=torch.zeros_like(encoder_hidden_states_image),
                              **kw)

    return _Blind()


# --- the session's shared runs ------------------------------------------------------------------

VIZ_RUN = ("train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=2", "validation.every_n_steps=2",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.frequency=2",
           "validation.subject_colour={subject: person, background: background, distractors: [object]}")


ZERO3_OFFLOAD_RUN = ("train.max_steps=8", "train.micro_batch_size=2", "lora.alpha=4", "train.export_comfyui_checkpoint=true",
                     "deepspeed.config=ds_configs/zero3_offload.json", "validation.every_n_steps=0",
                     "visualization.enabled=false")

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


@pytest.fixture(scope="session")
def _early_handles() -> dict:
    return {}


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


@pytest.fixture(scope="session", autouse=True)
def _start_early(request, _early_handles):
    _WarmServer.wanted = any(i.get_closest_marker("train") for i in request.session.items)
    if _WarmServer.wanted:
        _WarmServer.ensure()  # its imports overlap the first in-process tests

    def finish():  # the early runs first: the warm server's ones end with it
        _finish(_early_handles, failed=request.session.testsfailed > 0)
        _WarmServer.stop()
    request.addfinalizer(finish)
    for name in _EARLY:
        if any(name in getattr(i, "fixturenames", ()) for i in request.session.items):
            _start(name, request, _early_handles)


def early(name: str, request):
    """The handle of fixture `name`'s early start (started now if it was not)."""
    return _start(name, request, request.getfixturevalue("_early_handles"))


# --- the session's shared runs ------------------------------------------------------------------

def _shared_start(run_id: str, sets: tuple, gpus: int, launcher: str = "warm"):
    def start(request):
        out = early_dir(request, run_id)
        demo = request.getfixturevalue("demo_data")
        return launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo}", f"output_dir={out}",
                            f"run_id={run_id}", *sets, num_gpus=gpus, launcher=launcher), out / run_id
    return start


# One uninterrupted 2-process ZeRO-3 + CPU-offload run (fp32, 8 steps), shared by the resume,
# export, DeepSpeed and ZeRO-3 load tests. LoRA alpha != rank, so an export that loses the alpha shows.
starts_early("zero3_offload_run")(_shared_start("z3o", ("train.checkpoint_every=4", *ZERO3_OFFLOAD_RUN), 2,
                                                launcher="deepspeed"))
# One 4-step run of the demo config with validation at steps 0, 2, 4, visualizations at 2 and 4 and
# checkpoints at 2 and 4, shared by test_train_e2e (its losses are the golden ones: validation and
# visualization leave the training RNGs alone), test_viz, test_validation and test_sampling (6 of
# the 8 samples held out).
starts_early("viz_run")(_shared_start("viz", VIZ_RUN, 1))


def _shared_run(name: str, request) -> Path:
    launch, run = early(name, request)
    launch.wait()
    return run


@pytest.fixture(scope="session")
def zero3_offload_run(request) -> Path:
    return _shared_run("zero3_offload_run", request)


@pytest.fixture(scope="session")
def viz_run(request) -> Path:
    return _shared_run("viz_run", request)


@pytest.fixture(scope="session")
def viz_run_output(request, viz_run) -> subprocess.CompletedProcess:
    """What the viz run printed (stdout, stderr)."""
    return early("viz_run", request)[0].wait()


def load_checkpoint_module(model, state: dict) -> None:
    """A checkpoint's module state into a model built from the same base: checkpoints hold only what
    trains (e2v/train/checkpoint.py), so every key it lacks must be a frozen parameter of the model,
    which already holds the base's value; nothing in it may be unknown to the model."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not unexpected, f"checkpoint keys the model lacks: {unexpected[:5]}"
    assert not trained & set(missing), f"trained tensors missing from the checkpoint: {sorted(trained & set(missing))[:5]}"
