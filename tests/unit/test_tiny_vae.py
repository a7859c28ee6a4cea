"""The tiny Wan VAE: shapes of the real code path, latents that carry the video (linear probe),
decoded colours, determinism, and normalised-latent statistics.

The probe is the property the tiny preset exists for: if a linear map cannot read the 8x8-pooled
colour back out of the normalised latent, a tiny transformer cannot use reference images either.
"""

from __future__ import annotations

import pytest
import torch

from e2v.models.tiny_vae import build_tiny_vae, pooled_targets, synthetic_videos

FRAMES, SIZE = 17, 64
LATENT_FRAMES = 1 + (FRAMES - 1) // 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def informative_vae():
    return build_tiny_vae(0, informative=True)


@pytest.fixture(scope="module")
def random_vae():
    return build_tiny_vae(0, informative=False)


@pytest.fixture(scope="module")
def clips():
    """Probe-fit clips and held-out clips, from a generator the VAE's calibration never uses."""
    g = torch.Generator().manual_seed(1)
    return synthetic_videos(8, g, FRAMES, SIZE), synthetic_videos(4, g, FRAMES, SIZE)


@torch.no_grad()
def _normalised_latents(vae, video_BCFHW: torch.Tensor) -> torch.Tensor:
    z_BZTHW = vae.encode(video_BCFHW).latent_dist.mode()
    mean_Z = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std_Z = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z_BZTHW - mean_Z) * (1.0 / std_Z)


def _positions(x_BCTHW: torch.Tensor) -> torch.Tensor:
    """[B,C,T,h,w] -> [B*T*h*w, C]: one row per latent position."""
    return x_BCTHW.permute(0, 2, 3, 4, 1).reshape(-1, x_BCTHW.shape[1]).double()


def _probe_r2(vae, fit_BCFHW: torch.Tensor, held_BCFHW: torch.Tensor) -> float:
    """Least squares (with bias) from the normalised latent at each (t, h, w) to the pooled RGB of
    that block; R^2 on the held-out clips, pooled over the 3 colour channels."""
    def design(video_BCFHW):
        x_NZ = _positions(_normalised_latents(vae, video_BCFHW))
        return torch.cat([x_NZ, torch.ones(len(x_NZ), 1, dtype=x_NZ.dtype)], 1), _positions(pooled_targets(video_BCFHW))

    x_fit, y_fit = design(fit_BCFHW)
    x_held, y_held = design(held_BCFHW)
    w = torch.linalg.lstsq(x_fit, y_fit).solution
    sse = ((x_held @ w - y_held) ** 2).sum()
    sst = ((y_held - y_held.mean(0)) ** 2).sum()
    return float(1 - sse / sst)


@pytest.mark.parametrize("informative", [True, False])
def test_shapes_follow_wan(informative, informative_vae, random_vae, clips):
    vae = informative_vae if informative else random_vae
    video_BCFHW = clips[1][:2]
    with torch.no_grad():
        z_BZTHW = vae.encode(video_BCFHW).latent_dist.mode()
        assert z_BZTHW.shape == (2, 16, LATENT_FRAMES, SIZE // 8, SIZE // 8)
        assert vae.decode(z_BZTHW).sample.shape == video_BCFHW.shape
    assert len(vae.config.latents_mean) == len(vae.config.latents_std) == 16


def test_first_frame_is_encoded_alone(informative_vae, clips):
    """Causal: latent frame 0 is frame 0 only (what a reference image encodes to), and a still
    video gives the same latent in every frame."""
    video_BCFHW = clips[1][:2]
    with torch.no_grad():
        z_BZTHW = informative_vae.encode(video_BCFHW).latent_dist.mode()
        z0_BZ1HW = informative_vae.encode(video_BCFHW[:, :, :1]).latent_dist.mode()
        still_BCFHW = video_BCFHW[:, :, :1].expand(-1, -1, FRAMES, -1, -1)
        z_still_BZTHW = informative_vae.encode(still_BCFHW).latent_dist.mode()
    assert torch.allclose(z0_BZ1HW, z_BZTHW[:, :, :1], atol=1e-5)
    assert torch.allclose(z_still_BZTHW, z0_BZ1HW.expand_as(z_still_BZTHW), atol=1e-4)


def test_latents_carry_pooled_colour(informative_vae, random_vae, clips):
    r2_informative = _probe_r2(informative_vae, *clips)
    r2_random = _probe_r2(random_vae, *clips)
    # Measured: informative 1.000; random -0.2 (the random latent is mostly a sample-independent
    # pattern, so the probe does worse than predicting the mean).
    assert r2_informative > 0.98, r2_informative
    assert r2_random < 0.5, r2_random


def test_decode_recovers_blurred_colours(informative_vae, clips):
    video_BCFHW = clips[1][:2]
    with torch.no_grad():
        z_BZTHW = informative_vae.encode(video_BCFHW).latent_dist.mode()
        decoded_BCFHW = informative_vae.decode(z_BZTHW).sample
    # Blurred target: each pixel frame shows its latent frame's 8x8 block means (nearest upsample).
    target_BCTHW = pooled_targets(video_BCFHW)
    frame_to_latent = [0] + [1 + (f - 1) // 4 for f in range(1, FRAMES)]
    blurred_BCFHW = target_BCTHW[:, :, frame_to_latent].repeat_interleave(8, 3).repeat_interleave(8, 4)
    psnr = float(10 * torch.log10(4 / ((decoded_BCFHW - blurred_BCFHW) ** 2).mean()))
    # Measured ~35 dB: the decoder also restores the half-group motion, which this target lacks.
    assert psnr > 30, psnr
    # Averaged back over each group, the decoded video is the target to within the RMS-norm error.
    groups_BCTHW = torch.cat([decoded_BCFHW[:, :, :1],
                              decoded_BCFHW[:, :, 1:].unflatten(2, (LATENT_FRAMES - 1, 4)).mean(3)], 2)
    pooled_BCTHW = torch.nn.functional.avg_pool3d(groups_BCTHW, (1, 8, 8))
    assert (pooled_BCTHW - target_BCTHW).abs().max() < 0.01


@pytest.mark.parametrize("informative", [True, False])
def test_same_seed_same_vae_and_global_rng_untouched(informative, informative_vae, random_vae):
    rng_before = torch.random.get_rng_state()
    vae = build_tiny_vae(0, informative=informative)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    reference = informative_vae if informative else random_vae
    ref_state = reference.state_dict()
    state = vae.state_dict()
    assert state.keys() == ref_state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, ref_state[name]), name
    assert vae.config.latents_mean == reference.config.latents_mean
    assert vae.config.latents_std == reference.config.latents_std


@pytest.mark.parametrize("informative", [True, False])
def test_normalised_latents_are_standardised(informative, informative_vae, random_vae, clips):
    vae = informative_vae if informative else random_vae
    latents_BZTHW = _normalised_latents(vae, torch.cat(clips))
    mean_Z = latents_BZTHW.mean(dim=(0, 2, 3, 4))
    std_Z = latents_BZTHW.std(dim=(0, 2, 3, 4))
    assert mean_Z.abs().max() < 0.5, mean_Z
    assert 0.3 < std_Z.min() and std_Z.max() < 3, std_Z


def test_small(informative_vae):
    assert sum(p.numel() for p in informative_vae.parameters()) < 200_000
