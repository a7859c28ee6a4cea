"""Two runs on one machine: the Makefile gives each launch a free rendezvous port (MASTER_PORT, or
one found when the recipe starts) instead of deepspeed's fixed 29500, and a port another program
holds stops the run in one line naming the fix (e2v/runtime/distributed.py), not torch's
EADDRINUSE traceback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

VENV = Path(sys.executable).parent.parent  # the venv running the tests is the one make should use


def make(*args: str, env: dict | None = None) -> list[str]:
    """`make` in the repository root with this venv, never reinstalling it (-o: the install stamp and
    the demo data count as made; the tests bring their own data)."""
    return ["make", "-s", "-o", f"{VENV}/.installed", "-o", "demo-data", f"VENV={VENV}", *args]


def ports_of(recipe: str) -> list[int]:
    return [int(p) for p in re.findall(r"--master_port (\d+)", recipe)]


def test_make_targets_take_master_port_and_find_a_free_one_by_default():
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    dry = [subprocess.run(make("-n", "demo-quick"), cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout for _ in range(2)]
    found = [ports_of(d) for d in dry]
    assert all(len(p) == 1 and p[0] != 29500 for p in found), dry
    for (port,) in found:  # free when found (nothing listens there now)
        with socket.socket() as s:
            s.bind(("", port))
    assert ports_of(subprocess.run(make("-n", "demo", "MASTER_PORT=29650"), cwd=ROOT, env=env, capture_output=True,
                                   text=True, check=True).stdout) == [29650]
    assert ports_of(subprocess.run(make("-n", "demo-quick"), cwd=ROOT, env={**env, "MASTER_PORT": "29651"},
                                   capture_output=True, text=True, check=True).stdout) == [29651]


def test_a_taken_port_stops_the_rendezvous_in_one_line(monkeypatch):
    """What a rank launched onto a port another program holds meets (the launcher's environment,
    in this process): torch's EADDRINUSE becomes the one line with a port free now."""
    import torch

    from e2v.runtime.distributed import init_distributed

    assert not torch.distributed.is_initialized()
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as stop:
            init_distributed()
    line = str(stop.value)
    free = int(re.search(r"--master_port (\d+)", line).group(1))
    assert line.startswith(f"distributed: port {port} (MASTER_PORT) is already in use on this machine")
    assert f"or make ... MASTER_PORT={free}" in line and "\n" not in line and free != port
    assert not torch.distributed.is_initialized()


@pytest.mark.train
def test_two_demo_quick_runs_side_by_side(demo_data, tmp_path):
    """Two `make demo-quick` at once (one step each, on the session's 8-sample demo data, through
    the deepspeed launcher) both finish, each on its own port."""
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1"}

    def start(name: str, *extra: str) -> subprocess.Popen:
        train_args = (f"--set data.datasets.0.data_root={demo_data} --set output_dir={tmp_path / name} "
                      "--set train.max_steps=1 --set validation.every_n_steps=0")
        return subprocess.Popen(make("demo-quick", f"TRAIN_ARGS={train_args}", *extra), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = {"a": start("a"), "b": start("b")}
    try:
        got = {name: p.communicate(timeout=600) for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for name in ("a", "b"):
        out, err = got[name]
        assert procs[name].returncode == 0, err[-3000:]
        assert "[e2v] done: 1 steps" in out and "EADDRINUSE" not in err
    ports = [ports_of(got[name][0].replace("--master_port=", "--master_port ")) for name in ("a", "b")]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1], ports
