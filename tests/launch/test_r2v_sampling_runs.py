"""Sampling in the sequence layout as SkyReels-V3 R2V samples: diffusers' UniPC (flow, shift 5)
driven by hand with the references re-attached at every step and the scheduler stepping the
video's frames only, and Phantom's three-pass dual guidance; then a LoRA trained through the
launcher on the tiny T2V preset, loaded into a plain diffusers `WanPipeline` with
`load_lora_weights`, denoised by a loop written here as V3's pipeline runs it, against
tools/sample.py: the same latents within 1e-5; the same for Wan2.2-T2V-A14B's two experts, each
expert's LoRA in the pipeline's `transformer` and `transformer_2`.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_r2v_sampling.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_launch import launch_train, wait_all
from helpers_r2v import R2V_TINY, SIZES, F, H, W, v3_denoise, v3_ref_latents, v3_resize_ref, v3_scheduler, v3_to_tensor
from PIL import Image

pytestmark = pytest.mark.usefixtures("one_thread")


# a LoRA on a small tiny T2V, three steps at a high rate (so it changes the output), encoding each step
SMALL_LORA = ("model.training_type=lora", "model.tiny.layers=2", "model.tiny.heads=2", "model.tiny.head_dim=12",
              "model.tiny.ffn_dim=32", "lora.target_modules=[to_q,to_k,to_v,to_out.0]", "lora.rank=4",
              "train.max_steps=3", "train.lr=5e-2", "train.micro_batch_size=2", "train.checkpoint_every=3",
              "cache.enabled=false", "validation.every_n_steps=0", "visualization.enabled=false",
              f"data.num_frames={F}", f"data.resolution=[{H},{W}]")


@pytest.fixture(scope="module")
def lora_runs(demo_data, tmp_path_factory):
    """Side by side: the tiny T2V, and Wan2.2-T2V-A14B's shape (the tiny two-expert preset with
    16-channel experts), both experts trained in one run."""
    out = tmp_path_factory.mktemp("r2v_runs")
    common = (f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", *SMALL_LORA)
    wait_all(launch_train(R2V_TINY, *common, "run_id=r2v_lora"),
             launch_train(R2V_TINY, *common, "run_id=r2v_wan22", "model.preset=tiny_wan22_a14b", "model.expert=both"))
    return {"t2v": out / "r2v_lora", "wan22": out / "r2v_wan22"}


def _references(tmp_path) -> dict:
    refs = {}
    for k, name in enumerate(("person", "object")):
        path = tmp_path / f"{name}.png"
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (SIZES[k][1], SIZES[k][0], 3), dtype=np.uint8)).save(path)
        refs[name] = path
    return refs


def _sample_cli(run, refs, out, monkeypatch) -> torch.Tensor:
    """tools/sample.py on the run, V3's settings (8 steps, guidance 1, shift 5): the latents it denoised."""
    import e2v.eval.sample_cli as sample
    import e2v.eval.sampling as sampling  # sample_cli imports generate from here when it runs

    captured = []
    real_generate = sampling.generate

    def recording_generate(*args, **kwargs):
        captured.append(real_generate(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(sampling, "generate", recording_generate)
    sample.main(["--run", str(run), "--prompt", "a red shape moves", "--seed", "11", "--steps", "8",
                 "--guidance", "1", "--shift", "5", "--device", "cpu", "--dtype", "fp32",
                 "--element", f"person={refs['person']}", "--element", f"object={refs['object']}", "--out", str(out)])
    assert len(captured) == 1 and out.stat().st_size > 0
    return captured[0]


def _v3_inputs(pipe, vae, refs):
    """V3's pipeline before its loop: the prompt's embedding, the noise, then each reference's
    posterior sample from the same generator (V3's order), zero slots to 4."""
    from e2v.data.media import load_image

    text, _ = pipe.encode_prompt("a red shape moves", do_classifier_free_guidance=False, max_sequence_length=512)
    generator = torch.Generator().manual_seed(11)
    latents = torch.randn((1, 16, (F - 1) // 4 + 1, H // 8, W // 8), generator=generator)
    pixels = [v3_to_tensor(v3_resize_ref(load_image(refs[n]), W, H)) for n in ("person", "object")]
    return text, latents, v3_ref_latents(pixels, vae, generator, "sample", 4)


def test_r2v_lora_in_diffusers_wanpipeline_with_v3s_loop_equals_tools_sample(lora_runs, tmp_path, monkeypatch):
    from diffusers import WanPipeline

    from e2v.models.tiny import build_tiny_parts

    lora_run = lora_runs["t2v"]
    refs = _references(tmp_path)
    ours = _sample_cli(lora_run, refs, tmp_path / "video.mp4", monkeypatch)
    p = build_tiny_parts(seed=0, base="t2v")  # the run's base: the same seed, the config's default tiny shape
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                       scheduler=v3_scheduler())
    pipe.load_lora_weights(str(lora_run / "lora"))
    base = build_tiny_parts(seed=0, base="t2v").transformer
    with torch.no_grad():
        text, latents, condition = _v3_inputs(pipe, p.vae, refs)
        theirs = v3_denoise(pipe.transformer, latents, condition, text, None, steps=8, guidance=1.0, guidance_img=None)
        without_lora = v3_denoise(base, latents, condition, text, None, steps=8, guidance=1.0, guidance_img=None)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (theirs - without_lora).abs().max() > 1e-3, "the LoRA changes the output"


def test_r2v_wan22_t2v_expert_loras_in_wanpipeline_with_v3s_loop_equal_tools_sample(lora_runs, tmp_path, monkeypatch):
    """Wan2.2-T2V-A14B's shape in the sequence layout: each expert's LoRA loads into a diffusers
    WanPipeline (`transformer`, `transformer_2` with `load_into_transformer_2=True`, the run's
    boundary_ratio); V3's loop, its transformer call the pipeline's switch (t >= boundary_ratio x
    1000: `transformer`, else `transformer_2`), gives tools/sample.py's latents."""
    from diffusers import WanPipeline

    from e2v.config.experts import boundary_ratio
    from e2v.config.load import load_config
    from e2v.models.load import load_parts

    run = lora_runs["wan22"]
    assert sorted(p.name for p in (run / "lora").iterdir()) == ["high_noise", "low_noise"]
    refs = _references(tmp_path)
    ours = _sample_cli(run, refs, tmp_path / "video.mp4", monkeypatch)
    cfg = load_config(run / "config.yaml", check_paths=False)
    p = load_parts(cfg, all_experts=True)  # the run's base experts, as built from its config
    assert [e.config.in_channels for e in p.transformer.experts.values()] == [16, 16]
    ratio = boundary_ratio(cfg)
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=v3_scheduler(),
                       transformer=p.transformer.high_noise, transformer_2=p.transformer.low_noise, boundary_ratio=ratio)
    pipe.load_lora_weights(str(run / "lora/high_noise"))
    pipe.load_lora_weights(str(run / "lora/low_noise"), load_into_transformer_2=True)
    ran = []

    def wan_pipeline_switch(hidden_states, timestep, **kwargs):
        expert = pipe.transformer if timestep[0] >= pipe.config.boundary_ratio * 1000 else pipe.transformer_2
        ran.append(expert is pipe.transformer)
        return expert(hidden_states=hidden_states, timestep=timestep, **kwargs)

    with torch.no_grad():
        text, latents, condition = _v3_inputs(pipe, p.vae, refs)
        theirs = v3_denoise(wan_pipeline_switch, latents, condition, text, None, steps=8, guidance=1.0,
                            guidance_img=None)
        pipe.disable_lora()
        without_lora = v3_denoise(wan_pipeline_switch, latents, condition, text, None, steps=8, guidance=1.0,
                                  guidance_img=None)
    assert True in ran and False in ran  # both experts denoised
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (theirs - without_lora).abs().max() > 1e-3, "the LoRAs change the output"
