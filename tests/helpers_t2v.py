"""Small generated datasets in the two seed formats without elements (docs/formats.md):
an `.npz` JSONL manifest (text-to-video LoRA) and a `metadata.csv` of mp4 clips (video regression).

Clips are a coloured square moving over a gradient, so the tiny VAE's latents differ between clips;
every clip holds both 0 and 255, so a loader that normalises to [-1, 1] reaches both ends exactly.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

PROMPTS = ["a person clapping their hands", "a person sitting", "a person walking", "a dog moves slowly"]


def make_clip(index: int, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 frames [F, H, W, 3]."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width]
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    colour = rng.integers(0, 256, 3)
    size = max(4, height // 4)
    for f in range(num_frames):
        img = np.stack([(x * 255 // max(1, width - 1)), (y * 255 // max(1, height - 1)),
                        np.full_like(x, (37 * index) % 256)], -1)
        top, left = (f * 2 + index * 3) % (height - size), (f * 3 + index * 5) % (width - size)
        img[top:top + size, left:left + size] = colour
        img[0, 0], img[-1, -1] = 0, 255  # both ends of the uint8 range in every frame
        frames[f] = img
    return frames


def make_npz_manifest(root: Path, num_clips: int = 4, num_frames: int = 9, height: int = 32,
                      width: int = 32) -> Path:
    """root/train.jsonl with {"path": "clips/clip_000i.npz", "prompt": ...}; returns the manifest."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(num_clips):
        rel = f"clips/clip_{i:04d}.npz"
        np.savez(root / rel, frames=make_clip(i, num_frames, height, width))
        lines.append(json.dumps({"path": rel, "prompt": PROMPTS[i % len(PROMPTS)]}))
    manifest = root / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def make_csv_videos(root: Path, num_clips: int = 4, num_frames: int = 9, height: int = 32,
                    width: int = 32) -> Path:
    """root/metadata.csv (columns video,prompt; paths relative to root) over mp4 clips."""
    import imageio.v2 as imageio

    (root / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num_clips):
        rel = f"videos/{i:04d}.mp4"
        imageio.mimwrite(root / rel, list(make_clip(i, num_frames, height, width)), fps=8, codec="libx264",
                         macro_block_size=16, quality=8)
        rows.append({"video": rel, "prompt": PROMPTS[i % len(PROMPTS)]})
    meta = root / "metadata.csv"
    with meta.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["video", "prompt"])
        w.writeheader()
        w.writerows(rows)
    return meta


def make_video_folder(root: Path, num_clips: int = 2, num_frames: int = 9, height: int = 32,
                      width: int = 32) -> Path:
    """A plain video folder: root/ID.mp4 + root/ID.txt (the prompt), no element images."""
    import imageio.v2 as imageio

    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_clips):
        imageio.mimwrite(root / f"{i:04d}.mp4", list(make_clip(i, num_frames, height, width)), fps=8,
                         codec="libx264", macro_block_size=16, quality=8)
        (root / f"{i:04d}.txt").write_text(PROMPTS[i % len(PROMPTS)])
    return root

CONFIG = str(ROOT / "configs/t2v_lora.yaml")


NPZ_FRAMES, NUM_FRAMES, SIZE = 11, 9, 32  # the npz holds more frames than a sample takes: the first 9


def tiny_sets(data_root: Path) -> list[str]:
    return ["model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data_root}",
            f"data.num_frames={NUM_FRAMES}", f"data.resolution=[{SIZE},{SIZE}]",
            "train.mixed_precision='no'", "train.gradient_checkpointing=false"]


@pytest.fixture(scope="module")
def npz_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("t2v_npz")
    make_npz_manifest(root, num_clips=4, num_frames=NPZ_FRAMES, height=SIZE, width=SIZE)
    return root


@pytest.fixture(scope="module")
def t2v_parts():
    """What load_parts builds for this config with model.preset tiny (built once: ~3 s)."""
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0, base="t2v")
