"""The DeepSpeed config a run uses: the chosen ds_configs/*.json with its "auto" fields filled from
the YAML (micro batch, accumulation, clipping, bf16, the optimizer's hyperparameters), the Adam
this machine can run, and the ZeRO settings context parallelism needs. Written to the run folder
as ds_config.json."""

from __future__ import annotations

import json

from e2v.config.schema import Config, ConfigError, resolve_repo_path
from e2v.models import context_parallel
from e2v.runtime.device import choose_adam


def optimizer_offloaded(ds_config: dict) -> bool:
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"


def adam_choice(cfg: Config, ds_config: dict, cuda: bool) -> tuple[bool, str]:
    """(torch's AdamW rather than DeepSpeed's, why) for this DeepSpeed config on this machine."""
    return choose_adam(cfg.deepspeed.torch_adam, cuda, optimizer_offloaded(ds_config))


def resolve_deepspeed_config(cfg: Config, world_size: int, cuda: bool) -> dict:
    """Fill the "auto" fields of the chosen ds_configs/*.json from the YAML. `world_size`: the
    data-parallel ranks (under context parallelism, the processes / its degree).

    The LR schedule is not DeepSpeed's (its WarmupLR forbids 0 warmup steps and starts at lr 0);
    train_e2v.py passes a torch LambdaLR, which DeepSpeed checkpoints with the engine.
    Which Adam: e2v.runtime.device.choose_adam (DeepSpeed's where it can be built, else torch's AdamW)."""
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
    if torch_adam and cuda and not offload and "optimizer" in ds:
        ds["optimizer"].setdefault("params", {})["fused"] = True  # torch's one-kernel AdamW on the GPU
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    return context_parallel.zero_settings(cfg, ds)
