"""The real entry point, end to end: `deepspeed train_e2v.py` on the tiny config (the session's
`viz_run`: validation and visualizations on, which must leave the losses alone), then the exported
LoRA in a fresh, plain diffusers WanImageToVideoPipeline."""

import json
import os
import platform
from pathlib import Path

import pytest
import torch
import yaml
from helpers import read_scalars

pytestmark = pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)

GOLDEN = Path(__file__).resolve().parents[1] / "golden_losses.json"


@pytest.fixture(scope="module")
def trained_run(viz_run, viz_run_output):
    return viz_run, viz_run_output


def _pipe():
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from e2v.models.tiny import build_tiny_parts

    p = build_tiny_parts(seed=0)
    return WanImageToVideoPipeline(
        tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, image_encoder=p.image_encoder,
        image_processor=p.image_processor, transformer=p.transformer,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    )


def _probe_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                encoder_hidden_states_image=torch.randn(1, 17 * 3, 32, generator=g), return_dict=False)


def test_run_folder_and_logs(trained_run):
    run, proc = trained_run
    assert "LoRA:" in proc.stdout and "TensorBoard:" in proc.stdout
    if platform.libc_ver()[0] == "glibc":  # e2v/runtime/hostmem.py, set before the weights load
        assert "[e2v] malloc: blocks of 4 MiB and more go back to the OS when freed" in proc.stdout
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 4
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 2
    assert "auto" not in json.dumps(ds)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    assert (run / "checkpoints/latest").read_text() == "step_000004"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    losses = [e.value for e in ea.Scalars("train/loss")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    for tag in ("train/lr", "train/grad_norm", "perf/step_time_s", "perf/samples_per_s"):
        assert tag in ea.Tags()["scalars"]


def test_golden_losses(trained_run):
    """Golden losses: the fixed-seed tiny run's first losses. A change meant to keep the numerics
    (a refactor, a faster data path) must reproduce them; a change that moves them on purpose
    says so in its commit and rewrites the file with E2V_UPDATE_GOLDEN=1. The tolerance only
    absorbs float32 kernel differences between CPUs (~1e-7); any change to the data, the
    conditioning, the RNG order or the update moves them by far more."""
    run, _ = trained_run
    losses = [read_scalars(run)[step]["train/loss"] for step in range(1, 5)]
    golden = json.loads(GOLDEN.read_text())
    if os.environ.get("E2V_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({**golden, "e2e_tiny": losses}, indent=2) + "\n")
    assert losses == pytest.approx(golden["e2e_tiny"], rel=1e-5, abs=0), (losses, golden["e2e_tiny"])


def test_exported_lora_loads_in_plain_diffusers_and_reproduces_checkpoint(trained_run):
    run, _ = trained_run
    from e2v.train.export import load_extra_modules

    pipe = _pipe()
    with torch.no_grad():
        base = pipe.transformer(**_probe_inputs())[0]
    pipe.load_lora_weights(str(run / "lora"))
    with torch.no_grad():
        lora_only = pipe.transformer(**_probe_inputs())[0]
    assert (lora_only - base).abs().max() > 1e-4, "the LoRA did not change the output"
    loaded = load_extra_modules(pipe.transformer, run / "lora")
    assert "patch_embedding.weight" in loaded
    with torch.no_grad():
        exported = pipe.transformer(**_probe_inputs())[0]

    # Second path: the DeepSpeed checkpoint's module weights in a freshly built peft model.
    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training

    cfg = load_config(run / "config.yaml", check_paths=False)
    fresh = build_tiny_parts(seed=0, with_encoders=False).transformer
    setup_training(fresh, cfg, expanded=False)
    from helpers import load_checkpoint_module

    state = torch.load(run / "checkpoints/step_000004/mp_rank_00_model_states.pt", weights_only=False)["module"]
    load_checkpoint_module(fresh, state)
    with torch.no_grad():
        engine_out = fresh(**_probe_inputs())[0]
    torch.testing.assert_close(exported, engine_out, atol=1e-5, rtol=0)


def test_pipeline_output_changes_with_lora(trained_run):
    run, _ = trained_run
    from PIL import Image

    def generate(pipe):
        img = Image.new("RGB", (64, 64), (200, 30, 30))
        return pipe(image=img, prompt="a shape moves", height=64, width=64, num_frames=17, num_inference_steps=2,
                    guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    pipe = _pipe()
    before = generate(pipe)
    pipe.load_lora_weights(str(run / "lora"))
    after = generate(pipe)
    assert before.shape == after.shape == (1, 16, 5, 8, 8)
    assert (after - before).abs().max() > 1e-4
