"""Shared fixtures: tiny parts built in code, a small demo dataset made on the fly, and a helper to
run the real entry point (`deepspeed train_e2v.py`) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_parts():
    from e2v.tiny import build_tiny_parts

    return build_tiny_parts(seed=0)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "data"
    subprocess.run([sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(out), "--num-samples", "8"],
                   check=True, capture_output=True)
    return out


def run_train(config: str, *sets: str, num_gpus: int = 1, extra: tuple = (), timeout: int = 600,
              check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train_e2v.py --config ... --set ...`, as a user runs it."""
    proc = subprocess.run(train_command(config, *sets, num_gpus=num_gpus, extra=extra), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


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


@pytest.fixture(scope="session")
def zero3_offload_run(demo_data, tmp_path_factory) -> Path:
    """One uninterrupted 2-process ZeRO-3 + CPU-offload run (fp32, 8 steps), shared by the resume,
    export and DeepSpeed tests. LoRA alpha != rank, so an export that loses the alpha shows."""
    out = tmp_path_factory.mktemp("z3o")
    run_train("configs/e2v_tiny.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=z3o",
              "train.checkpoint_every=4", *ZERO3_OFFLOAD_RUN, num_gpus=2)
    return out / "z3o"


@pytest.fixture(scope="session")
def viz_run(demo_data, tmp_path_factory) -> Path:
    """One 4-step run of the demo config with validation at steps 0, 2, 4 and visualizations at
    2 and 4, shared by test_viz, test_validation and test_sampling (6 of the 8 samples held out)."""
    out = tmp_path_factory.mktemp("viz")
    run_train("configs/e2v_tiny.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=viz",
              *VIZ_RUN)
    return out / "viz"


VIZ_RUN = ("train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=4", "validation.every_n_steps=2",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.frequency=2")


ZERO3_OFFLOAD_RUN = ("train.max_steps=8", "train.micro_batch_size=2", "lora.alpha=4",
                     "deepspeed.config=ds_configs/zero3_offload.json", "validation.every_n_steps=0",
                     "visualization.enabled=false")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
