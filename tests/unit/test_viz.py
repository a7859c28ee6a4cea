"""Visualizations: files at exactly the configured steps with the right shapes (from a real
`deepspeed train_e2v.py` run), the dumper's formats in-process, the contact-sheet layout, and
tools/dump_visualizations.py rendering saved latents later.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_viz_runs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import ROOT
from PIL import Image


def test_dumper_formats_and_frequency(tiny_parts, tmp_path):
    from e2v.conditioning.encode import Conditions
    from e2v.config.schema import VisProcessor
    from e2v.eval.viz import Visualizer

    vis_cfg = SimpleNamespace(enabled=True, output_dir="vis/{run_id}", frequency=3, sheet_frames=[0, -1], processors=[
        VisProcessor(type="latent_save", data=["input_latents", "noisy_latents", "reference_images"], format="safetensors"),
        VisProcessor(type="vae_decode", data=["noisy_latents"], frames=[-1], format="png", video=True)])
    cfg = SimpleNamespace(visualization=vis_cfg, flow=SimpleNamespace(objective="flow"),
                          cache=SimpleNamespace(enabled=False))
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
    from e2v.eval.viz import LABEL_BAND, LABEL_MARGIN

    assert Image.open(d / "step_000003/contact_sheet.png").size == (LABEL_MARGIN + 5 * 32 + 4 * 2, LABEL_BAND + 32)


def test_other_ranks_and_disabled_write_nothing(tiny_parts, tmp_path):
    from e2v.eval.viz import Visualizer

    cfg = SimpleNamespace(visualization=SimpleNamespace(enabled=True, output_dir="v", frequency=1, processors=[]),
                          cache=SimpleNamespace(enabled=False))
    assert not Visualizer(cfg, tmp_path, tiny_parts.vae, rank=1).due(1)
    cfg.visualization.enabled = False
    assert not Visualizer(cfg, tmp_path, tiny_parts.vae, rank=0).due(1)


def test_contact_sheet_layout():
    from e2v.eval.viz import GAP, contact_sheet

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
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"visualization.processors=[{json.dumps(bad)}]"], check_paths=False)


@pytest.mark.parametrize("key, value, match", [
    ("visualization.sheet_frames", "[0,17]", r"visualization.sheet_frames: \[17\] out of range for 17 .*-17\.\.16"),
    ("visualization.processors", '[{"type": "vae_decode", "format": "png", "frames": [-18]}]',
     r"visualization.processors\[0\].frames: \[-18\] out of range .*-17\.\.16"),
])
def test_config_rejects_frames_out_of_range(key, value, match):
    """Rejected at load, not as an IndexError at the first visualization step mid-run."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"{key}={value}"], check_paths=False)
    ok = load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["visualization.sheet_frames=[-17,16]"], check_paths=False)
    assert ok.visualization.sheet_frames == [-17, 16]


@pytest.mark.parametrize("sets", [
    ["data.auto_frame_buckets=true", "data.frame_buckets=[9,17]"],
    ["data.time_division_factor=4"],  # 5, 9, 13, 17, but nothing below the 9 reference frames
    ["e2v_type=none", "model.base=t2v", "data.time_division_factor=4"],
    ["data.auto_frame_buckets=true", "data.num_frames=33"],
])
def test_frames_are_bounded_by_the_shortest_bucket(sets):
    """With auto frame buckets the shortest batch bounds the index; the oracle is the bucket list
    data.py draws from (config.py keeps its own copy of the rule)."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError
    from e2v.config.shapes import frame_bucket_list

    tiny = ROOT / "configs/e2v_tiny_lora.yaml"
    short = min(frame_bucket_list(load_config(tiny, sets, check_paths=False)))
    assert load_config(tiny, sets + [f"visualization.sheet_frames=[{short - 1},-{short}]"], check_paths=False)
    for bad in (short, -short - 1):
        with pytest.raises(ConfigError, match=rf"\[{bad}\] out of range for {short} .*-{short}\.\.{short - 1}"):
            load_config(tiny, sets + [f"visualization.sheet_frames=[{bad}]"], check_paths=False)


def _dump(cfg, tmp_path, tiny_parts, dropout: float):
    """One visualization of a real encoded demo batch (2 samples) at the given reference and
    caption dropout; returns the step folder."""
    import random

    from e2v.conditioning.layout import batch_conditions
    from e2v.data.dataset import E2VDataset, collate, index_samples
    from e2v.eval.viz import Visualizer

    cfg.conditioning.reference_dropout = cfg.conditioning.caption_dropout = dropout
    samples = index_samples(cfg, verbose=False)[:2]
    batch = collate([E2VDataset(cfg, samples)[i] for i in range(2)])
    c = batch_conditions(batch, tiny_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
    assert c.ref_dropped == [dropout == 1.0] * 2 and c.caption_dropped == [dropout == 1.0] * 2
    vis = Visualizer(cfg, tmp_path / f"run{dropout}", tiny_parts.vae, rank=0)
    lat = c.latents_BCTHW
    vis.maybe_dump(1, batch, c, lat, torch.zeros_like(lat), torch.tensor([0.5, 0.5]))
    vis.close()
    return tmp_path / f"run{dropout}/visualizations/step_000001", batch


def test_dropped_references_and_captions_are_shown_as_dropped(tiny_parts, demo_data, tmp_path):
    """With reference_dropout 1.0 the model saw no references: the sheet shows blank (mid-grey)
    tiles, reference_images are zeros, and meta.json says so; with 0.0 the real references."""
    from e2v.config.load import load_config
    from e2v.eval.viz import to_uint8

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={demo_data}",
                                                       "visualization.frequency=1"])
    kept, batch = _dump(cfg, tmp_path, tiny_parts, 0.0)
    dropped, _ = _dump(cfg, tmp_path, tiny_parts, 1.0)

    names = ["person", "object", "background"]
    meta = json.loads((dropped / "meta.json").read_text())
    assert meta["ref_dropped"] == [True, True] and meta["caption_dropped"] == [True, True]
    assert meta["prompts"] == ["", ""] and meta["references"] == [[], []]
    meta0 = json.loads((kept / "meta.json").read_text())
    assert meta0["ref_dropped"] == [False, False] and meta0["caption_dropped"] == [False, False]
    assert meta0["prompts"] == list(batch["prompt"]) and meta0["references"] == [names, names]

    refs = torch.load(dropped / "reference_images.pt", weights_only=True)
    assert refs.shape == (2, 3, 3, 64, 64) and not refs.any()
    refs0 = torch.load(kept / "reference_images.pt", weights_only=True)
    for i in range(2):
        assert torch.equal(refs0[i], torch.stack([batch["vae_refs"][i][k] for k in names]))

    # sheet rows: 3 reference tiles | target 0, -1 | predicted 0, -1; 64-px tiles, 2-px gaps
    from e2v.eval.viz import LABEL_BAND, LABEL_MARGIN

    sheet = np.asarray(Image.open(dropped / "contact_sheet.png"))[LABEL_BAND:, LABEL_MARGIN:]  # the body
    sheet0 = np.asarray(Image.open(kept / "contact_sheet.png"))[LABEL_BAND:, LABEL_MARGIN:]
    for row in range(2):
        for j in range(3):
            y, x = row * 66, j * 66
            assert (sheet[y:y + 64, x:x + 64] == 128).all()  # blank: zero pixels, mid-grey
            assert np.array_equal(sheet0[y:y + 64, x:x + 64], to_uint8(refs0[row, j]))
        assert np.array_equal(sheet[row * 66:row * 66 + 64, 3 * 66:], sheet0[row * 66:row * 66 + 64, 3 * 66:])
    ref_pngs = sorted((dropped / "reference_images").glob("*.png"))
    assert len(ref_pngs) == 6 and all((np.asarray(Image.open(p)) == 128).all() for p in ref_pngs)


def test_write_errors_raise_at_the_next_dump_and_finished_writes_are_dropped(tiny_parts, tmp_path):
    from e2v.conditioning.encode import Conditions
    from e2v.eval.viz import Visualizer

    cfg = SimpleNamespace(visualization=SimpleNamespace(enabled=True, output_dir="v", frequency=1, sheet_frames=[0],
                                                        processors=[]), flow=SimpleNamespace(objective="flow"),
                          cache=SimpleNamespace(enabled=False))
    v = Visualizer(cfg, tmp_path, tiny_parts.vae, rank=0)
    lat = torch.zeros(1, 16, 1, 4, 4)
    batch = {"id": ["a"], "prompt": ["p"], "vae_refs": [{}]}
    c = Conditions(lat, torch.zeros(1, 512, 32), None, None, kept=[[]])

    def dump(step):
        v.maybe_dump(step, batch, c, lat, lat, torch.tensor([0.5]))
        v.pool.submit(lambda: None).result()  # one FIFO writer thread: every earlier write has finished

    for step in (1, 2, 3):
        dump(step)
        assert len(v.pending) == 2  # meta.json + contact_sheet.png of this step only
    (tmp_path / "v/step_000004/meta.json").mkdir(parents=True)  # the write of meta.json will fail
    dump(4)
    with pytest.raises(RuntimeError, match=r"writing .*step_000004/meta.json failed"):
        dump(5)
    assert (tmp_path / "v/step_000004/contact_sheet.png").exists()  # the other files still written
    v.close()

    v = Visualizer(cfg, tmp_path / "second", tiny_parts.vae, rank=0)  # a last failing write: at close
    (tmp_path / "second/v/step_000001/meta.json").mkdir(parents=True)
    v.maybe_dump(1, batch, c, lat, lat, torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="meta.json"):
        v.close()
