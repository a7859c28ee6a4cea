"""T2V -> E2V expansion: a 16-channel text-to-video transformer widened to take element conditions
(condition channels in the patch embedding, image cross-attention), initialised so that its
output at step 0 equals the base's; the new modules train in full. Wan2.2-I2V-A14B's experts have
the condition channels but no image attention: the CLIP pathway adds only that, the same way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from e2v.config.experts import boundary_ratio
from e2v.config.schema import Config
from e2v.models.parts import CLIP_VIT_H, Parts, clip_location
from e2v.models.tiny import TINY_CLIP_WIDTH, seeded

T2V_CHANNELS = 16  # latent channels: a T2V transformer's whole input
MASK_CHANNELS = 4  # the Wan I2V mask folded to latent frames (docs/conditioning.md, "The mask")


# Modules a T2V base gains when expanded for elements, per pathway; they start neutral and train
# in full. `vae` widens the patch embedding (condition channels), `clip` adds image cross-attention.
EXPANSION_MODULES = {
    "vae": [r"^patch_embedding\."],
    "clip": [r"\.add_k_proj\.", r"\.add_v_proj\.", r"\.norm_added_k\.", r"^condition_embedder\.image_embedder\."],
}


def clip_width(parts: Parts | None, cfg: Config) -> int:
    """The width of the CLIP features image attention reads: the loaded encoder's; without it (a
    cached run, the meta-device plan) its config.json where the encoder is a local folder (read,
    nothing loaded), the tiny CLIP's for the preset, ViT-H/14's (Wan's) otherwise."""
    if parts is not None and parts.image_encoder is not None:
        return parts.image_encoder.config.hidden_size
    if cfg.model.preset is not None:
        return TINY_CLIP_WIDTH
    if not cfg.uses_clip:
        return CLIP_VIT_H[1]
    path, in_pipeline = clip_location(cfg)
    config = Path(path) / ("image_encoder" if in_pipeline else "") / "config.json"
    if not config.is_file():
        return CLIP_VIT_H[1]
    try:
        c = json.loads(config.read_text())
        return int(c.get("vision_config", c)["hidden_size"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{config}: not a CLIP vision config with a hidden_size ({type(e).__name__}: {e}); "
                         f"model.image_encoder must name a CLIP vision model folder") from None


# The layouts whose references are latent frames of their own in the token sequence (Wan2.2 TI2V's
# clean prefix, SkyReels-V3's slots): the base takes them with its latent channels as they are.
IN_SEQUENCE = ("clean_prefix", "sequence")


def added_pathways(cfg: Config) -> list[str]:
    """The pathways (EXPANSION_MODULES keys) the base lacks and expansion adds: those e2v_type uses
    on a T2V base (model.base: t2v); image attention alone on a two-expert Wan2.2 base with the CLIP
    pathway. Known from the config, before any weight loads."""
    if cfg.e2v_type == "none" or cfg.conditioning.target_layout in IN_SEQUENCE:  # a T2V base takes it as it is
        return []
    if cfg.model.base == "t2v":
        return (["vae"] if cfg.uses_vae_condition else []) + (["clip"] if cfg.uses_clip else [])
    return ["clip"] if cfg.uses_clip and boundary_ratio(cfg) is not None else []


def is_expanded(cfg: Config) -> bool:
    """A base that load_parts widened for elements (its new modules train in full)."""
    return bool(added_pathways(cfg))


def needs_expansion(config, cfg: Config) -> bool:
    """Whether the transformer of `config` (its diffusers config) is a 16-channel T2V transformer
    asked to take element conditions, or a Wan2.2 expert asked to take CLIP tokens. The base is
    stated in the config (model.base), never guessed, so what trains in full is known before any
    weight loads."""
    if cfg.conditioning.target_layout in IN_SEQUENCE:  # the references go in the sequence: nothing is widened
        return False  # (what the base must be: shapes.check_base)
    t2v = config["in_channels"] == T2V_CHANNELS and config.get("added_kv_proj_dim") is None
    if t2v and cfg.e2v_type != "none" and cfg.model.base != "t2v":
        raise ValueError(f"model: {cfg.model.pretrained or cfg.model.preset} is a text-to-video transformer "
                         f"(16 input channels, no image attention): set model.base: t2v to expand it for "
                         f"e2v_type {cfg.e2v_type}, conditioning.target_layout: sequence to give it the references "
                         f"in the token sequence as it is (SkyReels-V3 R2V), or e2v_type: none for plain text-to-video")
    if not t2v and cfg.model.base == "t2v":
        raise ValueError(f"model.base: t2v, but {cfg.model.pretrained or cfg.model.preset} already has "
                         f"{config['in_channels']} input channels / image attention: set model.base: i2v")
    if t2v:
        return cfg.e2v_type != "none"
    return "clip" in added_pathways(cfg) and config.get("added_kv_proj_dim") is None


def expansion_shape(cfg: Config, image_width: int, in_channels: int = 16) -> tuple[int, int | None]:
    """(input channels, image width or None) a base of `in_channels` is expanded to, per e2v_type:
    on a T2V base the VAE pathway adds 20 channels (16 without the mask); the CLIP pathway adds
    image cross-attention."""
    added = added_pathways(cfg)
    if "vae" in added:
        in_channels += 20 if cfg.processors.vae.concatenate_mask else 16
    return in_channels, image_width if "clip" in added else None


def expansion_modules(cfg: Config) -> list[str]:
    """Name patterns of the modules expansion added for this e2v_type (they train in full)."""
    return [pattern for pathway in added_pathways(cfg) for pattern in EXPANSION_MODULES[pathway]]


def expanded_config(config, in_channels: int, image_dim: int | None) -> dict:
    """The config of `config`'s transformer widened to `in_channels` and (image_dim not None) given
    image cross-attention of that input width."""
    c = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    c.update(in_channels=in_channels)
    if image_dim is not None:
        c.update(image_dim=image_dim, added_kv_proj_dim=c["num_attention_heads"] * c["attention_head_dim"])
    return c


def init_new_modules(model: WanTransformer3DModel, is_new, device, dtype: torch.dtype, seed: int) -> None:
    """Give the modules expansion added (`is_new(module)`; the patch embedding excepted, it is
    widened from the base's) their default init, drawn in fp32 on `device` under a private RNG
    seeded `seed + 1`, in model order, then cast to `dtype`; zero `add_v_proj` so the image
    branch adds exactly 0. The one place these values are made: the whole load materialises its
    meta modules here, the ZeRO-3 partitioned load a meta copy it then streams from
    (e2v/models/zero3_load.py), so both start from the same weights."""
    with seeded(seed + 1):
        for module in model.modules():
            if module is model.patch_embedding or not is_new(module):
                continue
            module.to_empty(device=device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            module.to(dtype=dtype)
    with torch.no_grad():
        for block in model.blocks:
            if block.attn2.add_v_proj is not None and not block.attn2.add_v_proj.weight.is_meta:
                block.attn2.add_v_proj.weight.zero_()
                block.attn2.add_v_proj.bias.zero_()


def widened_patch_weight(patch_w: torch.Tensor, in_channels: int) -> torch.Tensor:
    """The base's patch-embedding weight [D, 16, 1, 2, 2] with zero weights for the added input
    channels: [D, in_channels, 1, 2, 2]."""
    w = torch.zeros(patch_w.shape[0], in_channels, *patch_w.shape[2:], dtype=patch_w.dtype, device=patch_w.device)
    w[:, : patch_w.shape[1]] = patch_w
    return w


def expand_for_elements(t2v: WanTransformer3DModel, in_channels: int = 36, image_dim: int | None = 1280,
                        seed: int = 0) -> WanTransformer3DModel:
    """Widen the patch embedding from 16 to `in_channels` and (image_dim not None) add image
    cross-attention, such that the output is unchanged at step 0 (tests/unit/test_expand.py): the new input
    channels are zero, `add_v_proj` is zero (weight and bias), so the image branch adds exactly 0;
    `add_k_proj`, `norm_added_k` and the image embedder start at their default init so gradients
    reach them from step 1 (init_new_modules). `to_out` stays as it is: the text path shares it.
    The model is rebuilt from its config (meta device, then weights assigned), so save_pretrained
    and from_pretrained see a consistent config. A meta-device input gives a meta-device model
    (the --dry_run plan)."""
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(expanded_config(t2v.config, in_channels, image_dim))
    old_sd = t2v.state_dict()
    patch_w = old_sd.pop("patch_embedding.weight")
    model.load_state_dict(old_sd, strict=False, assign=True)
    for name, buf in t2v.named_buffers():  # non-persistent buffers (the rope tables) are not in state_dict
        module, _, short = name.rpartition(".")
        if name not in old_sd and short in model.get_submodule(module)._buffers:
            model.get_submodule(module)._buffers[short] = buf
    if patch_w.is_meta:
        return model
    init_new_modules(model, lambda m: any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]),
                     patch_w.device, patch_w.dtype, seed)
    model.patch_embedding.weight = torch.nn.Parameter(widened_patch_weight(patch_w, in_channels))
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if bad:
        raise RuntimeError(f"expansion left uninitialised tensors: {bad[:5]}")
    return model


def expand_from_export(t2v: WanTransformer3DModel, lora_dir: str | Path) -> WanTransformer3DModel:
    """Inference side: rebuild the expanded shape recorded in `<lora_dir>/e2v_model.json` (written
    by checkpoint.export_lora) around a plain T2V transformer; then load the LoRA
    (`load_lora_weights`) and the fully-trained modules (`checkpoint.load_extra_modules`)."""
    shape = json.loads((Path(lora_dir) / "e2v_model.json").read_text())
    if shape["in_channels"] == t2v.config.in_channels and shape.get("added_kv_proj_dim") == t2v.config.added_kv_proj_dim:
        return t2v
    return expand_for_elements(t2v, in_channels=shape["in_channels"], image_dim=shape.get("image_dim")
                               if shape.get("added_kv_proj_dim") else None)
