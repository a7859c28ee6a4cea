"""The commands started from a checkout in a Python that has the requirements but not the package
(`pip install -r requirements.txt` without `pip install -e .`, the usual first step for a
research repository): every tools/*.py says in one line what to install (tools/_installed.py)
instead of a ModuleNotFoundError traceback, and train_e2v.py, at the checkout's root, runs.

The installed package is hidden the way a venv without it would be: `python -S` (no site
module, so no .pth file installs the editable finder) with PYTHONPATH naming only the
site-packages folders. A fresh interpreter per command: that is what is tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

TOOLS = sorted(p.name for p in (ROOT / "tools").glob("*.py") if not p.stem.startswith("_"))


def _without_the_package(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    sites = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": os.pathsep.join(sites)}
    return subprocess.run([sys.executable, "-S", str(script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_probe_hides_the_package(tmp_path):  # the negative control: without it the test proves nothing
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.util; print(importlib.util.find_spec('e2v'), importlib.util.find_spec('yaml'))")
    out = _without_the_package(probe, cwd=tmp_path).stdout
    assert out.startswith("None ") and "yaml" in out, out


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_says_what_to_install(tool, tmp_path):
    proc = _without_the_package(ROOT / "tools" / tool, "--help", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"e2v is not installed in this Python ({sys.executable}): run `make install` in "
                                   f"{ROOT} (its venv, .venv), or `pip install -e {ROOT}` in yours (README.md, "
                                   "\"Start here\")")


def test_train_e2v_runs_from_the_checkout_root(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("typo_key: 1\ntrain:\n  lr_typo: 1.0e-4\n")
    assert "usage: train_e2v.py" in _without_the_package(ROOT / "train_e2v.py", "--help", cwd=tmp_path).stdout
    proc = _without_the_package(ROOT / "train_e2v.py", "--config", str(bad), cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith(f"config error: 2 problems in {bad}:"), proc.stderr
