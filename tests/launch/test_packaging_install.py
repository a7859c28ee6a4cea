"""`pip install -e .` into a fresh venv, as a newcomer installs the package: the console scripts run
from a folder outside the checkout with no PYTHONPATH, and the dataset check gives a user the exit
code and the lines the in-process tests read from its main() (tests/unit/test_check_dataset.py).
What pyproject.toml declares is checked without installing, in tests/unit/test_packaging.py."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
import venv
from pathlib import Path

from helpers import ROOT
from helpers_check_dataset import CONFIG, defect_set, unprinted


def test_editable_install_in_a_fresh_venv_runs_the_console_scripts(tmp_path):
    """`pip install -e .` (offline: no build isolation, no dependencies fetched: they come from this
    interpreter's site-packages through a .pth), then the scripts from a folder outside the checkout
    with no PYTHONPATH: e2v and e2v.tools come from the install."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PIP_NO_INDEX": "1"}
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    # the dataset check as a user runs it before a training run: exit 1, each problem on its line
    data, expected = defect_set(tmp_path / "data")
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("DATA", str(data)))
    proc = subprocess.run([env_dir / "bin" / "e2v-check-dataset", "--config", "cfg.yaml", "--json", "report.json",
                           "--workers", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # some samples would fail training
    report = json.loads((tmp_path / "report.json").read_text())
    assert {(p["sample"], p["kind"]) for p in report["problems"]} == expected
    assert unprinted(report, proc.stdout) == []  # a line per problem (file: problem -> fix), a frequent warning counted
    # where the install resolves the module, found without running it (the script above ran it)
    where = subprocess.check_output([python, "-c", "import importlib.util as u; "
                                     "print(u.find_spec('e2v.tools.check_dataset').origin)"],
                                    cwd=tmp_path, env=env, text=True).strip()
    assert Path(where) == ROOT / "tools" / "check_dataset.py"
