"""CausVid's generator checkpoints, both ways: a released `.pt` (CausVid's, Self-Forcing's) into the
diffusers transformer (`model.generator_ckpt`), and a trained transformer into that same file, so
CausVid's own inference loads what e2v trained.

The file is a torch pickle of `{"generator": state_dict}`; Self-Forcing's also carry
`"generator_ema"` (its EMA weights, the ones its demo samples with). The state dict is CausVid's
generator wrapper's: keys `model.<original Wan name>` (`model.blocks.0.self_attn.q.weight`), the
same network as diffusers' WanTransformer3DModel under the Wan repository's names. The name map is
e2v/models/wan_names.py's table (original `norm3`, the cross-attention norm with weights, is
diffusers' `norm2`; the other two norms have none). A pickle can run code: it is read with
`weights_only=True` only (tensors, numbers, containers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from e2v.models.wan_names import wan_original_key
from e2v.runtime.files import replacing
from e2v.runtime.integrity import weights_only_load
from e2v.runtime.log import get_logger

log = get_logger("e2v")

PREFIX = "model."  # CausVid's generator wrapper holds the Wan network as `.model`
WHICH = ("generator", "generator_ema")


def causvid_key(name: str) -> str:
    """A diffusers parameter name as the checkpoint spells it: `blocks.0.norm2.weight` ->
    `model.blocks.0.norm3.weight`."""
    return PREFIX + wan_original_key(name)


def causvid_names(transformer) -> dict[str, str]:
    """checkpoint key -> diffusers parameter name, for every entry of the transformer's state dict
    (persistent tensors only: the rope tables are rebuilt, in Wan and in diffusers alike)."""
    names = list(transformer.state_dict())
    wrapped = [n for n in names if ".base_layer." in n or ".lora_" in n]
    if wrapped:
        raise ValueError(f"model.generator_ckpt: the transformer already carries a LoRA ({wrapped[0]}, ...): load the "
                         "generator checkpoint into the base before the LoRA is attached")
    return {causvid_key(n): n for n in names}


def load_causvid_checkpoint(transformer, path: str | Path, which: str = "generator") -> None:
    """Load a CausVid / Self-Forcing generator checkpoint into `transformer` (a plain diffusers
    WanTransformer3DModel of the same shape), in place, cast to its parameters' dtypes. Every key
    must map: the missing and the unexpected ones are named together, as are shape mismatches."""
    if which not in WHICH:
        raise ValueError(f"which: {which!r} is not one of {WHICH}")
    checkpoint = weights_only_load(path, map_location="cpu", mmap=True, allow=[])
    if not isinstance(checkpoint, dict) or which not in checkpoint:
        has = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"model.generator_ckpt {path}: no {which!r} entry (it has {has}); a CausVid generator "
                         f"checkpoint is {{'generator': state_dict}} (Self-Forcing's also 'generator_ema')")
    state = checkpoint[which]
    names = causvid_names(transformer)
    missing, unexpected = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    expected = transformer.state_dict()
    wrong = [f"{k} {tuple(state[k].shape)} (the model's {tuple(expected[names[k]].shape)})"
             for k in sorted(set(state) & set(names)) if state[k].shape != expected[names[k]].shape]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing: {_few(missing)}" if missing else "",
                 f"{len(unexpected)} unexpected: {_few(unexpected)}" if unexpected else "",
                 f"{len(wrong)} of another shape: {_few(wrong)}" if wrong else ""]
        raise ValueError(f"model.generator_ckpt {path} ['{which}'] does not fit the transformer ("
                         + "; ".join(p for p in parts if p) + "): the checkpoint must be of the same Wan model "
                         "as model.pretrained (CausVid's are Wan2.1-T2V-1.3B)")
    transformer.load_state_dict({names[k]: v for k, v in state.items()}, strict=True)
    log.info(f"model.generator_ckpt: {len(state)} tensors of {path} ['{which}'] loaded (original Wan names -> "
             "diffusers': e2v/models/wan_names.py)")


def _few(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def causvid_state(state_dict: dict) -> dict:
    """A diffusers transformer state dict (full weights: a LoRA fused in) under the checkpoint's keys."""
    return {causvid_key(k): v.detach().cpu().contiguous() for k, v in state_dict.items()}


def save_causvid_checkpoint(state_dict: dict, path: str | Path, ema_state_dict: dict | None = None) -> Path:
    """Write `{"generator": ...}` (and `"generator_ema"` when given) in CausVid's layout, replacing
    `path` in one step. The tensors keep their dtypes (CausVid's loader casts to its model's)."""
    path = Path(path)
    checkpoint = {"generator": causvid_state(state_dict)}
    if ema_state_dict is not None:
        checkpoint["generator_ema"] = causvid_state(ema_state_dict)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        torch.save(checkpoint, tmp)
    return path
