"""ComfyUI's LoRA loader emulated for tests (no ComfyUI here): its key map accepts, for every model
weight `diffusion_model.<name>.weight`, the key `diffusion_model.<name>` and, for every other model
tensor, its full key; `<key>.diff` is added to that tensor, `<key>.diff_b` to the bias of the same
module; LoRA keys (`.lora_A.weight`, `.lora_B.weight`, `.alpha`) are LoRA. Which diffusers
parameter a Wan key is, diffusers' own single-file conversion decides (the independent oracle)."""

from __future__ import annotations

import torch

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".alpha")


def split(comfy: dict) -> tuple[dict, dict]:
    """(LoRA keys, `.diff` / `.diff_b` keys); anything else is a key ComfyUI would not load."""
    lora = {k: v for k, v in comfy.items() if k.endswith(LORA_SUFFIXES)}
    diffs = {k: v for k, v in comfy.items() if k.endswith((".diff", ".diff_b"))}
    odd = set(comfy) - set(lora) - set(diffs)
    assert not odd, f"keys ComfyUI's LoRA loader would not load: {sorted(odd)[:5]}"
    return lora, diffs


def diffusers_name(diff_key: str, params: dict) -> str:
    """The diffusers parameter a ComfyUI `.diff` / `.diff_b` key patches, or KeyError."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    assert diff_key.startswith("diffusion_model."), diff_key
    stem = diff_key.removeprefix("diffusion_model.")
    if stem.endswith(".diff_b"):
        candidates = [stem.removesuffix(".diff_b") + ".bias"]
    else:
        stem = stem.removesuffix(".diff")
        candidates = [stem + ".weight", stem]  # a module's weight, else a tensor named in full
    for wan_key in candidates:
        (name,) = convert_wan_transformer_to_diffusers({wan_key: torch.zeros(1)})
        if name in params:
            return name
    raise KeyError(f"{diff_key}: no model tensor ComfyUI would patch")


def apply_diffs(transformer: torch.nn.Module, diffs: dict) -> list[str]:
    """Add each difference to the tensor ComfyUI would patch (the weight under a peft wrapper lives
    at `<module>.base_layer`). Returns the diffusers names patched."""
    params = {n.replace(".base_layer", ""): p for n, p in transformer.named_parameters()}
    done = []
    with torch.no_grad():
        for key, diff in diffs.items():
            name = diffusers_name(key, params)
            assert params[name].shape == diff.shape, key
            params[name].add_(diff.to(params[name].dtype))
            done.append(name)
    return done
