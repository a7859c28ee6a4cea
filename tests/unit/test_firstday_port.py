"""Two runs on one machine: the Makefile gives each launch a free rendezvous port (MASTER_PORT, or
one found when the recipe starts) instead of deepspeed's fixed 29500, and a port another program
holds stops the run in one line naming the fix (e2v/runtime/distributed.py), not torch's
EADDRINUSE traceback.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_firstday_port_runs.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest
from helpers import ROOT
from helpers_make import make, ports_of


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
