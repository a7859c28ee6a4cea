"""Sampling in the sequence layout as SkyReels-V3 R2V samples: diffusers' UniPC (flow, shift 5)
driven by hand with the references re-attached at every step and the scheduler stepping the
video's frames only, and Phantom's three-pass dual guidance; then a LoRA trained through the
launcher on the tiny T2V preset, loaded into a plain diffusers `WanPipeline` with
`load_lora_weights`, denoised by a loop written here as V3's pipeline runs it, against
tools/sample.py: the same latents within 1e-5.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_r2v_sampling_runs.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_r2v import SIZES, _batch, _cfg, _image, v3_denoise, v3_scheduler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def t2v_parts():
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0, base="t2v")


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
