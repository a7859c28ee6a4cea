"""Sampling in the sequence layout as SkyReels-V3 R2V samples: diffusers' UniPC (flow, shift 5)
driven by hand with the references re-attached at every step and the scheduler stepping the
video's frames only, and Phantom's three-pass dual guidance; then a LoRA trained through the
launcher on the tiny T2V preset, loaded into a plain diffusers `WanPipeline` with
`load_lora_weights`, denoised by a loop written here as V3's pipeline runs it, against
tools/sample.py: the same latents within 1e-5."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers_launch import run_train
from helpers_r2v import R2V_TINY, SIZES, F, H, W, _batch, _cfg, _image, v3_ref_latents, v3_resize_ref, v3_to_tensor
from PIL import Image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def t2v_parts():
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0, base="t2v")


def v3_scheduler(shift: float = 5.0):
    """`ReferenceToVideoPipeline.__init__`'s scheduler."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=shift)


def v3_denoise(transformer, latents, condition, text, negative, *, steps, guidance, guidance_img, shift=5.0):
    """V3's denoising loop (`WanSkyReelsA2WanT2VPipeline.__call__`, step 6), written from its code."""
    scheduler = v3_scheduler(shift)
    scheduler.set_timesteps(steps, device="cpu")
    uncondition = torch.zeros_like(condition)
    for t in scheduler.timesteps:
        timestep = t.expand(latents.shape[0])
        pred = transformer(hidden_states=torch.cat([latents, condition], dim=2), timestep=timestep,
                           encoder_hidden_states=text, return_dict=False)[0][:, :, : latents.shape[2]]
        if guidance > 1:
            u_txt = transformer(hidden_states=torch.cat([latents, condition], dim=2), timestep=timestep,
                                encoder_hidden_states=negative, return_dict=False)[0][:, :, : latents.shape[2]]
            u_all = transformer(hidden_states=torch.cat([latents, uncondition], dim=2), timestep=timestep,
                                encoder_hidden_states=negative, return_dict=False)[0][:, :, : latents.shape[2]]
            pred = u_all + guidance_img * (u_txt - u_all) + guidance * (pred - u_txt)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


def _conditions(parts, cfg, images):
    from e2v.conditioning.layout import batch_conditions

    with torch.no_grad():
        return batch_conditions(_batch(cfg, [images]), parts, cfg, rng=random.Random(0),
                                generator=torch.Generator().manual_seed(0), train=False)


def test_r2v_one_unipc_step_equals_the_scheduler_driven_by_hand(t2v_parts):
    """The first step: the velocity from the video's frames of cat([x, slots]) at t, and
    UniPCMultistepScheduler.step on the video's latents alone, driven here by hand."""
    from e2v.eval.sampling import denoise

    cfg = _cfg(2)
    c = _conditions(t2v_parts, cfg, {"e0": _image(1, SIZES[0]), "e1": _image(2, SIZES[1])})
    noise = torch.randn(c.latents_BCTHW.shape, generator=torch.Generator().manual_seed(9))
    seen = []
    with torch.no_grad():
        ours = denoise(t2v_parts.transformer, c, None, noise, num_steps=1, guidance_scale=1.0, shift=5.0,
                       on_step=lambda i, t, v: seen.append((t, v)))
        scheduler = v3_scheduler()
        scheduler.set_timesteps(1, device="cpu")
        t = scheduler.timesteps[0]
        x = torch.cat([noise, c.ref_latents_BCNhw], dim=2)
        v = t2v_parts.transformer(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=c.text_BLD,
                                  return_dict=False)[0][:, :, : noise.shape[2]]
        expected = scheduler.step(v, t, noise, return_dict=False)[0]
    assert torch.equal(seen[0][0], t) and torch.equal(seen[0][1], v)
    assert ours.shape == noise.shape and torch.equal(ours, expected)


@pytest.mark.parametrize("guidance, guidance_img", [(1.0, None), (4.0, 2.5)], ids=["v3_guidance_1", "phantom_dual"])
def test_r2v_eight_steps_equal_v3s_loop(t2v_parts, guidance, guidance_img):
    """8 UniPC steps at shift 5 (V3's R2V defaults), and Phantom's dual guidance (the image-free
    branch: every slot zero, the negative prompt)."""
    from e2v.conditioning.encode import encode_text
    from e2v.eval.sampling import denoise

    cfg = _cfg(3)
    c = _conditions(t2v_parts, cfg, {f"e{k}": _image(20 + k, SIZES[k]) for k in range(3)})
    noise = torch.randn(c.latents_BCTHW.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        negative = encode_text(["blurry"], t2v_parts.tokenizer, t2v_parts.text_encoder)
        ours = denoise(t2v_parts.transformer, c, negative, noise, num_steps=8, guidance_scale=guidance, shift=5.0,
                       image_guidance_scale=guidance_img)
        theirs = v3_denoise(t2v_parts.transformer, noise, c.ref_latents_BCNhw, c.text_BLD, negative, steps=8,
                            guidance=guidance, guidance_img=guidance_img)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_r2v_on_wan22_t2v_experts_each_step_goes_to_the_pipelines_expert():
    """Wan2.2-T2V-A14B in the sequence layout (the tiny two-expert preset with model.base t2v:
    16-channel experts): our sampler on the two experts equals V3's loop whose transformer call is
    WanPipeline's switch (t >= boundary_ratio x 1000: `transformer`, else `transformer_2`), written
    here; both experts ran, and they differ."""
    from e2v.config.experts import TINY_BOUNDARY_RATIO
    from e2v.eval.sampling import denoise
    from e2v.models.load import load_parts

    cfg = _cfg(2, "model.preset=tiny_wan22_a14b", "model.expert=both")
    parts = load_parts(cfg)
    two = parts.transformer
    assert [e.config.in_channels for e in two.experts.values()] == [16, 16]
    c = _conditions(parts, cfg, {"e0": _image(4, SIZES[2]), "e1": _image(5, SIZES[3])})
    noise = torch.randn(c.latents_BCTHW.shape, generator=torch.Generator().manual_seed(2))
    ran = []

    def wan_pipeline_switch(hidden_states, timestep, **kwargs):
        expert = two.high_noise if timestep[0] >= TINY_BOUNDARY_RATIO * 1000 else two.low_noise
        ran.append(expert is two.high_noise)
        return expert(hidden_states=hidden_states, timestep=timestep, **kwargs)

    with torch.no_grad():
        ours = denoise(two, c, None, noise, num_steps=8, guidance_scale=1.0, shift=5.0)
        theirs = v3_denoise(wan_pipeline_switch, noise, c.ref_latents_BCNhw, c.text_BLD, None, steps=8, guidance=1.0,
                            guidance_img=None)
        probe = dict(hidden_states=torch.cat([noise, c.ref_latents_BCNhw], 2), timestep=torch.tensor([950]),
                     encoder_hidden_states=c.text_BLD, return_dict=False)
        differ = (two.high_noise(**probe)[0] - two.low_noise(**probe)[0]).abs().max()
    assert True in ran and False in ran and differ > 1e-2
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# --- a LoRA trained through the launcher, in a plain diffusers WanPipeline ---------------------------


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


@pytest.mark.train
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
