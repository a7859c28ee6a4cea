"""Flow matching (rectified flow) as Wan trains it.

    x_t = (1 - sigma) * x0 + sigma * eps,   v = eps - x0,   timestep = 1000 * sigma

`sigma = shift*u / (1 + (shift-1)*u)` is exactly FlowMatchEulerDiscreteScheduler's shift
(tests/test_flow.py); an Euler loop with v recovers x0. Legend: B batch, C latent channels,
T latent frames, h/w latent size.
"""

from __future__ import annotations

import torch


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


def sample_sigmas(batch: int, *, generator: torch.Generator, mode: str = "uniform", shift: float = 5.0,
                  logit_mean: float = 0.0, logit_std: float = 1.0,
                  timestep_list: list[float] | None = None) -> torch.Tensor:
    """sigma_B in (0, 1). `timestep_list` (0..1000) restricts training to those timesteps: the video
    regression seed trains only at its `denoising_step_list`, unshifted (they are already schedule
    points)."""
    if timestep_list:
        idx = torch.randint(len(timestep_list), (batch,), generator=generator)
        return torch.tensor(timestep_list, dtype=torch.float32)[idx] / 1000.0
    if mode == "uniform":
        u = torch.rand(batch, generator=generator)
    elif mode == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(batch, generator=generator))
    else:
        raise ValueError(f"flow.sigma_sampling: unknown mode {mode!r}")
    # keep away from the exact ends: sigma=0 makes the x0 objective trivial, sigma=1 pure noise.
    return shift_sigma(u, shift).clamp(1e-4, 1.0 - 1e-4)


def _expand(sigma_B: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma_B.view(-1, *([1] * (like.ndim - 1))).to(like)


def add_noise(x0_BCTHW: torch.Tensor, noise_BCTHW: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
    s = _expand(sigma_B, x0_BCTHW)
    return (1 - s) * x0_BCTHW + s * noise_BCTHW


def velocity_target(x0_BCTHW: torch.Tensor, noise_BCTHW: torch.Tensor) -> torch.Tensor:
    return noise_BCTHW - x0_BCTHW


def x0_from_velocity(x_t_BCTHW: torch.Tensor, v_BCTHW: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
    """The model's clean-latent estimate: x0 = x_t - sigma * v."""
    return x_t_BCTHW - _expand(sigma_B, x_t_BCTHW) * v_BCTHW


def loss_weighting(sigma_B: torch.Tensor, scheme: str = "none") -> torch.Tensor:
    """Per-sample loss weights. `cosmap` and `sigma_sqrt` follow the SD3 paper's definitions."""
    if scheme == "none":
        return torch.ones_like(sigma_B)
    if scheme == "sigma_sqrt":
        return (sigma_B ** -2.0).clamp(max=1e3)
    if scheme == "cosmap":
        bot = 1 - 2 * sigma_B + 2 * sigma_B ** 2
        return 2 / (torch.pi * bot)
    raise ValueError(f"flow.weighting: unknown scheme {scheme!r}")


def per_sample_mse(pred_BCTHW: torch.Tensor, target_BCTHW: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, in fp32 whatever the model's dtype."""
    return (pred_BCTHW.float() - target_BCTHW.float()).pow(2).flatten(1).mean(1)


# --- what the loop logs (names follow the video-regression seed: docs/formats.md) ------------

TIME_BUCKET_EDGES = (250, 500, 750, 1000)  # timestep ranges of `loss_at_time_<lo>-<hi>`


def time_bucket(sigma: float, timestep_list: list[float] | None = None) -> str:
    """The `loss_at_time_<range>` bucket of one sample. Training at a `denoising_step_list` names
    the sampled timestep itself (rounded, not snapped to the list, so a stray timestep would show
    up as its own bucket); otherwise the 250-wide timestep range that holds 1000 * sigma."""
    t = 1000.0 * sigma
    if timestep_list:
        return f"{round(t, 2):g}"
    hi = next(b for b in TIME_BUCKET_EDGES if t <= b)
    return f"{hi - 250}-{hi}"


def latent_stats(target_BCTHW: torch.Tensor, pred_BCTHW: torch.Tensor) -> dict[str, float]:
    """Mean and std of the clean latents and of the model's x0 estimate: a regression whose
    prediction std collapses below the target's is averaging, not reconstructing."""
    target, pred = target_BCTHW.float(), pred_BCTHW.float()
    return {"target_latent_mean": target.mean().item(), "target_latent_std": target.std().item(),
            "pred_latent_mean": pred.mean().item(), "pred_latent_std": pred.std().item()}
