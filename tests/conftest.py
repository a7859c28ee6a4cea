"""The fixtures (tiny parts built in code, a small demo dataset made on the fly, the session's
shared runs) and the hooks (the `train` marker, the early starts). What tests import lives in
tests/helpers.py (paths, shared settings, small helpers) and tests/helpers_launch.py (starting
`deepspeed train_e2v.py` and other scripts); no test imports this file.

Two suites. `make test` runs every test. `make test-fast` (`pytest -n 2 --dist loadfile -m "not
train"`) leaves out the tests that start a training process, for the edit loop, and shares the
rest between two pytest-xdist workers, a test file each at a time (so a module fixture is built
once); each worker builds the session fixtures it uses for itself. The `train` marker is set here, not
by hand: a test is marked when its body, any fixture it uses (directly or through other
fixtures) or the early starter of such a fixture (tests/helpers_launch.py) calls `run_train`, `launch_train` or
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
import os
import subprocess
import types
from pathlib import Path

import pytest

# The tests import e2v from this checkout (pyproject.toml: pythonpath), and so do the commands they
# start (tools/, bench/, the launcher's ranks), installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one intra-op thread each (set before torch is imported), or their
    # OpenMP threads spin against each other (bench/RESULTS.md, section 7: `test_fast_threads`).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# after the variables above: what they import may import torch
from helpers import _free_port, close_process_group, shared_root  # noqa: E402
from helpers_launch import _EARLY, _finish, _running, _shared_run, _start, _WarmServer, early  # noqa: E402

TRAIN_HELPERS = {"run_train", "launch_train", "train_command", "launch_python"}


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


# --- started with the session (tests/helpers_launch.py: the early starts) ------------------------

@pytest.fixture(scope="session")
def _early_handles() -> dict:
    return {}


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


# --- the session's shared runs ------------------------------------------------------------------


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


