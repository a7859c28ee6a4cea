"""The original Wan2.1 parameter names (the Wan repository's, which ComfyUI and CausVid's
checkpoints use) and diffusers' names for the same tensors: the one table both directions are read
from (ComfyUI's export in e2v/train/comfy.py, CausVid's checkpoints in e2v/models/causvid_ckpt.py)."""

from __future__ import annotations

import re

# Diffusers names -> original Wan2.1 names (what ComfyUI and the Wan repo use): the inverse of
# diffusers' `convert_wan_transformer_to_diffusers` (loaders/single_file_utils.py, weights) and
# `_convert_non_diffusers_wan_lora_to_diffusers` (loaders/lora_conversion_utils.py, LoRAs).
# Applied in order, first match wins; keys are module names, or parameter names for the
# modulation tables (parameters of the block / the model itself).
WAN_ORIGINAL_NAMES = {
    r"^blocks\.(\d+)\.attn1\.to_q$": r"blocks.\1.self_attn.q",
    r"^blocks\.(\d+)\.attn1\.to_k$": r"blocks.\1.self_attn.k",
    r"^blocks\.(\d+)\.attn1\.to_v$": r"blocks.\1.self_attn.v",
    r"^blocks\.(\d+)\.attn1\.to_out\.0$": r"blocks.\1.self_attn.o",
    r"^blocks\.(\d+)\.attn1\.norm_(q|k)$": r"blocks.\1.self_attn.norm_\2",
    r"^blocks\.(\d+)\.attn2\.to_q$": r"blocks.\1.cross_attn.q",
    r"^blocks\.(\d+)\.attn2\.to_k$": r"blocks.\1.cross_attn.k",
    r"^blocks\.(\d+)\.attn2\.to_v$": r"blocks.\1.cross_attn.v",
    r"^blocks\.(\d+)\.attn2\.to_out\.0$": r"blocks.\1.cross_attn.o",
    r"^blocks\.(\d+)\.attn2\.norm_(q|k)$": r"blocks.\1.cross_attn.norm_\2",
    r"^blocks\.(\d+)\.attn2\.add_k_proj$": r"blocks.\1.cross_attn.k_img",
    r"^blocks\.(\d+)\.attn2\.add_v_proj$": r"blocks.\1.cross_attn.v_img",
    r"^blocks\.(\d+)\.attn2\.norm_added_k$": r"blocks.\1.cross_attn.norm_k_img",
    # Wan's block applies norm3 before cross-attention; diffusers calls that norm2 (its conversion
    # swaps the two names). The other two block norms have no weights.
    r"^blocks\.(\d+)\.norm2$": r"blocks.\1.norm3",
    r"^blocks\.(\d+)\.ffn\.net\.0\.proj$": r"blocks.\1.ffn.0",
    r"^blocks\.(\d+)\.ffn\.net\.2$": r"blocks.\1.ffn.2",
    r"^blocks\.(\d+)\.scale_shift_table$": r"blocks.\1.modulation",
    r"^scale_shift_table$": "head.modulation",
    r"^patch_embedding$": "patch_embedding",
    r"^condition_embedder\.time_proj$": "time_projection.1",
    r"^condition_embedder\.text_embedder\.linear_1$": "text_embedding.0",
    r"^condition_embedder\.text_embedder\.linear_2$": "text_embedding.2",
    r"^condition_embedder\.time_embedder\.linear_1$": "time_embedding.0",
    r"^condition_embedder\.time_embedder\.linear_2$": "time_embedding.2",
    r"^condition_embedder\.image_embedder\.norm1$": "img_emb.proj.0",
    r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj$": "img_emb.proj.1",
    r"^condition_embedder\.image_embedder\.ff\.net\.2$": "img_emb.proj.3",
    r"^condition_embedder\.image_embedder\.norm2$": "img_emb.proj.4",
    r"^proj_out$": "head.head",
}


def wan_original_name(module: str) -> str:
    for pattern, repl in WAN_ORIGINAL_NAMES.items():
        if re.match(pattern, module):
            return re.sub(pattern, repl, module)
    raise KeyError(f"no original Wan name for '{module}' (add it to WAN_ORIGINAL_NAMES in e2v/models/wan_names.py)")


def wan_original_key(param: str) -> str:
    """A diffusers parameter name in original Wan naming: `blocks.0.norm2.weight` -> `blocks.0.norm3.weight`."""
    module, _, leaf = param.rpartition(".")
    return f"{wan_original_name(module)}.{leaf}" if leaf in ("weight", "bias") else wan_original_name(param)


def wan_original_state(state: dict) -> dict:
    """A diffusers Wan transformer state dict under the original Wan key names: the layout of the
    Wan repository's checkpoints, which ComfyUI's diffusion-model loader reads (and diffusers'
    single-file loader converts back)."""
    return {wan_original_key(k): v for k, v in state.items()}
