"""The plan without weights (`--dry_run`, the preflight checks at start): the transformer as
training will see it, built on the meta device from its config (a tiny preset, a local
folder's config.json, or a known Wan hub id), its VAE's config, and the memory its training state
takes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from e2v.config.bases import resolve_pretrained, tiny_base, tiny_expert_base, vae_config
from e2v.config.experts import SUBFOLDERS, boundary_ratio, range_text, trained_experts
from e2v.config.schema import Config
from e2v.config.shapes import check_base
from e2v.models.context_parallel import check_heads
from e2v.models.expand import clip_width, expand_for_elements, expansion_shape, is_expanded, needs_expansion
from e2v.models.experts import TwoExperts
from e2v.models.fp8 import Fp8Linear, fp8_bytes, quantize_base
from e2v.models.parts import CLIP_VIT_H
from e2v.models.tiny import tiny_transformer_config
from e2v.models.trainable import describe_trained, full_patterns, setup_training
from e2v.runtime.adam import optimizer_bytes

# Transformer configs of the released Wan2.1 checkpoints (diffusers' conversion script; their
# parameter counts, 1.42 B / 14.29 B / 16.40 B, are checked in tests/unit/test_expand.py),
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
    # Wan2.2 TI2V-5B (diffusers' conversion script, "Wan2.2-TI2V-5B"): 24 heads x 128 = 3072, 30
    # layers, 48 latent channels in and out, no image attention; 5.0 B parameters (tests/unit/test_wan22_ti2v.py).
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {**_WAN_COMMON, "num_attention_heads": 24, "num_layers": 30,
                                        "ffn_dim": 14336, "in_channels": 48, "out_channels": 48},
    # SkyReels-V3's reference-to-video model: the Wan2.1 T2V-14B transformer (its model_index.json
    # declares WanPipeline / WanTransformer3DModel, no image encoder; the references go in the sequence).
    "Skywork/SkyReels-V3-R2V-14B": {**_WAN_COMMON, **_WAN_14B, "in_channels": 16},
    # Each of the two experts (transformer/, transformer_2/): the 14B shape with the I2V input channels
    # and no image attention (diffusers' conversion script, "Wan2.2-I2V-14B-720p"); 14.29 B parameters.
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {**_WAN_COMMON, **_WAN_14B, "in_channels": 36},
    # Wan2.2-T2V-A14B's experts: the Wan2.1 T2V-14B shape (diffusers' conversion script, "Wan2.2-T2V-A14B").
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {**_WAN_COMMON, **_WAN_14B, "in_channels": 16},
}


def transformer_config(cfg: Config, expert: str = "high_noise") -> dict:
    """The base transformer's config without reading weights: the tiny preset, a local diffusers
    folder's transformer/config.json (a Wan2.2 expert's subfolder), or a known hub id
    (KNOWN_WAN_CONFIGS; no download)."""
    if cfg.model.preset is not None:
        two = boundary_ratio(cfg) is not None
        return tiny_transformer_config(tiny_expert_base(cfg.model) if two else tiny_base(cfg.model), cfg.model.tiny)
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
    width = clip_width(None, cfg)

    def build(expert: str) -> WanTransformer3DModel:
        c = {k: v for k, v in transformer_config(cfg, expert).items() if not k.startswith("_")}
        with torch.device("meta"):
            transformer = WanTransformer3DModel.from_config(c)
        if needs_expansion(transformer.config, cfg):
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
    """The model-dependent config checks (base vs model.base, what the model's shape allows:
    shapes.check_base, heads vs parallel.ulysses_degree, train.trainable patterns, LoRA targets) on the meta device, in seconds,
    before any weight loads: a 14B load takes minutes and ~31 GB per rank, too much to spend on a
    typo. Returns the meta transformer set up for training and the names trained in full."""
    transformer = build_meta_transformer(cfg)
    check_base(cfg, transformer.config, vae_config(cfg))
    check_heads(cfg, transformer.config.num_attention_heads)
    expanded = is_expanded(cfg)
    if cfg.model.base_dtype == "fp8":  # the plan counts what the GPU holds: fp8 weights are buffers
        quantize_base(transformer, full_patterns(cfg, expanded))
        layers = transformer.config.num_layers
        if cfg.model.fp8_blocks_on_host > layers:
            raise ValueError(f"model.fp8_blocks_on_host={cfg.model.fp8_blocks_on_host}: this transformer has "
                             f"{layers} blocks; use at most {layers}")
    full_names = setup_training(transformer, cfg, expanded=expanded)
    return transformer, full_names


# --- activations ----------------------------------------------------------------------------------
# Elements autograd keeps for backward per sample (the formula's fit and its checks:
# e2v/train/memory.py's docstring). S video tokens, C context tokens, D width, F FFN width,
# K layers, P = ulysses x ring ranks sharing the tokens (docs/context_parallel.md):
#   one block            A = (a S D + b S F) / P + c C D      (the context's keys / values are whole on every rank)
#   outside the blocks   O = d S D / P + f C D + g S           (patch embedding, rope tables and the gathered output stay whole)
#   checkpointing keeps the block inputs: S D (K / P + 1 - 1/P) (the first block's input is split inside it)
ACT_BLOCK = (24.2, 2.0, 4.0)
ACT_OUTSIDE = (2.3, 3.4, 267.0)
# Per-token timesteps (the clean_prefix layout, e2v/conditioning/ti2v.py): the time embedding and each block's
# modulation are per token instead of per sample: A += 5.5 S D, O += 11 S D (fitted like the rest).
ACT_PER_TOKEN_TIME = (5.5, 11.0)
OUT_PER_TOKEN = 64  # proj_out's outputs per token: 16 latent channels x the 1 x 2 x 2 patch


def tokens(cfg: Config) -> tuple[int, int]:
    """(video tokens S, context tokens C) of one data.num_frames x data.resolution sample: the
    clip's latent frames under the model's VAE (16x space for Wan2.2's), plus the references' own
    latent frames in the sequence: the clean_prefix frames in front, or the sequence layout's
    slots (SkyReels-V3: 4 more frames, ~13% more tokens at 121 frames' 31)."""
    from e2v.config.shapes import PATCH, TEXT_LEN, latent_size, reference_latent_frames
    from e2v.models.tiny import TINY_CLIP_TOKENS

    t, h, w = latent_size(cfg.data.num_frames, *cfg.data.resolution, vae_config(cfg))
    clip = sum(1 for e in cfg.data.elements if e.clip is not None) if cfg.uses_clip else 0
    per_ref = TINY_CLIP_TOKENS if cfg.model.preset is not None else CLIP_VIT_H[0]
    return (t + reference_latent_frames(cfg)) * (h // PATCH) * (w // PATCH), TEXT_LEN + per_ref * clip


def per_token_time(cfg: Config) -> bool:
    """Whether the model gets one timestep per token: the clean_prefix layout's reference frames (the
    sequence layout's slots share the sample's one timestep: no per-token time cost)."""
    from e2v.config.shapes import prefix_frames_of

    return prefix_frames_of(cfg) > 0


def activation_terms(s: int, ctx: int, c, cp: int = 1, per_token_time: bool = False) -> tuple[float, float]:
    """(A, O): elements saved for backward by one block and outside the blocks, per sample, on one
    of the `cp` ranks that share its tokens; per_token_time: one timestep per token (the
    clean_prefix layout). `c`: anything with .width, .ffn (e2v.train.memory's ModelCounts,
    `model_shape`)."""
    a, b, cc = ACT_BLOCK
    d, f, g = ACT_OUTSIDE
    ta, to = ACT_PER_TOKEN_TIME if per_token_time else (0.0, 0.0)
    return (((a + ta) * s * c.width + b * s * c.ffn) / cp + cc * ctx * c.width,
            (d + to) * s * c.width / cp + f * ctx * c.width + g * s)


def activation_bytes(s: int, ctx: int, c, batch: int, elem_bytes: int, checkpointing: bool,
                     offload: bool = False, cp: int = 1, per_token_time: bool = False) -> tuple[float, float]:
    """(bytes on the GPU, bytes moved to CPU RAM) of the activations saved for backward, per rank."""
    block, outside = activation_terms(s, ctx, c, cp, per_token_time)
    if not checkpointing:
        return elem_bytes * batch * (c.layers * block + outside), 0.0
    boundaries = elem_bytes * batch * s * c.width * (c.layers / cp + 1 - 1 / cp)
    gpu = elem_bytes * batch * (outside + block)
    return (gpu, boundaries) if offload else (gpu + boundaries, 0.0)


def exchange_bytes(s: int, c, batch: int, elem_bytes: int, ulysses: int = 1, ring: int = 1) -> float:
    """Transient buffers of the context-parallel exchange, per rank: Ulysses' all-to-all holds a
    send and a receive copy of one of q, k, v or the output at a time (2 S D / P); ring attention
    gathers the keys and values of its head shard over the whole sequence (2 S D / U); the gathered
    prediction is whole on every rank (S x 64)."""
    if ulysses * ring == 1:
        return 0.0
    d = c.width
    elements = (2 * s * d / (ulysses * ring) if ulysses > 1 else 0) + (2 * s * d / ulysses if ring > 1 else 0)
    return elem_bytes * batch * (elements + OUT_PER_TOKEN * s)


@dataclass
class ModelShape:
    width: int
    ffn: int
    layers: int


def model_shape(transformer: torch.nn.Module) -> ModelShape:
    c = transformer.config
    return ModelShape(c.num_attention_heads * c.attention_head_dim, c.ffn_dim, c.num_layers)


def count_params(module: torch.nn.Module, trainable_only: bool = False) -> int:
    # A ZeRO-3 partitioned parameter has numel() 0; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in module.parameters()
               if p.requires_grad or not trainable_only)


def memory_plan(transformer: torch.nn.Module, cfg: Config) -> dict:
    """Bytes of the training state summed over all GPUs, before ZeRO partitioning and offload:
    weights in the training precision, gradients of the trained parameters in that precision,
    and the optimizer's fp32 master copy + two moments (e2v.runtime.adam.optimizer_bytes). Activations
    depend on resolution and checkpointing: tools/estimate_memory.py."""
    params = count_params(transformer)
    trainable = count_params(transformer, trainable_only=True)
    width = 2 if cfg.train.mixed_precision == "bf16" else 4
    return {"params": params, "trainable_params": trainable, "weights_bytes": width * params,
            "gradient_bytes": width * trainable, "optimizer_bytes": optimizer_bytes(cfg.deepspeed.optimizer) * trainable}


def checkpoint_bytes(trainable: int, frozen: int, width: int, zero_stage: int, optim_bytes: float = 12) -> dict:
    """Bytes one checkpoint save writes, all ranks together (estimate; pickle framing adds a little
    per tensor): the optimizer's state of every trained parameter (`optim_bytes` each,
    e2v.runtime.adam.optimizer_bytes: 12 for AdamW's fp32 master copy and two moments),
    plus under ZeRO-1/2 the trained module weights in the training precision (`width` bytes; under
    ZeRO-3 the module state holds empty partitions). A save leaves the frozen weights out
    (e2v/train/checkpoint.py); `before` is the save with them (DeepSpeed's default, `width` bytes
    each, once: ZeRO-2's frozen fragments share storage with the module state, ZeRO-3's are the
    partitions). Every save is written, hashed and kept `train.keep_last` times."""
    after = optim_bytes * trainable + (width * trainable if zero_stage < 3 else 0)
    return {"after": after, "before": after + width * frozen, "frozen": width * frozen}


def checkpoint_line(params: int, trainable: int, width: int, zero_stage: int, keep_last: int,
                    optim_bytes: float = 12) -> str:
    """The plan's line on checkpoint size: per save, with and without the frozen weights."""
    b, gib = checkpoint_bytes(trainable, params - trainable, width, zero_stage, optim_bytes), 1024 ** 3
    kept = f", {keep_last} kept" if keep_last else ", all kept"
    return (f"checkpoint per save (estimate): {b['after'] / gib:.2f} GiB (trained weights + optimizer state{kept}); "
            f"the frozen {b['frozen'] / gib:.2f} GiB stay in the model folder (saving them too: "
            f"{b['before'] / gib:.2f} GiB)")


# The frozen encoders of the released Wan pipelines, for counting on the meta device without a
# download: UMT5-XXL's encoder (google/umt5-xxl) and CLIP ViT-H/14's vision tower; the VAE is built
# from vae_config (the default AutoencoderKLWan() is the Wan2.1 VAE, WAN22_VAE TI2V-5B's).
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

    if cfg.model.preset is not None:
        from e2v.models.tiny import build_tiny_parts

        p = build_tiny_parts(cfg.model.tiny_seed, base=tiny_base(cfg.model))
        return {"vae": p.vae, "text_encoder": p.text_encoder, **({"image_encoder": p.image_encoder} if cfg.uses_clip else {})}
    local = Path(resolve_pretrained(cfg.model.pretrained))
    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(vae_config(cfg))
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
    """Weight bytes of each resident encoder: CLIP in fp32 (as A2 runs it), the VAE in
    model.vae_dtype (fp32 by default, as A2), UMT5 in model.weight_dtype. Empty with cache.enabled: a cached run never builds them. Not counted:
    the VAE's encode workspace (it encodes 4 frames at a time, so it grows with H x W, not F)."""
    if cfg.cache.enabled:
        return {}
    width = {"text_encoder": 2 if cfg.model.weight_dtype == "bf16" else 4,
             "vae": 2 if cfg.model.vae_dtype == "bf16" else 4}
    return {name: width.get(name, 4) * n for name, n in encoder_numels(cfg).items()}


def encoder_numels(cfg: Config) -> dict[str, int]:
    """Parameter counts of encoder_modules(cfg), kept per model section and CLIP use: building the
    released encoders on the meta device takes about a second, and the memory advice asks again for
    every plan it tries (e2v/train/memory.py)."""
    key = json.dumps([dataclasses.asdict(cfg.model), cfg.uses_clip], sort_keys=True, default=str)
    if key not in _ENCODER_NUMELS:
        _ENCODER_NUMELS[key] = {name: sum(p.numel() for p in m.parameters()) for name, m in encoder_modules(cfg).items()}
    return _ENCODER_NUMELS[key]


_ENCODER_NUMELS: dict[str, dict[str, int]] = {}  # encoder_numels', per model section and CLIP use


def describe_plan(transformer: torch.nn.Module, cfg: Config, ds_config: dict, full_names: list[str]) -> str:
    """The --dry_run report: model shape, what trains, and the memory plan under the DeepSpeed config."""
    plan, gib = memory_plan(transformer, cfg), 1024 ** 3
    zero = ds_config.get("zero_optimization", {})
    offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param")
               if zero.get(k, {}).get("device") == "cpu"]
    c = transformer.config
    fp8 = [m for m in transformer.modules() if isinstance(m, Fp8Linear)]
    fp8_n, fp8_b = sum(m.weight_fp8.numel() for m in fp8), fp8_bytes(transformer)
    fp8_line = ([f"fp8 base: {fp8_n / 1e9:.3f} B frozen weights in float8 e4m3 + per-channel scales, {fp8_b / gib:.2f} GiB"
                 + (f" ({cfg.model.fp8_blocks_on_host} of {c.num_layers} blocks' in host RAM, on the GPU while their "
                    "block runs)" if cfg.model.fp8_blocks_on_host else " on every GPU")] if fp8 else [])
    enc = encoder_bytes(cfg)
    encoders = (", ".join(f"{k} {v / gib:.2f}" for k, v in enc.items()) + f" GiB: {sum(enc.values()) / gib:.2f} GiB on "
                "every GPU for the whole run" if enc else "none resident (cache.enabled)")
    return "\n".join([
        f"transformer: {c.num_layers} layers x {c.num_attention_heads} heads x {c.attention_head_dim}, "
        f"in_channels {c.in_channels}, image attention {'yes' if c.added_kv_proj_dim else 'no'}"
        f"{(' (expanded from a T2V base)' if cfg.model.base == 't2v' else ' (added, zero-initialised)') if is_expanded(cfg) else ''}",
        *([describe_experts(cfg)] if trained_experts(cfg) else []),
        f"params {(plan['params'] + fp8_n) / 1e9:.3f} B, trainable {plan['trainable_params'] / 1e6:.2f} M "
        f"({describe_trained(cfg, full_names)})",
        f"weights   {plan['weights_bytes'] / gib:9.2f} GiB ({cfg.train.mixed_precision}{', beside the fp8 base' if fp8 else ''})",
        *fp8_line,
        f"gradients {plan['gradient_bytes'] / gib:9.2f} GiB",
        f"optimizer {plan['optimizer_bytes'] / gib:9.2f} GiB (fp32 master + AdamW moments, "
        f"{optimizer_bytes(cfg.deepspeed.optimizer):.4g} B per trained param; deepspeed.optimizer: {cfg.deepspeed.optimizer})",
        f"frozen encoders: {encoders}",
        f"weights, gradients and optimizer are totals over all GPUs, sharded by ZeRO-{zero.get('stage', 0)}"
        f"{', ' + ' and '.join(offload) + ' offloaded to CPU' if offload else ''}",
        checkpoint_line(plan["params"], plan["trainable_params"], 2 if cfg.train.mixed_precision == "bf16" else 4,
                        zero.get("stage", 0), cfg.train.keep_last, optimizer_bytes(cfg.deepspeed.optimizer)),
        activation_line(transformer, cfg),
    ])


def activation_line(transformer: torch.nn.Module, cfg: Config) -> str:
    """The plan's activations per GPU at data.num_frames x data.resolution: an estimate
    (the formula above; tools/estimate_memory.py for every ds_config and GPU size)."""
    p, t, gib = cfg.parallel, cfg.train, 1024 ** 3
    s, ctx = tokens(cfg)
    e = 2 if t.mixed_precision == "bf16" else 4
    cp = p.ulysses_degree * p.ring_degree
    shape = model_shape(transformer)
    gpu, moved = activation_bytes(s, ctx, shape, t.micro_batch_size, e, t.gradient_checkpointing,
                                  t.activation_offload, cp)
    split = (f", {s // cp} per GPU over {cp} context-parallel ranks (ulysses {p.ulysses_degree} x ring "
             f"{p.ring_degree}) + {exchange_bytes(s, shape, t.micro_batch_size, e, p.ulysses_degree, p.ring_degree) / gib:.2f} "
             "GiB exchange buffers" if cp > 1 else "")
    return (f"activations per GPU (estimate): {gpu / gib:.2f} GiB"
            f"{f' + {moved / gib:.2f} GiB in CPU RAM (activation_offload)' if moved else ''} for {s} video tokens"
            f"{split}, micro batch {t.micro_batch_size}, checkpointing {'on' if t.gradient_checkpointing else 'off'} "
            "(tools/estimate_memory.py)")
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
