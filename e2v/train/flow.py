"""Flow matching (rectified flow) as Wan trains it.

    x_t = (1 - sigma) * x0 + sigma * eps,   v = eps - x0,   timestep = 1000 * sigma

`sigma = shift*u / (1 + (shift-1)*u)` is exactly FlowMatchEulerDiscreteScheduler's shift
(tests/unit/test_flow.py); an Euler loop with v recovers x0. Legend: B batch, C latent channels,
T latent frames, h/w latent size.
"""

from __future__ import annotations

import math

import torch

SIGMA_MIN, SIGMA_MAX = 1e-4, 1.0 - 1e-4  # the draw's ends: sigma=0 makes the x0 objective trivial, 1 is pure noise


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


def unshift_sigma(sigma: float, shift: float) -> float:
    """The inverse of shift_sigma: the u that the shift takes to `sigma`."""
    return sigma / (shift - (shift - 1) * sigma)


def sample_sigmas(batch: int, *, generator: torch.Generator, mode: str = "uniform", shift: float = 5.0,
                  logit_mean: float = 0.0, logit_std: float = 1.0,
                  timestep_list: list[float] | None = None,
                  sigma_range: tuple[float, float] | None = None) -> torch.Tensor:
    """sigma_B in (0, 1). `timestep_list` (0..1000) restricts training to those timesteps: the video
    regression seed trains only at its `denoising_step_list`, unshifted (they are already schedule
    points). `sigma_range` (lo, hi), both inclusive: the same distribution conditioned on that range
    (one Wan2.2 expert's timesteps, e2v/config/experts.py), drawn by inverting its CDF, so its shape within
    the range is kept and each sample costs one draw, as without a range."""
    if timestep_list:
        sigmas = torch.tensor(timestep_list, dtype=torch.float32) / 1000.0
        if sigma_range is not None:
            sigmas = sigmas[(sigmas >= sigma_range[0]) & (sigmas <= sigma_range[1])]
            if not len(sigmas):
                raise ValueError(f"flow.denoising_step_list: no timestep in the sigma range {sigma_range}")
        return sigmas[torch.randint(len(sigmas), (batch,), generator=generator)]
    lo, hi = sigma_range or (0.0, 1.0)
    u_lo, u_hi = unshift_sigma(lo, shift), unshift_sigma(hi, shift)
    if mode == "uniform":
        u = u_lo + (u_hi - u_lo) * torch.rand(batch, generator=generator)
    elif mode == "logit_normal":
        if sigma_range is None:
            u = torch.sigmoid(logit_mean + logit_std * torch.randn(batch, generator=generator))
        else:  # the normal's CDF between the range's ends, inverted (float64: the tails are thin)
            p_lo, p_hi = (_normal_cdf(v, logit_mean, logit_std) for v in (u_lo, u_hi))
            p = p_lo + (p_hi - p_lo) * torch.rand(batch, generator=generator, dtype=torch.float64)
            u = torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(p)).float()
    else:
        raise ValueError(f"flow.sigma_sampling: unknown mode {mode!r}")
    return shift_sigma(u, shift).clamp(max(SIGMA_MIN, lo), min(SIGMA_MAX, hi))


def _normal_cdf(u: float, mean: float, std: float) -> torch.Tensor:
    """P(sigmoid(mean + std * z) <= u) for a standard normal z."""
    logit = math.log(u / (1 - u)) if 0 < u < 1 else (-math.inf if u <= 0 else math.inf)
    return torch.special.ndtr(torch.tensor((logit - mean) / std, dtype=torch.float64))


def sigma_mass(lo: float, hi: float, *, mode: str = "uniform", shift: float = 5.0, logit_mean: float = 0.0,
               logit_std: float = 1.0, timestep_list: list[float] | None = None) -> float:
    """The probability sample_sigmas (without a range) gives a sigma in [lo, hi]."""
    if timestep_list:
        sigmas = torch.tensor(timestep_list, dtype=torch.float32) / 1000.0
        return ((sigmas >= lo) & (sigmas <= hi)).float().mean().item()
    u_lo, u_hi = unshift_sigma(lo, shift), unshift_sigma(hi, shift)
    if mode == "uniform":
        return u_hi - u_lo
    return (_normal_cdf(u_hi, logit_mean, logit_std) - _normal_cdf(u_lo, logit_mean, logit_std)).item()


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


def latent_stats(target_BCTHW: torch.Tensor, pred_BCTHW: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and std of the clean latents and of the model's x0 estimate (0-dim tensors on their
    device: read back when logged): a regression whose prediction std collapses below the
    target's is averaging, not reconstructing."""
    target, pred = target_BCTHW.detach().float(), pred_BCTHW.detach().float()
    return {"target_latent_mean": target.mean(), "target_latent_std": target.std(),
            "pred_latent_mean": pred.mean(), "pred_latent_std": pred.std()}


# --- CausVid's training grid and per-frame timesteps (task: causal) ----------------------------

GRID_STEPS = 1000  # the training grid's timesteps (CausVid's and Self-Forcing's set_timesteps(1000))


def training_grid(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) of the grid CausVid's and Self-Forcing's Wan wrapper trains on, float32 as
    their scheduler builds them: 1001 equal steps from 1 to 0 without the last (1, 0.999, ..., 0.001),
    shifted by `shift` (shift_sigma), timesteps 1000 x sigma. Index i is i places from the noisy end."""
    sigmas = shift_sigma(torch.linspace(1.0, 0.0, GRID_STEPS + 1)[:-1], shift)
    return sigmas, sigmas * GRID_STEPS


def training_timesteps(fl) -> torch.Tensor:
    """flow.denoising_step_list as trained, float32: itself, or with `warp_denoising_step` each t
    replaced by the grid's timestep 1000 - t places from its start (t = 0 stays 0), as CausVid and
    Self-Forcing warp it: [1000, 750, 500, 250] -> [1000, 960, 888.9, 727.3] at shift 8."""
    steps = torch.tensor(fl.denoising_step_list, dtype=torch.float32)
    if not fl.warp_denoising_step:
        return steps
    timesteps = torch.cat([training_grid(fl.shift)[1], torch.zeros(1)])
    return timesteps[GRID_STEPS - steps.long()]


def timestep_sigmas(timesteps: torch.Tensor, shift: float) -> torch.Tensor:
    """The sigma each timestep is trained at: the sigma of the grid point nearest it (CausVid's
    scheduler takes the argmin over the grid, in float64), and exactly 0 at t = 0, a clean frame
    (its last grid point is sigma 0.008 at shift 8; CausVid's own real-video path gives the clean
    latent there, and sampling caches the finished block at t = 0)."""
    sigmas, grid = training_grid(shift)
    nearest = (grid.double()[None, :] - timesteps.double().flatten()[:, None]).abs().argmin(1)
    return torch.where(timesteps.flatten() == 0, 0.0, sigmas[nearest]).view(timesteps.shape)


def frame_noise(x0_BCTHW: torch.Tensor, noise_BCTHW: torch.Tensor, sigma_BT: torch.Tensor) -> torch.Tensor:
    """x_t per frame: (1 - sigma) x0 + sigma eps with each latent frame's own sigma (x0 itself where
    sigma is 0)."""
    s = sigma_BT[:, None, :, None, None].to(x0_BCTHW)
    return (1 - s) * x0_BCTHW + s * noise_BCTHW


def frame_x0(x_t_BCTHW: torch.Tensor, v_BCTHW: torch.Tensor, sigma_BT: torch.Tensor) -> torch.Tensor:
    """The x0 estimate x_t - sigma v per frame, computed in float64 as CausVid's wrapper does, fp32 out."""
    s = sigma_BT[:, None, :, None, None].double()
    return (x_t_BCTHW.double() - s * v_BCTHW.double()).float()


def per_frame_mse(pred_BCTHW: torch.Tensor, target_BCTHW: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample and latent frame [B, T], in fp32."""
    return (pred_BCTHW.float() - target_BCTHW.float()).pow(2).mean((1, 3, 4))


def seed_time_bucket(mean_t: float) -> str:
    """The video-regression seed's `loss_at_time_<k>` bucket: a sample's mean timestep over its
    frames, floored to a multiple of 250 (0, 250, 500, 750, 1000)."""
    return str(int(mean_t) // 250 * 250)
