"""Wan's rotary embedding as diffusers' WanAttnProcessor applies it (a function local to
transformer_wan.py there, so restated here once): the self-attention processors that replace
diffusers' own (e2v/models/causal.py, e2v/models/context_parallel.py) apply it to their queries and
keys. Legend: B batch, S tokens, H heads, D head width."""

from __future__ import annotations

import torch


def apply_rope(x_BSHD: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the head dimension by the rope tables ([1, S, 1, D] each)."""
    x1, x2 = x_BSHD.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x_BSHD)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x_BSHD)
