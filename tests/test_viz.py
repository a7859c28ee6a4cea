"""Visualizations: files at exactly the configured steps with the right shapes (from a real
`deepspeed train_e2v.py` run), the dumper's formats in-process, the contact-sheet layout, and
tools/dump_visualizations.py rendering saved latents later."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT


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
        assert Image.open(d / "contact_sheet.png").size == (7 * 64 + 6 * 2, 2 * 64 + 2)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(viz_run / "tb"), size_guidance={"images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("viz/contact_sheet")] == [2, 4]


def test_predicted_latents_decode_to_the_sheet(viz_run):
    """The sheet's prediction tiles are the VAE decode of the saved x0 estimate (a second path:
    tools/dump_visualizations.py decodes the .pt files offline)."""
    d = viz_run / "visualizations/step_000004"
    subprocess.run([sys.executable, str(ROOT / "tools/dump_visualizations.py"), "--config",
                    str(viz_run / "config.yaml"), str(d)], check=True, capture_output=True)
    assert (d / "render/predicted_latents_grid.png").exists() and (d / "render/input_latents_sample1.mp4").exists()
    online = np.asarray(Image.open(d / "contact_sheet.png"))
    offline = np.asarray(Image.open(d / "render/contact_sheet.png"))
    assert online.shape == offline.shape
    assert np.abs(online.astype(int) - offline.astype(int)).max() <= 1


def test_dumper_formats_and_frequency(tiny_parts, tmp_path):
    from e2v.conditioning import Conditions
    from e2v.config import VisProcessor
    from e2v.viz import Visualizer

    vis_cfg = SimpleNamespace(enabled=True, output_dir="vis/{run_id}", frequency=3, sheet_frames=[0, -1], processors=[
        VisProcessor(type="latent_save", data=["input_latents", "noisy_latents", "reference_images"], format="safetensors"),
        VisProcessor(type="vae_decode", data=["noisy_latents"], frames=[-1], format="png", video=True)])
    cfg = SimpleNamespace(visualization=vis_cfg, flow=SimpleNamespace(objective="flow"))
    run = tmp_path / "myrun"
    v = Visualizer(cfg, run, tiny_parts.vae, rank=0)
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 16, 1, 4, 4, generator=g)  # one latent frame, 32x32 pixels: decodes stay cheap
    batch = {"id": ["a"], "prompt": ["p"], "vae_refs": [{"person": torch.zeros(3, 32, 32)}]}
    c = Conditions(lat, torch.zeros(1, 512, 32), None, None, kept=[["person"]])
    for step in range(1, 5):
        v.maybe_dump(step, batch, c, lat + 1, torch.zeros_like(lat), torch.tensor([0.5]))
        v.maybe_dump(step, batch, c, lat + 1, torch.zeros_like(lat), torch.tensor([0.5]))  # 2nd micro-batch: ignored
    v.close()
    d = run / "vis/myrun"
    assert [p.name for p in d.iterdir()] == ["step_000003"]
    from safetensors.torch import load_file

    saved = load_file(str(d / "step_000003/latents.safetensors"))
    assert sorted(saved) == ["input_latents", "noisy_latents", "reference_images"]
    assert torch.equal(saved["noisy_latents"], lat + 1) and tuple(saved["reference_images"].shape) == (1, 1, 3, 32, 32)
    assert [p.name for p in sorted((d / "step_000003/noisy_latents").iterdir())] == ["sample0.mp4", "sample0_frame000.png"]
    import imageio.v3 as iio

    assert iio.imread(d / "step_000003/noisy_latents/sample0.mp4").shape[1:] == (32, 32, 3)
    # ref | target frames 0, -1 | predicted frames 0, -1 (one decoded frame: both are frame 0)
    assert Image.open(d / "step_000003/contact_sheet.png").size == (5 * 32 + 4 * 2, 32)


def test_other_ranks_and_disabled_write_nothing(tiny_parts, tmp_path):
    from e2v.viz import Visualizer

    cfg = SimpleNamespace(visualization=SimpleNamespace(enabled=True, output_dir="v", frequency=1, processors=[]))
    assert not Visualizer(cfg, tmp_path, tiny_parts.vae, rank=1).due(1)
    cfg.visualization.enabled = False
    assert not Visualizer(cfg, tmp_path, tiny_parts.vae, rank=0).due(1)


def test_contact_sheet_layout():
    from e2v.viz import GAP, contact_sheet

    def tile(v):
        return np.full((4, 4, 3), v, np.uint8)

    video = np.stack([tile(10), tile(20), tile(30)])[None]  # [B=1, F=3, 4, 4, 3]
    sheet = contact_sheet([[tile(1), tile(2)]], video, video + 100, frames=[0, -1])
    step = 4 + GAP
    assert sheet.shape == (4, 6 * 4 + 5 * GAP, 3)
    assert [sheet[0, i * step, 0] for i in range(6)] == [1, 2, 10, 30, 110, 130]
    assert (sheet[:, 4:4 + GAP] == 255).all()


@pytest.mark.parametrize("bad, match", [
    ({"type": "latent_save", "data": ["latents"]}, "unknown"),
    ({"type": "vae_decode", "format": "pt"}, "not valid for vae_decode"),
])
def test_config_rejects_bad_processors(bad, match):
    from e2v.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/e2v_tiny.yaml", [f"visualization.processors=[{json.dumps(bad)}]"], check_paths=False)
