"""The user's training command as the harness and the tests start it: `deepspeed --num_gpus N
train_e2v.py --config C --set ...` on a port no earlier launch of this process took, and the
per-step scalars a run writes (scalars.jsonl), read back. One home for both: bench/ (the smoke, the
GPU check) and tests/ (the launcher tests, the warm launcher) build the same command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from e2v.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def train_command(config: str, *sets: str, num_gpus: int = 1, extra: tuple = (), script: Path | None = None) -> list[str]:
    """The user's command, `deepspeed --num_gpus N --master_port P train_e2v.py --config C --set ...`
    (`script`: a wrapper of train_e2v.py in its place); tests/conftest.py's warm launcher reads this
    layout."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(num_gpus), "--master_port", str(free_port()),
           str(script or ROOT / "train_e2v.py"), "--config", config]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def read_scalars(run_dir: Path) -> dict[int, dict]:
    """Per-step scalars from the run's scalars.jsonl (full float precision; {} before the first
    step is logged); a resumed run appends, so a later value for the same step wins."""
    steps: dict[int, dict] = {}
    f = Path(run_dir) / "scalars.jsonl"
    for d in map(json.loads, f.read_text().splitlines() if f.exists() else []):
        steps.setdefault(d["step"], {}).update(d)
    return steps
