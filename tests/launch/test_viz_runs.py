"""Visualizations: files at exactly the configured steps with the right shapes (from a real
`deepspeed train_e2v.py` run), the dumper's formats in-process, the contact-sheet layout, and
tools/dump_visualizations.py rendering saved latents later.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_viz.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)


def test_files_only_at_configured_steps(viz_run):
    root = viz_run / "visualizations"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]  # frequency 2, 4 steps
    for step in (2, 4):
        d = root / f"step_{step:06d}"
        assert json.loads((d / "meta.json").read_text())["step"] == step
        shapes = {"input_latents": (2, 16, 5, 8, 8), "predicted_latents": (2, 16, 5, 8, 8),
                  "conditioned_latents": (2, 20, 5, 8, 8)}  # micro batch 2, 17x64x64 -> T 5, 8x8; cond = 4 + 16
        for name, shape in shapes.items():
            t = torch.load(d / f"{name}.pt", weights_only=True)
            assert tuple(t.shape) == shape and torch.isfinite(t).all()
        cond = torch.load(d / "conditioned_latents.pt", weights_only=True)
        assert torch.equal(cond[:, :4, :3], torch.ones_like(cond[:, :4, :3]))  # 3 references, repeats 1,4,4
        assert not cond[:, :4, 3:].any()
        for name in ("input_latents", "predicted_latents"):
            pngs = sorted(p.name for p in (d / name).glob("*.png"))
            assert pngs == [f"sample{i}_frame{f:03d}.png" for i in (0, 1) for f in (0, 16)]  # frames [0, -1]
            assert Image.open(d / name / pngs[0]).size == (64, 64)
        assert len(list((d / "reference_images").glob("*.png"))) == 6
        # contact sheet: 2 rows of 3 references + 2 target + 2 predicted 64-px tiles, 2-px gaps
        from e2v.eval.viz import LABEL_BAND, LABEL_MARGIN

        sheet = np.asarray(Image.open(d / "contact_sheet.png"))
        assert sheet.shape[:2] == (LABEL_BAND + 2 * 64 + 2, LABEL_MARGIN + 7 * 64 + 6 * 2)
        # labelled: a header over every column (3 references, 2 target, 2 predicted frames), and
        # each row's sigma and sample id beside it
        for col in range(7):
            x = LABEL_MARGIN + col * 66
            assert (sheet[:LABEL_BAND, x:x + 64] < 100).any(), col
        for row in range(2):
            assert (sheet[LABEL_BAND + row * 66:LABEL_BAND + row * 66 + 64, :LABEL_MARGIN] < 100).any(), row

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(viz_run / "tb"), size_guidance={"images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("viz/contact_sheet")] == [2, 4]


def test_predicted_latents_decode_to_the_sheet(viz_run):
    """The sheet's prediction tiles are the VAE decode of the saved x0 estimate (a second path:
    tools/dump_visualizations.py decodes the .pt files offline)."""
    d = viz_run / "visualizations/step_000004"
    from tools.dump_visualizations import main

    main(["--config", str(viz_run / "config.yaml"), str(d)])
    assert (d / "render/predicted_latents_grid.png").exists() and (d / "render/input_latents_sample1.mp4").exists()
    online = np.asarray(Image.open(d / "contact_sheet.png"))
    offline = np.asarray(Image.open(d / "render/contact_sheet.png"))
    assert online.shape == offline.shape
    assert np.abs(online.astype(int) - offline.astype(int)).max() <= 1


def test_dump_tool_uses_the_configured_sheet_frames(viz_run, tmp_path):
    """tools/dump_visualizations.py draws the contact sheet with visualization.sheet_frames, as
    the run did: frame 8 alone here, which is the third tile (frames 0, 4, 8, ...) of its grid."""
    import shutil

    import yaml

    raw = yaml.safe_load((viz_run / "config.yaml").read_text())
    raw["visualization"]["sheet_frames"] = [8]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    step = tmp_path / "step_000004"
    shutil.copytree(viz_run / "visualizations/step_000004", step, ignore=shutil.ignore_patterns("render"))
    from tools.dump_visualizations import main

    main(["--config", str(tmp_path / "config.yaml"), str(step)])
    from e2v.eval.viz import LABEL_BAND, LABEL_MARGIN

    sheet = np.asarray(Image.open(step / "render/contact_sheet.png"))
    assert sheet.shape == (LABEL_BAND + 2 * 64 + 2, LABEL_MARGIN + 5 * 64 + 4 * 2, 3)  # 3 refs | target f8 | pred f8
    sheet = sheet[LABEL_BAND:, LABEL_MARGIN:]  # the body, below the headers and right of the row labels
    for name, col in (("input_latents", 3), ("predicted_latents", 4)):
        grid = np.asarray(Image.open(step / f"render/{name}_grid.png"))
        assert np.array_equal(sheet[:64, col * 66:col * 66 + 64], grid[:64, 2 * 66:2 * 66 + 64]), name
