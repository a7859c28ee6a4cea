"""A missing model stops in one line (e2v/models/weights.py): offline and not downloaded names
each repo, where it was looked for and the download command; a local folder that does not exist
is named; the tiny presets need nothing."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_train_stops_in_one_line_without_a_traceback(demo_data, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "train_e2v.py"), "--config", "configs/e2v.yaml", "--set",
                        f"data.datasets.0.data_root={demo_data}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("weights: model.pretrained: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers is not downloaded"), line
