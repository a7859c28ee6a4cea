"""`srun python train_e2v.py` on a SLURM allocation: each task reads its rank, the world size and
its local rank from SLURM's variables (e2v/runtime/slurm.py), so the tasks make one run, not N
runs of one. No SLURM here: the two processes get the variables srun would give them (one node,
two tasks), and train a few steps together on CPU (gloo).

This file starts the training processes; the variables' rules and the one-line refusals are
checked in tests/unit/test_firstday_start.py."""

from __future__ import annotations

import json
import os
import random
import socket

from helpers import ROOT
from helpers_launch import launch_python, wait_all

from e2v.runtime.slurm import PORT_BASE


def _port_a_job_id_gives() -> int:
    """A port free now in the range SLURM_JOB_ID maps to (PORT_BASE + its last four digits)."""
    for port in random.sample(range(PORT_BASE, PORT_BASE + 10000), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in the SLURM job-id range")


def test_two_srun_tasks_are_one_run_of_world_size_two(demo_data, tmp_path):
    port = _port_a_job_id_gives()
    unset = {k: None for k in [*os.environ] if k.startswith("SLURM_")}
    unset |= dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    step = {"SLURM_JOB_ID": f"98{port - PORT_BASE:04d}", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    sets = [f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}", "run_id=slurm", "train.max_steps=2",
            "validation.every_n_steps=0", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1"]
    args = ["--config", "configs/e2v_tiny_lora.yaml", *[a for s in sets for a in ("--set", s)]]
    tasks = [launch_python(ROOT / "train_e2v.py", *args,
                           env={**unset, **step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)]
    first, second = wait_all(*tasks)
    assert f"[e2v] SLURM: 2 tasks (srun); rendezvous at localhost:{port}" in first.stdout, first.stdout[-3000:]
    assert "no launcher" not in first.stdout + second.stdout
    assert "[e2v] done: 2 steps" in first.stdout and "done:" not in second.stdout  # one run, said by its rank 0
    # DeepSpeed checks micro batch x accumulation x world against the batch it was given: a world of 1
    # on either task would have stopped here
    assert json.loads((tmp_path / "slurm/ds_config.json").read_text())["train_batch_size"] == 2 * 1 * 2
    steps = [json.loads(line) for line in (tmp_path / "slurm/scalars.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "train/loss" in s] == [1, 2]
