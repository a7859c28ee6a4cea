"""Wan2.2's two experts (I2V-A14B): two transformers of one shape, `transformer` for the high-noise
timesteps (t >= boundary_ratio x 1000) and `transformer_2` for the rest, switched at the boundary
as diffusers' WanImageToVideoPipeline switches them. `expert_for` is the one home of that rule:
the training draw, the module that holds the experts, validation and the sampler all ask it.

`model.expert` says what a run trains:
- `high_noise` / `low_noise`: only that expert is loaded and trained, and sigmas are drawn from its
  timesteps alone (the usual way to fit 14B on one GPU);
- `both`: one module holds both experts (`TwoExperts`, the module DeepSpeed wraps); each
  micro-batch first picks an expert (the same on every rank), with the probability its timesteps
  have under `flow:`, then draws its sigmas from that expert's range, so over many micro-batches the sigmas follow the
  unrestricted distribution. The expert a micro-batch does not use gets a zero gradient (under
  AdamW it still moves by its momentum, as any parameter with a zero gradient does). Weights,
  gradients and optimizer state are twice one expert's.
Validation and sampling run the model inference runs: a run that trains one expert takes the
other expert's base weights for the other timesteps (models.with_all_experts).

Names: the experts are the children `high_noise` / `low_noise` of `TwoExperts`, so its parameters
read `low_noise.blocks.0.attn1.to_q.lora_A.default.weight`; the exports go to one folder per
expert under the plain names (e2v/export.py). Legend: B batch.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from e2v.schema import Config, ConfigError

EXPERTS = ("high_noise", "low_noise")  # diffusers' `transformer`, `transformer_2`
SUBFOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}  # in a diffusers pipeline folder
NUM_TRAIN_TIMESTEPS = 1000  # timestep = 1000 * sigma (the Wan schedulers' num_train_timesteps)
TINY_PRESET = "tiny_wan22_a14b"  # two tiny experts built in code (e2v/tiny.py)
# boundary_ratio of the released two-expert pipelines, for a hub id that is not downloaded: diffusers'
# conversion script (scripts/convert_wan_to_diffusers.py) writes 0.9 for Wan2.2-I2V-A14B, Wan2.2's own
# config (wan/configs/wan_i2v_A14B.py) has `boundary = 0.900`.
KNOWN_BOUNDARY_RATIOS = {"Wan-AI/Wan2.2-I2V-A14B-Diffusers": 0.9}
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
    from e2v.parts import resolve_pretrained

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
    timesteps of one call must all belong to one expert."""
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
    edge = torch.tensor(boundary, dtype=torch.float32)
    down, up = torch.tensor(0.0), torch.tensor(2.0)
    while _is_high(edge, boundary):
        edge = torch.nextafter(edge, down)
    while not _is_high(edge, boundary):
        edge = torch.nextafter(edge, up)
    if expert == "high_noise":
        return edge.item(), 1.0
    return 0.0, torch.nextafter(edge, down).item()


def expert_sigma_range(cfg: Config, step: int, micro_batch: int) -> tuple[float, float] | None:
    """The sigma range of one micro-batch's draw (flow.sample_sigmas): None for a one-transformer
    base; the trained expert's range; with `both`, one expert's, picked with the probability its
    range has under `flow:`, so that the mixture is the unrestricted distribution. The pick is the
    same on every rank (a ZeRO-3 forward gathers one expert's parameters on all ranks together,
    and one expert's gradients are reduced together: ranks on different experts would hang), so
    it comes from (seed, step, micro-batch) alone, not from a rank's stream; a resumed run picks
    as the uninterrupted one did."""
    experts, boundary = trained_experts(cfg), boundary_ratio(cfg)
    if not experts:
        return None
    if len(experts) == 1:
        return sigma_range(experts[0], boundary)
    from e2v.flow import sigma_mass

    fl = cfg.flow
    mass = {e: sigma_mass(*sigma_range(e, boundary), mode=fl.sigma_sampling, shift=fl.shift, logit_mean=fl.logit_mean,
                          logit_std=fl.logit_std, timestep_list=fl.denoising_step_list) for e in EXPERTS}
    p_high = mass["high_noise"] / (mass["high_noise"] + mass["low_noise"])
    pick = np.random.default_rng([cfg.seed, step, micro_batch]).random()
    return sigma_range("high_noise" if pick < p_high else "low_noise", boundary)


def trains_sigma(cfg: Config, sigma: float) -> bool:
    """Whether the run trains the expert of this (validation) sigma. A run that trains one expert
    scores only its own sigmas: the others would measure the untrained base."""
    experts = trained_experts(cfg)
    if len(experts) != 1:
        return True
    return expert_for(NUM_TRAIN_TIMESTEPS * torch.full((1,), sigma), boundary_ratio(cfg)) == experts[0]


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
    if cfg.model.base == "t2v":
        raise ConfigError(f"model.base: t2v, but {base}'s experts already have the I2V input channels: set model.base: i2v")
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


# --- the module ------------------------------------------------------------------------------------


class TwoExperts(torch.nn.Module):
    """The experts a run holds (one or both), as one module: `forward` runs the expert the
    timestep belongs to (`expert_for`), so the DeepSpeed engine, validation and the sampler call
    it as they call one transformer. A timestep of an expert it does not hold is an error."""

    def __init__(self, experts: dict[str, torch.nn.Module], boundary: float):
        super().__init__()
        assert experts and set(experts) <= set(EXPERTS), sorted(experts)
        self.boundary_ratio = boundary
        for name in EXPERTS:
            if name in experts:
                self.add_module(name, experts[name])

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        return {name: self._modules[name] for name in EXPERTS if name in self._modules}

    @property
    def config(self):
        """The experts' transformer config (both have the same shape)."""
        return next(iter(self.experts.values())).config

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs):
        name = expert_for(timestep, self.boundary_ratio)
        if name not in self._modules:
            raise RuntimeError(f"timesteps {timestep.tolist()} belong to the {name} expert, which this model does not "
                               f"hold (it holds {', '.join(self.experts)}); models.with_all_experts adds the base")
        return self._modules[name](hidden_states, timestep=timestep, **kwargs)

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts.values():
            expert.enable_gradient_checkpointing()


def each_expert(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(expert name, transformer) for each expert a model holds; ("", model) for one transformer."""
    return list(model.experts.items()) if isinstance(model, TwoExperts) else [("", model)]


def split_names(names, expert: str) -> list[str]:
    """The names of one expert's parameters (`low_noise.blocks.0...`) without its prefix; all of
    them for expert "" (a one-transformer model)."""
    if not expert:
        return list(names)
    return [n.removeprefix(f"{expert}.") for n in names if n.startswith(f"{expert}.")]


def plain_name(name: str) -> str:
    """A parameter name without its expert prefix: `low_noise.blocks.0.norm2.weight` -> `blocks.0.norm2.weight`."""
    head, _, rest = name.partition(".")
    return rest if head in EXPERTS else name


def switch(experts: dict[str, object], boundary: float):
    """Inference: a callable that runs `experts[expert_for(timestep)]`, the pipeline's switch.
    The experts may be DeepSpeed engines (the trained one) or plain transformers (a base)."""
    def call(hidden_states, timestep, **kwargs):
        return experts[expert_for(timestep, boundary)](hidden_states, timestep=timestep, **kwargs)
    return call


def map_experts(model: torch.nn.Module, fn) -> torch.nn.Module:
    """fn applied to each expert of a TwoExperts (a new TwoExperts of the results), or to the model."""
    if isinstance(model, TwoExperts):
        return TwoExperts({name: fn(expert) for name, expert in model.experts.items()}, model.boundary_ratio)
    return fn(model)


def split_state(state: dict, expert: str) -> dict:
    """One expert's entries of a name -> tensor dict, without its prefix (all of them for "")."""
    return {name: state[f"{expert}.{name}" if expert else name] for name in split_names(state, expert)}
