"""ComfyUI's naming: the original Wan key names (`diffusion_model.blocks.0.self_attn.q`), its LoRA
layout (`.lora_down` / `.lora_up` / `.alpha`) and full-weight differences (`.diff`, `.diff_b`),
which LoRA targets diffusers' Wan converter can place, and which trained tensors a ComfyUI LoRA
load accepts but never applies (docs/comfyui.md)."""

from __future__ import annotations

import re

import torch

from e2v.models.experts import plain_name

# The original Wan names of diffusers' parameters live in one table, e2v/models/wan_names.py
# (CausVid's checkpoints read it too); wan_original_state is re-exported for export.py.
from e2v.models.wan_names import wan_original_key, wan_original_name, wan_original_state as wan_original_state


def comfy_diffs(extra: dict, base: dict) -> tuple[dict, list[str]]:
    """ComfyUI's full-weight differences for the trained modules the base model has (same name and
    shape in `base`): `diffusion_model.<Wan module>.diff` for a weight, `.diff_b` for its bias,
    `diffusion_model.<Wan parameter>.diff` for a parameter that is not a module's weight or bias
    (the modulation tables). ComfyUI's LoRA loader accepts `<key>.diff` for every model key it
    knows (`<module>` for a `.weight`, the full name for anything else) and adds it to the weight;
    `<module>.diff_b` to the bias. Returns (differences, names of trained tensors that have none)."""
    diffs, kept = {}, []
    for name, value in sorted(extra.items()):
        if name not in base or base[name].shape != value.shape:
            kept.append(name)
            continue
        key = wan_original_key(name)
        leaf = {".weight": ".diff", ".bias": ".diff_b"}
        stem, suffix = next(((key[: -len(s)], d) for s, d in leaf.items() if key.endswith(s)), (key, ".diff"))
        diffs[f"diffusion_model.{stem}{suffix}"] = value.float() - base[name].float()
    return diffs, kept


# ComfyUI's ModelPatcher applies a LoRA's patches while it loads the model's modules, and there it
# skips every parameter of a module that also has submodules (ModelPatcher._load_list: "skip random
# weights in non leaf modules"). In its Wan model the modulation tables are such parameters: the
# block's (`blocks.N.modulation`, diffusers' `blocks.N.scale_shift_table`) and the head's
# (`head.modulation`, diffusers' `scale_shift_table`). Their `.diff` patches are accepted and
# dropped, silently. Original Wan key patterns.
COMFY_LORA_UNAPPLIED = (r"^blocks\.\d+\.modulation$", r"^head\.modulation$")


def comfy_lora_unapplied(names: list[str]) -> list[str]:
    """The trained tensors among `names` (diffusers parameter names) that a stock ComfyUI LoRA
    load does not apply (COMFY_LORA_UNAPPLIED)."""
    return [n for n in names if any(re.match(p, wan_original_key(n)) for p in COMFY_LORA_UNAPPLIED)]


def comfy_lora(lora: dict, alpha: float) -> dict:
    """ComfyUI / original-Wan LoRA keys: `diffusion_model.<wan name>.lora_A.weight`, `.lora_B.weight`
    and the scalar `.alpha` (both loaders scale by alpha / rank). Outside the blocks diffusers'
    converter rejects `.alpha` keys, so there alpha / rank is folded into lora_A and no `.alpha`
    is written: ComfyUI and diffusers then both use scale 1, the same product."""
    out = {}
    for key, value in lora.items():
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key)
        if m is None:
            raise KeyError(f"unexpected LoRA key {key}")
        name = f"diffusion_model.{wan_original_name(m.group(1))}"
        if m.group(1).startswith("blocks."):
            out[f"{name}.{m.group(2)}.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
        else:
            rank = lora[f"{m.group(1)}.lora_A.weight"].shape[0]
            out[f"{name}.{m.group(2)}.weight"] = value * (alpha / rank) if m.group(2) == "lora_A" else value
    return out


def lora_module_names(transformer: torch.nn.Module) -> list[str]:
    """Names of the modules peft wrapped with a LoRA (`blocks.0.attn1.to_q`, ...); a Wan2.2 expert's
    without its prefix (each expert's ComfyUI file has the plain names)."""
    names = [plain_name(n) for n, m in transformer.named_modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]
    return list(dict.fromkeys(names))


def check_comfy_mappable(lora_target_names: list[str]) -> None:
    """Fail at setup, not at the export after training, when the ComfyUI copy of this LoRA could
    not be written or would not load in diffusers. The oracle is diffusers' own ComfyUI/Wan LoRA
    converter, run on a rank-1 dummy LoRA of the same modules: it must give back exactly them.
    It knows the attention and FFN layers of every block (all of them, k_img and v_img together)
    and time_projection, text/time embeddings, img_emb and head outside them."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_wan_lora_to_diffusers,
    )

    names = sorted(lora_target_names)
    if not names:  # a full fine-tune: no LoRA to convert
        return
    dummy = {f"{n}.lora_{ab}.weight": torch.ones(1, 1) for n in names for ab in "AB"}
    fix = ("remove them from lora.target_modules (or train them in full with train.trainable), or set "
           "the targets to attention / FFN layers of every block")
    try:
        comfy = comfy_lora(dummy, alpha=1.0)
    except KeyError as e:
        raise ValueError(f"lora.target_modules: the ComfyUI export has no original Wan name for a LoRA module "
                         f"({e}); {fix}") from None
    try:
        back = {k.removeprefix("transformer.") for k in _convert_non_diffusers_wan_lora_to_diffusers(comfy)}
        odd, why = sorted({k.rsplit(".lora_", 1)[0] for k in set(dummy) ^ back}), "keys lost or renamed"
    except (ValueError, KeyError) as e:  # the converter lists the keys it could not place
        odd = [n for n in names if f"{wan_original_name(n)}." in str(e)] or names
        why = f"{type(e).__name__}: {str(e)[:200]}"
    if odd:
        raise ValueError(f"lora.target_modules: the ComfyUI copy of a LoRA on {odd[:6]} would not load in "
                         f"diffusers' Wan LoRA converter ({why}); {fix}")
