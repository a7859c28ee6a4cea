"""The DeepSpeed config a run uses: the chosen ds_configs/*.json with its "auto" fields filled from
the YAML (micro batch, accumulation, clipping, bf16, the optimizer's hyperparameters), the Adam
named by deepspeed.optimizer, and the ZeRO settings context parallelism needs. Written to the run folder
as ds_config.json."""

from __future__ import annotations

import json
import os

from e2v.config.schema import Config, ConfigError, resolve_repo_path
from e2v.models import context_parallel
from e2v.runtime import distributed
from e2v.runtime.adam import ADAMW_8BIT, TORCH_ADAMW, preflight_deepspeed_adam


def optimizer_offloaded(ds_config: dict) -> bool:
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"


def adam_choice(cfg: Config, ds_config: dict, cuda: bool) -> tuple[bool, str]:
    """(torch's AdamW rather than DeepSpeed's, what it is) for this DeepSpeed config. The YAML decides,
    never the machine: every rank reads the same key, so no rank can pick another optimizer."""
    offload = optimizer_offloaded(ds_config)
    if cfg.deepspeed.optimizer == ADAMW_8BIT:
        where = "on the CPU (optimizer offload)" if offload else "on the GPU" if cuda else "(no CUDA: on the CPU)"
        return False, (f"bitsandbytes' AdamW8bit {where} (deepspeed.optimizer: {ADAMW_8BIT}; 8-bit moments, "
                       "no build, exact resume)")
    if cfg.deepspeed.optimizer == TORCH_ADAMW:
        where = "on the CPU (optimizer offload)" if offload else "on the GPU" if cuda else "(no CUDA: not fused)"
        fused = " fused" if cuda else ""
        return True, f"torch's AdamW{fused} {where} (deepspeed.optimizer: {TORCH_ADAMW}; no build, exact resume)"
    return False, (f"DeepSpeed's {'CPU Adam (optimizer offload)' if offload else 'FusedAdam'} "
                   f"(deepspeed.optimizer: {cfg.deepspeed.optimizer}; built in the preflight)")


def optimizer_preflight(cfg: Config, ds_config: dict, cuda: bool) -> None:
    """Before any weight is read: build DeepSpeed's Adam when the YAML names it, stopping every
    rank with the cause and the fix if any rank cannot (e2v.runtime.adam). A collective when it
    builds; nothing to do for torch's AdamW."""
    if cfg.deepspeed.optimizer not in (TORCH_ADAMW, ADAMW_8BIT):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # the launcher's; the node's first rank builds
        preflight_deepspeed_adam(optimizer_offloaded(ds_config), cuda, local_rank, distributed.gather_all)


def resolve_deepspeed_config(cfg: Config, world_size: int, cuda: bool) -> dict:
    """Fill the "auto" fields of the chosen ds_configs/*.json from the YAML. `world_size`: the
    data-parallel ranks (under context parallelism, the processes / its degree).

    The LR schedule is not DeepSpeed's (its WarmupLR forbids 0 warmup steps and starts at lr 0);
    train_e2v.py passes a torch LambdaLR, which DeepSpeed checkpoints with the engine.
    Which Adam: deepspeed.optimizer. torch's AdamW is fused wherever CUDA is (a GPU partition, or
    the CPU partition of optimizer offload: torch's fused CPU kernel); without CUDA it keeps torch's
    default implementation (the CPU-only runs, the golden losses)."""
    ds = json.loads(resolve_repo_path(cfg.deepspeed.config).read_text())
    t = cfg.train
    torch_adam, _ = adam_choice(cfg, ds, cuda)
    offload = optimizer_offloaded(ds)
    auto = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "lr": t.lr,
        "betas": list(t.betas),
        "eps": t.eps,
        "weight_decay": t.weight_decay,
        "torch_adam": torch_adam,
        "pin_memory": cuda,  # offload_*.pin_memory: page-locked buffers exist only with CUDA
    }

    def fill(node, key=None):
        if isinstance(node, dict):
            return {k: fill(v, k) for k, v in node.items()}
        if node == "auto":
            if key == "enabled":  # bf16.enabled
                return t.mixed_precision == "bf16"
            if key not in auto:
                raise ConfigError(f"{cfg.deepspeed.config}: no YAML value fills the \"auto\" field '{key}'")
            return auto[key]
        return node

    ds = fill(ds)
    if torch_adam and cuda and "optimizer" in ds:
        ds["optimizer"].setdefault("params", {})["fused"] = True  # one kernel over the flat partition
    if torch_adam and offload:
        # DeepSpeed's switch for a torch optimizer under offload (a client-built one is refused without it)
        ds["zero_force_ds_cpu_optimizer"] = False
    if cfg.deepspeed.optimizer == ADAMW_8BIT:
        # e2v.train.engine builds it (runtime.adam.adamw_8bit) and hands it to deepspeed.initialize:
        # DeepSpeed's optimizer section names only its own types, and ZeRO wraps a client optimizer
        # only when told it may (it steps the flat fp32 partition like any torch optimizer).
        ds.pop("optimizer", None)
        ds["zero_allow_untested_optimizer"] = True
        ds["zero_force_ds_cpu_optimizer"] = False
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    return context_parallel.zero_settings(cfg, ds)
