"""Wan2.2's two experts as a config sees them, before anything loads: which base has two (its
boundary_ratio), which timesteps each denoises (`expert_for`, the one home of diffusers' switch
rule), which a run trains (`model.expert`), and the checks of those keys. The module that holds
two experts, and the names of their parameters: e2v/models/experts.py.

Legend: B batch.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from e2v.config.schema import Config, ConfigError

if TYPE_CHECKING:  # the config loads without torch (a config error answers before torch's import)
    import torch

EXPERTS = ("high_noise", "low_noise")  # diffusers' `transformer`, `transformer_2`


SUBFOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}  # in a diffusers pipeline folder


NUM_TRAIN_TIMESTEPS = 1000  # timestep = 1000 * sigma (the Wan schedulers' num_train_timesteps)


TINY_PRESET = "tiny_wan22_a14b"  # two tiny experts built in code (e2v/models/tiny.py)


# boundary_ratio of the released two-expert pipelines, for a hub id that is not downloaded: diffusers'
# conversion script (scripts/convert_wan_to_diffusers.py) writes 0.9 for Wan2.2-I2V-A14B, Wan2.2's own
# config (wan/configs/wan_i2v_A14B.py) has `boundary = 0.900`.
# Wan2.2-T2V-A14B: 0.875 in its diffusers model_index.json and in wan_t2v_A14B.py (`boundary = 0.875`).
KNOWN_BOUNDARY_RATIOS = {"Wan-AI/Wan2.2-I2V-A14B-Diffusers": 0.9, "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 0.875}


TINY_BOUNDARY_RATIO = 0.9  # the real I2V-A14B's


def boundary_ratio(cfg: Config) -> float | None:
    """The base's boundary_ratio, None for a one-transformer base (Wan2.1, TI2V-5B): the tiny
    two-expert preset's, a local pipeline folder's model_index.json (a `transformer_2` and a
    `boundary_ratio`), or a released hub id's (KNOWN_BOUNDARY_RATIOS). Nothing is downloaded."""
    return _boundary_ratio(cfg.model.preset, cfg.model.pretrained)


@functools.lru_cache(maxsize=None)
def _boundary_ratio(preset: str | None, pretrained: str | None) -> float | None:
    if preset is not None:
        return TINY_BOUNDARY_RATIO if preset == TINY_PRESET else None
    from e2v.config.bases import resolve_pretrained

    index = Path(resolve_pretrained(pretrained)) / "model_index.json"
    if not index.is_file():
        return KNOWN_BOUNDARY_RATIOS.get(pretrained)
    meta = json.loads(index.read_text())
    second = meta.get("transformer_2")  # [library, class], or [null, null] when the pipeline has none
    has_second = isinstance(second, list) and bool(second) and second[0] is not None
    return meta.get("boundary_ratio") if has_second else None


def trained_experts(cfg: Config) -> tuple[str, ...]:
    """The experts a run loads and trains, in EXPERTS order; () for a one-transformer base."""
    if cfg.model.expert is None:
        return ()
    return EXPERTS if cfg.model.expert == "both" else (cfg.model.expert,)


def expert_for(timestep_B: torch.Tensor, boundary: float) -> str:
    """The expert that denoises these timesteps, by diffusers' rule (WanImageToVideoPipeline:
    `t >= boundary_ratio * num_train_timesteps` -> `transformer`, else `transformer_2`). The
    timesteps of one call must all belong to one expert. A float32 numpy array compares the same
    way (a Python float against fp32 values, in fp32)."""
    high = timestep_B >= boundary * NUM_TRAIN_TIMESTEPS
    if bool(high.all()):
        return "high_noise"
    if not bool(high.any()):
        return "low_noise"
    raise ValueError(f"timesteps {timestep_B.tolist()} straddle the experts' boundary "
                     f"{boundary * NUM_TRAIN_TIMESTEPS:g}: one call runs one expert")


def _is_high(sigma: torch.Tensor, boundary: float) -> bool:
    return expert_for(NUM_TRAIN_TIMESTEPS * sigma.view(1), boundary) == "high_noise"  # the step's timestep


@functools.lru_cache(maxsize=None)
def sigma_range(expert: str, boundary: float) -> tuple[float, float]:
    """(lo, hi), both inclusive: the fp32 sigmas whose timestep (1000 * sigma, as the step computes
    it) `expert_for` gives to `expert`. The edge is found on the fp32 grid, so a sigma drawn in
    the range can never land on the other expert's side of the rule."""
    import torch

    edge = torch.tensor(boundary, dtype=torch.float32)
    down, up = torch.tensor(0.0), torch.tensor(2.0)
    while _is_high(edge, boundary):
        edge = torch.nextafter(edge, down)
    while not _is_high(edge, boundary):
        edge = torch.nextafter(edge, up)
    if expert == "high_noise":
        return edge.item(), 1.0
    return 0.0, torch.nextafter(edge, down).item()


def trains_sigma(cfg: Config, sigma: float) -> bool:
    """Whether the run trains the expert of this (validation) sigma. A run that trains one expert
    scores only its own sigmas: the others would measure the untrained base."""
    import numpy as np  # fp32 as the step's tensors, without torch: the config's checks call this at load

    experts = trained_experts(cfg)
    if len(experts) != 1:
        return True
    return expert_for(NUM_TRAIN_TIMESTEPS * np.full((1,), sigma, dtype=np.float32), boundary_ratio(cfg)) == experts[0]


def check_expert_config(cfg: Config) -> None:
    """model.expert against the base (two experts or one), and what a two-expert run needs."""
    boundary = boundary_ratio(cfg)
    base = cfg.model.pretrained or f"model.preset {cfg.model.preset}"
    if boundary is None:
        if cfg.model.expert is not None:
            why = "" if cfg.model.preset else " (its model_index.json has no transformer_2 and boundary_ratio)"
            raise ConfigError(f"model.expert: {cfg.model.expert}, but {base} has one transformer{why}, as Wan2.1 and "
                              f"Wan2.2-TI2V-5B do: remove model.expert, or use a two-expert base "
                              f"({', '.join(KNOWN_BOUNDARY_RATIOS)}, a local copy of it, or model.preset: {TINY_PRESET})")
        return
    if cfg.model.expert is None:
        raise ConfigError(f"model.expert is required: {base} has two experts (boundary_ratio {boundary:g}: timesteps "
                          f">= {boundary * NUM_TRAIN_TIMESTEPS:g} go to the high-noise one); set high_noise, low_noise "
                          "(one expert loaded and trained: fits one GPU) or both (weights, gradients and optimizer "
                          "state double)")
    if cfg.model.base == "t2v" and cfg.model.preset is None:  # the tiny preset's t2v: Wan2.2-T2V-A14B-shaped experts
        raise ConfigError(f"model.base: t2v widens a one-transformer T2V base, but {base}'s experts are taken as "
                          "released: remove model.base (Wan2.2-I2V-A14B's experts have the I2V input channels; "
                          "Wan2.2-T2V-A14B's take conditioning.target_layout: sequence)")
    if cfg.uses_clip and cfg.model.preset is None and cfg.model.image_encoder is None:
        raise ConfigError(f"e2v_type: {cfg.e2v_type} needs a CLIP image encoder, and {base} ships none (its experts "
                          "have no image attention; training adds it, zero-initialised): set model.image_encoder "
                          "(e.g. Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, whose image_encoder/ is CLIP ViT-H/14), "
                          "or e2v_type: vae")
    v = cfg.validation
    if v.every_n_steps and v.num_samples and not any(trains_sigma(cfg, s) for s in v.sigmas):
        raise ConfigError(f"validation.sigmas {v.sigmas}: none is the {cfg.model.expert} expert's "
                          f"({range_text(cfg.model.expert, boundary)}), the only sigmas a run that trains it scores; "
                          "add one")
    steps = cfg.flow.denoising_step_list
    if steps and len(trained_experts(cfg)) == 1:
        lo, hi = sigma_range(cfg.model.expert, boundary)
        if not any(lo <= t / NUM_TRAIN_TIMESTEPS <= hi for t in steps):
            raise ConfigError(f"flow.denoising_step_list {steps}: no timestep of the {cfg.model.expert} expert "
                              f"({range_text(cfg.model.expert, boundary)}); add one, or train the other expert")


def range_text(expert: str, boundary: float) -> str:
    """An expert's sigmas in words: `sigma >= 0.9` (high noise), `sigma < 0.9`."""
    return f"sigma {'>=' if expert == 'high_noise' else '<'} {boundary:g}"
