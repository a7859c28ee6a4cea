"""The plan without weights (`--dry_run`, the preflight checks at start): the transformer as
training will see it, built on the meta device from its config (the tiny preset, a local
folder's config.json, or a known Wan2.1 hub id), and the memory its training state takes."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from e2v.config import Config
from e2v.expand import expand_for_elements, expansion_shape, is_expanded, needs_expansion
from e2v.experts import SUBFOLDERS, TwoExperts, boundary_ratio, range_text, trained_experts
from e2v.parts import CLIP_VIT_H, resolve_pretrained
from e2v.schema import check_plain_t2v_base
from e2v.tiny import TINY_CLIP_WIDTH, tiny_transformer_config
from e2v.trainable import setup_training


# Transformer configs of the released Wan2.1 checkpoints (diffusers' conversion script; their
# parameter counts, 1.42 B / 14.29 B / 16.40 B, are checked in tests/test_expand.py),
# so `--dry_run` builds a hub-id model on the meta device without downloading its config.
_WAN_COMMON = dict(patch_size=[1, 2, 2], attention_head_dim=128, out_channels=16, text_dim=4096, freq_dim=256,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


_WAN_14B = dict(num_attention_heads=40, num_layers=40, ffn_dim=13824)


_WAN_I2V = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)


KNOWN_WAN_CONFIGS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {**_WAN_COMMON, "num_attention_heads": 12, "num_layers": 30,
                                         "ffn_dim": 8960, "in_channels": 16},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {**_WAN_COMMON, **_WAN_14B, "in_channels": 16},
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {**_WAN_COMMON, **_WAN_14B, **_WAN_I2V},
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": {**_WAN_COMMON, **_WAN_14B, **_WAN_I2V},
    # Each of the two experts (transformer/, transformer_2/): the 14B shape with the I2V input channels
    # and no image attention (diffusers' conversion script, "Wan2.2-I2V-14B-720p"); 14.29 B parameters.
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {**_WAN_COMMON, **_WAN_14B, "in_channels": 36},
}


def transformer_config(cfg: Config, expert: str = "high_noise") -> dict:
    """The base transformer's config without reading weights: the tiny preset, a local diffusers
    folder's transformer/config.json (a Wan2.2 expert's subfolder), or a known hub id
    (KNOWN_WAN_CONFIGS; no download)."""
    if cfg.model.preset is not None:
        two = boundary_ratio(cfg) is not None
        return tiny_transformer_config("i2v_a14b" if two else "t2v" if cfg.model.base == "t2v" else "i2v")
    local = Path(resolve_pretrained(cfg.model.pretrained)) / SUBFOLDERS[expert] / "config.json"
    if local.exists():
        return dict(WanTransformer3DModel.load_config(str(local.parent)))
    if cfg.model.pretrained in KNOWN_WAN_CONFIGS:
        return dict(KNOWN_WAN_CONFIGS[cfg.model.pretrained])
    raise ValueError(f"model.pretrained: {cfg.model.pretrained} is neither a local diffusers folder (with "
                     f"transformer/config.json) nor one of {', '.join(KNOWN_WAN_CONFIGS)}")


def build_meta_transformer(cfg: Config) -> WanTransformer3DModel:
    """The transformer as training will see it (expanded if the base asks for it; a TwoExperts of
    the experts the run trains for a two-expert base), on the meta device: every shape, no memory,
    nothing read or downloaded."""
    width = TINY_CLIP_WIDTH if cfg.model.preset is not None else CLIP_VIT_H[1]

    def build(expert: str) -> WanTransformer3DModel:
        c = {k: v for k, v in transformer_config(cfg, expert).items() if not k.startswith("_")}
        with torch.device("meta"):
            transformer = WanTransformer3DModel.from_config(c)
        if needs_expansion(transformer, cfg):
            in_channels, image_dim = expansion_shape(cfg, width, transformer.config.in_channels)
            transformer = expand_for_elements(transformer, in_channels=in_channels, image_dim=image_dim)
        return transformer

    experts = trained_experts(cfg)
    return TwoExperts({e: build(e) for e in experts}, boundary_ratio(cfg)) if experts else build("high_noise")


def knows_shape_offline(cfg: Config) -> bool:
    """Whether transformer_config can tell the base's shape without reading weights or downloading."""
    return (cfg.model.preset is not None
            or (Path(resolve_pretrained(cfg.model.pretrained)) / "transformer" / "config.json").exists()
            or cfg.model.pretrained in KNOWN_WAN_CONFIGS)


def preflight(cfg: Config) -> tuple[WanTransformer3DModel, list[str]]:
    """The model-dependent config checks (base vs model.base, e2v_type none on a 16-channel base,
    train.trainable patterns, LoRA targets) on the meta device, in seconds, before any weight
    loads: a 14B load takes minutes and ~31 GB per rank, too much to spend on a typo.
    Returns the meta transformer set up for training and the names trained in full."""
    transformer = build_meta_transformer(cfg)
    check_plain_t2v_base(cfg, transformer.config.in_channels)
    full_names = setup_training(transformer, cfg, expanded=is_expanded(cfg))
    return transformer, full_names


def count_params(module: torch.nn.Module, trainable_only: bool = False) -> int:
    # A ZeRO-3 partitioned parameter has numel() 0; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in module.parameters()
               if p.requires_grad or not trainable_only)


def memory_plan(transformer: torch.nn.Module, cfg: Config) -> dict:
    """Bytes of the training state summed over all GPUs, before ZeRO partitioning and offload:
    weights in the training precision, gradients of the trained parameters in that precision,
    and AdamW's fp32 master copy + two moments (12 bytes per trained parameter). Activations
    depend on resolution and checkpointing: tools/estimate_memory.py."""
    params = count_params(transformer)
    trainable = count_params(transformer, trainable_only=True)
    width = 2 if cfg.train.mixed_precision == "bf16" else 4
    return {"params": params, "trainable_params": trainable, "weights_bytes": width * params,
            "gradient_bytes": width * trainable, "optimizer_bytes": 12 * trainable}


# The frozen encoders of the released Wan2.1 pipelines, for counting on the meta device without a
# download: UMT5-XXL's encoder (google/umt5-xxl) and CLIP ViT-H/14's vision tower; the default
# AutoencoderKLWan() is the Wan2.1 VAE.
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")
CLIP_VIT_H14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                    image_size=224, patch_size=14, projection_dim=1024)


def encoder_modules(cfg: Config) -> dict[str, torch.nn.Module]:
    """The frozen encoders an online run keeps on every GPU (the VAE, UMT5, CLIP when the CLIP
    pathway is used), built on the meta device from their configs: a local folder's, the tiny
    preset's, or the released ones above. Nothing is read or downloaded."""
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    local = None if cfg.model.preset is not None else Path(resolve_pretrained(cfg.model.pretrained))
    if cfg.model.preset is not None:
        from e2v.tiny import build_tiny_parts

        p = build_tiny_parts(cfg.model.tiny_seed)
        return {"vae": p.vae, "text_encoder": p.text_encoder, **({"image_encoder": p.image_encoder} if cfg.uses_clip else {})}
    with torch.device("meta"):
        if (local / "vae" / "config.json").exists():
            vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(str(local / "vae")))
        else:
            vae = AutoencoderKLWan()
        text_cfg = (UMT5Config.from_pretrained(str(local / "text_encoder")) if (local / "text_encoder").is_dir()
                    else UMT5Config(**UMT5_XXL))
        out = {"vae": vae, "text_encoder": UMT5EncoderModel(text_cfg)}
        if cfg.uses_clip:
            clip_dir = Path(cfg.model.image_encoder or local)
            clip_dir = clip_dir / "image_encoder" if (clip_dir / "image_encoder").is_dir() else clip_dir
            clip_cfg = (CLIPVisionConfig.from_pretrained(str(clip_dir)) if (clip_dir / "config.json").exists()
                        else CLIPVisionConfig(**CLIP_VIT_H14))
            out["image_encoder"] = CLIPVisionModel(clip_cfg)
    return out


def encoder_bytes(cfg: Config) -> dict[str, int]:
    """Weight bytes of each resident encoder: the VAE and CLIP in fp32 (as A2 runs them), UMT5 in
    model.weight_dtype. Empty with cache.enabled: a cached run never builds them. Not counted:
    the VAE's encode workspace (it encodes 4 frames at a time, so it grows with H x W, not F)."""
    if cfg.cache.enabled:
        return {}
    text_width = 2 if cfg.model.weight_dtype == "bf16" else 4
    return {name: (text_width if name == "text_encoder" else 4) * sum(p.numel() for p in m.parameters())
            for name, m in encoder_modules(cfg).items()}


def describe_plan(transformer: torch.nn.Module, cfg: Config, ds_config: dict, full_names: list[str]) -> str:
    """The --dry_run report: model shape, what trains, and the memory plan under the DeepSpeed config."""
    plan, gib = memory_plan(transformer, cfg), 1024 ** 3
    zero = ds_config.get("zero_optimization", {})
    offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param")
               if zero.get(k, {}).get("device") == "cpu"]
    c = transformer.config
    enc = encoder_bytes(cfg)
    encoders = (", ".join(f"{k} {v / gib:.2f}" for k, v in enc.items()) + f" GiB: {sum(enc.values()) / gib:.2f} GiB on "
                "every GPU for the whole run" if enc else "none resident (cache.enabled)")
    return "\n".join([
        f"transformer: {c.num_layers} layers x {c.num_attention_heads} heads x {c.attention_head_dim}, "
        f"in_channels {c.in_channels}, image attention {'yes' if c.added_kv_proj_dim else 'no'}"
        f"{(' (expanded from a T2V base)' if cfg.model.base == 't2v' else ' (added, zero-initialised)') if is_expanded(cfg) else ''}",
        *([describe_experts(cfg)] if trained_experts(cfg) else []),
        f"params {plan['params'] / 1e9:.3f} B, trainable {plan['trainable_params'] / 1e6:.2f} M "
        f"({cfg.model.training_type}; {len(full_names)} tensors in full beside the LoRA)",
        f"weights   {plan['weights_bytes'] / gib:9.2f} GiB ({cfg.train.mixed_precision})",
        f"gradients {plan['gradient_bytes'] / gib:9.2f} GiB",
        f"optimizer {plan['optimizer_bytes'] / gib:9.2f} GiB (fp32 master + AdamW moments, 12 B per trained param)",
        f"frozen encoders: {encoders}",
        f"weights, gradients and optimizer are totals over all GPUs, sharded by ZeRO-{zero.get('stage', 0)}"
        f"{', ' + ' and '.join(offload) + ' offloaded to CPU' if offload else ''}; "
        "activations not included (tools/estimate_memory.py)",
    ])


def describe_experts(cfg: Config) -> str:
    """The --dry_run line of a two-expert base: what trains, what that costs, what validation loads."""
    boundary = boundary_ratio(cfg)
    if cfg.model.expert == "both":
        return (f"experts: both trained in one module (high_noise for timesteps >= {boundary * 1000:g}, low_noise "
                "below; each micro-batch picks one): params, weights, gradients and optimizer below are twice one "
                "expert's")
    other = "low_noise" if cfg.model.expert == "high_noise" else "high_noise"
    return (f"experts: {cfg.model.expert} alone ({range_text(cfg.model.expert, boundary)}); {other} is not loaded for training, but validation videos load its base "
            "weights for the time they run (once more the weights below: set validation.num_videos: 0 where "
            "they do not fit)")
