"""The sequence layout against ComfyUI's own code (a ComfyUI checkout named by $E2V_COMFYUI; skipped
without one, tests/helpers_comfy.py): what its `WanPhantomSubjectToVideo` node does to a reference
before the VAE (comfy.utils.common_upscale, "bilinear", "center") is e2v's `crop_bilinear`, and its
Wan model, given the reference latents as `time_dim_concat` (the node's conditioning), predicts
what e2v's training step predicts for the video's frames with the same slots, on the same weights
(loaded from e2v's ComfyUI single-file export)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel  # before ComfyUI's import (its torchvision stand-in)
from helpers_comfy import comfyui_or_skip
from PIL import Image
from safetensors.torch import load_file

# A tiny T2V transformer ComfyUI's model detection reads: its text width (4096), time width (256) and
# 128-wide heads; 16 input channels and no image attention (a Wan2.1 T2V / SkyReels-V3 R2V shape).
T2V_SHAPE = dict(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, in_channels=16,
                 out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)


@pytest.mark.parametrize("size", [(50, 80), (90, 40), (64, 64)])
def test_r2v_crop_bilinear_is_the_phantom_nodes_resize(size):
    _, utils = comfyui_or_skip()
    from e2v.data.media import crop_bilinear_tensor

    img = Image.fromarray(np.random.default_rng(size[0]).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    image_BHWC = torch.from_numpy(np.array(img).astype(np.float32) / 255.0)[None]  # LoadImage's IMAGE
    theirs = utils.common_upscale(image_BHWC.movedim(-1, 1), 64, 48, "bilinear", "center").movedim(1, -1)
    ours = crop_bilinear_tensor(img, 48, 64)  # [3,H,W] in [-1, 1], as the VAE takes it
    torch.testing.assert_close((ours + 1) / 2, theirs[0].permute(2, 0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kept", [1, 3])
def test_r2v_comfyuis_wan_with_time_dim_concat_predicts_the_training_steps_video(tmp_path, kept):
    sd, _ = comfyui_or_skip()
    from e2v.conditioning.encode import Conditions
    from e2v.train.export import save_comfy_checkpoint
    from e2v.train.step import predict

    torch.manual_seed(0)
    model = WanTransformer3DModel(**T2V_SHAPE).eval()
    path = save_comfy_checkpoint(model.state_dict(), tmp_path / "r2v.safetensors")
    comfy = sd.load_diffusion_model_state_dict(load_file(str(path))).model.diffusion_model.float()

    g = torch.Generator().manual_seed(kept)
    noisy = torch.randn(1, 16, 3, 8, 8, generator=g)
    refs = torch.randn(1, 16, kept, 8, 8, generator=g)  # the node concatenates exactly the references (Phantom)
    text = torch.randn(1, 512, 4096, generator=g)
    timestep = torch.tensor([700.0])
    c = Conditions(latents_BCTHW=noisy, text_BLD=text, ref_latents_BCNhw=refs, ref_layout="after")
    with torch.no_grad():
        ours = predict(model, noisy, timestep, c, text, torch.float32)
        theirs = comfy(noisy, timestep, text, time_dim_concat=refs)
    assert theirs.shape == ours.shape == noisy.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
