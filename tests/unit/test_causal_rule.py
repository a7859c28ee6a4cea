"""The causal task's training rule (e2v/train/step.py, docs/causal.md) against CausVid's, written
here from CausVid's code (causvid/ode_regression.py's `_process_timestep` and warp,
causvid/models/wan/wan_wrapper.py's x0 conversion, causvid/models/wan/flow_match.py's grid, the
video-regression extension's `video_loss` and its logging), never from e2v's helpers: the per-block
index draw, the warp, the sigma of a timestep, the masked fp32 loss, the redraw of an all-clean
draw, and the logged names.

Legend: B batch, C channels, T latent frames, h/w latent size, L tokens."""

import math

import pytest
import torch
import torch.nn.functional as F

from e2v.config.schema import Causal, Flow

# --- CausVid's rules, restated --------------------------------------------------------------------


def causvid_grid(shift: float = 8.0):
    """FlowMatchScheduler(shift, sigma_min=0.0, extra_one_step=True).set_timesteps(1000, training=True)."""
    sigmas = torch.linspace(1.0, 0.0, 1001)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas, sigmas * 1000


def causvid_index(generator, batch, frames, n_steps, per_block, independent_first_frame=False):
    """ode_regression._process_timestep for causal_video (Self-Forcing's _get_timestep with
    independent_first_frame): one randint over [B, T], each block then copies its first frame's."""
    index = torch.randint(0, n_steps, [batch, frames], generator=generator, dtype=torch.long)
    if independent_first_frame:
        rest = index[:, 1:].reshape(batch, -1, per_block)
        rest[:, :, 1:] = rest[:, :, 0:1]
        return torch.cat([index[:, 0:1], rest.reshape(batch, -1)], dim=1)
    index = index.reshape(batch, -1, per_block)
    index[:, :, 1:] = index[:, :, 0:1]
    return index.reshape(batch, -1)


def causvid_warp(step_list, shift=8.0):
    timesteps = torch.cat((causvid_grid(shift)[1], torch.tensor([0], dtype=torch.float32)))
    return timesteps[1000 - torch.tensor(step_list, dtype=torch.long)]


def causvid_sigma(t, shift=8.0):
    """The wrapper's sigma of a timestep: the grid sigma at argmin |timesteps - t| (float64)."""
    sigmas, timesteps = causvid_grid(shift)
    return sigmas[(timesteps.double()[None] - t.double().flatten()[:, None]).abs().argmin(1)].view(t.shape)


def fl(steps, warp=False, shift=8.0):
    return Flow(shift=shift, objective="x0", denoising_step_list=[float(s) for s in steps], warp_denoising_step=warp)


# --- the draw ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,frames,per_block,first", [(2, 21, 3, False), (3, 6, 2, False), (2, 7, 3, True),
                                                          (1, 5, 1, False)])
def test_seeded_block_draws_equal_causvids_process_timestep(batch, frames, per_block, first):
    from e2v.train.step import draw_block_timesteps

    steps = [1000, 757, 522, 250]  # no 0: no redraw, the first draw is the one
    for seed in range(5):
        ours = draw_block_timesteps(batch, frames, fl(steps), Causal(per_block, first), torch.Generator().manual_seed(seed))
        index = causvid_index(torch.Generator().manual_seed(seed), batch, frames, len(steps), per_block, first)
        assert torch.equal(ours, torch.tensor(steps, dtype=torch.float32)[index]), seed
        blocks = ours[:, 1:] if first else ours
        assert (blocks.view(batch, -1, per_block) == blocks.view(batch, -1, per_block)[:, :, :1]).all()


def test_all_clean_draws_are_redrawn():
    """A draw whose every timestep is 0 has no loss (CausVid: the mean over an empty mask, NaN):
    it is drawn again from the same generator, as often as it takes."""
    from e2v.conditioning.encode import Conditions
    from e2v.train.step import draw_block_timesteps, draw_flow

    steps = [0, 0, 0, 600]
    redrawn = 0
    for seed in range(40):
        ours = draw_block_timesteps(1, 6, fl(steps), Causal(3), torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        draws = 0
        while True:
            draws += 1
            oracle = torch.tensor(steps, dtype=torch.float32)[causvid_index(g, 1, 6, 4, 3)]
            if (oracle != 0).any():
                break
        redrawn += draws > 1
        assert torch.equal(ours, oracle) and ours.any(), seed
    assert redrawn > 10  # the seeds did exercise the redraw

    # the bidirectional task: a listed 0 is a clean sample; a micro-batch of clean samples is drawn again
    c = Conditions(torch.randn(2, 4, 3, 2, 2), torch.zeros(2, 1, 8))
    for seed in range(20):
        sigma, noise, noisy = draw_flow(c, fl([0, 500], shift=5.0), torch.Generator().manual_seed(seed))
        assert sigma.any() and set(sigma.tolist()) <= {0.0, 0.5}
        torch.testing.assert_close(noisy[sigma == 0], c.latents_BCTHW[sigma == 0], rtol=0, atol=0)


def test_warp_maps_the_list_through_the_shift_grid():
    from e2v.train.flow import training_timesteps

    for steps, shift in (([1000, 750, 500, 250], 8.0), ([1000, 757, 522, 0], 8.0), ([1000, 750, 500, 250], 5.0)):
        warped = training_timesteps(fl(steps, warp=True, shift=shift))
        assert torch.equal(warped, causvid_warp(steps, shift)), (steps, shift)
    assert [round(x, 1) for x in training_timesteps(fl([1000, 750, 500, 250], warp=True)).tolist()] == \
        [1000.0, 960.0, 888.9, 727.3]
    assert torch.equal(training_timesteps(fl([1000, 757, 522, 0])), torch.tensor([1000.0, 757.0, 522.0, 0.0]))


def test_a_timesteps_sigma_is_the_nearest_grid_sigma_and_zero_is_clean():
    from e2v.train.flow import timestep_sigmas

    t = torch.tensor([[1000.0, 757.0, 522.0], [960.0, 727.2727, 1.0]])
    torch.testing.assert_close(timestep_sigmas(t, 8.0), causvid_sigma(t), rtol=0, atol=0)
    assert timestep_sigmas(torch.tensor([1000.0]), 8.0).item() == 1.0
    assert abs(timestep_sigmas(torch.tensor([757.0]), 8.0).item() - 0.757) < 5e-4  # about t / 1000
    # CausVid's grid ends at sigma 0.008 (shift 8); a listed 0 is the clean latent exactly here
    assert causvid_sigma(torch.tensor([0.0])).item() == pytest.approx(8 * 0.001 / (1 + 7 * 0.001))
    assert timestep_sigmas(torch.tensor([0.0, 0.0]), 8.0).tolist() == [0.0, 0.0]


# --- the loss ---------------------------------------------------------------------------------------


def tiny_causal(per_block=3, first=False):
    from diffusers import WanTransformer3DModel

    from e2v.models.causal import enable_causal
    from e2v.models.tiny import seeded, tiny_transformer_config

    with seeded(0):
        transformer = WanTransformer3DModel(**tiny_transformer_config("t2v")).eval()
    return enable_causal(transformer, per_block, first, "blocks")


@pytest.mark.parametrize("first", [False, True])
def test_the_loss_equals_the_hand_computation(first):
    """draw_flow + forward_loss on the causal tiny transformer against CausVid's video_loss by hand:
    the same indices, the noise drawn next from the same generator, x_t per frame (the clean
    latent where t = 0), the listed t per token to the model, x0 = x_t - sigma v in float64, the
    MSE over the noisy frames only; the per-sample loss over all frames (unnormalized_loss)."""
    from e2v.conditioning.encode import Conditions
    from e2v.config.load import load_config
    from e2v.train.step import draw_flow, forward_loss

    model = tiny_causal(3, first)
    frames = 7 if first else 6
    cfg = load_config(raw={"e2v_type": "none", "task": "causal", "model": {"preset": "tiny", "base": "t2v"},
                           "data": {"datasets": [{"data_root": "."}], "num_frames": 4 * (frames - 1) + 1,
                                    "resolution": [32, 32]},
                           "causal": {"frames_per_block": 3, "independent_first_frame": first},
                           "flow": {"objective": "x0", "shift": 8.0, "denoising_step_list": [1000, 757, 522, 0]}})
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 16, frames, 4, 4, generator=g)
    text = torch.randn(2, 512, model.config.text_dim, generator=g)
    c = Conditions(x0, text)
    for seed in range(3):
        sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(seed), causal=cfg.causal)
        loss, per_sample, pred, target = forward_loss(model, c, sigma, noise, noisy, cfg, torch.float32)

        g = torch.Generator().manual_seed(seed)
        while True:
            t_BT = torch.tensor([1000.0, 757.0, 522.0, 0.0])[causvid_index(g, 2, frames, 4, 3, first)]
            if t_BT.any():
                break
        eps = torch.randn(x0.shape, generator=g)
        s = torch.where(t_BT == 0, 0.0, causvid_sigma(t_BT))[:, None, :, None, None]
        x_t = (1 - s) * x0 + s * eps
        clean = t_BT == 0
        assert clean.any() and torch.equal(x_t.transpose(1, 2)[clean], x0.transpose(1, 2)[clean])
        with torch.no_grad():
            v = model(x_t, timestep=t_BT[:, :, None].expand(2, frames, 4).reshape(2, frames * 4),
                      encoder_hidden_states=text, return_dict=False)[0]
        pred_BFCHW = (x_t.double() - s.double() * v.double()).float().permute(0, 2, 1, 3, 4)
        x0_BFCHW = x0.permute(0, 2, 1, 3, 4)
        mask = t_BT != 0
        expected = F.mse_loss(pred_BFCHW[mask], x0_BFCHW[mask], reduction="mean")
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(per_sample.detach(), F.mse_loss(pred_BFCHW, x0_BFCHW, reduction="none")
                                   .mean(dim=[1, 2, 3, 4]), rtol=1e-6, atol=0)
        assert loss.dtype == torch.float32 and torch.equal(target, x0)


def test_clean_frames_carry_no_loss():
    """The prediction of a frame at t = 0 does not reach the loss: changing it changes nothing."""
    from e2v.conditioning.encode import Conditions
    from e2v.config.schema import Config
    from e2v.train.step import forward_loss

    cfg = Config(task="causal", flow=fl([1000, 0]))
    x0 = torch.randn(1, 16, 6, 4, 4)
    c = Conditions(x0, torch.zeros(1, 512, 16))
    sigma = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])

    def model_returning(v):
        return lambda *a, **k: (v,)

    v = torch.randn(1, 16, 6, 4, 4)
    loss, *_ = forward_loss(model_returning(v), c, sigma, torch.randn_like(x0), x0.clone(), cfg, torch.float32)
    v2 = v.clone()
    v2[:, :, 3:] += 100.0
    loss2, *_ = forward_loss(model_returning(v2), c, sigma, torch.randn_like(x0), x0.clone(), cfg, torch.float32)
    assert loss.item() == loss2.item()
    assert loss.item() == pytest.approx(((x0[:, :, :3] - v[:, :, :3] - x0[:, :, :3]) ** 2).mean().item(), rel=1e-6)


def test_the_logged_names_follow_the_seeds_loop():
    """The extension's logging: generator_loss (our train/loss), target/pred latent mean and std over
    all frames, and loss_at_time_<k>: each sample's unnormalized loss bucketed by its mean timestep
    floored to 250, averaged within the bucket."""
    from collections import defaultdict

    from e2v.train.flow import timestep_sigmas
    from e2v.train.step import add_step_stats, read_step_stats

    flow = fl([1000, 757, 522, 0])
    t_BT = torch.tensor([[1000.0] * 3 + [0.0] * 3, [757.0] * 3 + [522.0] * 3, [522.0] * 3 + [0.0] * 3])
    sigma = timestep_sigmas(t_BT, flow.shift)
    per_sample = torch.tensor([0.5, 0.25, 0.125])
    target, pred = torch.randn(3, 16, 6, 2, 2), torch.randn(3, 16, 6, 2, 2)
    stats = {}
    add_step_stats(stats, sigma, per_sample, target, pred, flow)
    logged = read_step_stats(stats)

    breakdown = defaultdict(list)
    for t, loss in zip(t_BT.float().mean(dim=1), per_sample):
        breakdown[str(int(t.item()) // 250 * 250)].append(loss.item())
    expected = {f"train/loss_at_time_{k}": sum(v) / len(v) for k, v in breakdown.items()}
    assert {k: sum(v) / len(v) for k, v in logged.items() if "loss_at_time" in k} == pytest.approx(expected)
    assert set(expected) == {"train/loss_at_time_500", "train/loss_at_time_250"}
    for name, value in (("target_latent_mean", target.mean()), ("target_latent_std", target.std()),
                        ("pred_latent_mean", pred.mean()), ("pred_latent_std", pred.std())):
        assert logged[f"train/{name}"] == [pytest.approx(value.item(), rel=1e-6)]


def test_the_bidirectional_draw_is_unchanged_without_a_zero():
    """A bidirectional list without 0 draws as before the causal task: one index per sample, sigma = t / 1000."""
    from e2v.conditioning.encode import Conditions
    from e2v.train.step import draw_flow

    c = Conditions(torch.randn(4, 16, 3, 2, 2), torch.zeros(4, 1, 8))
    flow = fl([1000, 750, 500, 250], shift=5.0)
    sigma, noise, noisy = draw_flow(c, flow, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    expected = torch.tensor([1000.0, 750.0, 500.0, 250.0])[torch.randint(4, (4,), generator=g)] / 1000
    assert torch.equal(sigma, expected) and torch.equal(noise, torch.randn(c.latents_BCTHW.shape, generator=g))
    assert math.isclose(noisy.sum().item(), ((1 - sigma.view(-1, 1, 1, 1, 1)) * c.latents_BCTHW
                                             + sigma.view(-1, 1, 1, 1, 1) * noise).sum().item(), rel_tol=1e-6)
