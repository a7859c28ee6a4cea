"""The shape rules more than one stage needs, each written once: valid sides and frame counts, the
latent size a VAE config gives (`latent_size`), the frame buckets, what a base's shape allows
(`check_base`), the text length Wan's cross-attention splits at, and how many frames the
references take in each condition layout.

Legend: B batch.
"""

from __future__ import annotations

from e2v.config.schema import Config, ConfigError


def nearest_valid_sizes(x: int, multiple: int = 16) -> tuple[int, int]:
    lo = (x // multiple) * multiple
    return lo, lo + multiple


def nearest_valid_size(x: int, multiple: int = 16) -> int:
    """The multiple of 16 (VAE /8, then the 2x2 patch) nearest x; a tie rounds down: less upscaling."""
    lo, hi = nearest_valid_sizes(x, multiple)
    return lo if x - lo <= hi - x else hi


# Every Wan VAE divides time by VAE_T (causally: F pixel frames -> 1 + (F-1)/4 latent frames), and
# every Wan transformer patches 2 x 2. Space is per VAE: Wan2.1's divides by 8, Wan2.2's (TI2V-5B)
# by 16 (a 2x2 patchify, then 8). So a frame count is 4k+1 and a side a multiple of 16 pixels for
# any Wan (PIXELS_PER_TOKEN, checked at config load), 32 for the Wan2.2 VAE (check_base, once the
# model is known). A VAE config is a diffusers AutoencoderKLWan config (a dict, or `vae.config`);
# e2v.config.bases.vae_config gives a model's without loading it.
VAE_T, PATCH = 4, 2
PIXELS_PER_TOKEN = 8 * PATCH


def vae_space_stride(vae_config) -> int:
    """Pixels per latent cell side: scale_factor_spatial (8 when absent: diffusers' default, the Wan2.1 VAE)."""
    return vae_config.get("scale_factor_spatial") or 8


def latent_channels(vae_config) -> int:
    """Latent channels of the VAE: z_dim (16 when absent: the Wan2.1 VAE; Wan2.2's: 48)."""
    return vae_config.get("z_dim") or 16


def latent_size(num_frames: int, height: int, width: int, vae_config) -> tuple[int, int, int]:
    """(T, h, w) of the latents of a num_frames x height x width clip under this VAE."""
    s = vae_space_stride(vae_config)
    return (num_frames - 1) // VAE_T + 1, height // s, width // s


def frame_bucket_list(cfg: Config) -> list[int]:
    """Allowed frame counts with auto frame buckets: data.frame_buckets, or 1 + step, 1 + 2 step, ...
    up to num_frames (step: data.time_division_factor, else 16), without counts shorter than the
    condition frames the elements take. The loader buckets clips by it (e2v/data/dataset.py); validation
    bounds the visualised frame indexes by its shortest count (e2v/config/checks.py)."""
    d = cfg.data
    step = d.time_division_factor or 16
    counts = d.frame_buckets or [*range(1 + step, d.num_frames + 1, step), d.num_frames]
    if cfg.task == "causal" and not d.frame_buckets:  # a clip trains at its largest count of whole blocks
        counts = [f for f in counts if whole_blocks(f, cfg.causal.frames_per_block, cfg.causal.independent_first_frame)]
    return sorted(f for f in set(counts) if f >= max(cfg.reference_frames(), 1))


def whole_blocks(num_frames: int, frames_per_block: int, independent_first_frame: bool) -> bool:
    """Whether a clip of `num_frames` pixel frames gives latent frames that split into whole blocks of
    the causal task (frame 0 alone first with `independent_first_frame`): the config's side of
    e2v.models.causal.block_ids, without torch."""
    rest = (num_frames - 1) // VAE_T + 1 - int(independent_first_frame)
    return rest >= (0 if independent_first_frame else 1) and rest % frames_per_block == 0


def whole_block_frames(num_frames: int, frames_per_block: int, independent_first_frame: bool) -> list[int]:
    """The pixel frame counts nearest `num_frames` (the one below when there is one, the one above)
    whose latent frames split into whole blocks: what a refusal offers (e2v/config/checks.py)."""
    first, k = int(independent_first_frame), frames_per_block
    t = (num_frames - 1) // VAE_T + 1
    below = first + (t - 1 - first) // k * k  # the largest whole-block count under t
    counts = [c for c in (below, below + k) if c >= (1 if first else k)]
    return [VAE_T * (c - 1) + 1 for c in counts]


def check_base(cfg: Config, transformer_config, vae_config) -> None:
    """What the model's shape allows, once it is known: e2v.models.plan.preflight checks the transformer
    as training builds it (expanded when model.base is t2v) on the meta device before loading, and
    train_e2v.py checks the loaded one again (a hub id's shape is known only then). Its input is
    its latents alone (in_channels == the VAE's z_dim: a T2V or a TI2V base) or latents plus
    condition channels (I2V, expanded T2V); sides must fit the VAE's stride."""
    name = cfg.model.pretrained or f"the {cfg.model.preset} preset"
    in_channels, z = transformer_config["in_channels"], latent_channels(vae_config)
    latents_only, layout = in_channels == z, cfg.conditioning.target_layout
    if cfg.e2v_type == "none" and not latents_only:
        raise ConfigError(f"e2v_type: none trains plain text-to-video, but {name} has {in_channels} input channels "
                          f"for {z} latent channels: use a T2V or TI2V base (model.base: t2v with the tiny preset)")
    if cfg.uses_vae_condition and latents_only and layout not in ("clean_prefix", "sequence"):
        raise ConfigError(f"{name} takes its {z} latent channels alone (no condition channels): its references go "
                          "in the token sequence; set conditioning.target_layout: clean_prefix (Wan2.2 TI2V) or "
                          "conditioning.target_layout: sequence (a Wan2.1 T2V or SkyReels-V3 R2V base) (docs/conditioning.md)")
    if layout in ("clean_prefix", "sequence") and not latents_only:
        hint = " (the tiny preset: set model.base: t2v)" if cfg.model.preset == "tiny" else ""
        raise ConfigError(f"conditioning.target_layout: {layout} needs a model whose input is its latents alone, "
                          f"but {name} has {in_channels} input channels for {z} latent channels (condition "
                          f"channels): use a T2V base{hint}, or target_layout: overlay for an I2V base")
    if layout == "sequence" and transformer_config.get("added_kv_proj_dim") is not None:
        raise ConfigError(f"conditioning.target_layout: sequence feeds no image tokens, but {name} has image "
                          "attention (an I2V base): use a T2V or SkyReels-V3 R2V base, or target_layout: overlay")
    if cfg.uses_clip and transformer_config.get("added_kv_proj_dim") is None:
        raise ConfigError(f"e2v_type: {cfg.e2v_type} feeds CLIP image tokens, but {name} has no image attention "
                          "(Wan2.2 TI2V has none): use e2v_type: vae")
    side = vae_space_stride(vae_config) * PATCH
    bad = [hw for hw in [cfg.data.resolution, *cfg.data.resolution_buckets] if hw[0] % side or hw[1] % side]
    if bad:
        raise ConfigError(f"data.resolution / resolution_buckets {bad}: {name}'s VAE divides space by "
                          f"{side // PATCH}, then the transformer patches 2x2: sides must be multiples of {side}")


# --- reference latent layouts (conditioning, the cache and the plan share them) ---

TEXT_LEN = 512  # Wan's cross-attention splits image | text at the last 512 context tokens


def after_ref_frames(ref_latent_frames_B: list[int]) -> list[int]:
    """`combine: after`: the mask marks the latent frames that hold reference latents (the same as
    `before` for repeats 1, 4, 4; without repeats each reference still takes one latent frame)."""
    return [1 + VAE_T * (t - 1) if t else 0 for t in ref_latent_frames_B]


def after_frames(repeat: int) -> int:
    """`combine: after`: pixel frames one reference is encoded with (the VAE keeps 4k+1 frames)."""
    return 1 + (repeat - 1) // VAE_T * VAE_T if repeat > 1 else 1


def reference_pixel_frames(cfg, repeat: int) -> int:
    """Pixel frames one reference is encoded with when it is encoded alone: one (a one-frame video)
    in the sequence layout, as SkyReels-V3 encodes each reference; else after_frames(repeat)."""
    return 1 if cfg.conditioning.target_layout == "sequence" else after_frames(repeat)


def prefix_frames_of(cfg) -> int:
    """N of a sample that keeps every VAE element, for shape and memory plans: each reference takes
    the latent frames conditioning encodes it to (after_frames(repeat) pixel frames: one latent
    frame for repeat <= 4); 0 outside the clean_prefix layout."""
    if cfg.conditioning.target_layout != "clean_prefix" or not cfg.uses_vae_condition:
        return 0
    return sum((after_frames(e.vae.repeat) - 1) // VAE_T + 1 for e in cfg.vae_elements)


def sequence_slots_of(cfg) -> int:
    """S, the reference slots after (or before) the video in the sequence layout, for shape and
    memory plans: conditioning.sequence.slots, or (null: as many as references) one per VAE
    element; 0 outside the layout."""
    if cfg.conditioning.target_layout != "sequence" or not cfg.uses_vae_condition:
        return 0
    slots = cfg.conditioning.sequence.slots
    return len(cfg.vae_elements) if slots is None else slots


def reference_latent_frames(cfg) -> int:
    """Latent frames of the references' own in the token sequence (clean_prefix or sequence), 0 in
    the condition-channel layouts: what the token count adds to the video's frames."""
    return prefix_frames_of(cfg) + sequence_slots_of(cfg)
