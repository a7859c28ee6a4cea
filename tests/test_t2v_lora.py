"""The text-to-video LoRA recipe (configs/t2v_lora.yaml, docs/formats.md): an .npz JSONL
manifest, `e2v_type: none` on the 16-channel T2V transformer, LoRA on the attention projections;
the exported LoRA in a plain diffusers `WanPipeline`."""

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers_launch import run_train
from helpers_t2v import PROMPTS, make_npz_manifest, make_video_folder

from e2v.runtime.device import as_pixels

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


@pytest.fixture(scope="module")
def trained_run(npz_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("t2v_runs")
    # lr 1e-2 (config: 1e-4) so three steps move the LoRA visibly; gradient accumulation 4 as shipped.
    proc = run_train(CONFIG, *tiny_sets(npz_data), f"output_dir={out}", "run_id=t2v", "train.max_steps=3",
                     "train.lr=1e-2", "train.checkpoint_every=3")
    return out / "t2v", proc


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


def test_run_trains_lora_only_with_accumulation(trained_run):
    run, proc = trained_run
    import json

    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 4
    assert "0 tensors in full beside the LoRA" in proc.stdout
    shape = json.loads((run / "lora/e2v_model.json").read_text())
    assert shape["in_channels"] == 16 and shape["added_kv_proj_dim"] is None and shape["extra_modules"] == []
    assert not (run / "lora/e2v_modules.safetensors").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    losses = [e.value for e in ea.Scalars("train/loss")]
    assert len(losses) == 3 and all(np.isfinite(losses))
    buckets = [t for t in tags if t.startswith("train/loss_at_time_")]
    assert buckets and set(buckets) <= {f"train/loss_at_time_{a}-{a + 250}" for a in (0, 250, 500, 750)}
    assert "train/pred_latent_std" not in tags, "latent stats belong to the x0 objective"


def _pipe(p):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    return WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                       transformer=copy.deepcopy(p.transformer),  # load_lora_weights changes it in place
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         flow_shift=5.0))


def _probe_inputs():
    g = torch.Generator().manual_seed(0)
    t = (NUM_FRAMES - 1) // 4 + 1
    return dict(hidden_states=torch.randn(1, 16, t, SIZE // 8, SIZE // 8, generator=g), timestep=torch.tensor([600.0]),
                encoder_hidden_states=torch.randn(1, 512, 32, generator=g), return_dict=False)


def test_exported_lora_in_wan_pipeline_reproduces_the_trained_model(trained_run, t2v_parts):
    run, _ = trained_run

    def generate(pipe):
        return pipe(prompt="a person clapping their hands", height=SIZE, width=SIZE, num_frames=NUM_FRAMES,
                    num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames

    pipe = _pipe(t2v_parts)
    with torch.no_grad():
        base = pipe.transformer(**_probe_inputs())[0]
    video_base = generate(pipe)
    pipe.load_lora_weights(str(run / "lora"))
    with torch.no_grad():
        exported = pipe.transformer(**_probe_inputs())[0]
    video_lora = generate(pipe)
    assert (exported - base).abs().max() > 1e-3, "the LoRA did not change the transformer output"
    assert video_base.shape == video_lora.shape == (1, 16, (NUM_FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)
    assert (video_lora - video_base).abs().max() > 1e-3, "the LoRA did not change the generated latents"

    # Second path: the DeepSpeed checkpoint's module weights in a freshly built peft-wrapped model.
    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training

    cfg = load_config(run / "config.yaml", check_paths=False)
    fresh = build_tiny_parts(seed=0, base="t2v", with_encoders=False).transformer
    assert setup_training(fresh, cfg, expanded=False) == []
    from helpers import load_checkpoint_module

    state = torch.load(run / "checkpoints/step_000003/mp_rank_00_model_states.pt", weights_only=False)["module"]
    load_checkpoint_module(fresh, state)
    with torch.no_grad():
        engine_out = fresh(**_probe_inputs())[0]
    torch.testing.assert_close(exported, engine_out, atol=1e-5, rtol=0)


def test_sample_py_writes_n_videos_per_prompt_base_and_lora(trained_run, tmp_path):
    """The seed's evaluation: N videos per activity prompt, base model and LoRA with the same seeds."""
    import importlib.util

    import imageio.v3 as iio

    run, _ = trained_run
    spec = importlib.util.spec_from_file_location("sample_tool", ROOT / "tools/sample.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prompts = tmp_path / "activities.txt"
    prompts.write_text("a person clapping their hands\na person sitting\na person walking\n")
    out = tmp_path / "eval"
    tool.main(["--config", str(run / "config.yaml"), "--lora", str(run / "lora"), "--prompt-file", str(prompts),
               "--num-videos", "2", "--also-base", "--steps", "2", "--out", str(out)])
    expected = [f"{i:03d}_a_person_{a}_{k}.mp4" for i, a in enumerate(["clapping_their_hands", "sitting", "walking"])
                for k in (0, 1)]
    videos = {}
    for tag in ("base", "lora"):
        assert sorted(p.name for p in (out / tag).glob("*.mp4")) == expected
        videos[tag] = [iio.imread(out / tag / name).astype(int) for name in expected]
        assert all(v.shape == (NUM_FRAMES, SIZE, SIZE, 3) for v in videos[tag])
    assert np.abs(videos["lora"][0] - videos["lora"][1]).max() > 0, "video k uses seed + k"
    assert max(np.abs(b - l).max() for b, l in zip(videos["base"], videos["lora"])) > 0, "the LoRA changes the videos"
