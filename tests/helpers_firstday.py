"""What tests/unit/test_firstday.py and tests/launch/test_firstday_runs.py share."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HOLD_ALL = ("validation.num_samples: 8 samples held out for validation, but the dataset has 8 usable, so none "
            "is left to train on; hold out fewer (--set validation.num_samples=1), or none (--set "
            "validation.every_n_steps=0: no validation)")

VENV = Path(sys.executable).parent.parent  # the venv running the tests is the one make should use


def make(*args: str, env: dict | None = None) -> list[str]:
    """`make` in the repository root with this venv, never reinstalling it (-o: the install stamp and
    the demo data count as made; the tests bring their own data)."""
    return ["make", "-s", "-o", f"{VENV}/.installed", "-o", "demo-data", f"VENV={VENV}", *args]


def ports_of(recipe: str) -> list[int]:
    return [int(p) for p in re.findall(r"--master_port (\d+)", recipe)]
