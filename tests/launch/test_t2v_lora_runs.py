"""The text-to-video LoRA recipe (configs/t2v_lora.yaml, docs/formats.md): an .npz JSONL
manifest, `e2v_type: none` on the 16-channel T2V transformer, LoRA on the attention projections;
the exported LoRA in a plain diffusers `WanPipeline`.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_t2v_lora.py."""

import copy

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers_launch import run_train
from helpers_t2v import CONFIG, NUM_FRAMES, SIZE, tiny_sets


@pytest.fixture(scope="module")
def trained_run(npz_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("t2v_runs")
    # lr 1e-2 (config: 1e-4) so three steps move the LoRA visibly; gradient accumulation 4 as shipped;
    # no periodic checkpoint (checkpoint_every 0): the run saves once, at its end.
    proc = run_train(CONFIG, *tiny_sets(npz_data), f"output_dir={out}", "run_id=t2v", "train.max_steps=3",
                     "train.lr=1e-2", "train.checkpoint_every=0")
    return out / "t2v", proc


def test_run_saves_at_its_end_and_names_the_encoders_it_loaded(trained_run):
    """checkpoint_every 0: the end-of-run save only; a T2V run loads no image encoder, and says so."""
    run, proc = trained_run
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000003"]
    assert "frozen encoders loaded: vae, text_encoder\n" in proc.stdout, proc.stdout[-2000:]


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
