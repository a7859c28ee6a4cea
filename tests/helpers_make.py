"""`make` from a test, as a user types it, with the venv running the tests (tests/unit/test_firstday_port.py,
tests/launch/test_firstday_port_runs.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

VENV = Path(sys.executable).parent.parent  # the venv running the tests is the one make should use


def make(*args: str, env: dict | None = None) -> list[str]:
    """`make` in the repository root with this venv, never reinstalling it (-o: the install stamp and
    the demo data count as made; the tests bring their own data)."""
    return ["make", "-s", "-o", f"{VENV}/.installed", "-o", "demo-data", f"VENV={VENV}", *args]


def ports_of(recipe: str) -> list[int]:
    return [int(p) for p in re.findall(r"--master_port (\d+)", recipe)]
