"""The A2 sampler: its first step is a hand-built transformer call on hand-built conditions (three
references), and, for a trained LoRA loaded as tools/sample.py loads it, a call on the inputs
diffusers' WanImageToVideoPipeline builds for one reference; with one reference (and for T2V) it
reproduces diffusers' own Wan pipelines; tools/sample.py writes mp4s with the configured frame
count from a trained tiny LoRA, and in bf16 keeps diffusers' fp32 modules in fp32.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_sampling.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_sampling import _sample_tool
from PIL import Image

pytestmark = pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)


def test_trained_lora_first_call_takes_the_diffusers_i2v_inputs(viz_run):
    """The model as tools/sample.py loads it (parts of the run's config + its exported LoRA) on the
    real sampling path (e2v.eval.sampling.generate). Its first two transformer calls (cond, uncond) must
    receive exactly the tensors diffusers' WanImageToVideoPipeline builds for one reference
    (prepare_latents: noise + condition; encode_image; encode_prompt): with one element of repeat 1,
    A2's layout is the Wan I2V layout."""
    from diffusers import WanImageToVideoPipeline

    from e2v.config.load import load_config
    from e2v.eval.sampling import generate, load_trained, make_scheduler
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_parts

    tool = _sample_tool()
    cfg = load_config(viz_run / "config.yaml", check_paths=False)
    parts = load_parts(cfg, device="cpu")
    model = tool.to_inference_dtype(load_trained(parts.transformer, viz_run / "lora"), "cpu", torch.float32)
    calls = []

    def recorder(hidden_states, **kw):
        calls.append({"hidden_states": hidden_states, **kw})
        return model(hidden_states, **kw)

    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    generate(recorder, parts, cfg, ["a shape moves"], [{"person": image}], seed=7, num_steps=2, guidance_scale=3.0,
             shift=3.0, negative_prompt="static")
    assert len(calls) == 4  # 2 steps x (cond, uncond)

    pipe = WanImageToVideoPipeline(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae,
                                   image_encoder=parts.image_encoder, image_processor=parts.image_processor,
                                   transformer=model, scheduler=make_scheduler(3.0))
    with torch.no_grad():
        text, negative = pipe.encode_prompt("a shape moves", "static", max_sequence_length=512, device="cpu")
        clip = pipe.encode_image(image, "cpu")
        pixels = pipe.video_processor.preprocess(image, height=64, width=64).float()
        noise, condition = pipe.prepare_latents(pixels, 1, 16, 64, 64, 17, torch.float32, "cpu",
                                                torch.Generator().manual_seed(7))
        first_t = torch.tensor([999])  # UniPC flow sigmas start at 1 - 1/1000; shift 3 -> 999
        for call, txt in zip(calls[:2], (text, negative)):
            oracle = {"hidden_states": torch.cat([noise, condition], 1), "timestep": first_t,
                      "encoder_hidden_states": txt, "encoder_hidden_states_image": clip}
            for k, want in oracle.items():
                torch.testing.assert_close(call[k].float(), want.float(), atol=1e-5, rtol=0, msg=k)
        v = model(**{k: calls[0][k] for k in oracle}, return_dict=False)[0]
        base = build_tiny_parts(seed=0, with_encoders=False).transformer.eval()
        v_base = base(**{k: calls[0][k] for k in oracle}, return_dict=False)[0]
    assert (v - v_base).abs().max() > 1e-3  # the LoRA is in effect: not the base model's call


def test_sample_py_from_trained_lora(viz_run, demo_data, tmp_path):
    import imageio.v3 as iio

    out = tmp_path / "video.mp4"
    main = _sample_tool().main
    main(["--config", str(viz_run / "config.yaml"), "--lora", str(viz_run / "lora"),
          "--element", f"person={demo_data / '000_person.png'}", "--element", f"object={demo_data / '000_object.png'}",
          "--prompt", "a shape moves", "--steps", "3", "--out", str(out)])
    assert iio.imread(out).shape == (17, 64, 64, 3)  # data.num_frames of the config

    # a prompt file, 9 frames with the reference frames dropped (person x1 + object x4 = 5), base beside it
    folder = tmp_path / "cmp"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a shape moves\n# a comment\n\na dog moves slowly\n")
    main(["--config", str(viz_run / "config.yaml"), "--lora", str(viz_run / "lora"), "--prompt-file", str(prompts),
          "--element", f"person={demo_data / '000_person.png'}", "--element", f"object={demo_data / '000_object.png'}",
          "--also-base", "--steps", "2", "--frames", "9", "--drop-frames", "ref", "--out", str(folder)])
    for tag in ("base", "lora"):
        files = sorted(p.name for p in (folder / tag).glob("*.mp4"))
        assert files == ["000_a_shape_moves_0.mp4", "001_a_dog_moves_slowly_0.mp4"]
        assert iio.imread(folder / tag / files[0]).shape == (4, 64, 64, 3)  # 9 frames - F_ref 5
    base = iio.imread(folder / "base" / files[0]).astype(int)
    lora = iio.imread(folder / "lora" / files[0]).astype(int)
    assert np.abs(base - lora).max() > 0  # the LoRA changes the video
