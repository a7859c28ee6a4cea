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
expert under the plain names (e2v/train/export.py). Legend: B batch.
"""

from __future__ import annotations

import torch

from e2v.config.experts import EXPERTS, expert_for

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
