"""References in the token sequence (`conditioning.target_layout: sequence`): SkyReels-V3's
reference-to-video layout, and Phantom-Wan's with `conditioning.sequence.slots: null`.

SkyReels-V3 R2V (its `reference_to_video_pipeline.py`) runs a plain 16-channel Wan2.1 T2V
transformer, no condition channels, no image attention. Each reference image is fitted inside
the video size and centre-padded with white (e2v/data/media.py's `fit_pad_white`), encoded ALONE
as a one-frame video, normalised, and the latents are zero-padded to exactly 4 slots, real
references first. Every denoising step:

    ref_slots       each kept reference's latent frame, position order, zero slots after  [B,C,S,h,w]
    model_input     cat([x_t, ref_slots], frames)        (`place: before`: cat([ref_slots, x_t]))
    timestep        the sample's one t on every token: a [B] timestep, as for plain T2V
    model_pred      model(...)[:, :, :T]: the video's frames only; the slots' outputs are dropped

Zero slots are V3's "no reference" input (its image-free guidance branch is all slots zero), so
reference dropout zeroes every slot. With `slots: null` (Phantom, ComfyUI's
`WanPhantomSubjectToVideo`) a sample has exactly as many slots as references, none padded; a batch
whose samples keep different numbers pads the shorter ones with zero slots on the far side from
the video (with `micro_batch_size: 1` nothing is padded). With `place: before` the slots mirror:
zero slots first, then the references, then the video, so the references stay next to it.

Legend: B batch, C latent channels, S reference slots, T video latent frames, h/w latent size.
"""

from __future__ import annotations

import torch


def fill_slots(chunks_per_sample: list[list[torch.Tensor]], dropped: list[bool], like: torch.Tensor, *,
               slots: int | None, after: bool = True) -> torch.Tensor | None:
    """Per sample its references' latents [1,C,1,h,w] (position order) -> the slots [B,C,S,h,w]:
    S = `slots`, or (None) the most references any sample has; zero slots for a dropped sample.
    None when `slots` is None and no sample has a reference (the plain T2V input). `like`: a
    [.., C, .., h, w] tensor on the device the zeros belong to (the video's latents)."""
    counts = [sum(c.shape[2] for c in chunks) for chunks in chunks_per_sample]
    n = max(counts, default=0) if slots is None else slots
    if slots is not None and max(counts, default=0) > slots:
        raise ValueError(f"a sample has {max(counts)} references but conditioning.sequence.slots is {slots}: "
                         f"raise slots (or set it to null: as many slots as references)")
    if n == 0:
        return None
    _, c, _, h, w = like.shape
    out = like.new_zeros(len(chunks_per_sample), c, n, h, w)
    for i, chunks in enumerate(chunks_per_sample):
        if chunks and not dropped[i]:
            row = torch.cat(chunks, dim=2)[0]
            if after:
                out[i, :, : row.shape[1]] = row
            else:
                out[i, :, n - row.shape[1]:] = row
    return out


def sequence_input(ref_slots_BCShw: torch.Tensor, input_BCThw: torch.Tensor, after: bool = True) -> torch.Tensor:
    """The model input: the video's (noisy) frames and the clean slots on the time axis."""
    refs = ref_slots_BCShw.to(input_BCThw.dtype)
    return torch.cat([input_BCThw, refs] if after else [refs, input_BCThw], dim=2)


def video_frames(pred_BCFhw: torch.Tensor, slots: int, after: bool = True) -> torch.Tensor:
    """The model output's video frames (F = T + S in, T out)."""
    return pred_BCFhw[:, :, : pred_BCFhw.shape[2] - slots] if after else pred_BCFhw[:, :, slots:]


def slot_frames(pred_BCFhw: torch.Tensor, slots: int, after: bool = True) -> torch.Tensor:
    """The model output's reference-slot frames (what `loss_on_references` adds to the loss)."""
    return pred_BCFhw[:, :, pred_BCFhw.shape[2] - slots:] if after else pred_BCFhw[:, :, :slots]
