"""Conditioning against independent oracles: diffusers' WanImageToVideoPipeline (one reference) and
hand-built tensors for A2's multi-reference layout."""

import torch

from e2v.conditioning.encode import build_vae_condition, condition_mask, condition_video, encode_text


def _i2v_pipe(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    return WanImageToVideoPipeline(
        tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), image_processor=parts.image_processor,
        image_encoder=parts.image_encoder, transformer=parts.transformer,
    )


def test_one_reference_equals_diffusers_i2v_condition(tiny_parts):
    pipe = _i2v_pipe(tiny_parts)
    g = torch.Generator().manual_seed(0)
    image_B3HW = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    with torch.no_grad():
        # the pipeline takes one image per call (it repeats the condition over its batch)
        expected = torch.cat([
            pipe.prepare_latents(image_B3HW[i:i + 1], 1, 16, 64, 64, 17, torch.float32, torch.device("cpu"),
                                 generator=torch.Generator().manual_seed(1))[1]
            for i in range(2)
        ])
        ours = torch.cat([build_vae_condition([image_B3HW[i:i + 1].unsqueeze(2)], [1], 17, tiny_parts.vae)
                          for i in range(2)])
        batched = build_vae_condition([image_B3HW.unsqueeze(2)], [1], 17, tiny_parts.vae)
    assert ours.shape == expected.shape == (2, 20, 5, 8, 8)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    # a batch of 2 through the VAE differs from two batches of 1 only by conv summation order
    torch.testing.assert_close(batched, expected, atol=3e-5, rtol=0)


def test_three_references_repeats_144_fill_latent_frames_0_to_2(tiny_parts):
    refs = [torch.full((1, 3, 1, 64, 64), v) for v in (-0.5, 0.25, 0.75)]
    video = condition_video(refs, [1, 4, 4], 17)
    assert video.shape == (1, 3, 17, 64, 64)
    assert (video[:, :, 0] == -0.5).all() and (video[:, :, 1:5] == 0.25).all() and (video[:, :, 5:9] == 0.75).all()
    assert (video[:, :, 9:] == 0).all()
    mask = condition_mask([9], 17, 8, 8)
    assert mask.shape == (1, 4, 5, 8, 8)
    assert (mask[:, :, :3] == 1).all() and (mask[:, :, 3:] == 0).all()
    with torch.no_grad():
        cond = build_vae_condition(refs, [1, 4, 4], 17, tiny_parts.vae)
        one_pass = tiny_parts.vae.encode(video).latent_dist.mode()
    assert cond.shape == (1, 20, 5, 8, 8)
    torch.testing.assert_close(cond[:, :4], mask)
    # ONE encode of the whole condition video (A2's combine=before), normalised with 1/std.
    mean = torch.tensor(tiny_parts.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(tiny_parts.vae.config.latents_std).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(cond[:, 4:], (one_pass - mean) * inv_std, atol=1e-6, rtol=0)


def test_one_reference_mask_is_plain_i2v_mask():
    mask = condition_mask([1], 17, 2, 2)
    assert (mask[:, :, 0] == 1).all() and (mask[:, :, 1:] == 0).all()
    mask2 = condition_mask([5], 17, 2, 2)  # N=2 with repeats 1,4: latent frames 0 and 1
    assert (mask2[:, :, :2] == 1).all() and (mask2[:, :, 2:] == 0).all()


def test_text_is_padded_to_512_and_zero_after_prompt(tiny_parts):
    with torch.no_grad():
        text = encode_text(["a shape moves across a patterned background", ""], tiny_parts.tokenizer,
                           tiny_parts.text_encoder)
    assert text.shape == (2, 512, 32)
    n0 = len("a shape moves across a patterned background".split()) + 1  # + </s>
    assert text[0, :n0].abs().sum(-1).gt(0).all() and (text[0, n0:] == 0).all()
    assert text[1, :1].abs().sum() > 0 and (text[1, 1:] == 0).all()  # empty prompt = the single </s>


def test_text_matches_diffusers_wan_pipeline(tiny_parts):
    pipe = _i2v_pipe(tiny_parts)
    # The second and third need the pipelines' prompt_clean (HTML entities, curly quotes, newlines).
    prompts = ["a shape moves across a patterned background", "an object &amp; a “shape”\n  glide ", "an object glides"]
    with torch.no_grad():
        expected = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=512, device=torch.device("cpu"))
        ours = encode_text(prompts, tiny_parts.tokenizer, tiny_parts.text_encoder)
    torch.testing.assert_close(ours, expected.float(), atol=1e-6, rtol=0)


def test_clip_tokens_match_diffusers_i2v_encode_image(tiny_parts):
    """Penultimate hidden states with CLS kept, as the pipeline's encode_image returns them."""
    import numpy as np

    from e2v.conditioning.encode import encode_clip_images

    pipe = _i2v_pipe(tiny_parts)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]
    with torch.no_grad():
        expected = pipe.encode_image(images, device=torch.device("cpu"))
        ours = encode_clip_images(images, tiny_parts.image_encoder, tiny_parts.image_processor)
    assert ours.shape == (3, 17, 32)
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=0)
