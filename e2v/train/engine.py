"""From loaded parts to a DeepSpeed engine, the same way for every caller (train_e2v.py,
bench/bench.py, the tests): what trains, gradient checkpointing, the seeded LoRA init, the
optimizer DeepSpeed can build here, and the fp32 modules kept through `deepspeed.initialize`.

Seeds: `seed * 1000 + rank` drives each rank's discrete choices (`random.Random`) and its draws
(a CPU `torch.Generator`: sigmas, noise, posterior samples); `seed` alone initialises the LoRA,
so every rank starts from the same adapter whatever loading drew. Under context parallelism the
rank here is the data-parallel rank (`context_parallel.Layout.dp_rank`): the ranks that share a
sample share its streams.
"""

from __future__ import annotations

import math
import random

import torch

from e2v.models import context_parallel, speed
from e2v.models.causal import enable_causal
from e2v.models.causvid_ckpt import load_causvid_checkpoint
from e2v.models.expand import is_expanded
from e2v.models.fp8 import quantize_base, swap_blocks
from e2v.models.precision import fp32_kept_params, restore_fp32_params
from e2v.models.trainable import full_patterns, setup_training
from e2v.runtime.adam import ADAMW_8BIT, adamw_8bit


def rank_seed(seed: int, rank: int) -> int:
    """The per-rank seed of the step's random streams."""
    return seed * 1000 + rank


def seed_process(cfg, rank: int) -> None:
    """torch's global RNG of this rank (anything the libraries draw from it while loading)."""
    torch.manual_seed(cfg.seed + rank)


def step_rngs(cfg, rank: int) -> tuple[random.Random, torch.Generator]:
    """(element choices and dropouts, sigmas / noise / posterior samples) of one rank."""
    s = rank_seed(cfg.seed, rank)
    return random.Random(s), torch.Generator().manual_seed(s)


def training_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float32


def lr_lambda(cfg):
    """The LR multiplier per step: linear warmup, then constant, linear or cosine decay to 0."""
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_scheduler == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        if t.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def prepare_for_training(parts, cfg) -> list[str]:
    """Load a CausVid generator checkpoint into the base (`model.generator_ckpt`), make the
    transformer block-causal (`task: causal`), freeze the base, attach the LoRA (seeded by `cfg.seed` alone, so every rank holds the same
    adapter), unfreeze `train.trainable` and an expanded base's new modules, and turn on gradient
    checkpointing. The encoders are already frozen (models.place_encoders). With model.base_dtype
    fp8 the frozen block Linears are stored in fp8 first, layer by layer on the host, before the
    LoRA wraps them and before DeepSpeed moves the model to the GPU (e2v/models/fp8.py). Returns
    the names trained in full beside the LoRA."""
    if cfg.model.generator_ckpt:  # the base's weights: before fp8 storage and before the LoRA wraps them
        load_causvid_checkpoint(parts.transformer, cfg.model.generator_ckpt, cfg.model.generator_ckpt_dict)
    if cfg.task == "causal":  # processors and a rope hook only: no parameter for DeepSpeed to see
        c = cfg.causal
        enable_causal(parts.transformer, c.frames_per_block, c.independent_first_frame, c.attention)
    if cfg.model.base_dtype == "fp8":
        quantize_base(parts.transformer, full_patterns(cfg, is_expanded(cfg)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        full_names = setup_training(parts.transformer, cfg, expanded=is_expanded(cfg))
    if cfg.train.gradient_checkpointing:
        parts.transformer.enable_gradient_checkpointing()
    return full_names


def initialize_engine(parts, cfg, ds_config: dict, layout: context_parallel.Layout | None = None):
    """deepspeed.initialize on the transformer with the YAML's LR schedule (a torch LambdaLR,
    checkpointed with the engine). DeepSpeed's bf16 mode casts every parameter, including the
    modules diffusers keeps in fp32: their exact fp32 values are put back afterwards. With a
    context-parallel `layout` the transformer is made context-parallel first and DeepSpeed gets
    its groups (gradients averaged over the data-parallel groups, ZeRO over every rank). The speed:
    keys (attention backend, compiled blocks, TF32) are applied here, for every caller."""
    import deepspeed

    mpu = context_parallel.enable(parts.transformer, cfg, layout) if layout is not None and layout.enabled else None
    speed.apply(parts.transformer, cfg, speed.bucket_shapes(cfg),  # after the processors context parallelism puts in
                ds_config.get("zero_optimization", {}).get("stage", 0))
    params = [p for p in parts.transformer.parameters() if p.requires_grad]
    kept_fp32 = fp32_kept_params(parts.transformer, parts.fp32_file_values)
    t = cfg.train
    optimizer = adamw_8bit(params, t.lr, t.betas, t.eps, t.weight_decay) if cfg.deepspeed.optimizer == ADAMW_8BIT else None
    engine, _, _, scheduler = deepspeed.initialize(
        model=parts.transformer, model_parameters=params, optimizer=optimizer, config=ds_config, mpu=mpu,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
    )
    restore_fp32_params(parts.transformer, kept_fp32)
    if cfg.model.fp8_blocks_on_host:  # after DeepSpeed placed the model: the blocks' device copies are freed
        swap_blocks(parts.transformer, cfg.model.fp8_blocks_on_host, engine.device)
    return engine, scheduler
