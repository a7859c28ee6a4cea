"""What the Wan2.2 tests share (tests/unit/test_wan22_experts.py, tests/unit/test_wan22_ti2v.py and their
launch halves in tests/launch/): the reference image, the two-expert pipeline oracle, the tiny TI2V parts."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

S = 64  # test videos: 64 x 64 -> latents 4 x 4 under the 16x Wan2.2 VAE (2 x 2 tokens a frame)


def _image(seed: int = 1, size: int = S) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _pipe(parts, high, low, **kw):
    from diffusers import WanImageToVideoPipeline

    from e2v.config.experts import TINY_BOUNDARY_RATIO
    from e2v.eval.sampling import make_scheduler

    return WanImageToVideoPipeline(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae,
                                   transformer=high, transformer_2=low, boundary_ratio=TINY_BOUNDARY_RATIO,
                                   scheduler=make_scheduler(3.0), **kw)


SAMPLE = dict(prompt="a shape moves", negative_prompt="static", seed=5, steps=4, guidance=2.5)


def _pipeline_latents(pipe, image):
    import torch  # here, not at the top: tests/conftest.py loads this file in the pytest-xdist controller too

    return pipe(image=image, prompt=SAMPLE["prompt"], negative_prompt=SAMPLE["negative_prompt"], height=64, width=64,
                num_frames=17, num_inference_steps=SAMPLE["steps"], guidance_scale=SAMPLE["guidance"],
                output_type="latent", generator=torch.Generator().manual_seed(SAMPLE["seed"])).frames


def _our_latents(model, parts, cfg, image):
    from e2v.eval.sampling import generate

    return generate(model, parts, cfg, [SAMPLE["prompt"]], [{"person": image}], seed=SAMPLE["seed"],
                    num_steps=SAMPLE["steps"], guidance_scale=SAMPLE["guidance"], shift=3.0,
                    negative_prompt=SAMPLE["negative_prompt"])


@pytest.fixture(scope="module")
def ti2v_parts():
    from e2v.models.tiny import build_tiny_parts

    return build_tiny_parts(seed=0, base="ti2v")
