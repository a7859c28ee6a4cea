"""The A2 sampler: its first step is a hand-built transformer call on hand-built conditions (three
references), and, for a trained LoRA loaded as tools/sample.py loads it, a call on the inputs
diffusers' WanImageToVideoPipeline builds for one reference; with one reference (and for T2V) it
reproduces diffusers' own Wan pipelines; tools/sample.py writes mp4s with the configured frame
count from a trained tiny LoRA, and in bf16 keeps diffusers' fp32 modules in fp32.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_sampling_runs.py."""

from __future__ import annotations

import numpy as np
import torch
from helpers import ROOT
from helpers_sampling import _sample_tool
from PIL import Image


def _cfg(*sets):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", list(sets), check_paths=False)


def _images():
    rng = np.random.default_rng(0)
    return {"person": Image.fromarray(rng.integers(0, 256, (56, 40, 3), dtype=np.uint8)),  # taller than wide
            "object": Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)),
            "background": Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))}


def test_first_step_is_a_hand_built_transformer_call(tiny_parts):
    from e2v.conditioning.encode import build_vae_condition, encode_clip_images, encode_text
    from e2v.data.dataset import collate
    from e2v.data.media import center_crop, image_to_tensor, pad_white
    from e2v.eval.sampling import denoise, element_item, encode_conditions

    cfg, images, p = _cfg(), _images(), tiny_parts
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(1, 16, 5, 8, 8, generator=g)
    c = encode_conditions(p, cfg, collate([element_item(cfg, "a shape moves", images)]))
    with torch.no_grad():
        negative = encode_text(["static"], p.tokenizer, p.text_encoder)
    seen = []
    denoise(p.transformer, c, negative, noise, num_steps=4, guidance_scale=4.0, shift=3.0,
            on_step=lambda i, t, v: seen.append((t, v)))

    # by hand: A2's layout [person x1, object x4, background x4, grey], one VAE pass, 3 CLIP blocks
    vae_imgs = [pad_white(images["person"], 64, 64), pad_white(images["object"], 64, 64),
                center_crop(images["background"], 64, 64)]
    refs = [image_to_tensor(im)[None, :, None] for im in vae_imgs]
    clip_imgs = [np.asarray(pad_white(im, 64, 64)) for im in images.values()]
    first_t = int(1000 * 3 * 0.999 / (1 + 2 * 0.999))  # UniPC flow sigmas start at 1 - 1/1000, shifted
    with torch.no_grad():  # (UMT5 takes another attention kernel with autograd on: 5e-7 apart)
        cond = build_vae_condition(refs, [1, 4, 4], 17, p.vae)
        clip = encode_clip_images(clip_imgs, p.image_encoder, p.image_processor).reshape(1, -1, 32)
        text = encode_text(["a shape moves"], p.tokenizer, p.text_encoder)
        def call(txt):
            return p.transformer(torch.cat([noise, cond], 1), timestep=torch.tensor([first_t]),
                                 encoder_hidden_states=txt, encoder_hidden_states_image=clip, return_dict=False)[0]
        v_cond, v_uncond = call(text), call(negative)
    assert int(seen[0][0]) == first_t == 999 and len(seen) == 4
    torch.testing.assert_close(seen[0][1], v_uncond + 4.0 * (v_cond - v_uncond), atol=1e-6, rtol=0)


def test_bf16_sampling_keeps_diffusers_fp32_modules(tmp_path):
    """tools/sample.py --dtype bf16 casts the transformer as diffusers' from_pretrained(torch_dtype=
    bf16) loads it: time embedder, scale_shift_table, norms and rope tables stay fp32 (the oracle:
    a saved tiny transformer reloaded by diffusers), with their exact fp32 values."""
    import imageio.v3 as iio
    from diffusers import WanTransformer3DModel

    from e2v.models.tiny import build_tiny_parts

    tool = _sample_tool()
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    model.save_pretrained(tmp_path / "tiny")
    fp32 = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    oracle = WanTransformer3DModel.from_pretrained(tmp_path / "tiny", torch_dtype=torch.bfloat16)
    tool.to_inference_dtype(model, "cpu", torch.bfloat16)
    ours = dict([*model.named_parameters(), *model.named_buffers()])
    want = dict([*oracle.named_parameters(), *oracle.named_buffers()])
    assert {n: t.dtype for n, t in ours.items()} == {n: t.dtype for n, t in want.items()}
    kept = [n for n, t in ours.items() if t.dtype == torch.float32]
    assert any("time_embedder" in n for n in kept) and "scale_shift_table" in kept and "rope.freqs_cos" in kept
    assert all(torch.equal(ours[n], fp32[n]) for n in kept)
    assert any(t.dtype == torch.bfloat16 for t in ours.values())

    out = tmp_path / "bf16.mp4"  # the whole tool in bf16 on CPU
    tool.main(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), "--set", "e2v_type=none", "--set", "model.base=t2v",
               "--prompt", "a person walking", "--steps", "1", "--frames", "5", "--dtype", "bf16", "--device", "cpu",
               "--out", str(out)])
    assert iio.imread(out).shape == (5, 64, 64, 3)


def test_exact_velocity_model_lands_on_its_clean_latents():
    """An analytic oracle for the loop itself: for data that is a single point x0, the true
    velocity at x_t is (x_t - x0) / sigma. A loop that gets timesteps, shift, CFG plumbing or the
    UniPC update wrong does not land on x0 (the Wan pipelines' integer timesteps cost ~1e-3)."""
    import dataclasses

    from e2v.conditioning.encode import Conditions
    from e2v.eval.sampling import denoise

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 16, 5, 8, 8, generator=g)

    def oracle(model_input, timestep, encoder_hidden_states, encoder_hidden_states_image, return_dict):
        sigma = timestep.float().view(-1, 1, 1, 1, 1) / 1000
        return ((model_input[:, :16] - x0) / sigma,)

    c = Conditions(**{f.name: None for f in dataclasses.fields(Conditions)})
    c.text_BLD = torch.zeros(1, 512, 32)
    for steps, shift in ((20, 3.0), (50, 8.0)):
        out = denoise(oracle, c, torch.zeros(1, 512, 32), torch.randn(1, 16, 5, 8, 8, generator=g),
                      num_steps=steps, guidance_scale=5.0, shift=shift)
        assert (out - x0).abs().max() < 1e-2, (steps, shift, (out - x0).abs().max())
        assert (out - x0).abs().mean() < 2e-3


def test_one_reference_matches_diffusers_i2v_pipeline(tiny_parts):
    """With a single element (repeat 1) A2's layout is the Wan I2V layout: the whole sampled
    trajectory must equal WanImageToVideoPipeline's (noise first, CFG with the same image tokens)."""
    from diffusers import WanImageToVideoPipeline

    from e2v.eval.sampling import generate, make_scheduler

    cfg = _cfg("data.elements=[{name: person, suffixes: [_p.png], vae: {repeat: 1, position: 0}}]")
    p = tiny_parts
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    ours = generate(p.transformer, p, cfg, ["a shape moves"], [{"person": image}], seed=5, num_steps=3,
                    guidance_scale=2.5, shift=3.0, negative_prompt="static")
    pipe = WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                                   image_encoder=p.image_encoder, image_processor=p.image_processor,
                                   transformer=p.transformer, scheduler=make_scheduler(3.0))
    ref = pipe(image=image, prompt="a shape moves", negative_prompt="static", height=64, width=64, num_frames=17,
               num_inference_steps=3, guidance_scale=2.5, output_type="latent",
               generator=torch.Generator().manual_seed(5)).frames
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


def test_t2v_matches_diffusers_wan_pipeline():
    from diffusers import WanPipeline

    from e2v.eval.sampling import generate, make_scheduler
    from e2v.models.tiny import build_tiny_parts

    cfg = _cfg("e2v_type=none", "model.base=t2v")
    p = build_tiny_parts(seed=0, base="t2v")
    ours = generate(p.transformer, p, cfg, ["a person walking"], seed=2, num_steps=3, guidance_scale=3.0, shift=5.0)
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                       scheduler=make_scheduler(5.0))
    ref = pipe(prompt="a person walking", negative_prompt="", height=64, width=64, num_frames=17, num_inference_steps=3,
               guidance_scale=3.0, output_type="latent", generator=torch.Generator().manual_seed(2)).frames
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)


def test_element_item_matches_training_item(demo_data):
    from e2v.data.dataset import E2VDataset, index_samples
    from e2v.data.media import load_image
    from e2v.eval.sampling import element_item

    cfg = _cfg(f"data.datasets.0.data_root={demo_data}")
    sample = index_samples(cfg, verbose=False)[0]
    train_item = E2VDataset(cfg, [sample])[0]
    item = element_item(cfg, sample.prompt, {k: load_image(v) for k, v in sample.elements.items()})
    assert item["element_names"] == train_item["element_names"] == ["person", "object", "background"]
    for k in item["element_names"]:
        assert torch.equal(item["vae_refs"][k], train_item["vae_refs"][k])
        assert np.array_equal(item["clip_refs"][k], train_item["clip_refs"][k])
        assert item["vae_repeats"][k] == train_item["vae_repeats"][k]


def test_sample_py_t2v_base_without_elements(tmp_path):
    import imageio.v3 as iio

    _sample_tool().main(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), "--set", "e2v_type=none",
                         "--set", "model.base=t2v", "--prompt", "a person walking", "--steps", "2",
                         "--num-videos", "2", "--frames", "5", "--out", str(tmp_path)])
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == ["000_a_person_walking_0.mp4",
                                                                     "000_a_person_walking_1.mp4"]
    assert iio.imread(tmp_path / "base/000_a_person_walking_0.mp4").shape == (5, 64, 64, 3)
