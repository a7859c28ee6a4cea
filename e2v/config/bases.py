"""What a config's base model is, read without loading it: where `model.pretrained` lives on
disk (`resolve_pretrained`), which tiny preset a config builds, and the VAE's config (its latent
channels and strides), which config checks, the plan and the loaders all need. Nothing here reads
weights or downloads."""

from __future__ import annotations

import functools
from pathlib import Path

from e2v.config.schema import Config

# Short names for the released Wan transformers (tools/estimate_memory.py's --model; their configs:
# e2v.models.plan.KNOWN_WAN_CONFIGS).
KNOWN_MODELS = {"t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                "i2v-14b": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}


@functools.lru_cache(maxsize=None)
def resolve_pretrained(name: str) -> str:
    """A hub id that is already in the local Hugging Face cache -> its snapshot folder, so every
    path that wants a local folder (the ZeRO-3 partitioned load, the dry run's config) takes it;
    anything else unchanged (from_pretrained then downloads, outside the tests). Looked up once
    per name: preflight, the plan, the load and the encoders all ask."""
    if Path(name).exists() or name.count("/") != 1:
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub: keep the id
        return name


def tiny_expert_base(model) -> str:
    """Which tiny experts the two-expert preset builds: Wan2.2-T2V-A14B's shape (16 input channels)
    with model.base t2v, else Wan2.2-I2V-A14B's (36)."""
    return "t2v" if model.base == "t2v" else "i2v_a14b"


def tiny_base(model) -> str:
    """Which tiny transformer a config's `model` section builds: ti2v (preset tiny_ti2v), t2v
    (preset tiny, base t2v) or i2v."""
    if model.preset == "tiny_ti2v":
        return "ti2v"
    return "t2v" if model.base == "t2v" else "i2v"


# The AutoencoderKLWan arguments of the tiny Wan2.2 VAE: the real one's structure (is_residual,
# 2x2 patchify to 12 channels, 16x space) at width 8. e2v.models.plan reads it for the tiny TI2V plan.
TINY_VAE22_CONFIG = dict(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=0,
                         temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                         patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16)


# VAE configs of the known hub ids whose VAE is not Wan2.1's (AutoencoderKLWan's defaults): the
# Wan2.2 VAE of TI2V-5B (diffusers' conversion script, `vae22_diffusers_config`; its latents_mean /
# std are not needed for shapes and counts): 48 channels, a 2x2 patchify then 8x: 16x space.
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16)


KNOWN_VAE_CONFIGS = {"Wan-AI/Wan2.2-TI2V-5B-Diffusers": WAN22_VAE}


def vae_config(cfg: Config) -> dict:
    """The VAE's config without loading it, the one home of "which VAE does this model have" (its
    latent channels and strides: e2v.config.shapes.latent_size): the tiny TI2V VAE's, a local folder's
    vae/config.json, or a known hub id's (KNOWN_VAE_CONFIGS). Keys left out are AutoencoderKLWan's
    defaults, the Wan2.1 VAE: the tiny Wan2.1 preset, the Wan2.1 hub ids, and a hub id that is
    neither known nor in the local cache (its VAE is read when it loads)."""
    if cfg.model.preset is not None:
        return dict(TINY_VAE22_CONFIG) if tiny_base(cfg.model) == "ti2v" else {}
    local = Path(resolve_pretrained(cfg.model.pretrained)) / "vae" / "config.json"
    if local.exists():
        from diffusers import AutoencoderKLWan

        return dict(AutoencoderKLWan.load_config(str(local.parent)))
    return dict(KNOWN_VAE_CONFIGS.get(cfg.model.pretrained, {}))
