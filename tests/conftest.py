"""The fixtures (tiny parts built in code, a small demo dataset made on the fly, the session's
shared runs) and the hooks (the folder's marker, the pytest-xdist groups). What tests import
lives in tests/helpers.py (paths, shared settings, small helpers), tests/helpers_launch.py
(starting `deepspeed train_e2v.py` and other scripts) and tests/helpers_<topic>.py (what the
test files of one topic share); no test imports this file.

Two folders, two suites. tests/unit/ holds the tests that run in this process (they call the
package, `train_e2v.main([...])` and the commands' `main(argv)` included); tests/launch/ the ones
that start a process of their own: `deepspeed train_e2v.py` or a script running engine steps, and
a command where the process is what is tested (killed mid-run, installed by pip into a fresh venv,
in a fresh interpreter), each marked `launch` here by its folder.
`make test-fast` runs tests/unit/, `make test` both (`-m "not slow"`: the tools' whole end-to-end
runs, `make test-slow`, are left out). A unit test that starts a launch fails at the launch
(tests/helpers_launch.py), naming the fix: move it to tests/launch/.

Two pytest-xdist workers share the tests by group (`--dist loadgroup`): a test file is a group
(its module fixtures are built once), except the tests that check one of the session's shared
runs, which carry that run's group (`pytest.mark.xdist_group("viz_run")`, `("zero3_offload_run")`)
wherever they live, so the one worker that runs the group builds the run (no run is shared
across workers). Each worker builds the session fixtures it uses for itself, except what tests only
read (the demo data, the prepared hard footage): the first worker to ask makes it in a folder both
see, under a lock (tests/helpers.py: `built_once`).

What a launch costs here is mostly start-up (the launcher, imports, process groups). Imports are
paid once per worker: launches go through a warm server (tests/warm.py) that has imported torch,
DeepSpeed, diffusers, peft and e2v and forks each rank with the environment and argv the deepspeed
launcher gives it; the shared 2-process ZeRO-3 run uses the real `deepspeed` launcher, so every
suite runs it (E2V_TEST_LAUNCHER=deepspeed sends every launch through it). A fixture that needs
several independent runs starts them side by side (`launch_train` returns at once; `wait_all`
collects)."""

from __future__ import annotations

import gc
import os
import subprocess
from pathlib import Path

import pytest

# The tests import e2v from this checkout (pyproject.toml: pythonpath), and so do the commands they
# start (tools/, bench/, the launcher's ranks), installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("ATEN_CPU_CAPABILITY"):
    # A suite run with forced CPU kernels (make test-portable) compiles into an inductor cache of its own:
    # kernels cached under the machine's own capability, loaded under another, gave NaN losses here
    # (a fresh cache under the forced one gives the eager losses).
    import getpass
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one intra-op thread each (set before torch is imported), or their
    # OpenMP threads spin against each other (bench/RESULTS.md, section 7: `test_fast_threads`).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# after the variables above: what they import may import torch
from helpers import VIZ_RUN, ZERO3_OFFLOAD_RUN, _free_port, built_once, close_process_group  # noqa: E402
from helpers_launch import _running, _WarmServer, launch_train  # noqa: E402

# Fixtures that test files of both folders use, defined beside the helpers they build on.
pytest_plugins = ["helpers_opens2v", "helpers_preflight", "helpers_prepare", "helpers_pretrained", "helpers_t2v",
                  "helpers_wan22"]

TESTS = Path(__file__).resolve().parent
FOLDERS = {"unit": None, "launch": pytest.mark.launch}  # folder -> the marker its tests carry
SHARED_RUNS = ("viz_run", "zero3_offload_run")  # the session's shared runs: the groups of the tests that use them


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker and pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        if folder not in FOLDERS:
            raise pytest.UsageError(f"{item.path}: test files live in tests/unit/ (in this process) or "
                                    f"tests/launch/ (starts a process); move it to the one it belongs to")
        if FOLDERS[folder] is not None:
            item.add_marker(FOLDERS[folder])
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(str(item.path.relative_to(TESTS))))
    # The shared runs' groups are the longest: sent first (make test: --no-loadscope-reorder keeps
    # this order), so no worker starts one at the end while the other idles
    items.sort(key=lambda i: _group(i) not in SHARED_RUNS)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collecting imports every test file's modules (torch, diffusers, transformers: most of a
    worker's heap) with the cyclic garbage collector off, and freezes what it made: the collections
    during the tests and at the session's end (pytest collects five times there) skip it instead
    of walking it every time (bench/RESULTS.md, section 7: `test_fast_gc`)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs.get("name", "default")  # pytest-xdist's reading


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

    return built_once(tmp_path_factory, "demo_data", lambda out: main([str(out), "--num-samples", "8"]))


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


@pytest.fixture(scope="session", autouse=True)
def _warm_server(request):
    """Started with the session when a selected test is a launch test (its imports overlap the first tests),
    stopped at its end."""
    _WarmServer.wanted = (os.environ.get("E2V_TEST_LAUNCHER", "warm") == "warm"
                          and any(i.get_closest_marker("launch") for i in request.session.items))
    if _WarmServer.wanted:
        _WarmServer.ensure()
    yield
    _WarmServer.stop()


# --- the session's shared runs (their users carry their group: see above) -----------------------

def _session_run(request, run_id: str, sets: tuple, num_gpus: int, launcher: str = "warm"):
    out = request.getfixturevalue("tmp_path_factory").mktemp(run_id)
    launch = launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={request.getfixturevalue('demo_data')}",
                          f"output_dir={out}", f"run_id={run_id}", *sets, num_gpus=num_gpus, launcher=launcher)
    return launch.wait(), out / run_id


@pytest.fixture(scope="session")
def zero3_offload_run(request) -> Path:
    """One uninterrupted 2-process ZeRO-3 + CPU-offload run (fp32, 8 steps), through the real
    launcher, shared by the resume, export, DeepSpeed, ZeRO-3 load and context-parallel tests. LoRA
    alpha != rank, so an export that loses the alpha shows."""
    return _session_run(request, "z3o", ("train.checkpoint_every=4", *ZERO3_OFFLOAD_RUN), 2, launcher="deepspeed")[1]


@pytest.fixture(scope="session")
def _viz(request) -> tuple[subprocess.CompletedProcess, Path]:
    return _session_run(request, "viz", VIZ_RUN, 1)


@pytest.fixture(scope="session")
def viz_run(_viz) -> Path:
    """One 4-step run of the demo config with validation at steps 0, 2, 4, visualizations at 2 and
    4 and checkpoints at 2 and 4, shared by the end-to-end, visualization, validation, sampling and
    context-parallel tests (its losses are the golden ones: validation and visualization leave the
    training RNGs alone; 6 of the 8 samples held out)."""
    return _viz[1]


@pytest.fixture(scope="session")
def viz_run_output(_viz) -> subprocess.CompletedProcess:
    """What the viz run printed (stdout, stderr)."""
    return _viz[0]
