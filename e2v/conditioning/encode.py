"""Condition tensors, built exactly as SkyReels-A2 inference builds them (docs/conditioning.md).

VAE pathway: references in position order, reference k repeated `repeat[k]` times, zero (mid-grey)
frames to F, ONE VAE encode of the whole condition video (`combine: before`; the causal VAE makes
the padding latents depend on the references), the Wan I2V mask, `cat([mask, latents])`.
CLIP pathway: each reference -> CLIPImageProcessor -> vision `hidden_states[-2]` (penultimate,
CLS kept) -> 257 tokens; concatenated along tokens. Text: UMT5 last hidden state, zeroed after
each prompt's length, padded to exactly 512 (Wan takes the LAST 512 context tokens as text).
Wan2.2 TI2V (`target_layout: clean_prefix`) and SkyReels-V3 R2V (`sequence`): each reference
encoded alone, its latent frames placed in the token sequence instead of in condition channels.
Which of these a batch gets, and in which order the draws happen: e2v/conditioning/layout.py; this
module encodes (EncodedReferences answers the layout's questions by encoding now).

Legend: B batch, F pixel frames, T = (F-1)/4+1 latent frames, H/W pixels, h/w = H/s, W/s latent
size (s the VAE's stride: 8 for Wan2.1's, 16 for Wan2.2's), N references, L tokens, D width.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from e2v.config.shapes import TEXT_LEN, VAE_T, latent_size
from e2v.runtime.device import as_pixels, module_device, vae_tf32

# --- latents -----------------------------------------------------------------------------------


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    return mean, inv_std


def normalize_latents(z_BCTHW: torch.Tensor, vae) -> torch.Tensor:
    """`(z - mean) * (1 / std)`: multiply by the reciprocal, the exact arithmetic of A2 and diffusers."""
    mean, inv_std = _latent_stats(vae, z_BCTHW)
    return (z_BCTHW - mean) * inv_std


def denormalize_latents(latents_BCTHW: torch.Tensor, vae) -> torch.Tensor:
    mean, inv_std = _latent_stats(vae, latents_BCTHW)
    return latents_BCTHW / inv_std + mean


def _vae_input(video_BCFHW: torch.Tensor, vae) -> torch.Tensor:
    """Pixels (uint8, or float in [-1, 1]) on the VAE's device and in its dtype, shape and range
    checked. The range only of float input: uint8 maps into [-1, 1] by construction, and the
    reduction would cost a host sync before every encode (nor where no values exist: the meta
    device tests use for a second device)."""
    checked_range = video_BCFHW.dtype != torch.uint8
    video_BCFHW = as_pixels(video_BCFHW.to(vae.device))
    assert video_BCFHW.ndim == 5 and video_BCFHW.shape[1] == 3, f"expected [B,3,F,H,W], got {tuple(video_BCFHW.shape)}"
    assert (video_BCFHW.shape[2] - 1) % VAE_T == 0, f"F={video_BCFHW.shape[2]} must be 4k+1"
    if checked_range and not video_BCFHW.is_meta:
        lo, hi = video_BCFHW.aminmax()
        assert lo >= -1.0001 and hi <= 1.0001, f"pixels must be in [-1, 1], got [{lo:.3f}, {hi:.3f}]"
    return video_BCFHW.to(vae.dtype)


def encode_video(video_BCFHW: torch.Tensor, vae, *, sample_mode: str = "argmax",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Pixels -> normalised latents [B,C,T,h,w] on the VAE's device (posterior mean, or a sample
    drawn from the CPU `generator` and moved, as diffusers' randn_tensor does)."""
    with vae_tf32(vae):
        dist = vae.encode(_vae_input(video_BCFHW, vae)).latent_dist
    z = dist.sample(generator) if sample_mode == "sample" else dist.mode()
    return normalize_latents(z.float(), vae)


@torch.no_grad()
def decode_latents(latents_BCTHW: torch.Tensor, vae) -> torch.Tensor:
    """Normalised latents (the VAE's C channels) -> pixels [B,3,F,H,W], float32 on the VAE's device (about
    [-1, 1]; callers clamp as their output needs)."""
    z = denormalize_latents(latents_BCTHW.to(vae.device, vae.dtype), vae)
    with vae_tf32(vae):
        return vae.decode(z, return_dict=False)[0].float()


def encode_video_stats(video_BCFHW: torch.Tensor, vae) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised posterior mean and std, for caches that must still allow sampling."""
    with vae_tf32(vae):
        dist = vae.encode(_vae_input(video_BCFHW, vae)).latent_dist
    _, inv_std = _latent_stats(vae, dist.mean)
    return normalize_latents(dist.mean.float(), vae), (dist.std * inv_std).float()


# --- the VAE condition -------------------------------------------------------------------------


def condition_video(ref_pixels: list[torch.Tensor], repeats: list[int], num_frames: int) -> torch.Tensor:
    """[r0 x rep0, r1 x rep1, ..., zeros] -> [B,3,F,H,W]; zeros are mid-grey in [-1, 1]."""
    if len(ref_pixels) != len(repeats):
        raise ValueError(f"{len(ref_pixels)} references but {len(repeats)} repeats")
    frames = [r.expand(-1, -1, n, -1, -1) for r, n in zip(ref_pixels, repeats)]
    f_ref = sum(repeats)
    if f_ref > num_frames:
        raise ValueError(f"references take {f_ref} frames but the video has only {num_frames}")
    if (num_frames - 1) % VAE_T:
        raise ValueError(f"num_frames={num_frames} must be 4k+1")
    b, c, _, h, w = ref_pixels[0].shape
    pad = ref_pixels[0].new_zeros(b, c, num_frames - f_ref, h, w)
    return torch.cat(frames + [pad], dim=2)


def condition_mask(ref_frames_B: list[int], num_frames: int, h: int, w: int, device=None) -> torch.Tensor:
    """The Wan I2V mask rule, per sample: pixel frames [0, F_ref) are 1, frame 0 is repeated 4
    times, the F+3 frames fold to [B,4,T,h,w]. One reference gives the plain I2V mask (A2 crashes
    there: it repeats frame 0 eight times)."""
    b = len(ref_frames_B)
    mask_B1Fhw = torch.zeros(b, 1, num_frames, h, w, device=device)
    for i, n in enumerate(ref_frames_B):
        mask_B1Fhw[i, :, :n] = 1
    first = mask_B1Fhw[:, :, :1].repeat_interleave(VAE_T, dim=2)
    mask = torch.cat([first, mask_B1Fhw[:, :, 1:]], dim=2)  # [B,1,F+3,h,w]
    t = (num_frames - 1) // VAE_T + 1
    return mask.view(b, t, VAE_T, h, w).transpose(1, 2)


def build_vae_condition(ref_pixels: list[torch.Tensor], repeats: list[int], num_frames: int, vae, *,
                        sample_mode: str = "argmax", generator: torch.Generator | None = None) -> torch.Tensor:
    """A2's `prepare_latents` condition: `ref_pixels` is a list (position order) of [B,3,1,H,W]
    float tensors in [-1,1]; returns [B,20,T,H/8,W/8] = cat([mask4, latents16]).

    With sample_mode="sample" the posterior sample consumes `generator` as A2's pipeline does
    after its noise draw, so a caller that draws the noise first gets A2's tensors bit for bit."""
    video_BCFHW = condition_video(ref_pixels, repeats, num_frames)
    latents = encode_video(video_BCFHW, vae, sample_mode=sample_mode, generator=generator)
    b, _, _, h, w = latents.shape
    mask = condition_mask([sum(repeats)] * b, num_frames, h, w, latents.device)
    return torch.cat([mask, latents], dim=1)


# --- CLIP and text -----------------------------------------------------------------------------


def encode_clip_images(images: list[np.ndarray], image_encoder, image_processor) -> torch.Tensor:
    """uint8 [S,S,3] images (already brought to the CLIP resolution) -> [n, L, D] penultimate-layer
    tokens (CLS kept, no post-layernorm), as A2 feeds Wan's image embedder."""
    device = module_device(image_encoder)
    pixel_values = image_processor(images=images, return_tensors="pt").pixel_values
    out = image_encoder(pixel_values=pixel_values.to(device, image_encoder.dtype), output_hidden_states=True)
    return out.hidden_states[-2].float()


def clean_prompt(prompt: str) -> str:
    """The cleaning diffusers' Wan pipelines (and A2's) apply before tokenizing: ftfy, HTML
    unescape, whitespace collapsed. Without it a caption with `&amp;`, curly quotes or a newline
    embeds differently in training than at inference."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(prompt)


def encode_text(prompts: list[str], tokenizer, text_encoder, max_length: int = TEXT_LEN) -> torch.Tensor:
    """UMT5 last hidden state of the cleaned prompts, zero after each prompt's true length, padded
    to exactly 512."""
    prompts = [clean_prompt(p) for p in prompts]
    tok = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = module_device(text_encoder)
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state.float()
    text_BLD = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    assert text_BLD.shape[1] == TEXT_LEN, f"text must be exactly {TEXT_LEN} tokens, got {text_BLD.shape[1]}"
    return text_BLD


# --- element selection (frame-conditioning modes) ----------------------------------------------


def select_elements(n: int, mode: str, rng: random.Random, frame_index: int = 0) -> list[int]:
    """Which of n present elements (position order) a sample keeps. Dropped ones are treated as
    absent, so training sees exactly the layouts inference with fewer references produces.
    `index` counts the present elements; a sample with fewer keeps its last one (config.py checks
    frame_index against the configured elements)."""
    if n == 0:
        return []
    if mode == "full":
        return list(range(n))
    if mode == "index":
        return [min(frame_index, n - 1)]
    if mode == "prefix":
        return list(range(rng.randint(1, n)))
    if mode == "random":
        k = rng.randint(1, n)
        return sorted(rng.sample(range(n), k))
    if mode == "first_and_last":
        return sorted({0, n - 1})
    raise ValueError(f"processors.vae.frame_conditioning: unknown mode {mode!r}")


# --- a whole batch -----------------------------------------------------------------------------


@dataclass
class Conditions:
    latents_BCTHW: torch.Tensor  # target x0
    text_BLD: torch.Tensor  # [B,512,D_text]
    cond_BCTHW: torch.Tensor | None = None  # [B,20,T,h,w] (16+4), or [B,16,...] without mask
    clip_BLD: torch.Tensor | None = None  # [B,L_img*N_max,D_clip]
    kept: list[list[str]] | None = None  # element names each sample was conditioned on
    ref_dropped: list[bool] | None = None
    caption_dropped: list[bool] | None = None
    # reference latent frames of their own: clean_prefix's [B,C,N,h,w] before the clip (e2v/conditioning/ti2v.py),
    # or the sequence layout's slots [B,C,S,h,w] (e2v/conditioning/sequence.py)
    ref_latents_BCNhw: torch.Tensor | None = None
    ref_layout: str | None = None  # where they go: clean_prefix, after or before (layout.place_references)


def condition_or_zeros(cond_BCTHW: torch.Tensor | None, latents_BCTHW: torch.Tensor, transformer):
    """The condition, or, when there is none (e2v_type clip or none) but the model has condition
    channels (an I2V base), zeros: they read "no reference", the zero condition and zero mask that
    reference dropout also gives. None for a model without condition channels."""
    cond_channels = transformer.config.in_channels - latents_BCTHW.shape[1]
    if cond_BCTHW is None and cond_channels > 0:
        b, _, *thw = latents_BCTHW.shape
        return latents_BCTHW.new_zeros(b, cond_channels, *thw)
    return cond_BCTHW


def draw_choices(element_names: list[list[str]], cfg, rng: random.Random,
                 train: bool = True) -> tuple[list[list[str]], list[bool], list[bool]]:
    """Per sample (present element names in position order): the kept element names, reference
    dropout, caption dropout. cache.py calls this too, so a cached run consumes `rng` exactly as
    an encoding run does."""
    pv, cd = cfg.processors.vae, cfg.conditioning
    kept, ref_drop, cap_drop = [], [], []
    for names in element_names:
        idx = select_elements(len(names), pv.frame_conditioning, rng, pv.frame_index) if cfg.e2v_type != "none" else []
        kept.append([names[k] for k in idx])
        ref_drop.append(train and cd.reference_dropout > 0 and rng.random() < cd.reference_dropout)
        cap_drop.append(train and cd.caption_dropout > 0 and rng.random() < cd.caption_dropout)
    return kept, ref_drop, cap_drop


def finish_condition(cond_lat_BCTHW: torch.Tensor, ref_frames_B: list[int], kept: list[list[str]],
                     ref_drop: list[bool], num_frames: int, concatenate_mask: bool) -> torch.Tensor:
    """Condition latents -> cat([mask4, latents16]), with dropped (or absent) references as a zero
    condition AND a zero mask (A2's unconditional layout). A sample with no reference frame (all
    kept elements CLIP-only) gets the same exact zeros, not the encoded grey video."""
    b, _, _, h, w = cond_lat_BCTHW.shape
    mask = condition_mask(ref_frames_B, num_frames, h, w, cond_lat_BCTHW.device)
    keep = torch.tensor([0.0 if (d or not kept[i] or not ref_frames_B[i]) else 1.0 for i, d in enumerate(ref_drop)],
                        device=cond_lat_BCTHW.device).view(b, 1, 1, 1, 1)
    cond_lat_BCTHW, mask = cond_lat_BCTHW * keep, mask * keep
    return torch.cat([mask, cond_lat_BCTHW], dim=1) if concatenate_mask else cond_lat_BCTHW


def pad_after_latents(chunks: list[torch.Tensor], t: int, z: int, h: int, w: int, device=None
                      ) -> tuple[torch.Tensor, int]:
    """One sample's per-reference latents [1,z,t_k,h,w] (position order) -> concatenated in time and
    zero-padded to [1,z,T,h,w], plus how many latent frames hold references."""
    lat = torch.cat(chunks, dim=2) if chunks else torch.zeros(1, z, 0, h, w, device=device)
    if lat.shape[2] > t:
        raise ValueError(f"combine: after gives {lat.shape[2]} latent frames, more than T={t}")
    return torch.cat([lat, lat.new_zeros(1, z, t - lat.shape[2], h, w)], dim=2), lat.shape[2]


def clip_names(kept: list[str], available, ref_dropped: bool, cfg) -> list[str]:
    """The elements whose CLIP tokens a sample gets: kept, in the CLIP stream, references not dropped."""
    return [k for k in kept if k in available] if (cfg.uses_clip and not ref_dropped) else []


def pad_clip_tokens(tokens_per_sample: list[torch.Tensor], n_tok: int, width: int, device=None) -> torch.Tensor:
    """Per sample [n_i, L, D] (n_i may be 0) -> [B, L*N_max, D] on `device`, zero blocks after each
    sample's own."""
    n_max = max(1, max(len(t) for t in tokens_per_sample))
    rows = []
    for tokens in tokens_per_sample:
        row = torch.zeros(n_max * n_tok, width, device=device)
        if len(tokens):
            row[: len(tokens) * n_tok] = tokens.reshape(-1, width)
        rows.append(row)
    return torch.stack(rows)


class EncodedReferences:
    """How a reference latent is obtained in an encoding run: encoded now, from the raw batch's
    pixels (data.py's collate), with the frozen encoders. e2v/conditioning/layout.py decides the
    layout; this class only answers its questions, each draw from `generator` in the order asked.
    e2v/conditioning/cached.py's CachedReferences answers the same questions from the cache."""

    def __init__(self, batch: dict, parts):
        self.batch, self.parts = batch, parts
        self.video_BCFHW = as_pixels(batch["video"])  # on the device (to_device), uint8 from the loader

    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, T, h, w) of the clip's latents, without encoding it."""
        vae = self.parts.vae
        return (vae.config.z_dim, *latent_size(self.video_BCFHW.shape[2], *self.video_BCFHW.shape[-2:], vae.config))

    @property
    def device(self):
        return self.parts.vae.device

    def has_reference(self, i: int, name: str) -> bool:
        return name in self.batch["vae_refs"][i]

    def _reference_pixels(self, i: int, name: str) -> torch.Tensor:
        ref = self.batch["vae_refs"][i][name]
        return ref.view(1, 3, 1, *ref.shape[-2:])

    def reference(self, i: int, name: str, pixel_frames: int, sample_mode: str, generator) -> torch.Tensor:
        """Sample i's reference `name` encoded alone as a `pixel_frames`-frame still video -> [1,C,t,h,w]."""
        video = self._reference_pixels(i, name).expand(-1, -1, pixel_frames, -1, -1)
        return encode_video(video, self.parts.vae, sample_mode=sample_mode, generator=generator)

    def _condition_videos(self, kept: list[list[str]]) -> list[torch.Tensor]:
        """Per sample, A2's condition video of its kept references (grey without any): [1,3,F,H,W]."""
        b, _, f, hh, ww = self.video_BCFHW.shape
        rows = []
        for i in range(b):
            names = [k for k in kept[i] if self.has_reference(i, k)]
            rows.append(condition_video([self._reference_pixels(i, k) for k in names],
                                        [self.batch["vae_repeats"][i][k] for k in names], f) if names
                        else self.video_BCFHW.new_zeros(1, 3, f, hh, ww))
        return rows

    def condition_video_latents(self, kept: list[list[str]], sample_mode: str, generator) -> torch.Tensor:
        """`combine: before`: ONE encode of the whole batch's condition videos -> [B,C,T,h,w]."""
        return encode_video(torch.cat(self._condition_videos(kept)), self.parts.vae, sample_mode=sample_mode,
                            generator=generator)

    def target(self, kept: list[list[str]], cfg, generator) -> torch.Tensor:
        """The clip's latents; with target_layout prepend, each sample's reference frames first,
        then its clip's first F - F_ref frames (one encode)."""
        video_BCFHW = self.video_BCFHW
        if cfg.conditioning.target_layout == "prepend" and cfg.uses_vae_condition:
            f = video_BCFHW.shape[2]
            rows = []
            for i, ref_video in enumerate(self._condition_videos(kept)):
                n_ref = cfg.reference_frames([k for k in kept[i] if self.has_reference(i, k)])
                rows.append(torch.cat([ref_video[:, :, :n_ref], video_BCFHW[i:i + 1, :, : f - n_ref]], dim=2))
            video_BCFHW = torch.cat(rows)
        return encode_video(video_BCFHW, self.parts.vae, sample_mode=cfg.conditioning.target_sample_mode,
                            generator=generator)

    def clip_tokens(self, kept: list[list[str]], ref_drop: list[bool], cfg) -> torch.Tensor:
        """[B, L*N_max, D]: samples with fewer CLIP references are padded with zero tokens (the same
        tokens reference dropout uses), so one batch can mix element counts; a sample with none (or
        e2v_type vae on an image-attention model) gets one zero block.

        Padding rather than grouping batches by element count: the sampler stays a plain resumable
        shuffle, and a zero block is what the model already learns to read as "no reference" from
        reference dropout. The cost: a padded sample's cross-attention also sees the zero blocks
        (they are not masked; Wan's attention takes no image mask), a layout inference with fewer
        references never shows. With micro_batch_size 1 (the 14B recipe) nothing is ever padded."""
        batch, parts, device = self.batch, self.parts, self.device  # where the latents are
        names_per_sample = [clip_names(kept[i], batch["clip_refs"][i], ref_drop[i], cfg) for i in range(len(kept))]
        flat = [batch["clip_refs"][i][k] for i, names in enumerate(names_per_sample) for k in names]
        n_tok, width = image_token_shape(parts)
        tokens = (encode_clip_images(flat, parts.image_encoder, parts.image_processor) if flat
                  else torch.zeros(0, n_tok, width, device=device))
        return pad_clip_tokens(list(tokens.split([len(n) for n in names_per_sample])), n_tok, width, device)

    def text(self, caption_dropped: list[bool]) -> torch.Tensor:
        prompts = ["" if d else p for p, d in zip(self.batch["prompt"], caption_dropped)]
        return encode_text(prompts, self.parts.tokenizer, self.parts.text_encoder)


def image_token_shape(parts) -> tuple[int, int]:
    """(tokens per reference, width): 257 x 1280 for CLIP ViT-H/14 at 224 px."""
    if parts.image_encoder is None:  # e2v_type vae on an image-attention model: zero blocks only
        return 257, parts.transformer.config.image_dim
    c = parts.image_encoder.config
    return (c.image_size // c.patch_size) ** 2 + 1, c.hidden_size
