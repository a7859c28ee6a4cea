"""CausVid's few-step sampler restated for the causal tests' oracles (tests/unit/test_causal_sampling.py,
tests/unit/test_causal_e2v.py), from CausVid's code, not from e2v's: its released list, its shifted
1000-step scheduler, and one step of its rollout (the x0 estimate, then fresh noise to the next
listed timestep)."""

from __future__ import annotations

import torch

from e2v.runtime.device import randn

SHIFT = 8.0
STEPS = (1000.0, 757.0, 522.0)  # CausVid's released list without its trailing 0


def grid_sigma(t: float, shift: float = SHIFT) -> float:
    """CausVid's scheduler: 1000 training steps from sigma 1 towards 0, shifted; a timestep's sigma
    is the one of the nearest grid timestep (1000 x sigma)."""
    s = torch.linspace(1.0, 0.0, 1001)[:-1]
    sigmas = shift * s / (1 + (shift - 1) * s)
    return sigmas[(sigmas.double() * 1000 - t).abs().argmin()].item()


def rollout_step(x: torch.Tensor, v: torch.Tensor, i: int, generator: torch.Generator, renoise: str = "fresh"):
    """Step i of the list on a block: (the x0 estimate x - sigma v in float64, the next step's input:
    that estimate at the next listed sigma with fresh noise from `generator`; the estimate itself
    after the last step). `renoise="predicted"` (e2v's causal.renoise, not CausVid's): the noise is
    the flow's own estimate eps = x + (1 - sigma) v (x = (1 - sigma) x0 + sigma eps, v = eps - x0):
    DDIM with eta 0."""
    sigma = grid_sigma(STEPS[i])
    x0 = (x.double() - sigma * v.double()).float()
    if i + 1 == len(STEPS):
        return x0, x0
    s = grid_sigma(STEPS[i + 1])
    eps = randn(x0.shape, generator, x0.device) if renoise == "fresh" else x + (1 - sigma) * v
    return x0, (1 - s) * x0 + s * eps
