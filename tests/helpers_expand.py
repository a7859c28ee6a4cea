"""What tests/unit/test_expand.py and tests/launch/test_expand_runs.py share."""

from __future__ import annotations

import torch


def _inputs(in_channels: int, image_blocks: int | None, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, in_channels, 5, 8, 8, generator=g), timestep=torch.tensor([300.0, 800.0]),
                encoder_hidden_states=torch.randn(2, 512, 32, generator=g),
                encoder_hidden_states_image=None if image_blocks is None
                else torch.randn(2, 17 * image_blocks, 32, generator=g),
                return_dict=False)
