"""Shared fixtures: tiny parts built in code, a small demo dataset made on the fly, and helpers to
run the real entry point (`deepspeed train_e2v.py`) in a subprocess.

Two suites. `make test` runs every test. `make test-fast` (`pytest -m "not train"`) leaves out
the tests that start a training process, for the edit loop. The `train` marker is set here, not
by hand: a test is marked when its body, any fixture it uses (directly or through other
fixtures) or the early starter of such a fixture (below) calls `run_train`, `launch_train` or
`train_command`, the only ways a test starts `deepspeed train_e2v.py`. So a new test that trains
through these helpers is marked without anyone remembering to. A test that reaches them some
other way (through a helper function of its own) is not seen here, and fails at the launch, in
both suites, naming the test and the fix: mark it `@pytest.mark.train` (the explicit marker
works too).

What a launch costs here is mostly start-up (the launcher, imports, process groups), so launches
are shared rather than repeated: one run serves every test that checks it (the session's
`zero3_offload_run` and `viz_run`, and module-scoped fixtures in the test files), and a fixture
that needs several independent runs starts them side by side (`launch_train` returns at once;
`wait_all` collects). Long subprocesses that need nothing from earlier tests (the two session
runs, a few others registered with `starts_early`) start in the background when the session
starts, if a selected test needs them, so they overlap the in-process tests before their first
user."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TRAIN_HELPERS = {"run_train", "launch_train", "train_command"}
_running: dict = {"item": None}  # the test being set up or run (the launch guard reads it)


def pytest_configure(config):
    config.addinivalue_line("markers", "train: starts `deepspeed train_e2v.py` (set automatically: tests/conftest.py)")


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
    from e2v.tiny import build_tiny_parts

    return build_tiny_parts(seed=0)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "data"
    from tools.make_demo_dataset import main

    main([str(out), "--num-samples", "8"])
    return out


class Launch:
    """A subprocess (in the repository root) started now and collected by wait(): output goes to
    temporary files, so a process that prints a lot never blocks on a full pipe while nobody reads it."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.cmd = cmd
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._out, stderr=self._err, text=True,
                                     env={**os.environ, **(env or {})})
        self.result: subprocess.CompletedProcess | None = None

    def wait(self, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
        if self.result is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
            self._out.seek(0), self._err.seek(0)
            self.result = subprocess.CompletedProcess(self.cmd, self.proc.returncode, self._out.read(), self._err.read())
            self._out.close(), self._err.close()
        if check and self.result.returncode != 0:
            raise AssertionError(f"{self.cmd[:4]} failed ({self.result.returncode}):\n{self.result.stdout[-4000:]}\n"
                                 f"{self.result.stderr[-6000:]}")
        return self.result

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


def launch_train(config: str, *sets: str, num_gpus: int = 1, extra: tuple = (), env: dict | None = None,
                 script: Path | None = None) -> Launch:
    """Start `deepspeed --num_gpus N train_e2v.py --config ... --set ...` (as a user runs it) and
    return at once; `script` runs a wrapper of train_e2v.py instead (a test-only hook)."""
    item = _running["item"]
    if item is not None and item.get_closest_marker("train") is None:
        pytest.fail(f"{item.nodeid} starts a training process but is not marked `train`, so `make test-fast` "
                    f"would run it: add @pytest.mark.train (tests/conftest.py explains the marker)", pytrace=False)
    cmd = train_command(config, *sets, num_gpus=num_gpus, extra=extra)
    if script is not None:
        cmd = [str(script) if c == str(ROOT / "train_e2v.py") else c for c in cmd]
    return Launch(cmd, env)


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


def train_command(config: str, *sets: str, num_gpus: int = 1, extra: tuple = ()) -> list[str]:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(num_gpus), "--master_port", str(_free_port()),
           str(ROOT / "train_e2v.py"), "--config", config]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def read_scalars(run_dir: Path) -> dict[int, dict]:
    """Per-step scalars from the run's scalars.jsonl (full float precision); a resumed run
    appends, so a later value for the same step wins."""
    import json

    steps: dict[int, dict] = {}
    for d in map(json.loads, (Path(run_dir) / "scalars.jsonl").read_text().splitlines()):
        steps.setdefault(d["step"], {}).update(d)
    return steps


# --- the session's shared runs ------------------------------------------------------------------

VIZ_RUN = ("train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=2", "validation.every_n_steps=2",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.frequency=2")


ZERO3_OFFLOAD_RUN = ("train.max_steps=8", "train.micro_batch_size=2", "lora.alpha=4",
                     "deepspeed.config=ds_configs/zero3_offload.json", "validation.every_n_steps=0",
                     "visualization.enabled=false")

# --- started with the session ---------------------------------------------------------------------
# A fixture whose subprocesses take long and need nothing from the tests before it registers a
# starter with `starts_early(fixture name)`: when the session starts and a selected test uses
# that fixture, the starter runs (it returns at once, its processes work in the background while
# the in-process tests run), and the fixture collects the result with `early(name, request)`,
# starting it then if it was not started yet. Whatever is still running at the end is stopped.

_EARLY: dict = {}  # fixture name -> starter(request) -> handle (a Launch, a Popen, or a dict/tuple of them)


def starts_early(fixture_name: str):
    def register(starter):
        _EARLY[fixture_name] = starter
        return starter
    return register


def _stop(handle) -> None:
    if isinstance(handle, dict):
        handle = list(handle.values())
    if isinstance(handle, (list, tuple)):
        for h in handle:
            _stop(h)
    elif isinstance(handle, Launch):
        handle.kill()
    elif isinstance(handle, subprocess.Popen) and handle.poll() is None:
        handle.kill()
        handle.wait()


@pytest.fixture(scope="session")
def _early_handles() -> dict:
    handles: dict = {}
    yield handles
    for handle in handles.values():
        _stop(handle)


def _start(name: str, request, handles: dict):
    if name not in handles:
        item, _running["item"] = _running["item"], None  # a shared start, for the tests marked by their fixture
        try:
            handles[name] = _EARLY[name](request)
        finally:
            _running["item"] = item
    return handles[name]


@pytest.fixture(scope="session", autouse=True)
def _start_early(request, _early_handles):
    for name in _EARLY:
        if any(name in getattr(i, "fixturenames", ()) for i in request.session.items):
            _start(name, request, _early_handles)


def early(name: str, request):
    """The handle of fixture `name`'s early start (started now if it was not)."""
    return _start(name, request, request.getfixturevalue("_early_handles"))


# --- the session's shared runs ------------------------------------------------------------------

def _shared_start(run_id: str, sets: tuple, gpus: int):
    def start(request):
        out = request.getfixturevalue("tmp_path_factory").mktemp(run_id)
        demo = request.getfixturevalue("demo_data")
        return launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo}", f"output_dir={out}",
                            f"run_id={run_id}", *sets, num_gpus=gpus), out / run_id
    return start


# One uninterrupted 2-process ZeRO-3 + CPU-offload run (fp32, 8 steps), shared by the resume,
# export, DeepSpeed and ZeRO-3 load tests. LoRA alpha != rank, so an export that loses the alpha shows.
starts_early("zero3_offload_run")(_shared_start("z3o", ("train.checkpoint_every=4", *ZERO3_OFFLOAD_RUN), 2))
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


_ports: set[int] = set()


def _free_port() -> int:
    """A free port, never one handed out before in this session: launches started side by side
    bind theirs only seconds later."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports:
            _ports.add(port)
            return port
