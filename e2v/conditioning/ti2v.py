"""The Wan2.2 TI2V layout (`conditioning.target_layout: clean_prefix`): references as clean latent
frames in front of the clip's, per-token timesteps, the loss on the clip's frames only.

Wan2.2 TI2V-5B has no condition channels and no image attention: its input is its 48 latent
channels alone. diffusers' `WanImageToVideoPipeline(expand_timesteps=True)` conditions it on an
image by putting the image's latent (one VAE encode of the image alone: one latent frame) in the
place of latent frame 0, clean, and giving that frame's tokens timestep 0 while the others get the
step's timestep ("temp_ts" = first-frame mask x t, one value per token after the 2x2 patch). The
model's prediction for that frame is never used. Elements extend this to N references:

    ref_latents     each kept reference encoded alone (as `combine: after` encodes it: one latent
                    frame for repeat <= 4), normalised, position order              [B,C,N,h,w]
    model_input     cat([ref_latents, x_t], frames)                                 [B,C,N+T,h,w]
    timestep        0 on the N (h/2)(w/2) reference tokens, t on the T (h/2)(w/2)   [B,(N+T)(h/2)(w/2)]
    model_pred      model(...)[:, :, N:]: the clip's frames only, so the target, the loss, the
                    x0 estimate, validation and the sampler all see clip-shaped tensors [B,C,T,h,w]

task: causal (docs/causal.md, "Elements to video") takes the same input with a timestep per clip
frame ([B, T]: the references' tokens still 0), and its block-causal model makes the N reference
frames a block of their own, block 0, that every clip block sees (e2v/models/causal.py).

With one reference and the clip's T latent frames this is the pipeline's input at every step for a
video of 4T + 1 frames whose first frame is the reference (tests/unit/test_wan22_ti2v.py checks it
against the pipeline itself). The clip is encoded on its own, so its decode needs no frames
dropped, and the references take none of its frames (`Config.reference_frames` is 0).

A batch whose samples keep different numbers of references pads at the front with zero frames
(clean, timestep 0: the mean latent), so each sample's references stay next to its clip, as in a
sample encoded alone; Wan's rotary positions are relative, so the padding shifts no distance between
real tokens. Reference dropout zeroes a sample's reference frames (the same zero frames), as it
zeroes the Wan2.1 condition. A batch where no sample keeps a reference has no prefix at all: the
plain TI2V text-to-video layout. The cost: a padded sample also attends to its zero frames, a layout
inference with fewer references never shows; with `micro_batch_size: 1` nothing is padded.

Legend: B batch, C latent channels, N reference latent frames, T clip latent frames, h/w latent
size, L tokens.
"""

from __future__ import annotations

import torch

from e2v.config.shapes import PATCH


def pad_prefix(chunks_per_sample: list[list[torch.Tensor]], dropped: list[bool], like: torch.Tensor
               ) -> torch.Tensor | None:
    """Per sample, its references' latents [1,C,n_k,h,w] (position order) -> [B,C,N,h,w], N the
    most frames any sample has, zero frames in front of a sample with fewer, all zeros for a
    sample whose references were dropped. None when no sample has a reference. `like`: a
    [.., C, .., h, w] tensor on the device the zeros belong to (the clip's latents)."""
    rows = [torch.cat(chunks, dim=2) if chunks else None for chunks in chunks_per_sample]
    n = max((r.shape[2] for r in rows if r is not None), default=0)
    if n == 0:
        return None
    _, c, _, h, w = like.shape
    out = like.new_zeros(len(rows), c, n, h, w)
    for i, row in enumerate(rows):
        if row is not None and not dropped[i]:
            out[i, :, n - row.shape[2]:] = row[0]
    return out


def prefix_input(ref_latents_BCNhw: torch.Tensor, input_BCThw: torch.Tensor, timestep: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model input and its per-token timesteps: the clean reference frames, then the clip's
    noisy frames; timestep 0 on each reference token, the sample's timestep (`timestep` [B]) or
    its frame's (task: causal: [B, T], one per clip frame) on each clip token, in the
    transformer's token order (frame, then row, then column of 2x2 patches), fp32 as the
    pipeline builds them (its first-frame mask is fp32)."""
    b, _, n, h, w = ref_latents_BCNhw.shape
    t = input_BCThw.shape[2]
    per_frame = (h // PATCH) * (w // PATCH)
    timestep = timestep.to(input_BCThw.device, torch.float32)
    timestep_BT = timestep if timestep.ndim == 2 else timestep[:, None].expand(b, t)
    timestep_BL = torch.cat([timestep_BT.new_zeros(b, n), timestep_BT], 1).repeat_interleave(per_frame, 1)
    return torch.cat([ref_latents_BCNhw.to(input_BCThw.dtype), input_BCThw], dim=2), timestep_BL
