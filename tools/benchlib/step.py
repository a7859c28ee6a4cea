"""One benchmark configuration built and stepped the way train_e2v.py does it, from the same e2v
functions: parts from `e2v.models.load.load_parts`, then `e2v.train.engine.prepare_for_training` (freeze,
seeded LoRA, trainable modules, gradient checkpointing) and `e2v.train.engine.initialize_engine`
(deepspeed.initialize with the fp32-kept modules restored); per step, the batch moved once with
`e2v.runtime.device.to_device`, `e2v.data.store.batch_conditions`, then `e2v.train.step`'s draw, forward and loss,
the non-finite guard, backward, optimizer step, and the loop's logging (`e2v.train.runlog.Log`).
tests/test_bench_step.py holds this to train_e2v.py's own loop: same losses, same gradient norms.

What the bench adds is only the phase timer around each part. The bare PyTorch loop (`BareLoop`)
is the overhead baseline of section 2: the same forward and loss without DeepSpeed.
Legend: B batch, C channels, T latent frames, h/w latent size.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import time
from pathlib import Path

import torch

import e2v.conditioning.encode as conditioning
from e2v.conditioning.layout import batch_conditions
from e2v.runtime.distributed import any_rank, init_distributed
from e2v.train.guard import NonFiniteGuard
from e2v.train.ds_config import resolve_deepspeed_config
from e2v.runtime.device import to_device
from e2v.train.engine import (initialize_engine, lr_lambda, prepare_for_training, seed_process, step_rngs,
    training_dtype)
from e2v.models.load import load_parts
from e2v.models.tiny import tiny_transformer_config
from e2v.train.runlog import Log
from e2v.train.step import add_step_stats, draw_flow, forward_loss, step_scalars

from tools.benchlib.common import PRESETS, Phases, timed_functions


def init_single_rank() -> None:
    """A one-process gloo (or NCCL) group, so deepspeed.initialize runs inside this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()


def small_transformer(cfg, overrides: dict):
    """The tiny preset's I2V transformer config with `overrides` (a custom preset), seeded by
    model.tiny_seed like the tiny one."""
    from diffusers import WanTransformer3DModel

    tcfg = tiny_transformer_config("i2v")
    tcfg.update(overrides)
    tcfg["added_kv_proj_dim"] = tcfg["num_attention_heads"] * tcfg["attention_head_dim"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.tiny_seed)
        return WanTransformer3DModel(**tcfg)


def build_parts(preset: str, cfg, with_encoders: bool, device, ds_config: dict):
    """The parts train_e2v.py builds for rank 0, ready for `make_engine`; for a custom preset
    ("small") the tiny encoders with a bigger transformer."""
    seed_process(cfg, 0)  # as train_e2v.py seeds rank 0 before loading
    parts = load_parts(cfg, with_encoders=with_encoders, device=device, ds_config=ds_config)
    if PRESETS.get(preset, {}).get("transformer") is not None:
        parts.transformer = small_transformer(cfg, PRESETS[preset]["transformer"])
    prepare_for_training(parts, cfg)
    return parts


def make_engine(parts, cfg, cuda: bool, ds_config: dict | None = None, transformer=None):
    """`e2v.train.engine.initialize_engine` with the config train_e2v.py resolves for one rank (or an
    edited one), on `parts.transformer` or on a copy of it (`transformer`). -> (engine, scheduler)"""
    if transformer is not None:
        parts = dataclasses.replace(parts, transformer=transformer)
    return initialize_engine(parts, cfg, ds_config or resolve_deepspeed_config(cfg, 1, cuda))


class BareLoop:
    """The same work as the engine step in plain PyTorch: forward, loss, backward, gradient
    clipping, AdamW (torch's, with the YAML's hyper-parameters), LambdaLR, zero_grad. In bf16
    configs the weights stay fp32 under autocast (DeepSpeed's bf16 keeps fp32 master weights)."""

    def __init__(self, transformer, cfg, device):
        self.model = transformer.to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        t = cfg.train
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.grad_clip = t.grad_clip
        self.autocast = t.mixed_precision == "bf16"
        self.device = torch.device(device)

    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)


class StepRunner:
    """train_e2v.py's step (gradient accumulation 1, rank 0 of one), split into phases. `model` is
    the DeepSpeed engine or a BareLoop. With `log_dir` the step ends with the loop's bookkeeping
    (non-finite guard, step statistics, TensorBoard + scalars.jsonl, progress bar, stop check);
    without it, the bare engine step."""

    def __init__(self, cfg, parts, device, cuda: bool, log_dir: Path | None):
        from tqdm import tqdm

        self.cfg, self.parts, self.device, self.cuda = cfg, parts, torch.device(device), cuda
        self.dtype = training_dtype(cfg)
        self.rng, self.gen = step_rngs(cfg, 0)  # element choices and dropouts; sigmas, noise, posteriors
        self.log = self.bar = self.guard = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log = Log(log_dir, 0)
            # the loop's progress bar, writing where nobody reads (a terminal costs more: not ours)
            self.bar = tqdm(total=10**9, file=io.StringIO(), desc="train", mininterval=30)
            self.guard = NonFiniteGuard(cfg.train.skip_nonfinite, 0)
        self.global_step = 0

    def conditions(self, batches, phases: Phases):
        """The loop's data part: the next batch, moved to the device once (both in `data_wait`, as
        the loop's data time), then the step's tensors, read from the cache or encoded (VAE, text
        and CLIP encoders timed apart)."""
        with phases("data_wait"):
            batch = to_device(next(batches), self.device)
        if self.cfg.cache.enabled:
            with phases("cache_assembly"), torch.no_grad():
                return batch_conditions(batch, self.parts, self.cfg, rng=self.rng, generator=self.gen)
        fns = {"encode_video": "vae_encode", "encode_text": "text_encode", "encode_clip_images": "clip_encode"}
        with timed_functions(conditioning, fns, phases), phases("encode_total"), torch.no_grad():
            c = batch_conditions(batch, self.parts, self.cfg, rng=self.rng, generator=self.gen)
        inner = sum(phases.t.get(p, 0.0) for p in fns.values())
        phases.t["conditioning_other"] = phases.t.pop("encode_total") - inner
        return c

    def train_step(self, model, batches, phases: Phases, scheduler=None):
        """One whole step from the loader: -> (the step's conditions, its loss)."""
        c = self.conditions(batches, phases)
        return c, self.step(model, c, phases, scheduler)

    def step(self, model, c, phases: Phases, scheduler=None) -> float:
        """Everything after the conditions exist: flow draw, model input, forward, loss, backward,
        optimizer, and (with a log) the loop's per-step bookkeeping."""
        t_step = time.perf_counter()
        with phases("noise_and_input"):
            sigma, noise, noisy_model_input = draw_flow(c, self.cfg.flow, self.gen)
        with phases("forward_and_loss"):
            loss, per_sample, model_pred, target = forward_loss(model, c, sigma, noise, noisy_model_input,
                                                                self.cfg, self.dtype)
        if self.guard is not None:
            with phases("loss_check"):  # the loop's non-finite check: all ranks agree before backward
                loss_value = loss.item()
                self.guard.bad(loss_value, "loss", self.global_step + 1, [])
        with phases("backward"):
            model.backward(loss)
        with phases("optimizer"):
            model.step()
        if self.log is None:
            return loss.item()
        with phases("logging"):  # what the loop does after engine.step (checkpointing aside), its functions
            with phases("logging/loss_and_grad_norm"):
                stats = {}
                add_step_stats(stats, sigma, per_sample, target, model_pred, self.cfg.flow)
                self.global_step += 1
                step_time = time.perf_counter() - t_step
                grad_norm = self.guard.grad_norm(model.get_global_grad_norm(), self.global_step, [])
            with phases("logging/tensorboard"):  # incl. the loop's sum of losses and skips over ranks
                if self.global_step % self.cfg.train.log_every == 0:
                    self.log.scalars(self.global_step, step_scalars(
                        self.cfg, 1, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm, step_time=step_time,
                        data_time=0.0, step_losses=[loss_value], stats=stats, skipped_ids=set(), excluded=0,
                        nonfinite=0))
            with phases("logging/progress_bar"):
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}", refresh=False)
            with phases("logging/stop_check"):
                any_rank(False)  # the per-step stop-signal check (a collective every step)
        return loss_value

    def close(self):
        if self.log is not None:
            self.log.close()
            self.bar.close()
