"""What tests/unit/test_preflight.py and tests/launch/test_preflight_runs.py share."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def bad_data(demo_data, tmp_path_factory) -> Path:
    """One shared copy: 001's mp4 cut in half, 002's caption empty, 003 a 9-frame clip (the tiny
    configs need 17)."""
    from e2v.data.demo import write_video
    from e2v.data.media import load_video

    out = tmp_path_factory.mktemp("bad") / "data"
    shutil.copytree(demo_data, out)
    mp4 = (out / "001.mp4").read_bytes()
    (out / "001.mp4").write_bytes(mp4[: len(mp4) // 2])
    (out / "002.txt").write_text("")
    video = load_video(out / "003.mp4", 9, 64, 64)  # uint8 [3, F, H, W]
    write_video(out / "003.mp4", np.ascontiguousarray(video.permute(1, 2, 3, 0).numpy()))
    return out


BAD = {"001": "truncated", "002": "empty caption", "003": "9 frames"}


def _cfg(data, *sets):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={data}", *sets])
