"""The training loop's body, the one copy: train_e2v.py trains with it and the step benchmark
(bench/benchlib/step.py) times it. One optimizer step is `gradient_accumulation_steps`
micro-batches (`train_step`), each fetched and moved to the device once, conditioned (encoded or
from the cache), then `micro_step`: the flow draw (Wan2.2's experts: the expert's sigma range; task: causal: per block),
forward and loss, the non-finite check, backward and optimizer step. `StepLog.record` is what
the loop does after a step: the gradient norm, the scalars, the progress bar.

Timing hook: every part runs inside `phase(name)`, a context manager factory; training passes
`no_phase` (nothing), the benchmark its phase timer. The names are PHASES; "conditioning" is
the benchmark's to split (cache assembly, or the three encoders), and "logging/..." are parts of
"logging". Legend: B batch, C channels, T latent frames, h/w latent size.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ContextManager

import torch

from e2v.conditioning.encode import Conditions
from e2v.conditioning.layout import batch_conditions
from e2v.config.experts import boundary_ratio
from e2v.runtime import distributed
from e2v.runtime.device import to_device
from e2v.train.flops import FlopCounter, MicroBatch, perf_scalars
from e2v.train.guard import NonFiniteGuard
from e2v.train.runlog import Log
from e2v.train.step import add_step_stats, draw_flow, expert_sigma_range, forward_loss, frame_rule, step_scalars

Phase = Callable[[str], ContextManager]
PHASES = ("data_wait", "conditioning", "noise_and_input", "forward_and_loss", "loss_check", "backward", "optimizer",
          "logging", "logging/step_stats", "logging/grad_norm", "logging/tensorboard", "logging/progress_bar",
          "logging/stop_check")


def no_phase(name: str) -> ContextManager:
    """The training loop's timing hook: times nothing."""
    return contextlib.nullcontext()


@dataclass
class MicroStep:
    """One micro-batch after its optimizer call: what the visualizer draws. `loss` None: the
    non-finite guard skipped it (on every rank), before backward."""
    loss: float | None
    sigma_B: torch.Tensor
    noisy_model_input: torch.Tensor
    model_pred: torch.Tensor | None = None


@dataclass
class StepRecord:
    """What one optimizer step leaves for logging: the kept micro-batches' losses, their pending
    statistics (e2v.train.step.add_step_stats), the sample ids trained, the ids the loader skipped,
    the time spent waiting for data, the kept micro-batches' shapes (what the FLOP count reads,
    e2v/train/flops.py), and, when asked for (the benchmark replays them), the conditions of the
    last micro-batch."""
    losses: list[float] = field(default_factory=list)
    stats: dict[str, list] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)
    data_time: float = 0.0
    samples: int = 0
    micro_batches: list[MicroBatch] = field(default_factory=list)
    conditions: Conditions | None = None

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)


def micro_step(engine, c: Conditions, cfg, record: StepRecord, *, step: int, dtype, gen: torch.Generator,
               guard: NonFiniteGuard | None = None, sample_ids: list | tuple = (), phase: Phase = no_phase) -> MicroStep:
    """Everything after a micro-batch's conditions exist: the flow draw (the expert of Wan2.2's
    micro-batch `len(record.losses)`), forward and loss, the non-finite check (skipped without a
    `guard`), backward, engine step; the loss and its statistics go into `record`. `engine` is a
    DeepSpeed engine or anything with its call, backward and step (the benchmark's bare loop)."""
    expert_range = expert_sigma_range(cfg, step, len(record.losses))  # Wan2.2's experts: one per micro-batch
    with phase("noise_and_input"):
        sigma, noise, noisy_model_input = draw_flow(c, cfg.flow, gen, expert_range, causal=frame_rule(cfg))
    with phase("forward_and_loss"):
        loss, per_sample, model_pred, target = forward_loss(engine, c, sigma, noise, noisy_model_input, cfg, dtype)
    with phase("loss_check"):
        loss_value = loss.item()  # the micro-batch's one host sync (the non-finite guard needs it)
        if guard is not None and guard.bad(loss_value, "loss", step, list(sample_ids)):
            return MicroStep(None, sigma, noisy_model_input)
    with phase("backward"):
        engine.backward(loss)
    with phase("optimizer"):
        engine.step()
    record.losses.append(loss_value)
    record.micro_batches.append(MicroBatch.of(c))
    with phase("logging"), phase("logging/step_stats"):
        add_step_stats(record.stats, sigma, per_sample, target, model_pred, cfg.flow, boundary_ratio(cfg))
    return MicroStep(loss_value, sigma, noisy_model_input, model_pred)


def train_step(engine, data_iter: Iterator, parts, cfg, *, step: int, device, dtype, rng, gen: torch.Generator,
               guard: NonFiniteGuard | None, vis=None, phase: Phase = no_phase, keep_conditions: bool = False
               ) -> StepRecord:
    """One optimizer step: `gradient_accumulation_steps` micro-batches, each moved to the device
    once (e2v/runtime/device.py), conditioned, then `micro_step`. A micro-batch with a non-finite
    loss is skipped on every rank before backward and another one is drawn. `keep_conditions`:
    the record keeps the last micro-batch's conditions (training does not: they would stay
    allocated through the next step's forward)."""
    record = StepRecord()
    while len(record.losses) < cfg.train.gradient_accumulation_steps:
        t0 = time.perf_counter()
        with phase("data_wait"):
            batch = to_device(distributed.next_agreed(data_iter), device)
        record.data_time += time.perf_counter() - t0
        record.skipped.update(sid for sid, _ in batch["skipped"])
        record.samples += len(batch["id"])
        record.ids += batch["id"]
        with phase("conditioning"), torch.no_grad():
            c = batch_conditions(batch, parts, cfg, rng=rng, generator=gen)
        if keep_conditions:
            record.conditions = c
        m = micro_step(engine, c, cfg, record, step=step, dtype=dtype, gen=gen, guard=guard, sample_ids=batch["id"],
                       phase=phase)
        if m.loss is not None and vis is not None:
            vis.maybe_dump(step, batch, c, m.noisy_model_input, m.model_pred, m.sigma_B)
    return record


@dataclass
class StepLog:
    """The loop's bookkeeping after each optimizer step, on every rank (the scalars are a
    collective; rank 0 writes them): the checked gradient norm, the scalars every `log_every`
    steps, the progress bar. `excluded`: samples left out at the start; `skipped_ids` grows with
    the samples the loader skipped mid-run. `flops` (e2v/train/flops.py) counts each step's FLOPs
    from its micro-batches' shapes: tokens per second, TFLOPS per GPU and, against `peak_tflops`
    (the GPU's dense bf16 peak; None: unknown), the MFU, in the scalars and the progress bar."""
    cfg: object
    log: Log
    bar: object
    guard: NonFiniteGuard
    world: int
    data_parallel: int
    excluded: int = 0
    skipped_ids: set[str] = field(default_factory=set)
    flops: FlopCounter | None = None
    peak_tflops: float | None = None

    def record(self, step: int, rec: StepRecord, engine, scheduler, step_time: float, phase: Phase = no_phase) -> None:
        self.skipped_ids |= rec.skipped
        flops = self.flops.step(rec.micro_batches) if self.flops is not None else None
        with phase("logging"):
            with phase("logging/grad_norm"):
                grad_norm = self.guard.grad_norm(engine.get_global_grad_norm(), step, rec.ids)
                lr = scheduler.get_last_lr()[0]
            with phase("logging/tensorboard"):  # incl. the sum of losses and skips over ranks
                if step % self.cfg.train.log_every == 0:
                    self.log.scalars(step, step_scalars(
                        self.cfg, self.world, lr=lr, grad_norm=grad_norm, step_time=step_time,
                        data_time=rec.data_time, step_losses=rec.losses, stats=rec.stats,
                        skipped_ids=self.skipped_ids, excluded=self.excluded, nonfinite=self.guard.skipped,
                        data_parallel=self.data_parallel, flops=flops, peak_tflops=self.peak_tflops))
            with phase("logging/progress_bar"):
                self.bar.update(1)
                perf = perf_scalars(flops, step_time, self.data_parallel, self.peak_tflops)
                speed = {"tok_s": f"{perf['perf/tokens_per_s']:.3g}"} if perf else {}
                if "perf/mfu" in perf:
                    speed["mfu"] = f"{100 * perf['perf/mfu']:.1f}%"
                self.bar.set_postfix(loss=f"{rec.mean_loss:.4f}", lr=f"{lr:.1e}", **speed, refresh=False)


def stop_requested(stop: dict, phase: Phase = no_phase) -> bool:
    """Did a stop signal reach any rank (a collective every step: a signal may reach only some)?"""
    with phase("logging"), phase("logging/stop_check"):
        return distributed.any_rank(stop["signal"] is not None)


def stop_handlers() -> tuple[dict, Callable[[], None]]:
    """SIGTERM/SIGINT ask the loop to save and exit after the current step (install_stop_handlers).
    Returns the flag dict the loop reads and a function that puts the previous handlers back, so a
    run inside another program (a test calling main) leaves its handlers as they were."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    return distributed.install_stop_handlers(), restore
