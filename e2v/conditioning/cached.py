"""Conditions from the cache: what tools/precompute.py stores per sample (`compute_entry`, before
anything random happens) and how a training step reads a cached batch's reference latents back
(`CachedReferences`: posterior samples drawn where the encoding run's VAE draws them; the layout
and the order of draws are e2v/conditioning/layout.py's, the same for both). The files
themselves: e2v/data/store.py.

Legend: B batch, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import random

import torch

from e2v.conditioning.encode import (
    clip_names,
    condition_video,
    encode_clip_images,
    encode_text,
    encode_video_stats,
    image_token_shape,
    pad_clip_tokens,
    select_elements,
)
from e2v.config.schema import Config
from e2v.config.shapes import TEXT_LEN, reference_pixel_frames
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
                n = reference_pixel_frames(cfg, item["vae_repeats"][k])
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


class CachedReferences:
    """How a reference latent is obtained in a cached run: read back from the entries
    tools/precompute.py stored (posterior mean and std), a posterior sample drawn here where the
    encoding run's VAE would have drawn one. Answers e2v/conditioning/layout.py's questions as
    e2v/conditioning/encode.py's EncodedReferences does, with the same draws in the same order."""

    def __init__(self, batch: dict, parts):
        self.batch, self.parts = batch, parts
        self.entries = batch["cached"]

    def latent_shape(self) -> tuple[int, int, int, int]:
        return tuple(self.entries[0]["latents_mean"].shape)

    @property
    def device(self):
        return self.entries[0]["latents_mean"].device  # on the device (to_device)

    def has_reference(self, i: int, name: str) -> bool:
        """Whether sample i has a VAE reference for `name`: its own stored latent, or (`combine:
        before`, whose entry stores the fixed set's condition video only) a condition video at all."""
        e = self.entries[i]
        return f"vae.{name}.mean" in e or "cond_mean" in e

    def reference(self, i: int, name: str, pixel_frames: int, sample_mode: str, generator) -> torch.Tensor:
        """The stored latent of sample i's reference `name` (encoded alone with the pixel frames
        shapes.reference_pixel_frames gives; the fingerprint holds what decides them)."""
        e = self.entries[i]
        return _posterior(e[f"vae.{name}.mean"][None], e[f"vae.{name}.std"][None], sample_mode, generator)

    def condition_video_latents(self, kept: list[list[str]], sample_mode: str, generator) -> torch.Tensor:
        """`combine: before`: the stored condition video latents of the fixed element set (zeros for a
        sample without one: finish_condition zeroes it anyway), one draw over the whole batch."""
        z, t, h, w = self.latent_shape()
        zeros = torch.zeros(z, t, h, w, device=self.device)
        mean = torch.stack([e.get("cond_mean", zeros) for e in self.entries])
        std = torch.stack([e.get("cond_std", zeros) for e in self.entries])
        return _posterior(mean, std, sample_mode, generator)

    def target(self, kept: list[list[str]], cfg, generator) -> torch.Tensor:
        mean = torch.stack([e["latents_mean"] for e in self.entries])
        std = torch.stack([e["latents_std"] for e in self.entries])
        return _posterior(mean, std, cfg.conditioning.target_sample_mode, generator)

    def clip_tokens(self, kept: list[list[str]], ref_drop: list[bool], cfg) -> torch.Tensor:
        n_tok, width = self.batch["shared"][0]["clip_shape"]
        tokens = []
        for i, e in enumerate(self.entries):
            names = clip_names(kept[i], {k[5:] for k in e if k.startswith("clip.")}, ref_drop[i], cfg)
            tokens.append(torch.stack([e[f"clip.{k}"] for k in names]) if names
                          else torch.zeros(0, n_tok, width, device=self.device))
        return pad_clip_tokens(tokens, n_tok, width, self.device)

    def text(self, caption_dropped: list[bool]) -> torch.Tensor:
        empty = self.batch["shared"][0]["empty_text"]
        text = torch.zeros(len(self.entries), TEXT_LEN, empty.shape[-1], device=self.device)
        for i, e in enumerate(self.entries):
            row = empty if caption_dropped[i] else e["text"]
            text[i, : row.shape[0]] = row
        return text
