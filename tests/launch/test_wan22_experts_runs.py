"""Wan2.2-I2V-A14B's two experts (e2v/config/experts.py) against diffusers' WanImageToVideoPipeline as the
oracle: its boundary switch on base experts, and two runs of the real entry point whose LoRA
exports load into the pipeline (one expert: `load_into_transformer_2=True` only; both experts,
with image attention added for the CLIP pathway) and reproduce our sampler's trajectory. Plus the
config rules of `model.expert`, the per-expert sigma draw, the zero-initialised expansion, and the
memory plan of the released model. `pytest -k wan22` selects them all.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_wan22_experts.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, read_scalars
from helpers_launch import launch_train, wait_all
from helpers_wan22 import _image, _our_latents, _pipe, _pipeline_latents
from safetensors.torch import load_file

from e2v.config.load import load_config

TINY = ("model.preset=tiny_wan22_a14b",)
RUN_BOTH = (*TINY, "model.expert=both", "train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=4",
            "validation.every_n_steps=4", "validation.num_videos=1", "validation.num_inference_steps=2",
            "validation.sigmas=[0.3,0.9]", "visualization.frequency=4")


RUN_LOW = (*TINY, "model.expert=low_noise", "e2v_type=vae", "train.max_steps=3", "train.micro_batch_size=2",
           "cache.enabled=true", "validation.every_n_steps=3", "validation.num_videos=1",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.enabled=false")


@pytest.fixture(scope="module")
def wan22_runs(demo_data, tmp_path_factory):
    """Side by side: both experts (dual: image attention added) with validation and visualization;
    the low-noise expert alone (vae) from a cache filled by tools/precompute.py, in this process,
    while the first runs."""
    from tools.precompute import main as precompute

    out = tmp_path_factory.mktemp("wan22")
    common = (f"data.datasets.0.data_root={demo_data}", f"output_dir={out}")
    low = (*common, *RUN_LOW, f"cache.dir={out / 'cache'}")
    both = launch_train("configs/e2v_tiny_lora.yaml", *common, *RUN_BOTH, "run_id=both")
    try:
        assert precompute(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                           *[a for s in low if s != "cache.enabled=true" for a in ("--set", s)]]) == 0
    except BaseException:
        both.kill()
        raise
    wait_all(both, launch_train("configs/e2v_tiny_lora.yaml", *low, "run_id=low"))
    return {"both": out / "both", "low": out / "low"}


def test_wan22_runs_train_validate_and_export_per_expert(wan22_runs):
    both, low = read_scalars(wan22_runs["both"]), read_scalars(wan22_runs["low"])
    seen = {k for s in both.values() for k in s if k.startswith("train/loss_") and "noise" in k}
    assert seen == {"train/loss_high_noise", "train/loss_low_noise"}  # micro-batches went to each expert
    assert {k for s in low.values() for k in s if "noise" in k} == {"train/loss_low_noise"}
    assert {"val/loss_at_sigma_0.3", "val/loss_at_sigma_0.9", "val/reference_gap_shuffle"} <= set(both[4])
    # one expert: only its own sigmas are scored; the videos switch to the base high-noise expert
    assert "val/loss_at_sigma_0.3" in low[3] and "val/loss_at_sigma_0.9" not in low[3]
    for run in wan22_runs.values():
        assert list((run / "samples").glob("step_*/00.mp4"))
    assert (wan22_runs["both"] / "visualizations/step_000004/contact_sheet.png").exists()
    files = {"pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors", "e2v_model.json"}
    assert sorted(p.name for p in (wan22_runs["low"] / "lora").iterdir()) == ["low_noise"]
    assert files | {"e2v_modules.safetensors"} <= {p.name for p in (wan22_runs["low"] / "lora/low_noise").iterdir()}
    for expert in ("high_noise", "low_noise"):
        folder = wan22_runs["both"] / "lora" / expert
        assert files | {"e2v_modules.safetensors", "e2v_modules_comfyui.safetensors"} <= {p.name for p in folder.iterdir()}
        meta = json.loads((folder / "e2v_model.json").read_text())
        assert meta["image_dim"] == 32 and any("add_k_proj" in n for n in meta["extra_modules"])
        assert not any(k.startswith(("high_noise", "low_noise")) for k in load_file(str(folder / "pytorch_lora_weights.safetensors")))
        comfy = load_file(str(folder / "pytorch_lora_weights_comfyui.safetensors"))
        # the expert's base modules trained in full are differences; the added image attention is not
        assert "diffusion_model.patch_embedding.diff" in comfy and "diffusion_model.head.head.diff" in comfy
        assert not any(".k_img." in k and k.endswith("diff") for k in comfy)


def test_wan22_offline_export_of_a_checkpoint_matches_the_run_export(wan22_runs, tmp_path):
    from e2v.train.checkpoint import export_checkpoint

    run = wan22_runs["both"]
    export_checkpoint(run / "checkpoints/step_000004", tmp_path)
    for expert in ("high_noise", "low_noise"):
        for name in ("pytorch_lora_weights.safetensors", "e2v_modules.safetensors", "e2v_modules_comfyui.safetensors",
                     "pytorch_lora_weights_comfyui.safetensors"):
            want, got = load_file(str(run / "lora" / expert / name)), load_file(str(tmp_path / expert / name))
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (expert, name)


def test_wan22_both_expert_exports_load_into_the_pipeline(wan22_runs):
    """Both experts trained (dual: image attention added): the T2V-style rebuild of each expert's
    shape (expand_from_export), its LoRA (`load_into_transformer_2=True` for low noise) and its
    modules trained in full, in WanImageToVideoPipeline with CLIP: the trajectory equals our
    sampler's on the model tools/sample.py loads, and differs from the base pipeline's."""
    from e2v.eval.sampling import load_trained
    from e2v.models.expand import expand_from_export
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.export import load_extra_modules

    run = wan22_runs["both"]
    cfg = load_config(run / "config.yaml", check_paths=False)
    parts = load_parts(cfg, all_experts=True)
    ours = _our_latents(load_trained(parts.transformer, run / "lora"), parts, cfg, _image(2))

    def pipe(trained: bool):
        base = build_tiny_experts(0, ("high_noise", "low_noise"))
        high, low = (expand_from_export(base[e], run / "lora" / e) for e in ("high_noise", "low_noise"))
        p = _pipe(parts, high, low, image_encoder=parts.image_encoder, image_processor=parts.image_processor)
        if trained:
            p.load_lora_weights(str(run / "lora/high_noise"))
            p.load_lora_weights(str(run / "lora/low_noise"), load_into_transformer_2=True)
            load_extra_modules(p.transformer, run / "lora/high_noise")
            load_extra_modules(p.transformer_2, run / "lora/low_noise")
        return p

    ref = _pipeline_latents(pipe(True), _image(2))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    assert (ref - _pipeline_latents(pipe(False), _image(2))).abs().max() > 1e-3


def test_wan22_one_expert_export_loads_into_transformer_2(wan22_runs, tmp_path):
    """The low-noise expert alone: its LoRA and modules in the pipeline's transformer_2, the base
    transformer untouched, equal our sampler on (base high, trained low), and not the base video.
    Its ComfyUI copy (the LoRA through diffusers' ComfyUI converter, the modules trained in full
    added as ComfyUI adds `.diff`s) gives the same trajectory. tools/sample.py writes the video."""
    import importlib.util

    import imageio.v3 as iio
    from helpers_comfy import apply_diffs, split

    from e2v.eval.sampling import load_trained
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.export import load_extra_modules

    run = wan22_runs["low"]
    cfg = load_config(run / "config.yaml", check_paths=False)
    parts = load_parts(cfg, all_experts=True)
    model = load_trained(parts.transformer, run / "lora")
    assert not hasattr(model.high_noise, "peft_config") and hasattr(model.low_noise, "peft_config")
    ours = _our_latents(model, parts, cfg, _image(3))

    def pipe():
        base = build_tiny_experts(0, ("high_noise", "low_noise"))
        return _pipe(parts, base["high_noise"], base["low_noise"])

    p = pipe()
    p.load_lora_weights(str(run / "lora/low_noise"), load_into_transformer_2=True)
    load_extra_modules(p.transformer_2, run / "lora/low_noise")
    assert not hasattr(p.transformer, "peft_config")
    ref = _pipeline_latents(p, _image(3))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    assert (ref - _pipeline_latents(pipe(), _image(3))).abs().max() > 1e-3

    lora, diffs = split(load_file(str(run / "lora/low_noise/pytorch_lora_weights_comfyui.safetensors")))
    assert diffs and all(k.startswith("diffusion_model.") for k in lora)
    comfy = pipe()
    comfy.load_lora_weights(lora, load_into_transformer_2=True)
    apply_diffs(comfy.transformer_2, diffs)
    torch.testing.assert_close(_pipeline_latents(comfy, _image(3)), ref, atol=2e-5, rtol=0)

    spec = importlib.util.spec_from_file_location("sample_tool", ROOT / "tools/sample.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _image(3).save(tmp_path / "p.png")
    tool.main(["--config", str(run / "config.yaml"), "--lora", str(run / "lora"), "--prompt", "a shape moves",
               "--element", f"person={tmp_path / 'p.png'}", "--steps", "2", "--out", str(tmp_path / "v.mp4")])
    assert iio.imread(tmp_path / "v.mp4").shape == (17, 64, 64, 3)
