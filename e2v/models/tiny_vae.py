"""A tiny `diffusers.AutoencoderKLWan` whose latents actually carry the video, for CPU tests and demos.

Why this exists.  The tiny preset must run the real Wan VAE code path (`encode` in causal chunks of
1 then 4 frames with feature caches, `DiagonalGaussianDistribution`, chunked `decode`), so it has to
be an `AutoencoderKLWan`.  But a random-weight one is useless as a feature extractor: measured on
synthetic clips, about 97% of each latent is the same pattern for every sample, colour cannot be
read back, and a least-squares probe from normalised latents to 8x8-pooled RGB has held-out
R^2 ~ -0.2 (worse than predicting the mean).  A tiny transformer trained on such latents can never
learn to use reference images, because the references are not in them.

So `informative=True` sets the weights analytically (no training) so that the encoder computes
    8x8 average pool of RGB, causal temporal grouping (frame 0 alone, then groups of 4 frames),
    then a fixed full-rank linear map into the 16 latent channels,
and the decoder inverts it up to nearest-neighbour upsampling.  Per latent position the latent
carries 6 numbers: the group's mean RGB, and the change of RGB from the group's first to its second
half (coarse motion; 0 for frame 0 and for still references).  Rank 6 inside 16 channels is fine
for a diffusion model: the other 10 directions are constant.  Measured (tests/unit/test_tiny_vae.py):
probe R^2 1.000 vs -0.2 random; decoded video vs the 8x8-blurred group-mean target 35 dB PSNR
(vs the half-group target the decoder actually aims at: 79 dB); 43k parameters; its encode's
speed against the random preset's: bench/RESULTS.md, section 7: `tiny_vae_encode`.

How the Wan blocks are made to do that (read `autoencoder_kl_wan.py` alongside):
- `num_res_blocks=0` and equal widths: the encoder's down path is conv_in + 3 Resamples; the
  residual blocks left (mid block, one per decoder up block) have `conv2` = 0, so each is its
  identity / 1x1 shortcut.  (Residual blocks at 64x64 would cost 5x the encode time for nothing:
  most of it in their per-position RMS norms over few channels);
- mid-block attention: output `proj` is zero, so it is the identity;
- stride-2 `Resample` convs: a 2x2 box filter (the ZeroPad2d on the right/bottom is never read);
- the temporal `time_conv` (3 taps, stride 2): in chunked encode it sees [last frame of the previous
  chunk, the chunk's frames], so taps (0, 1/2, 1/2) average frame pairs, then pairs of pairs; in
  the first chunk it is skipped, which is why frame 0 stays alone;
- 3x3x3 causal convs (`conv_in`, `conv_out`, ...): only the current-frame centre tap is non-zero,
  so they are per-position affine maps and the causal cache cannot leak other frames in;
- the RMS norm + SiLU before `conv_out` (encoder and decoder): RMS-normalising across channels
  destroys magnitude, so every 3 signal values s travel as 4 channels o + E s, where the offset o
  is large (`_OFFSET`) and orthogonal to the columns of E.  Then |o + E s|^2 = |o|^2 + |E s|^2 has
  no first-order term, the norm only rescales the signal by 1 / sqrt(1 + |E s|^2 / |o|^2) (at most
  0.5% for pixels in [-1, 1], 0.2% measured), a readout L with L o = 0 removes the offset exactly, and the
  channels sit above +12 where SiLU is the identity to 1e-4.

`latents_mean` / `latents_std` are measured at build time by encoding a fixed set of synthetic
clips (`synthetic_videos`, own generator), so `(z - mean) * (1 / std)` is about zero-mean,
unit-std per channel (held out: |mean| < 0.2, std 0.9-1.25).  Everything is deterministic given
`seed`, and building never touches the global RNG.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    WanAttentionBlock,
    WanCausalConv3d,
    WanResample,
    WanResidualBlock,
)

Z_DIM = 16
_OFFSET = 16.0  # offset of each signal channel: keeps RMS norm ~linear and SiLU at identity
_DIFF_GAIN = 1.0  # latent carries mean + gain * (second-half mean - first-half mean) of a group
_LOGVAR = -10.0  # posterior std exp(-5) ~ 0.007 raw units: sampling barely perturbs the mean
_CALIB_SEED = 20250101  # synthetic clips used to measure latents_mean / latents_std
_GROUP = 4  # channels per 3-signal group: 3 offset signal channels + 1 balancing channel


# --- synthetic content -------------------------------------------------------------------------


def synthetic_videos(batch: int, generator: torch.Generator, frames: int = 17, size: int = 64) -> torch.Tensor:
    """Coloured square moving over a two-colour striped background, colours random per sample.

    Returns video_BCFHW in [-1, 1].  At size 64: stripes are wide enough (period 12-48 px) that 8x8
    block means vary across the frame, the square (8-28 px) moves 0.5-3 px per frame, bouncing off
    the borders, so the 4 frames of a latent group differ.  Lengths scale with `size`.
    """
    g = generator

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    colours_B3 = [rand(batch, 3) * 2 - 1 for _ in range(3)]  # background a, background b, square
    period_B = size * (0.1875 + 0.5625 * rand(batch))
    angle_B = math.pi * rand(batch)
    phase_B = 2 * math.pi * rand(batch)
    side_B = (size * (0.125 + 0.3125 * rand(batch))).round()
    start_B2 = rand(batch, 2) * (size - side_B[:, None])
    speed_B = size / 64 * (0.5 + 2.5 * rand(batch))
    heading_B = 2 * math.pi * rand(batch)
    velocity_B2 = torch.stack([torch.cos(heading_B), torch.sin(heading_B)], 1) * speed_B[:, None]

    yy_HW, xx_HW = torch.meshgrid(torch.arange(size, dtype=torch.float32),
                                  torch.arange(size, dtype=torch.float32), indexing="ij")
    proj_BHW = (xx_HW * torch.cos(angle_B)[:, None, None] + yy_HW * torch.sin(angle_B)[:, None, None])
    stripe_BHW = 0.5 + 0.5 * torch.sin(2 * math.pi * proj_BHW / period_B[:, None, None] + phase_B[:, None, None])
    bg_B3HW = (colours_B3[0][:, :, None, None] * stripe_BHW[:, None]
               + colours_B3[1][:, :, None, None] * (1 - stripe_BHW[:, None]))

    t_F = torch.arange(frames, dtype=torch.float32)
    # Bounce off the borders so the square stays fully visible.
    span_B = (size - side_B)[:, None, None]
    pos_BF2 = start_B2[:, None, :] + velocity_B2[:, None, :] * t_F[None, :, None]
    pos_BF2 = span_B - (pos_BF2 % (2 * span_B) - span_B).abs()
    x0_BF, y0_BF = pos_BF2[..., 0], pos_BF2[..., 1]
    side_B11 = side_B[:, None, None]
    xs_11W = xx_HW[0][None, None]
    inside_x_BFW = (xs_11W >= x0_BF[..., None]) & (xs_11W < x0_BF[..., None] + side_B11)
    ys_11H = yy_HW[:, 0][None, None]
    inside_y_BFH = (ys_11H >= y0_BF[..., None]) & (ys_11H < y0_BF[..., None] + side_B11)
    mask_B1FHW = (inside_y_BFH[..., :, None] & inside_x_BFW[..., None, :]).float()[:, None]

    video_BCFHW = (bg_B3HW[:, :, None] * (1 - mask_B1FHW)
                   + colours_B3[2][:, :, None, None, None] * mask_B1FHW)
    return video_BCFHW.clamp(-1, 1)


def pooled_targets(video_BCFHW: torch.Tensor) -> torch.Tensor:
    """What the informative latent is meant to hold: 8x8 block means of RGB, per latent frame
    (frame 0 alone, then each group of 4 frames averaged).  [B,3,F,H,W] -> [B,3,T,H/8,W/8]."""
    first_BC1HW = video_BCFHW[:, :, :1]
    rest_BCFHW = video_BCFHW[:, :, 1:]
    b, c, f, h, w = rest_BCFHW.shape
    groups_BCTHW = rest_BCFHW.reshape(b, c, f // 4, 4, h, w).mean(3)
    frames_BCTHW = torch.cat([first_BC1HW, groups_BCTHW], 2)
    return F.avg_pool3d(frames_BCTHW, kernel_size=(1, 8, 8))


# --- analytic weights --------------------------------------------------------------------------


def _group_maps(offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """offset o [4], embedding E [4,3], readout L [3,4] with L E = I, L o = 0 and o orthogonal to E.

    Channels: (o1 + s_r, o1 + s_g, o1 + s_b, o4 - (s_r + s_g + s_b) / sqrt(3)) with o4 = sqrt(3) o1,
    so o . E[:, k] = o1 - o4 / sqrt(3) = 0.
    """
    r3 = math.sqrt(3.0)
    offset_4 = torch.tensor([offset, offset, offset, r3 * offset], dtype=torch.float64)
    embed_43 = torch.cat([torch.eye(3, dtype=torch.float64), torch.full((1, 3), -1 / r3, dtype=torch.float64)])
    basis_44 = torch.cat([embed_43, offset_4[:, None]], 1)
    readout_34 = torch.linalg.inv(basis_44)[:3]
    return offset_4, embed_43, readout_34


def _pointwise(conv: torch.nn.Module, matrix_OI: torch.Tensor, bias_O: torch.Tensor | None = None) -> None:
    """Make a conv a per-position affine map: only the current-frame (last causal tap), spatial-centre
    tap is non-zero, so neither the causal cache nor zero padding contributes anything."""
    w = conv.weight
    w.zero_()
    centre = tuple(k // 2 for k in w.shape[-2:])
    if w.ndim == 5:
        w[(slice(None), slice(None), w.shape[2] - 1) + centre] = matrix_OI.to(w.dtype)
    else:
        w[(slice(None), slice(None)) + centre] = matrix_OI.to(w.dtype)
    if conv.bias is not None:
        conv.bias.zero_()
        if bias_O is not None:
            conv.bias.copy_(bias_O.to(conv.bias.dtype))


def _tile_eye(out_dim: int, in_dim: int) -> torch.Tensor:
    """out channel j copies in channel j mod in_dim: widening repeats the 4-channel group layout."""
    m = torch.zeros(out_dim, in_dim, dtype=torch.float64)
    m[torch.arange(out_dim), torch.arange(out_dim) % in_dim] = 1
    return m


def _set_informative_weights(vae: AutoencoderKLWan, generator: torch.Generator) -> None:
    """Channel layout: group A (channels 0-3) carries the mean RGB s, group B (4-7) carries
    s + gain * change, each as o + E s (`_group_maps`).  The only randomness is the 16x6 mixing
    into the latent, drawn from `generator`; weights not set here do not affect the output."""
    offset_4, embed_43, readout_34 = _group_maps(_OFFSET)
    enc, dec = vae.encoder, vae.decoder
    if enc.conv_out.weight.shape[1] != 2 * _GROUP or dec.conv_in.weight.shape[0] != 2 * _GROUP:
        raise ValueError("the informative weights need 8-channel encoder and decoder (base_dim=8, dim_mult=[1,1,1,1])")
    eye4 = torch.eye(_GROUP, dtype=torch.float64)

    # Identity blocks: the residual branch (norm-SiLU-conv-norm-SiLU-conv) is switched off at its last
    # conv, attention at its output projection; 1x1 shortcuts (width changes) copy the group layout.
    for m in vae.modules():
        if isinstance(m, WanResidualBlock):
            m.conv2.weight.zero_()
            m.conv2.bias.zero_()
            if isinstance(m.conv_shortcut, WanCausalConv3d):
                _pointwise(m.conv_shortcut, _tile_eye(m.out_dim, m.in_dim))
        elif isinstance(m, WanAttentionBlock):
            m.proj.weight.zero_()
            m.proj.bias.zero_()

    # Encoder input: RGB -> o + E rgb, repeated over the channels (group B starts as a copy of A).
    enc_in_dim = enc.conv_in.weight.shape[0]
    _pointwise(enc.conv_in, _tile_eye(enc_in_dim, _GROUP) @ embed_43, _tile_eye(enc_in_dim, _GROUP) @ offset_4)

    # Downsamplers: 2x2 box filter in space; in time, pair averages, then at the last temporal stage
    # group A (channels 0-3) takes the mean and group B (4-7) mean + gain * (late half - early half).
    # Every temporal kernel sums to 1 so the offsets pass through unchanged.
    temporal_stage = 0
    for m in enc.down_blocks:
        if not isinstance(m, WanResample):
            continue
        conv2d = m.resample[1]
        dim = conv2d.weight.shape[0]
        conv2d.weight.zero_()
        conv2d.bias.zero_()
        conv2d.weight[:, :, :2, :2] = (torch.eye(dim) / 4)[:, :, None, None]
        if m.mode == "downsample3d":
            temporal_stage += 1
            tc = m.time_conv
            tc.weight.zero_()
            tc.bias.zero_()
            eye = torch.eye(dim)
            tc.weight[:, :, 1, 0, 0] = eye / 2
            tc.weight[:, :, 2, 0, 0] = eye / 2
            if temporal_stage == 2:
                gain = _DIFF_GAIN
                for j in range(_GROUP, 2 * _GROUP):
                    tc.weight[j, j, 1, 0, 0] = 0.5 - gain
                    tc.weight[j, j, 2, 0, 0] = 0.5 + gain
    if temporal_stage != 2:
        raise AssertionError("expected two temporal downsamplers (temperal_downsample=[False, True, True])")

    # Encoder head: RMS norm gamma undoes the normalisation on the offset manifold
    # (|o|/sqrt(C) per channel); SiLU is the identity around +16; then readout and mixing.
    enc_offset, mix_Z6 = _encoder_head(vae, offset_4, readout_34, Z_DIM, generator)

    # Decoder input: z -> (mean RGB, change) -> groups A = o + E mean, B = o + E (mean + change).
    unmix_6Z = mix_Z6.T
    dec_in_dim = dec.conv_in.weight.shape[0]
    dec_in_W = torch.zeros(dec_in_dim, Z_DIM, dtype=torch.float64)
    dec_in_b = torch.zeros(dec_in_dim, dtype=torch.float64)
    dec_in_W[:_GROUP] = embed_43 @ unmix_6Z[:3]
    dec_in_W[_GROUP:2 * _GROUP] = embed_43 @ (unmix_6Z[:3] + unmix_6Z[3:])
    dec_in_b[:2 * _GROUP] = enc_offset
    _pointwise(dec.conv_in, dec_in_W, dec_in_b)

    # Decoder upsamplers: nearest 2x then a centre-tap conv keeping group A.  The first temporal
    # upsampler splits a latent frame into its two half-group means A -/+ (B - A) / (2 gain); the
    # second repeats each (decoded group = [h1, h1, h2, h2]).  Chunk 0 skips time_conv: 1 frame.
    temporal_stage = 0
    for block in dec.up_blocks:
        if block.upsamplers is None:
            continue
        m = block.upsamplers[0]
        conv2d = m.resample[1]
        out_dim, dim = conv2d.weight.shape[:2]
        _pointwise(conv2d, _tile_eye(out_dim, dim))
        if m.mode == "upsample3d":
            temporal_stage += 1
            frame_DD = torch.eye(dim, dtype=torch.float64)
            if temporal_stage == 1:
                a = 1 / (2 * _DIFF_GAIN)
                half_DD = torch.zeros(dim, dim, dtype=torch.float64)
                half_DD[:_GROUP, :_GROUP] = a * eye4
                half_DD[:_GROUP, _GROUP:2 * _GROUP] = -a * eye4
                first_DD, second_DD = frame_DD + half_DD, frame_DD - half_DD
                # group B rows are never read again (the upsample conv keeps group A)
                first_DD[_GROUP:2 * _GROUP] = first_DD[:_GROUP]
                second_DD[_GROUP:2 * _GROUP] = second_DD[:_GROUP]
            else:
                first_DD = second_DD = frame_DD
            _pointwise(m.time_conv, torch.cat([first_DD, second_DD]))

    # Decoder head: same norm trick on one group, then readout L to RGB.
    dec_dim = dec.norm_out.gamma.shape[0]
    dec_offset = _tile_eye(dec_dim, _GROUP) @ offset_4
    dec.norm_out.gamma.fill_(float(dec_offset.norm() / math.sqrt(dec_dim)))
    out_W = torch.zeros(3, dec_dim, dtype=torch.float64)
    out_W[:, :_GROUP] = readout_34
    _pointwise(dec.conv_out, out_W)


# --- calibration and the public builder --------------------------------------------------------


# (VAE config, weight seed, informative) -> the measured (latents_mean, latents_std): a VAE built
# again in the same process (tests build many) is not measured again
_MEASURED: dict[tuple, tuple[list, list]] = {}


def _calibrate_latent_stats(vae: AutoencoderKLWan, informative: bool, seed: int) -> None:
    """Per-channel mean / std of posterior means on fixed synthetic clips, stored in the config,
    where the training code reads them for `(z - mean) * (1 / std)`. They depend only on the VAE's
    config and weights, which its config, seed and kind determine."""
    key = (repr(sorted(vae.config.items())), seed, informative)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_latent_stats(vae, informative)
    mean, std = _MEASURED[key]
    vae.register_to_config(latents_mean=list(mean), latents_std=list(std))


@torch.no_grad()
def _measure_latent_stats(vae: AutoencoderKLWan, informative: bool) -> tuple[list, list]:
    g = torch.Generator().manual_seed(_CALIB_SEED)
    if informative:
        # The statistics are dominated by how many independent colours are seen (3 per clip), not
        # by pixels, and this encoder is the same at every position: so one 32x32 quadrant per
        # 64x64 clip (same block statistics, a quarter of the encode cost).
        clips_BCFHW = synthetic_videos(32, g)
        clips_BCFHW = torch.stack([clips_BCFHW[i, :, :, (i % 2) * 32:(i % 2) * 32 + 32,
                                               (i // 2 % 2) * 32:(i // 2 % 2) * 32 + 32]
                                   for i in range(clips_BCFHW.shape[0])])
    else:
        # A random encoder's latent is mostly a fixed pattern that depends on the distance to the
        # frame border, so it must see full 64x64 frames; few clips suffice.
        clips_BCFHW = synthetic_videos(8, g)
    # Each clip with its negative: colours are symmetric around 0, so this removes the sampling
    # error of the mean colour (without it, 12 clips moved normalised means by up to 0.7).
    video_BCFHW = torch.cat([clips_BCFHW, -clips_BCFHW])
    z_BZTHW = vae.encode(video_BCFHW).latent_dist.mode().double()
    mean_Z = z_BZTHW.mean(dim=(0, 2, 3, 4))
    std_Z = z_BZTHW.std(dim=(0, 2, 3, 4)).clamp_min(1e-6)
    return [round(float(v), 6) for v in mean_Z], [round(float(v), 6) for v in std_Z]


def build_tiny_vae(seed: int = 0, informative: bool = True) -> AutoencoderKLWan:
    """A tiny Wan2.1 VAE: z_dim 16, 8x space, 4x causal time (F frames -> 1 + (F-1)//4).

    informative=False: plain random init (the latents say almost nothing about the video).
    informative=True: analytic weights: latent = fixed full-rank map of (8x8x4-pooled RGB, its
    half-group change); the decoder maps back to blocky RGB.  Deterministic in `seed`; the global
    RNG is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if informative:
            # 8 channels = groups A and B (see `_set_informative_weights`).  The decoder's
            # upsamplers halve the width, so 8 is also what carries one 4-channel group through.
            # num_res_blocks=0: no residual blocks in the encoder's down path (a faster encode,
            # bench/RESULTS.md, section 7: `tiny_vae_encode`; they would be identities anyway), one per decoder up block, two in each mid block.
            vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1],
                                   num_res_blocks=0, temperal_downsample=[False, True, True])
        else:
            vae = AutoencoderKLWan(base_dim=3, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True])
        vae.eval()
        if informative:
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                _set_informative_weights(vae, generator)
    _calibrate_latent_stats(vae, informative, seed)
    return vae


def _encoder_head(vae, offset_4: torch.Tensor, readout_34: torch.Tensor, z_dim: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's output head, shared by both tiny VAEs (this one and e2v/models/tiny_vae22.py): the
    RMS norm's gamma restores |o| on the offset manifold, then a fixed full-rank mixing of the 6
    signals (mean RGB from group A, gain * change = group B - group A) into z_dim channels, with
    orthonormal columns so the decoder inverts it with the transpose; log-variance _LOGVAR; the
    quant convs the identity. Returns (the two groups' offset, the mixing [z_dim, 6])."""
    enc = vae.encoder
    enc_dim = enc.norm_out.gamma.shape[0]
    enc_offset = torch.cat([offset_4, offset_4])
    enc.norm_out.gamma.fill_(float(enc_offset.norm() / math.sqrt(enc_dim)))
    mix_Z6, _ = torch.linalg.qr(torch.randn(z_dim, 6, generator=generator, dtype=torch.float64))
    a_rows, b_rows = slice(0, _GROUP), slice(_GROUP, 2 * _GROUP)
    signals_68 = torch.zeros(6, enc_dim, dtype=torch.float64)
    signals_68[:3, a_rows] = readout_34  # mean RGB from group A
    signals_68[3:, b_rows] = readout_34  # group B ...
    signals_68[3:, a_rows] -= readout_34  # ... minus group A = gain * change
    head_W = torch.zeros(2 * z_dim, enc_dim, dtype=torch.float64)
    head_W[:z_dim] = mix_Z6 @ signals_68
    head_b = torch.zeros(2 * z_dim, dtype=torch.float64)
    head_b[z_dim:] = _LOGVAR
    _pointwise(enc.conv_out, head_W, head_b)
    _pointwise(vae.quant_conv, torch.eye(2 * z_dim, dtype=torch.float64))
    _pointwise(vae.post_quant_conv, torch.eye(z_dim, dtype=torch.float64))
    return enc_offset, mix_Z6
