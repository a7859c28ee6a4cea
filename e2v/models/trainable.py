"""What trains: LoRA (peft) on the transformer, modules trained in full beside it
(`train.trainable`, an expanded base's new modules), or everything (a full fine-tune)."""

from __future__ import annotations

import contextlib
import re

import torch
from diffusers import WanTransformer3DModel

from e2v.config.schema import Config
from e2v.models.expand import expansion_modules
from e2v.models.experts import TwoExperts


def lora_target(patterns: list[str]) -> list[str] | str:
    """A list of module-name suffixes, or (seed style) one regex such as `blocks.*(to_q|to_k)`."""
    if len(patterns) == 1 and re.search(r"[*|()\[\]^$]", patterns[0]):
        return patterns[0]
    return list(patterns)


def describe_trained(cfg: Config, full_names: list[str]) -> str:
    """What trains, for the console and the plan: a full fine-tune, or the tensors beside the LoRA."""
    if cfg.model.training_type == "full":
        return f"full fine-tune: all {len(full_names)} tensors"
    return f"{len(full_names)} tensors in full beside the LoRA"


def full_patterns(cfg: Config, expanded: bool) -> list[str]:
    """Regexes of the parameter names trained in full beside the LoRA: `train.trainable`, plus an
    expanded base's new modules."""
    return list(cfg.train.trainable) + (expansion_modules(cfg) if expanded else [])


def setup_training(transformer: WanTransformer3DModel, cfg: Config, expanded: bool) -> list[str]:
    """Freeze everything, then add LoRA (training_type lora) and unfreeze `train.trainable`
    (plus the expansion modules of an expanded T2V base). Returns the names of parameters trained
    in full beside the LoRA."""
    from peft import LoraConfig

    if isinstance(transformer, TwoExperts):  # each expert its own adapter; names with the expert's prefix
        return [f"{name}.{n}" for name, expert in transformer.experts.items()
                for n in setup_training(expert, cfg, expanded)]
    transformer.requires_grad_(False)
    if cfg.model.training_type == "full":
        transformer.requires_grad_(True)
        return [n for n, _ in transformer.named_parameters()]
    targets = lora_target(cfg.lora.target_modules)
    if expanded and isinstance(targets, list):
        # The new image projections train in full; a LoRA on top of them would be redundant.
        targets = [t for t in targets if t not in ("add_k_proj", "add_v_proj")]
    if not transformer.config.added_kv_proj_dim and isinstance(targets, list):
        targets = [t for t in targets if t not in ("add_k_proj", "add_v_proj")]
    # A plan on the meta device (the start-up check, the memory estimate) gets its adapters there
    # too: created on the CPU and initialised, a 14B model's take seconds and gigabytes.
    on_meta = next(transformer.parameters()).is_meta
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        transformer.add_adapter(LoraConfig(
            r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=targets, init_lora_weights=True if cfg.lora.init_weights == "default" else "gaussian",
        ))
    full = []
    regexes = [re.compile(p) for p in full_patterns(cfg, expanded)]
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
        elif any(r.search(name) for r in regexes):
            p.requires_grad_(True)
            full.append(name)
    unmatched = [p for p in cfg.train.trainable if not any(re.search(p, n) for n in full)]
    if unmatched:
        raise ValueError(f"train.trainable: no parameter name matches {unmatched} (names look like "
                         f"'blocks.0.attn2.to_q.weight', 'patch_embedding.weight')")
    return full
