"""Two runs on one machine: the Makefile gives each launch a free rendezvous port (MASTER_PORT, or
one found when the recipe starts) instead of deepspeed's fixed 29500, and a port another program
holds stops the run in one line naming the fix (e2v/runtime/distributed.py), not torch's
EADDRINUSE traceback.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_firstday_port.py."""

from __future__ import annotations

import os
import subprocess

from helpers import ROOT
from helpers_make import make, ports_of


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
