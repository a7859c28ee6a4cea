"""The text-to-video LoRA recipe (configs/t2v_lora.yaml, docs/formats.md): an .npz JSONL
manifest, `e2v_type: none` on the 16-channel T2V transformer, LoRA on the attention projections;
the exported LoRA in a plain diffusers `WanPipeline`.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_t2v_lora_runs.py."""

import random

import numpy as np
import torch
from helpers_t2v import CONFIG, NUM_FRAMES, PROMPTS, SIZE, make_video_folder, tiny_sets

from e2v.runtime.device import as_pixels


def test_shipped_config_is_the_seed_recipe():
    from e2v.config.load import load_config

    cfg = load_config(CONFIG, check_paths=False)
    assert cfg.e2v_type == "none" and cfg.model.base == "t2v"
    assert cfg.model.pretrained == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (32, 32, ["to_q", "to_k", "to_v", "to_out.0"])
    assert (cfg.train.lr, cfg.train.mixed_precision, cfg.train.gradient_accumulation_steps,
            cfg.train.checkpoint_every) == (1e-4, "bf16", 4, 500)
    assert cfg.flow.shift == 5.0 and cfg.flow.objective == "flow"
    ds = cfg.data.datasets[0]
    assert (ds.dataset_type, ds.data_root, ds.metadata_path) == ("jsonl", "data/processed", "train.jsonl")
    assert (cfg.data.num_frames, cfg.data.resolution) == (81, [480, 832])


def test_npz_frames_reach_the_vae_in_minus_one_to_one(npz_data, t2v_parts, monkeypatch):
    """The tensor the VAE encodes is the npz's uint8 frames / 127.5 - 1 in [B,3,F,H,W]: no other
    scaling, no channel/frame mix-up, exactly -1 and 1 at the ends of the uint8 range."""
    from e2v.conditioning.layout import batch_conditions
    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples, make_loader
    from e2v.models.load import load_parts

    cfg = load_config(CONFIG, tiny_sets(npz_data) + ["train.micro_batch_size=2"])
    transformer = load_parts(cfg, with_encoders=False).transformer
    assert transformer.config.in_channels == 16 and transformer.config.added_kv_proj_dim is None
    parts = t2v_parts
    samples = index_samples(cfg, verbose=False)
    by_id = {s.id: s.video for s in samples}
    batch = next(iter(make_loader(cfg, samples, rank=0, world=1)))

    seen, encode = [], parts.vae.encode

    def recording_encode(x, *args, **kwargs):
        seen.append(x.detach().clone())
        return encode(x, *args, **kwargs)

    monkeypatch.setattr(parts.vae, "encode", recording_encode)
    c = batch_conditions(batch, parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
    assert len(seen) == 1, "e2v_type none encodes only the target video"
    expected = []
    for sid in batch["id"]:
        frames_FHWC = np.load(by_id[sid])["frames"][:NUM_FRAMES]
        expected.append(torch.from_numpy(frames_FHWC).float().div(127.5).sub(1.0).permute(3, 0, 1, 2))
    torch.testing.assert_close(seen[0], torch.stack(expected), atol=0, rtol=0)
    assert seen[0].min().item() == -1.0 and seen[0].max().item() == 1.0
    assert c.cond_BCTHW is None and c.clip_BLD is None
    assert c.latents_BCTHW.shape == (2, 16, (NUM_FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)


def test_plain_video_folder_is_a_t2v_source(tmp_path):
    """`ID.mp4 + ID.txt` with no element images: every clip is a sample with its prompt."""
    from e2v.config.load import load_config
    from e2v.data.dataset import E2VDataset, index_samples

    root = make_video_folder(tmp_path / "videos", num_clips=2, num_frames=NUM_FRAMES, height=SIZE, width=SIZE)
    cfg = load_config(CONFIG, tiny_sets(root) + ["data.datasets.0.dataset_type=e2v", "data.datasets.0.metadata_path=null"])
    samples = index_samples(cfg, verbose=False)
    assert [(s.id, s.prompt) for s in samples] == [("0000", PROMPTS[0]), ("0001", PROMPTS[1])]
    item = E2VDataset(cfg, samples)[1]
    assert item["video"].shape == (3, NUM_FRAMES, SIZE, SIZE) and item["element_names"] == []
    pixels = as_pixels(item["video"])
    assert item["video"].dtype == torch.uint8 and -1.0 <= pixels.min() < -0.9 and 0.9 < pixels.max() <= 1.0
