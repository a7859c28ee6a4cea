"""Sampling in the sequence layout as SkyReels-V3 R2V samples: diffusers' UniPC (flow, shift 5)
driven by hand with the references re-attached at every step and the scheduler stepping the
video's frames only, and Phantom's three-pass dual guidance; then a LoRA trained through the
launcher on the tiny T2V preset, loaded into a plain diffusers `WanPipeline` with
`load_lora_weights`, denoised by a loop written here as V3's pipeline runs it, against
tools/sample.py: the same latents within 1e-5.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_r2v_sampling.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_launch import run_train
from helpers_r2v import R2V_TINY, SIZES, F, H, W, v3_denoise, v3_ref_latents, v3_resize_ref, v3_scheduler, v3_to_tensor
from PIL import Image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lora_run(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("r2v_runs")
    run_train(R2V_TINY, f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=r2v_lora",
              "model.training_type=lora", "model.tiny.layers=2", "model.tiny.heads=2", "model.tiny.head_dim=12",
              "model.tiny.ffn_dim=32", "lora.target_modules=[to_q,to_k,to_v,to_out.0]", "lora.rank=4",
              "train.max_steps=3", "train.lr=5e-2", "train.micro_batch_size=2", "train.checkpoint_every=3",
              "cache.enabled=false", "validation.every_n_steps=0", "visualization.enabled=false",
              f"data.num_frames={F}", f"data.resolution=[{H},{W}]")
    return out / "r2v_lora"


def test_r2v_lora_in_diffusers_wanpipeline_with_v3s_loop_equals_tools_sample(lora_run, tmp_path, monkeypatch):
    from diffusers import WanPipeline

    import e2v.eval.sample_cli as sample
    from e2v.data.media import load_image
    from e2v.models.tiny import build_tiny_parts

    refs = {}
    for k, name in enumerate(("person", "object")):
        path = tmp_path / f"{name}.png"
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (SIZES[k][1], SIZES[k][0], 3), dtype=np.uint8)).save(path)
        refs[name] = path
    captured = []
    real_generate = sample.generate

    def recording_generate(*args, **kwargs):
        captured.append(real_generate(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(sample, "generate", recording_generate)
    sample.main(["--run", str(lora_run), "--prompt", "a red shape moves", "--seed", "11", "--steps", "8",
                 "--guidance", "1", "--shift", "5", "--device", "cpu", "--dtype", "fp32",
                 "--element", f"person={refs['person']}", "--element", f"object={refs['object']}",
                 "--out", str(tmp_path / "video.mp4")])

    p = build_tiny_parts(seed=0, base="t2v")  # the run's base: the same seed, the config's default tiny shape
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                       scheduler=v3_scheduler())
    pipe.load_lora_weights(str(lora_run / "lora"))
    base = build_tiny_parts(seed=0, base="t2v").transformer
    with torch.no_grad():
        text, _ = pipe.encode_prompt("a red shape moves", do_classifier_free_guidance=False, max_sequence_length=512)
        generator = torch.Generator().manual_seed(11)  # V3's order: the noise, then each reference's posterior sample
        latents = torch.randn((1, 16, (F - 1) // 4 + 1, H // 8, W // 8), generator=generator)
        pixels = [v3_to_tensor(v3_resize_ref(load_image(refs[n]), W, H)) for n in ("person", "object")]
        condition = v3_ref_latents(pixels, p.vae, generator, "sample", 4)
        theirs = v3_denoise(pipe.transformer, latents, condition, text, None, steps=8, guidance=1.0, guidance_img=None)
        without_lora = v3_denoise(base, latents, condition, text, None, steps=8, guidance=1.0, guidance_img=None)
    assert len(captured) == 1
    torch.testing.assert_close(captured[0], theirs, rtol=0, atol=1e-5)
    assert (theirs - without_lora).abs().max() > 1e-3, "the LoRA changes the output"
    assert (tmp_path / "video.mp4").stat().st_size > 0
