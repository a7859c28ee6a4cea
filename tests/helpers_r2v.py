"""The sequence layout's test oracle, written from SkyReels-V3's inference code
(`skyreels_v3/pipelines/reference_to_video_pipeline.py`) and ComfyUI's `WanPhantomSubjectToVideo`,
never from the project's helpers; and the tiny configs, images and batches the r2v tests share."""

from __future__ import annotations

import numpy as np
import torch
from helpers import ROOT
from PIL import Image, ImageOps

R2V_TINY = str(ROOT / "configs/r2v_tiny.yaml")

H = W = 64  # latents 8 x 8: 4 x 4 tokens a frame
F = 9  # 3 latent frames
SIZES = [(50, 80), (90, 40), (64, 64), (33, 71)]  # (w, h) of the references: wide, tall, square


def _cfg(n_elements: int = 3, *sets: str):
    from e2v.config.load import load_config
    from e2v.config.schema import Element, ElementVAE

    cfg = load_config(R2V_TINY, [f"data.num_frames={F}", f"data.resolution=[{H},{W}]", *sets], check_paths=False)
    cfg.data.elements = [Element(name=f"e{k}", suffixes=[f"_e{k}.png"], required=k == 0, vae=ElementVAE(position=k),
                                 clip=None) for k in range(n_elements)]
    return cfg


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _batch(cfg, images_per_sample: list[dict], seed: int = 0) -> dict:
    from e2v.data.dataset import collate, element_inputs

    g = torch.Generator().manual_seed(seed)
    items = [{"id": f"s{i}", "video": torch.randint(0, 256, (3, F, H, W), generator=g, dtype=torch.uint8),
              "prompt": f"a clip number {i}", "skipped": [], **element_inputs(cfg, images, H, W)}
             for i, images in enumerate(images_per_sample)]
    return collate(items)


class Recorder(torch.nn.Module):
    """The transformer, with the inputs of every call kept (`calls`, in order)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, hidden_states, **kwargs):
        self.calls.append({"hidden_states": hidden_states, **kwargs})
        return self.model(hidden_states, **kwargs)


# --- the oracle: SkyReels-V3's and ComfyUI's arithmetic, written from their code -----------------


def v3_resize_ref(img: Image.Image, w: int, h: int) -> Image.Image:
    """`resize_ref_images`: convert RGB, fit inside keeping the aspect (int() on the free side),
    LANCZOS, ImageOps.expand with white, left/top = delta // 2."""
    img = img.convert("RGB")
    ratio = img.width / img.height
    if ratio > w / h:
        nw, nh = w, int(w / ratio)
    else:
        nh, nw = h, int(h * ratio)
    img = img.resize((nw, nh), Image.Resampling.LANCZOS)
    dw, dh = w - img.size[0], h - img.size[1]
    return ImageOps.expand(img, (dw // 2, dh // 2, dw - dw // 2, dh - dh // 2), fill=(255, 255, 255))


def v3_to_tensor(img: Image.Image) -> torch.Tensor:
    """torchvision's F.to_tensor(img).sub_(0.5).div_(0.5) on an 8-bit RGB image."""
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous().float().div(255).sub_(0.5).div_(0.5)


def comfy_center_crop_bilinear(img: Image.Image, w: int, h: int) -> torch.Tensor:
    """ComfyUI: LoadImage's float pixels, common_upscale(..., "bilinear", "center"), then its VAE's
    process_input (x * 2 - 1): [3,H,W] in [-1, 1]."""
    s = torch.from_numpy(np.array(img.convert("RGB")).astype(np.float32) / 255.0)[None].movedim(-1, 1)
    old_w, old_h = s.shape[-1], s.shape[-2]
    old_aspect, new_aspect = old_w / old_h, w / h
    x = y = 0
    if old_aspect > new_aspect:
        x = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
    elif old_aspect < new_aspect:
        y = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
    s = s.narrow(-2, y, old_h - y * 2).narrow(-1, x, old_w - x * 2)
    return torch.nn.functional.interpolate(s, size=(h, w), mode="bilinear")[0] * 2.0 - 1.0


def v3_ref_latents(pixels: list[torch.Tensor], vae, generator, sample_mode: str, slots: int | None) -> torch.Tensor:
    """`prepare_latents`' reference half: each reference encoded alone as [1,3,1,H,W], the posterior
    sampled from the generator (or its mode), (z - mean) * (1 / std), zero latents appended to
    `slots` (None: Phantom, no padding), concatenated on time."""
    out = []
    for x in pixels:
        dist = vae.encode(x.unsqueeze(1).unsqueeze(0)).latent_dist
        z = dist.sample(generator) if sample_mode == "sample" else dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
        out.append((z - mean) * inv_std)
    assert slots is None or len(out) <= slots
    while slots is not None and len(out) < slots:
        out.append(torch.zeros(1, vae.config.z_dim, 1, H // 8, W // 8))
    return torch.cat(out, dim=2)


def v3_prompt_embeds(prompt: str, tokenizer, text_encoder) -> torch.Tensor:
    """`_get_t5_prompt_embeds`: cleaned prompt, 512 tokens, the hidden states trimmed to the prompt's
    length and zero-padded back to 512."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tok = tokenizer([prompt_clean(prompt)], padding="max_length", max_length=512, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    seq_len = tok.attention_mask.gt(0).sum(dim=1).long()
    hidden = text_encoder(tok.input_ids, tok.attention_mask).last_hidden_state
    u = hidden[0][: seq_len[0]]
    return torch.cat([u, u.new_zeros(512 - u.size(0), u.size(1))])[None]


def v3_target(video_u8: torch.Tensor, vae) -> torch.Tensor:
    """The clip's latents a V3 trainer would take: the video in [-1, 1], the posterior mode, normalised."""
    z = vae.encode((video_u8.float() / 127.5 - 1.0)[None]).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    return (z - mean) * (1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1))


def v3_step(model, noisy: torch.Tensor, refs: torch.Tensor, t: torch.Tensor, text: torch.Tensor):
    """The denoising step's transformer call: cat([latents, condition], dim=2), the step's t expanded
    to the batch, the prediction sliced to the video's frames. Returns (input, timestep, pred)."""
    hidden = torch.cat([noisy, refs], dim=2)
    timestep = t.expand(noisy.shape[0])
    pred = model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    return hidden, timestep, pred[:, :, : noisy.shape[2]]


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
