"""Conditions from the cache: what tools/precompute.py stores per sample (`compute_entry`, before
anything random happens) and how a training step turns a cached batch back into the Conditions an
encoding run would have built (`conditions_from_cache`: element choice, dropouts and posterior
samples drawn in the same order as encode_batch, so a cached and an encoding run with the same
seed see the same choices, sigmas and noise). The files themselves: e2v/data/store.py.

Legend: B batch, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import random

import torch

from e2v.conditioning.encode import (Conditions, clip_names, condition_or_zeros, condition_video, draw_choices,
                                     encode_batch, encode_clip_images, encode_text, encode_video_stats,
                                     finish_condition, image_token_shape, pad_after_latents, pad_clip_tokens,
                                     select_elements)
from e2v.conditioning.ti2v import pad_prefix
from e2v.config.schema import Config
from e2v.config.shapes import TEXT_LEN, VAE_T, after_frames, after_ref_frames
from e2v.runtime.device import randn

def text_length(prompt: str, tokenizer) -> int:
    """Tokens encode_text keeps for this prompt (after them its output is zero)."""
    return len(tokenizer(prompt, max_length=TEXT_LEN, truncation=True, add_special_tokens=True).input_ids)


@torch.no_grad()
def shared_entry(parts) -> tuple[torch.Tensor, tuple[int, int]]:
    """What every cached sample shares: the empty-prompt embedding (caption dropout) and the CLIP
    token shape of these encoders ((0, 0) for a model without image attention)."""
    empty = encode_text([""], parts.tokenizer, parts.text_encoder)[0, :text_length("", parts.tokenizer)]
    clip_shape = image_token_shape(parts) if parts.transformer.config.added_kv_proj_dim is not None else (0, 0)
    return empty, clip_shape


def compute_entry(item: dict, parts, cfg: Config) -> dict[str, torch.Tensor]:
    """One data.py item (pixels) -> the tensors of its cache entry (see the module docstring)."""
    pv = cfg.processors.vae
    dev = parts.vae.device
    video_BCFHW = item["video"].unsqueeze(0).to(dev)
    f = video_BCFHW.shape[2]
    mean, std = encode_video_stats(video_BCFHW, parts.vae)
    out = {"latents_mean": mean[0], "latents_std": std[0]}  # moved to the CPU by CacheStore.write
    out["text"] = encode_text([item["prompt"]], parts.tokenizer, parts.text_encoder)[0, :text_length(
        item["prompt"], parts.tokenizer)]
    if cfg.uses_clip and parts.image_encoder is not None and item["clip_refs"]:
        names = list(item["clip_refs"])
        tokens = encode_clip_images([item["clip_refs"][k] for k in names], parts.image_encoder, parts.image_processor)
        out.update({f"clip.{k}": t for k, t in zip(names, tokens)})
    if cfg.uses_vae_condition:
        refs = item["vae_refs"]
        if pv.combine == "before":  # the fixed set the mode keeps (config.py refuses prefix / random)
            idx = select_elements(len(item["element_names"]), pv.frame_conditioning, random.Random(0), pv.frame_index)
            names = [item["element_names"][k] for k in idx if item["element_names"][k] in refs]
            if names:
                video = condition_video([refs[k].view(1, 3, 1, *refs[k].shape[-2:]).to(dev) for k in names],
                                        [item["vae_repeats"][k] for k in names], f)
                out["cond_mean"], out["cond_std"] = (t[0] for t in encode_video_stats(video, parts.vae))
        else:
            for k, ref in refs.items():
                n = after_frames(item["vae_repeats"][k])
                ref_video = ref.view(1, 3, 1, *ref.shape[-2:]).expand(-1, -1, n, -1, -1).to(dev)
                m, s = encode_video_stats(ref_video, parts.vae)
                out[f"vae.{k}.mean"], out[f"vae.{k}.std"] = m[0], s[0]
    return out


def _posterior(mean: torch.Tensor, std: torch.Tensor, mode: str, generator) -> torch.Tensor:
    """The posterior mean, or a sample drawn as diffusers' DiagonalGaussianDistribution draws it
    (one randn of the whole shape), so the generator advances as in an encoding run."""
    if mode == "argmax":
        return mean
    return mean + std * randn(mean.shape, generator, mean.device, mean.dtype)


def conditions_from_cache(batch: dict, parts, cfg: Config, *, rng: random.Random,
                          generator: torch.Generator | None = None, train: bool = True) -> Conditions:
    """What encode_batch returns, assembled from cached entries; the same draws in the same order."""
    pv, cd = cfg.processors.vae, cfg.conditioning
    entries = batch["cached"]
    b = len(entries)
    kept, ref_drop, cap_drop = draw_choices(batch["element_names"], cfg, rng, train)
    lat_mean = torch.stack([e["latents_mean"] for e in entries])  # on the device (to_device)
    _, z, t, h, w = lat_mean.shape
    device = lat_mean.device
    f = VAE_T * (t - 1) + 1

    cond, ref_chunks = None, None
    if cfg.uses_vae_condition and cd.target_layout == "clean_prefix":  # combine: after entries (config.normalise)
        ref_chunks = [[_posterior(e[f"vae.{k}.mean"][None], e[f"vae.{k}.std"][None], pv.sample_mode, generator)
                       for k in kept[i] if f"vae.{k}.mean" in e] for i, e in enumerate(entries)]
    elif cfg.uses_vae_condition:
        if pv.combine == "before":
            zeros = torch.zeros(z, t, h, w, device=device)  # no reference kept: zero condition (finish_condition zeroes it anyway)
            mean = torch.stack([e.get("cond_mean", zeros) for e in entries])
            std = torch.stack([e.get("cond_std", zeros) for e in entries])
            cond_lat = _posterior(mean, std, pv.sample_mode, generator)
            ref_frames = [cfg.reference_frames(kept[i]) for i in range(b)]
        else:
            rows, n_lat = [], []
            for i, e in enumerate(entries):
                chunks = [_posterior(e[f"vae.{k}.mean"][None], e[f"vae.{k}.std"][None], pv.sample_mode, generator)
                          for k in kept[i] if f"vae.{k}.mean" in e]
                row, n = pad_after_latents(chunks, t, z, h, w, device)
                rows.append(row)
                n_lat.append(n)
            cond_lat, ref_frames = torch.cat(rows), after_ref_frames(n_lat)
        cond = finish_condition(cond_lat, ref_frames, kept, ref_drop, f, pv.concatenate_mask)

    latents = _posterior(lat_mean, torch.stack([e["latents_std"] for e in entries]), cd.target_sample_mode, generator)
    cond = condition_or_zeros(cond, latents, parts.transformer)
    ref_latents = None if ref_chunks is None else pad_prefix(ref_chunks, ref_drop, latents)

    clip = None
    if parts.transformer.config.added_kv_proj_dim is not None:
        n_tok, width = batch["shared"][0]["clip_shape"]
        tokens = []
        for i, e in enumerate(entries):
            names = clip_names(kept[i], {k[5:] for k in e if k.startswith("clip.")}, ref_drop[i], cfg)
            tokens.append(torch.stack([e[f"clip.{k}"] for k in names]) if names
                          else torch.zeros(0, n_tok, width, device=device))
        clip = pad_clip_tokens(tokens, n_tok, width, device)

    empty = batch["shared"][0]["empty_text"]
    text = torch.zeros(b, TEXT_LEN, empty.shape[-1], device=device)
    for i, e in enumerate(entries):
        row = empty if cap_drop[i] else e["text"]
        text[i, : row.shape[0]] = row
    return Conditions(latents, text, cond, clip, kept, ref_drop, cap_drop, ref_latents)


def batch_conditions(batch: dict, parts, cfg: Config, *, rng: random.Random,
                     generator: torch.Generator | None = None, train: bool = True) -> Conditions:
    """The step's tensors: from the cache when the batch holds cached entries, else encoded."""
    if "cached" in batch:
        return conditions_from_cache(batch, parts, cfg, rng=rng, generator=generator, train=train)
    return encode_batch(batch, parts, cfg, rng=rng, generator=generator, train=train)
