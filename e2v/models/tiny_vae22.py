"""A tiny Wan2.2 VAE (`AutoencoderKLWan` with `is_residual`, `patch_size` 2: 48 latent channels,
16x space, 4x causal time) whose latents carry the video, for the TI2V tiny preset.

It is to the Wan2.2 VAE what e2v/models/tiny_vae.py is to the Wan2.1 one (read that module first: the
same analytic-weight method, the same offset trick around the RMS norms): a random-weight VAE
keeps almost nothing of the video, so a tiny transformer trained on its latents cannot learn to
use references. With `informative=True` the encoder computes
    the 2x2 patchify, then a 16x16 average pool of RGB per causal latent frame (frame 0 alone,
    then groups of 4), plus the change of RGB from the group's first to its second half,
    mixed by a fixed orthonormal 48 x 6 map into the 48 latent channels,
and the decoder inverts it up to nearest-neighbour upsampling (a decoded group is [h1, h1, h2, h2],
the two half-group means, as in the Wan2.1 tiny). Per latent position: 6 numbers in 48 channels,
each latent cell 16 x 16 pixels, a quarter of the detail per cell of the Wan2.1 tiny's 8 x 8 cells,
which is what 16x compression means; a config that wants the Wan2.1 tiny's latent grid doubles its
resolution (configs/e2v_wan22_ti2v_tiny.yaml). Measured in tests/unit/test_wan22_ti2v.py: probe R^2 1.000
against the 16 x 16-pooled target (a random one: below 0).

How the Wan2.2 blocks are made to do that (read `autoencoder_kl_wan.py` alongside):
- the residual down block is `main(x) + AvgDown3D(x)`, where AvgDown3D with equal widths is a plain
  average pool (over 2 frames and 2 x 2 positions; a first chunk of one frame is averaged with a
  zero frame in front, which halves it). With `num_res_blocks=0` the main path is the block's
  downsampler alone; it is switched off (zero weights) except in the second temporal stage;
- there, the main path is a 2 x 2 box filter, then the temporal conv over [previous, first half,
  second half] with taps (0, 1/2, 1/2) for channel group A and (0, 1/2 - g, 1/2 + g) for group B:
  A = 2 mean, B = 2 mean + g change. In the first chunk the temporal conv is skipped and both
  groups get the same 3/4 of the frame, so frame 0 has no change and the same scale in A and B;
  scale alone does not matter, because the RMS norm before `conv_out` removes it (every channel
  carries o + E s with o orthogonal to E, tiny_vae._group_maps);
- the last down block (no downsampling) doubles its input (x + identity shortcut);
- decoder: every residual up block is `main(x) + DupUp3D(x)`, DupUp3D with equal widths being
  nearest-neighbour upsampling; the residual blocks inside are identities (`conv2` = 0), the main
  paths zero except in the first temporal up block, whose temporal conv splits a latent frame
  into its half-group means (A -/+ (B - A) / 2 g') and makes both groups equal from there on.
  Its first chunk skips the temporal conv: frame 0 comes out doubled, again only a scale.

`latents_mean` / `latents_std` are measured at build time, as for the Wan2.1 tiny
(tiny_vae._calibrate_latent_stats). Deterministic given `seed`; the global RNG is untouched.
"""

from __future__ import annotations

import math

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    WanAttentionBlock,
    WanResample,
    WanResidualBlock,
    WanResidualDownBlock,
    WanResidualUpBlock,
)

from e2v.config.bases import TINY_VAE22_CONFIG
from e2v.models.tiny_vae import _GROUP, _OFFSET, _calibrate_latent_stats, _encoder_head, _group_maps, _pointwise

Z_DIM = TINY_VAE22_CONFIG["z_dim"]
_GAIN = 1.0  # the latent's change signal is gain * (second-half mean - first-half mean), as in the Wan2.1 tiny
_RANDOM_VAE22_CONFIG = {**TINY_VAE22_CONFIG, "base_dim": 4, "decoder_base_dim": 4, "num_res_blocks": 1}


def _zero(*modules: torch.nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.zero_()


def _box_filter(conv2d: torch.nn.Conv2d) -> None:
    """A stride-2 downsampling conv as the 2x2 mean (the right / bottom zero padding is never read)."""
    dim = conv2d.weight.shape[0]
    _zero(conv2d)
    conv2d.weight[:, :, :2, :2] = (torch.eye(dim) / 4)[:, :, None, None]


def _set_informative_weights(vae: AutoencoderKLWan, generator: torch.Generator) -> None:
    offset_4, embed_43, readout_34 = _group_maps(_OFFSET)
    enc, dec = vae.encoder, vae.decoder
    dim = enc.conv_in.weight.shape[0]
    if dim != 2 * _GROUP or dec.conv_in.weight.shape[0] != 2 * _GROUP:
        raise ValueError("the informative weights need 8-channel encoder and decoder (base_dim=8, dim_mult=[1,1,1,1])")
    a_rows, b_rows = slice(0, _GROUP), slice(_GROUP, 2 * _GROUP)
    eye4 = torch.eye(_GROUP, dtype=torch.float64)

    # Identities: residual branches off at their last conv, attention at its output projection.
    for m in vae.modules():
        if isinstance(m, WanResidualBlock):
            _zero(m.conv2)
        elif isinstance(m, WanAttentionBlock):
            _zero(m.proj)

    # Encoder input: the 2x2 patchify's 12 channels are colour-major (c * 4 + sub-pixel); their mean
    # per colour, as o + E rgb, in both groups.
    mean_312 = torch.zeros(3, 12, dtype=torch.float64)
    for c in range(3):
        mean_312[c, 4 * c:4 * c + 4] = 0.25
    group_in = embed_43 @ mean_312
    _pointwise(enc.conv_in, torch.cat([group_in, group_in]), torch.cat([offset_4, offset_4]))

    # Down blocks: main paths off, except the second temporal stage's (box filter, then the taps
    # that give group A the mean and group B the mean plus g times the half-group change).
    temporal_stage = 0
    for block in enc.down_blocks:
        if not isinstance(block, WanResidualDownBlock) or block.downsampler is None:
            continue
        m: WanResample = block.downsampler
        _zero(m)
        if m.mode != "downsample3d":
            continue
        temporal_stage += 1
        if temporal_stage == 2:
            _box_filter(m.resample[1])
            # Group B = 2 mean + g change; the RMS norm then halves both groups' common scale, so the
            # latent's change signal is g / 2 times the change: g = 2 * gain.
            g = 2 * _GAIN
            tc = m.time_conv.weight
            for j in range(2 * _GROUP):
                early, late = (0.5, 0.5) if j < _GROUP else (0.5 - g, 0.5 + g)
                tc[j, j, 1, 0, 0], tc[j, j, 2, 0, 0] = early, late
    if temporal_stage != 2:
        raise AssertionError("expected two temporal downsamplers (temperal_downsample=[False, True, True])")

    # Encoder head (the Wan2.1 tiny's): readout and mixing.
    enc_offset, mix_Z6 = _encoder_head(vae, offset_4, readout_34, Z_DIM, generator)

    # Decoder input: z -> A = o + E mean, B = o + E (mean + gain * change).
    unmix_6Z = mix_Z6.T
    dec_in_W = torch.cat([embed_43 @ unmix_6Z[:3], embed_43 @ (unmix_6Z[:3] + unmix_6Z[3:])])
    _pointwise(dec.conv_in, dec_in_W, enc_offset)

    # Up blocks: main paths off, except the first temporal one: its upsample conv is the identity and
    # its temporal conv adds, to the shortcut's copy, what makes both groups the first (second)
    # half-group mean A -/+ a (B - A), a = 1 / (2 gain).
    a = 1 / (2 * _GAIN)
    first_done = False
    for block in dec.up_blocks:
        if not isinstance(block, WanResidualUpBlock) or block.upsampler is None:
            continue
        m = block.upsampler
        _zero(m)
        if m.mode != "upsample3d" or first_done:
            continue
        first_done = True
        _pointwise(m.resample[1], torch.eye(2 * _GROUP, dtype=torch.float64))
        halves = []
        for sign in (1, -1):  # first half: A + a (A - B); second: A - a (A - B)
            rows = torch.zeros(2 * _GROUP, 2 * _GROUP, dtype=torch.float64)
            rows[a_rows, a_rows], rows[a_rows, b_rows] = sign * a * eye4, -sign * a * eye4
            rows[b_rows, a_rows], rows[b_rows, b_rows] = (1 + sign * a) * eye4, -(1 + sign * a) * eye4
            halves.append(rows)
        _pointwise(m.time_conv, torch.cat(halves))
    if not first_done:
        raise AssertionError("expected a temporal upsampler in the decoder")

    # Decoder head: the same norm trick, then group A's readout to RGB on all four sub-pixels.
    dec.norm_out.gamma.fill_(float(enc_offset.norm() / math.sqrt(dim)))
    out_W = torch.zeros(12, dim, dtype=torch.float64)
    for c in range(3):
        out_W[4 * c:4 * c + 4, a_rows] = readout_34[c]
    _pointwise(dec.conv_out, out_W)


def build_tiny_vae22(seed: int = 0, informative: bool = True) -> AutoencoderKLWan:
    """A tiny Wan2.2 VAE: z_dim 48, 16x space (2x2 patchify, then 8x), 4x causal time.

    informative=False: plain random init (width 4, one residual block per stage).
    informative=True: the analytic weights above. Deterministic in `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**(TINY_VAE22_CONFIG if informative else _RANDOM_VAE22_CONFIG))
        vae.eval()
        if informative:
            with torch.no_grad():
                _set_informative_weights(vae, torch.Generator().manual_seed(seed))
    _calibrate_latent_stats(vae, informative, seed)
    return vae
