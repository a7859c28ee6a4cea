"""What tests/unit/test_trust.py and tests/launch/test_trust_runs.py share."""

import subprocess
import sys

from helpers import ROOT


class Payload:
    """Unpickling calls `Path(marker).touch()`: proof that a loader ran the file's code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (Path(self.marker),)


def _folder_files(folder):
    """A manifest's files for a folder as found (what an attacker, or a test, writes)."""
    from e2v.runtime.integrity import record_file

    return {str(p.relative_to(folder)): record_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


HOLD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from e2v.runtime.runlock import RunLock
lock = RunLock(sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT), str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc
