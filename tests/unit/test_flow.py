"""Flow matching against independent oracles: diffusers' FlowMatchEulerDiscreteScheduler for the
shift, the logit-normal law for the sigma draw, and the algebra of x_t / v / x0."""

import math

import torch

from e2v.config.schema import Flow
from e2v.train.flow import add_noise, sample_sigmas, shift_sigma, velocity_target, x0_from_velocity


def test_shift_equals_diffusers_flow_match_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (1.0, 3.0, 5.0, 8.0):
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        unshifted = torch.arange(1000, 0, -1) / 1000  # its training grid t/1000, before the shift
        torch.testing.assert_close(shift_sigma(unshifted, shift), sched.sigmas, atol=1e-6, rtol=0)


def test_default_shift_is_wans_5():
    assert Flow().shift == 5.0 and Flow().sigma_sampling == "uniform"


def test_uniform_draw_follows_the_shifted_law():
    """P(sigma <= s) = P(u <= u(s)) with u(s) the inverse of the shift: s / (shift - (shift-1) s)."""
    shift, n = 5.0, 200_000
    sigma = sample_sigmas(n, generator=torch.Generator().manual_seed(0), shift=shift)
    for s in (0.3, 0.6, 0.9):
        expected = s / (shift - (shift - 1) * s)
        assert abs((sigma <= s).float().mean().item() - expected) < 0.005, s


def test_logit_normal_draw_has_the_normal_logit():
    """Unshifted (shift 1), logit(sigma) ~ N(mean, std): check the first two moments."""
    sigma = sample_sigmas(200_000, generator=torch.Generator().manual_seed(1), mode="logit_normal", shift=1.0,
                          logit_mean=0.5, logit_std=0.8).double()
    logit = torch.log(sigma / (1 - sigma))
    assert abs(logit.mean().item() - 0.5) < 0.01 and abs(logit.std().item() - 0.8) < 0.01
    assert (sample_sigmas(64, generator=torch.Generator().manual_seed(2), timestep_list=[250.0, 750.0]) * 1000
            ).round().unique().tolist() == [250.0, 750.0]


def test_noising_target_and_x0_estimate_are_consistent():
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
    sigma = torch.tensor([0.2, 0.9])
    x_t = add_noise(x0, eps, sigma)
    torch.testing.assert_close(x_t[1], 0.1 * x0[1] + 0.9 * eps[1])
    v = velocity_target(x0, eps)
    torch.testing.assert_close(x0_from_velocity(x_t, v, sigma), x0, atol=1e-6, rtol=0)
    assert math.isclose((eps - x0).pow(2).mean().item(), v.pow(2).mean().item())
