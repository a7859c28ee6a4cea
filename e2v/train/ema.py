"""An exponential moving average of the trained weights (`train.ema_weight`, `train.ema_start_step`:
Self-Forcing's keys, docs/outputs.md, "The EMA weights"): after every optimizer step from
`ema_start_step` on, ema = w * ema + (1 - w) * weights, started from the weights of that step.

Self-Forcing trains with it and samples its demo from `generator_ema`; on a small model trained at a
high learning rate it smooths the step-to-step noise of the last weights (docs/causal.md, "The demo").
The average is of the weights the forward uses (bf16 under mixed precision), kept in fp32 on the
host of every rank (validation's forwards run on every rank; the parameters are whole under ZeRO-1/2,
so nothing is gathered: ZeRO-3, which partitions them, is refused by e2v/config/checks.py). A LoRA
run holds the LoRA's and the fully trained modules' averages (megabytes); a full fine-tune a second
fp32 copy of the transformer per rank (5.2 GB host memory for the 1.3B).

Checkpoints carry it as `ema.safetensors` (resume continues the same average); the end of the run
exports it beside `lora/` as `lora_ema/` (the same files, from these weights), and
tools/export_lora.py --ema does the same from a checkpoint.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

EMA_FILE = "ema.safetensors"


def read_ema(path: Path) -> dict[str, torch.Tensor] | None:
    """A checkpoint's EMA_FILE as fp32 tensors by parameter name; None when there is none."""
    from safetensors.torch import load_file

    return {n: t.float() for n, t in load_file(str(path)).items()} if Path(path).is_file() else None


class WeightEMA:
    """The average of the trained parameters of `module` (those with requires_grad), by name."""

    def __init__(self, module: torch.nn.Module, weight: float, start_step: int = 0):
        self.weight, self.start_step = weight, start_step
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.shadow: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, cfg, module: torch.nn.Module) -> WeightEMA | None:
        """The run's EMA, None when train.ema_weight is 0 (off)."""
        return cls(module, cfg.train.ema_weight, cfg.train.ema_start_step) if cfg.train.ema_weight > 0 else None

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step`: start the average at ema_start_step, then move it."""
        if step < self.start_step:
            return
        if not self.shadow:
            self.shadow = {n: p.detach().float().cpu().clone() for n, p in self.params.items()}
            return
        for n, p in self.params.items():
            self.shadow[n].mul_(self.weight).add_(p.detach().float().cpu(), alpha=1 - self.weight)

    @contextlib.contextmanager
    def applied(self):
        """The module runs with the averaged weights inside, its own weights back after (exactly:
        they are copied out first). Nothing changes before the average has started."""
        if not self.shadow:
            yield
            return
        saved = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}  # no second copy on the GPU
        try:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self.shadow[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    def payload(self) -> bytes | None:
        """The average as safetensors bytes (what a checkpoint's EMA_FILE holds); None before it has started."""
        from safetensors.torch import save

        if not self.shadow:
            return None
        return save({n: t.contiguous() for n, t in self.shadow.items()}, metadata={"ema_weight": str(self.weight)})

    def load(self, path: Path) -> bool:
        """Read a checkpoint's average; False when it has none (saved before ema_start_step, or by a
        run without an EMA: the average starts again at the next step that reaches ema_start_step).
        A file whose names differ from the trained parameters' is an error naming it."""
        shadow = read_ema(path)
        if shadow is None:
            return False
        if set(shadow) != set(self.params):
            missing, extra = sorted(set(self.params) - set(shadow)), sorted(set(shadow) - set(self.params))
            raise RuntimeError(f"{path} does not fit this run's trained parameters (missing {missing[:3]}, unexpected "
                               f"{extra[:3]}): resume with the config it was saved with (lora, train.trainable)")
        self.shadow = shadow
        return True
