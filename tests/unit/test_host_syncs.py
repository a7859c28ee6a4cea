"""What the step reads back to the host: nothing after engine.step() (the logged statistics stay on the
device until the logged step reads them, in one copy), and no pixel-range reduction before a VAE
encode of uint8 pixels (their range is [-1, 1] by construction). The meta device stands in for the
GPU: copying a meta tensor to the host raises, as a per-micro-batch sync would cost on a GPU."""

from __future__ import annotations

import pytest
import torch

META = torch.device("meta")


def flow(objective="flow", steps=None):
    from e2v.config.schema import Flow

    return Flow(objective=objective, denoising_step_list=steps)


def test_step_statistics_stay_on_the_device_until_the_logged_step():
    from e2v.train.step import add_step_stats

    stats = {}
    sigma, per_sample = torch.rand(3, device=META), torch.rand(3, device=META)
    latents = torch.rand(3, 16, 2, 4, 4, device=META)
    add_step_stats(stats, sigma, per_sample, latents, latents, flow("x0"), boundary=0.9)  # no copy to the host


def test_logged_statistics_read_once_equal_the_per_value_arithmetic(monkeypatch):
    """read_step_stats against the arithmetic done value by value on the host (the oracle: what the
    loop logged when it read each micro-batch back), with one device-to-host copy for them all."""
    from e2v.config.experts import expert_for
    from e2v.train.flow import time_bucket
    from e2v.train.step import add_step_stats, read_step_stats

    g = torch.Generator().manual_seed(0)
    # each micro-batch's sigmas on one side of the boundary 0.5, as expert_sigma_range draws them
    draws = [(0.05 + 0.5 * (i % 2) + 0.4 * torch.rand(2, generator=g), torch.rand(2, generator=g),
              torch.randn(2, 16, 2, 4, 4, generator=g), torch.randn(2, 16, 2, 4, 4, generator=g)) for i in range(3)]
    stats = {}
    for sigma, per_sample, target, pred in draws:
        add_step_stats(stats, sigma, per_sample, target, pred, flow("x0"), boundary=0.5)
    copies = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.numel()) or real(t))
    got = read_step_stats(stats)
    monkeypatch.undo()
    assert len(copies) == 1
    want = {}
    for sigma, per_sample, target, pred in draws:
        for s, l in zip(sigma.tolist(), per_sample.tolist()):
            want.setdefault(f"train/loss_at_time_{time_bucket(s, None)}", []).append(l)
            want.setdefault(f"train/loss_{expert_for(1000 * torch.tensor([s]), 0.5)}", []).append(l)
        for k, v in {"target_latent_mean": target.mean(), "target_latent_std": target.std(),
                     "pred_latent_mean": pred.mean(), "pred_latent_std": pred.std()}.items():
            want.setdefault(f"train/{k}", []).append(v.item())
    assert got == want


def test_uint8_pixels_reach_the_vae_without_a_range_reduction(tiny_parts, monkeypatch):
    """uint8 -> [-1, 1] cannot leave the range: no aminmax (a host sync per encode); float pixels
    out of range still fail, naming the range."""
    from e2v.conditioning.encode import encode_video

    video = torch.randint(0, 256, (1, 3, 5, 32, 32), dtype=torch.uint8)

    def no_reduction(self, *a, **kw):
        raise AssertionError("a pixel-range reduction ran")

    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "aminmax", no_reduction)
        with torch.no_grad():
            latents = encode_video(video, tiny_parts.vae)
    assert latents.shape[:3] == (1, 16, 2) and torch.isfinite(latents).all()
    with pytest.raises(AssertionError, match=r"pixels must be in \[-1, 1\], got \[.*2\.000\]"):
        encode_video(torch.full((1, 3, 5, 32, 32), 2.0), tiny_parts.vae)
