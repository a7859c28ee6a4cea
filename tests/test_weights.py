"""A missing model stops in one line (e2v/models/weights.py): offline and not downloaded names
each repo, where it was looked for and the download command; a local folder that does not exist
is named; the tiny presets need nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT


def _cfg(*sets):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_t2v_1.3b.yaml", list(sets), check_paths=False)


def test_offline_and_not_downloaded_names_both_repos_and_the_commands(tmp_path, monkeypatch):
    from e2v.config.bases import resolve_pretrained
    from e2v.models.weights import missing_weights

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_pretrained.cache_clear()
    error, notes = missing_weights(_cfg())
    assert notes == [] and "\n" not in error
    assert ("model.pretrained: Wan-AI/Wan2.1-T2V-1.3B-Diffusers is not downloaded (looked in "
            f"{tmp_path / 'hub/models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers'}) and HF_HUB_OFFLINE is set") in error
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir models/Wan2.1-T2V-1.3B-Diffusers" in error
    # the T2V base takes only the CLIP folders of the I2V repo (tests/test_firstday_weights.py parses it with hf's CLI)
    assert ('hf download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --include "image_encoder/*" '
            '--include "image_processor/*" --local-dir models/Wan2.1-I2V-14B-480P-Diffusers') in error
    error, _ = missing_weights(_cfg(f"model.pretrained={tmp_path / 'nowhere'}", f"model.image_encoder={tmp_path}"))
    assert error.startswith(f"model.pretrained: folder {tmp_path / 'nowhere'} does not exist")
    assert missing_weights(_cfg("model.preset=tiny", "model.pretrained=null", "model.image_encoder=null")) == (None, [])
    resolve_pretrained.cache_clear()


@pytest.mark.train  # a start of train_e2v.py (to its first check only)
def test_train_stops_in_one_line_without_a_traceback(demo_data, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "train_e2v.py"), "--config", "configs/e2v.yaml", "--set",
                        f"data.datasets.0.data_root={demo_data}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("weights: model.pretrained: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers is not downloaded"), line
