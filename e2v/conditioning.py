"""Condition tensors, built exactly as SkyReels-A2 inference builds them (A2_CONDITIONING.md).

VAE pathway: references in position order, reference k repeated `repeat[k]` times, zero (mid-grey)
frames to F, ONE VAE encode of the whole condition video (`combine: before`; the causal VAE makes
the padding latents depend on the references), the Wan I2V mask, `cat([mask, latents])`.
CLIP pathway: each reference -> CLIPImageProcessor -> vision `hidden_states[-2]` (penultimate,
CLS kept) -> 257 tokens; concatenated along tokens. Text: UMT5 last hidden state, zeroed after
each prompt's length, padded to exactly 512 (Wan takes the LAST 512 context tokens as text).

Legend: B batch, F pixel frames, T = (F-1)/4+1 latent frames, H/W pixels, h/w = H/8, W/8 latent
size, N references, L tokens, D width.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

TEXT_LEN = 512  # Wan's cross-attention splits image | text at the last 512 context tokens
VAE_T, VAE_S = 4, 8  # Wan VAE: time /4 (causal: 1 + (F-1)/4), space /8


# --- latents -----------------------------------------------------------------------------------


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    return mean, inv_std


def normalize_latents(z_BCTHW: torch.Tensor, vae) -> torch.Tensor:
    """`(z - mean) * (1 / std)`: multiply by the reciprocal, the exact arithmetic of A2 and diffusers."""
    mean, inv_std = _latent_stats(vae, z_BCTHW)
    return (z_BCTHW - mean) * inv_std


def denormalize_latents(latents_BCTHW: torch.Tensor, vae) -> torch.Tensor:
    mean, inv_std = _latent_stats(vae, latents_BCTHW)
    return latents_BCTHW / inv_std + mean


def encode_video(video_BCFHW: torch.Tensor, vae, *, sample_mode: str = "argmax",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Pixels [-1,1] -> normalised latents [B,16,T,h,w] (posterior mean, or a sample)."""
    assert video_BCFHW.ndim == 5 and video_BCFHW.shape[1] == 3, f"expected [B,3,F,H,W], got {tuple(video_BCFHW.shape)}"
    assert (video_BCFHW.shape[2] - 1) % VAE_T == 0, f"F={video_BCFHW.shape[2]} must be 4k+1"
    lo, hi = video_BCFHW.min().item(), video_BCFHW.max().item()
    assert lo >= -1.0001 and hi <= 1.0001, f"pixels must be in [-1, 1], got [{lo:.3f}, {hi:.3f}]"
    dist = vae.encode(video_BCFHW.to(vae.dtype)).latent_dist
    z = dist.sample(generator) if sample_mode == "sample" else dist.mode()
    return normalize_latents(z.float(), vae)


def encode_video_stats(video_BCFHW: torch.Tensor, vae) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised posterior mean and std, for caches that must still allow sampling."""
    dist = vae.encode(video_BCFHW.to(vae.dtype)).latent_dist
    _, inv_std = _latent_stats(vae, dist.mean)
    return normalize_latents(dist.mean.float(), vae), (dist.std * inv_std).float()


# --- the VAE condition -------------------------------------------------------------------------


def condition_video(ref_pixels: list[torch.Tensor], repeats: list[int], num_frames: int) -> torch.Tensor:
    """[r0 x rep0, r1 x rep1, ..., zeros] -> [B,3,F,H,W]; zeros are mid-grey in [-1, 1]."""
    if len(ref_pixels) != len(repeats):
        raise ValueError(f"{len(ref_pixels)} references but {len(repeats)} repeats")
    frames = [r.expand(-1, -1, n, -1, -1) for r, n in zip(ref_pixels, repeats)]
    f_ref = sum(repeats)
    if f_ref > num_frames:
        raise ValueError(f"references take {f_ref} frames but the video has only {num_frames}")
    if (num_frames - 1) % VAE_T:
        raise ValueError(f"num_frames={num_frames} must be 4k+1")
    b, c, _, h, w = ref_pixels[0].shape
    pad = ref_pixels[0].new_zeros(b, c, num_frames - f_ref, h, w)
    return torch.cat(frames + [pad], dim=2)


def condition_mask(ref_frames_B: list[int], num_frames: int, h: int, w: int) -> torch.Tensor:
    """The Wan I2V mask rule, per sample: pixel frames [0, F_ref) are 1, frame 0 is repeated 4
    times, the F+3 frames fold to [B,4,T,h,w]. One reference gives the plain I2V mask (A2 crashes
    there: it repeats frame 0 eight times)."""
    b = len(ref_frames_B)
    mask_B1Fhw = torch.zeros(b, 1, num_frames, h, w)
    for i, n in enumerate(ref_frames_B):
        mask_B1Fhw[i, :, :n] = 1
    first = mask_B1Fhw[:, :, :1].repeat_interleave(VAE_T, dim=2)
    mask = torch.cat([first, mask_B1Fhw[:, :, 1:]], dim=2)  # [B,1,F+3,h,w]
    t = (num_frames - 1) // VAE_T + 1
    return mask.view(b, t, VAE_T, h, w).transpose(1, 2)


def build_vae_condition(ref_pixels: list[torch.Tensor], repeats: list[int], num_frames: int, vae, *,
                        sample_mode: str = "argmax", generator: torch.Generator | None = None) -> torch.Tensor:
    """A2's `prepare_latents` condition: `ref_pixels` is a list (position order) of [B,3,1,H,W]
    float tensors in [-1,1]; returns [B,20,T,H/8,W/8] = cat([mask4, latents16]).

    With sample_mode="sample" the posterior sample consumes `generator` as A2's pipeline does
    after its noise draw, so a caller that draws the noise first gets A2's tensors bit for bit."""
    video_BCFHW = condition_video(ref_pixels, repeats, num_frames)
    latents = encode_video(video_BCFHW, vae, sample_mode=sample_mode, generator=generator)
    b, _, _, h, w = latents.shape
    mask = condition_mask([sum(repeats)] * b, num_frames, h, w).to(latents)
    return torch.cat([mask, latents], dim=1)


# --- CLIP and text -----------------------------------------------------------------------------


def encode_clip_images(images: list[np.ndarray], image_encoder, image_processor) -> torch.Tensor:
    """uint8 [S,S,3] images (already brought to the CLIP resolution) -> [n, L, D] penultimate-layer
    tokens (CLS kept, no post-layernorm), as A2 feeds Wan's image embedder."""
    device = next(image_encoder.parameters()).device
    pixel_values = image_processor(images=images, return_tensors="pt").pixel_values
    out = image_encoder(pixel_values=pixel_values.to(device, image_encoder.dtype), output_hidden_states=True)
    return out.hidden_states[-2].float()


def encode_text(prompts: list[str], tokenizer, text_encoder, max_length: int = TEXT_LEN) -> torch.Tensor:
    """UMT5 last hidden state, zero after each prompt's true length, padded to exactly 512."""
    tok = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state.float()
    text_BLD = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    assert text_BLD.shape[1] == TEXT_LEN, f"text must be exactly {TEXT_LEN} tokens, got {text_BLD.shape[1]}"
    return text_BLD


# --- element selection (frame-conditioning modes) ----------------------------------------------


def select_elements(n: int, mode: str, rng: random.Random, frame_index: int = 0) -> list[int]:
    """Which of n present elements (position order) a sample keeps. Dropped ones are treated as
    absent, so training sees exactly the layouts inference with fewer references produces."""
    if n == 0:
        return []
    if mode == "full":
        return list(range(n))
    if mode == "index":
        return [frame_index] if frame_index < n else []
    if mode == "prefix":
        return list(range(rng.randint(1, n)))
    if mode == "random":
        k = rng.randint(1, n)
        return sorted(rng.sample(range(n), k))
    if mode == "first_and_last":
        return sorted({0, n - 1})
    raise ValueError(f"processors.vae.frame_conditioning: unknown mode {mode!r}")


# --- a whole batch -----------------------------------------------------------------------------


@dataclass
class Conditions:
    latents_BCTHW: torch.Tensor  # target x0
    text_BLD: torch.Tensor  # [B,512,D_text]
    cond_BCTHW: torch.Tensor | None = None  # [B,20,T,h,w] (16+4), or [B,16,...] without mask
    clip_BLD: torch.Tensor | None = None  # [B,L_img*N_max,D_clip]
    kept: list[list[str]] | None = None  # element names each sample was conditioned on
    ref_dropped: list[bool] | None = None
    caption_dropped: list[bool] | None = None


def encode_batch(batch: dict, parts, cfg, *, rng: random.Random, generator: torch.Generator | None = None,
                 train: bool = True) -> Conditions:
    """Raw batch (from data.py) -> every tensor the transformer step needs.

    rng drives the discrete choices (which elements, dropouts); generator drives posterior
    samples. Both are owned by the caller so a resumed run repeats them."""
    pv = cfg.processors.vae
    cd = cfg.conditioning
    video_BCFHW = batch["video"]
    b, _, f, hh, ww = video_BCFHW.shape
    h, w = hh // VAE_S, ww // VAE_S

    kept_idx, ref_drop, cap_drop = [], [], []
    for i in range(b):
        n = len(batch["element_names"][i])
        kept_idx.append(select_elements(n, pv.frame_conditioning, rng, pv.frame_index) if cfg.e2v_type != "none" else [])
        ref_drop.append(train and cd.reference_dropout > 0 and rng.random() < cd.reference_dropout)
        cap_drop.append(train and cd.caption_dropout > 0 and rng.random() < cd.caption_dropout)
    kept = [[batch["element_names"][i][k] for k in idx] for i, idx in enumerate(kept_idx)]

    # VAE condition, one encode for the whole batch (each sample's own layout).
    cond = None
    ref_videos = []
    if cfg.uses_vae_condition:
        ref_frames = []
        for i in range(b):
            names = [k for k in kept[i] if k in batch["vae_refs"][i]]
            refs = [batch["vae_refs"][i][k].unsqueeze(0).unsqueeze(2) for k in names]
            reps = [batch["vae_repeats"][i][k] for k in names]
            if refs:
                ref_videos.append(condition_video(refs, reps, f))
            else:
                ref_videos.append(video_BCFHW.new_zeros(1, 3, f, hh, ww))
            ref_frames.append(sum(reps))
        cond_video = torch.cat(ref_videos)
        if pv.combine == "before":
            cond_lat = encode_video(cond_video, parts.vae, sample_mode=pv.sample_mode, generator=generator)
        else:
            cond_lat = _encode_after(batch, kept, parts.vae, f, pv.sample_mode, generator)
        mask = condition_mask(ref_frames, f, h, w).to(cond_lat)
        keep = torch.tensor([0.0 if (d or not kept[i]) else 1.0 for i, d in enumerate(ref_drop)]).view(b, 1, 1, 1, 1)
        # dropped references: zero condition AND zero mask (A2's unconditional layout)
        cond_lat, mask = cond_lat * keep, mask * keep
        cond = torch.cat([mask, cond_lat], dim=1) if pv.concatenate_mask else cond_lat

    # Target: the clip itself, or (prepend) the reference frames followed by the clip.
    target_video = video_BCFHW
    if cd.target_layout == "prepend" and ref_videos:
        rows = []
        for i in range(b):
            n_ref = sum(batch["vae_repeats"][i][k] for k in kept[i] if k in batch["vae_refs"][i])
            rows.append(torch.cat([ref_videos[i][:, :, :n_ref], video_BCFHW[i:i + 1, :, : f - n_ref]], dim=2))
        target_video = torch.cat(rows)
    latents = encode_video(target_video, parts.vae, sample_mode=cd.target_sample_mode, generator=generator)

    clip = None
    if parts.transformer.config.added_kv_proj_dim is not None:  # the model has image attention
        clip = _encode_clip_batch(batch, kept, ref_drop, parts, cfg)

    prompts = ["" if d else p for p, d in zip(batch["prompt"], cap_drop)]
    text = encode_text(prompts, parts.tokenizer, parts.text_encoder)
    return Conditions(latents, text, cond, clip, kept, ref_drop, cap_drop)


def _encode_after(batch, kept, vae, f, sample_mode, generator) -> torch.Tensor:
    """`combine: after` (A2's ablation): each reference encoded on its own (repeats included), the
    latents concatenated in time and zero-padded in latent space to T."""
    t = (f - 1) // VAE_T + 1
    rows = []
    for i, names in enumerate(kept):
        chunks = []
        for k in names:
            if k not in batch["vae_refs"][i]:
                continue
            n = batch["vae_repeats"][i][k]
            frames = 1 + (n - 1) // VAE_T * VAE_T if n > 1 else 1  # the VAE keeps 4k+1 frames
            ref = batch["vae_refs"][i][k].view(1, 3, 1, *batch["vae_refs"][i][k].shape[-2:])
            chunks.append(encode_video(ref.expand(-1, -1, frames, -1, -1), vae, sample_mode=sample_mode,
                                       generator=generator))
        lat = torch.cat(chunks, dim=2) if chunks else None
        if lat is None:
            z = vae.config.z_dim
            hh, ww = batch["video"].shape[-2:]
            lat = batch["video"].new_zeros(1, z, 0, hh // VAE_S, ww // VAE_S)
        if lat.shape[2] > t:
            raise ValueError(f"combine: after gives {lat.shape[2]} latent frames, more than T={t}")
        rows.append(torch.cat([lat, lat.new_zeros(1, lat.shape[1], t - lat.shape[2], *lat.shape[3:])], dim=2))
    return torch.cat(rows)


def _encode_clip_batch(batch, kept, ref_drop, parts, cfg) -> torch.Tensor:
    """[B, L*N_max, D]: samples with fewer CLIP references are padded with zero tokens (the same
    tokens reference dropout uses), so one batch can mix element counts; a sample with none (or
    e2v_type vae on an image-attention model) gets one zero block."""
    per_sample, names_per_sample = [], []
    flat = []
    for i in range(len(kept)):
        names = [k for k in kept[i] if k in batch["clip_refs"][i]] if not ref_drop[i] else []
        if not cfg.uses_clip:
            names = []
        names_per_sample.append(names)
        flat.extend(batch["clip_refs"][i][k] for k in names)
    tokens = encode_clip_images(flat, parts.image_encoder, parts.image_processor) if flat else None
    n_tok, width = image_token_shape(parts)
    n_max = max(1, max(len(n) for n in names_per_sample))
    j = 0
    for names in names_per_sample:
        row = torch.zeros(n_max * n_tok, width)
        if names:
            row[: len(names) * n_tok] = tokens[j: j + len(names)].reshape(-1, width)
            j += len(names)
        per_sample.append(row)
    return torch.stack(per_sample)


def image_token_shape(parts) -> tuple[int, int]:
    """(tokens per reference, width): 257 x 1280 for CLIP ViT-H/14 at 224 px."""
    if parts.image_encoder is None:  # e2v_type vae on an image-attention model: zero blocks only
        return 257, parts.transformer.config.image_dim
    c = parts.image_encoder.config
    return (c.image_size // c.patch_size) ** 2 + 1, c.hidden_size
