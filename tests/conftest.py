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
    from e2v.models import build_tiny_parts

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
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(num_gpus), "--master_port", str(_free_port()),
           str(ROOT / "train_e2v.py"), "--config", config]
    for s in sets:
        cmd += ["--set", s]
    cmd += list(extra)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
