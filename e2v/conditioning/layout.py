"""The one conditioning entry (`batch_conditions`) and the one layout rule (`conditions`): how a
batch's references, target, image tokens and text become the step's Conditions, whether the
reference latents are encoded now (EncodedReferences, e2v/conditioning/encode.py) or read back
from the cache (CachedReferences, e2v/conditioning/cached.py). The layout and the order of every
random draw are decided here once, so an encoding run and a cached run with the same seed see the
same choices, posterior samples, sigmas and noise (tests/unit/test_cache.py).

The order of draws: the element choices and dropouts (`rng`, draw_choices); then from `generator`
the reference latents (each reference alone, samples in batch order, elements in position order;
or one draw over the batch's condition videos for `combine: before`), then the target latents.

Layouts (docs/conditioning.md):
    overlay / prepend   A2: references in the condition channels (mask + condition video latents)
    clean_prefix        Wan2.2 TI2V: references as clean latent frames before the clip, timestep 0
                        on their tokens (e2v/conditioning/ti2v.py)
    sequence            SkyReels-V3 R2V / Phantom: references as clean latent slots after (or before)
                        the video, the sample's one timestep on every token (e2v/conditioning/sequence.py)

Legend: B batch, C latent channels, T latent frames, h/w latent size, S reference slots or frames,
F = T + S model frames, L tokens, D width.
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from e2v.conditioning.cached import CachedReferences
from e2v.conditioning.encode import (
    Conditions,
    EncodedReferences,
    condition_or_zeros,
    draw_choices,
    finish_condition,
    pad_after_latents,
)
from e2v.conditioning.sequence import fill_slots, sequence_input, slot_frames, video_frames
from e2v.conditioning.ti2v import pad_prefix, prefix_input
from e2v.config.shapes import PATCH, VAE_T, after_ref_frames, reference_pixel_frames
from e2v.models.causal import frame_timesteps


def batch_conditions(batch: dict, parts, cfg, *, rng: random.Random, generator: torch.Generator | None = None,
                     train: bool = True) -> Conditions:
    """The step's tensors from a raw batch (data.py's collate) or a cached one (its "cached"
    entries). rng drives the discrete choices (which elements, dropouts); generator drives
    posterior samples. Both are owned by the caller so a resumed run repeats them."""
    source = CachedReferences(batch, parts) if "cached" in batch else EncodedReferences(batch, parts)
    return conditions(source, batch["element_names"], parts, cfg, rng=rng, generator=generator, train=train)


def conditions(source, element_names: list[list[str]], parts, cfg, *, rng: random.Random,
               generator: torch.Generator | None = None, train: bool = True) -> Conditions:
    """The layout rule, given how reference latents are obtained (`source`)."""
    pv, cd = cfg.processors.vae, cfg.conditioning
    kept, ref_drop, cap_drop = draw_choices(element_names, cfg, rng, train)
    z, t, h, w = source.latent_shape()
    f = VAE_T * (t - 1) + 1

    own_frames = cfg.uses_vae_condition and (cd.target_layout in ("clean_prefix", "sequence") or pv.combine == "after")
    chunks = None
    if own_frames:  # each kept reference encoded alone, in position order
        repeats = {e.name: e.vae.repeat for e in cfg.vae_elements}
        chunks = [[source.reference(i, k, reference_pixel_frames(cfg, repeats[k]), pv.sample_mode, generator)
                   for k in names if source.has_reference(i, k)] for i, names in enumerate(kept)]

    cond = None
    if cfg.uses_vae_condition and cd.target_layout not in ("clean_prefix", "sequence"):
        if pv.combine == "before":  # A2: one encode of the whole condition video
            cond_lat = source.condition_video_latents(kept, pv.sample_mode, generator)
            ref_frames = [cfg.reference_frames([k for k in names if source.has_reference(i, k)])
                          for i, names in enumerate(kept)]
        else:  # A2's `combine: after` ablation: concatenated in time, zero-padded in latent space to T
            rows = [pad_after_latents(row, t, z, h, w, source.device) for row in chunks]
            cond_lat, ref_frames = torch.cat([r for r, _ in rows]), after_ref_frames([n for _, n in rows])
        cond = finish_condition(cond_lat, ref_frames, kept, ref_drop, f, pv.concatenate_mask)

    latents = source.target(kept, cfg, generator)
    cond = condition_or_zeros(cond, latents, parts.transformer)
    ref_latents, ref_layout = None, None
    if cfg.uses_vae_condition and cd.target_layout == "clean_prefix":
        ref_latents, ref_layout = pad_prefix(chunks, ref_drop, latents), "clean_prefix"
    elif cfg.uses_vae_condition and cd.target_layout == "sequence":
        sq = cd.sequence
        ref_latents, ref_layout = fill_slots(chunks, ref_drop, latents, slots=sq.slots, after=sq.after), sq.place

    clip = None
    if parts.transformer.config.added_kv_proj_dim is not None:  # the model has image attention
        clip = source.clip_tokens(kept, ref_drop, cfg)
    return Conditions(latents, source.text(cap_drop), cond, clip, kept, ref_drop, cap_drop, ref_latents,
                      ref_layout if ref_latents is not None else None)


# --- the references at the transformer's input ----------------------------------------------------


def place_references(c: Conditions, x_BCThw: torch.Tensor, timestep: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The model input with the references' latent frames where the layout puts them, its
    timestep, and S, the frames to drop from the output (0 without any): clean_prefix gives
    per-token timesteps (0 on the references); sequence keeps the sample's one timestep.
    `timestep` is one per sample [B], or (task: causal) one per latent frame of the clip [B, T],
    which comes back per token (diffusers' form; the clean_prefix references at 0 in front: the
    causal model's block 0, e2v.models.causal.reference_block); the sequence layout refuses it."""
    refs = c.ref_latents_BCNhw
    if refs is None:
        per_token = (x_BCThw.shape[3] // PATCH) * (x_BCThw.shape[4] // PATCH)
        return x_BCThw, frame_timesteps(timestep, per_token) if timestep.ndim == 2 else timestep, 0
    if c.ref_layout == "clean_prefix":
        x, timestep = prefix_input(refs, x_BCThw, timestep)
        return x, timestep, refs.shape[2]
    if timestep.ndim == 2:
        raise ValueError("per-frame timesteps (task: causal) with the sequence layout's slots: no causal block holds "
                         "them (e2v.models.causal.causal_refusal); use conditioning.target_layout: clean_prefix")
    if c.ref_layout not in ("after", "before"):
        raise ValueError(f"Conditions.ref_layout {c.ref_layout!r}: reference frames need clean_prefix, after or before")
    return sequence_input(refs, x_BCThw, after=c.ref_layout == "after"), timestep, refs.shape[2]


def split_prediction(c: Conditions, pred_BCFhw: torch.Tensor, n_ref: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the video's frames, the reference frames or None) of the model's output."""
    if not n_ref:
        return pred_BCFhw, None
    after = c.ref_layout == "after"
    return video_frames(pred_BCFhw, n_ref, after), slot_frames(pred_BCFhw, n_ref, after)


def stack_conditions(conds: list[Conditions]) -> Conditions:
    """Per-sample Conditions -> one batch, padded as the layout pads a training batch whose samples
    keep different numbers of references: image tokens with zero tokens after, clean_prefix frames
    with zero frames in front, sequence slots with zero slots on the far side from the video."""
    clip = None
    if conds[0].clip_BLD is not None:
        n = max(c.clip_BLD.shape[1] for c in conds)
        clip = torch.cat([torch.nn.functional.pad(c.clip_BLD, (0, 0, 0, n - c.clip_BLD.shape[1])) for c in conds])
    cond = None if conds[0].cond_BCTHW is None else torch.cat([c.cond_BCTHW for c in conds])
    latents = torch.cat([c.latents_BCTHW for c in conds])
    chunks = [[] if c.ref_latents_BCNhw is None else [c.ref_latents_BCNhw] for c in conds]
    layout = next((c.ref_layout for c in conds if c.ref_layout is not None), None)
    if layout in ("after", "before"):
        refs = fill_slots(chunks, [False] * len(conds), latents, slots=None, after=layout == "after")
    else:
        refs = pad_prefix(chunks, [False] * len(conds), latents)
    return Conditions(latents, torch.cat([c.text_BLD for c in conds]), cond, clip, ref_latents_BCNhw=refs,
                      ref_layout=layout if refs is not None else None)


def with_references(c: Conditions, refs: Conditions | None) -> Conditions:
    """c's target and prompt with the references of `refs`; None: references dropped (zero
    condition, zero mask, zero image tokens, zero reference frames or slots: the dropout layout)."""
    if refs is None:
        return replace(c, cond_BCTHW=None if c.cond_BCTHW is None else torch.zeros_like(c.cond_BCTHW),
                       clip_BLD=None if c.clip_BLD is None else torch.zeros_like(c.clip_BLD),
                       ref_latents_BCNhw=None if c.ref_latents_BCNhw is None else torch.zeros_like(c.ref_latents_BCNhw))
    return replace(c, cond_BCTHW=refs.cond_BCTHW, clip_BLD=refs.clip_BLD, ref_latents_BCNhw=refs.ref_latents_BCNhw,
                   ref_layout=refs.ref_layout)
