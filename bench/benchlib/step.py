"""One benchmark configuration built and stepped the way train_e2v.py does it, from the same e2v
functions: parts from `e2v.models.load.load_parts`, then `e2v.train.engine.prepare_for_training` (freeze,
seeded LoRA, trainable modules, gradient checkpointing) and `e2v.train.engine.initialize_engine`
(deepspeed.initialize with the fp32-kept modules restored); per step, the training loop's own body
(`e2v.train.loop`: train_step, micro_step, StepLog), timed through its phase hook.
tests/launch/test_bench_step.py holds the setup to train_e2v.py's: same losses, same gradient norms.

What the bench adds is only the phase timer around each part. The bare PyTorch loop (`BareLoop`)
is the overhead baseline of section 2: the same forward and loss without DeepSpeed.
Legend: B batch, C channels, T latent frames, h/w latent size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from pathlib import Path

import torch

import e2v.conditioning.encode as conditioning
from bench.benchlib.common import PRESETS, Phases, timed_functions
from e2v.models.load import load_parts
from e2v.models.tiny import tiny_transformer_config
from e2v.runtime.distributed import init_distributed
from e2v.runtime.ports import free_port
from e2v.train import loop
from e2v.train.ds_config import resolve_deepspeed_config
from e2v.train.engine import initialize_engine, lr_lambda, prepare_for_training, seed_process, step_rngs, training_dtype
from e2v.train.flops import FlopCounter, device_peak_tflops
from e2v.train.guard import NonFiniteGuard
from e2v.train.runlog import Log


def init_single_rank() -> None:
    """A one-process gloo (or NCCL) group, so deepspeed.initialize runs inside this process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
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
    """train_e2v.py's step (rank 0 of one) from the package's loop (e2v/train/loop.py), its parts
    timed through the loop's phase hook. `model` is the DeepSpeed engine or a BareLoop. With
    `log_dir` the step ends with the loop's bookkeeping (non-finite guard, step statistics, the FLOP
    count, TensorBoard + scalars.jsonl, progress bar, stop check); without it, the bare engine step."""

    def __init__(self, cfg, parts, device, cuda: bool, log_dir: Path | None):
        from tqdm import tqdm

        self.cfg, self.parts, self.device, self.cuda = cfg, parts, torch.device(device), cuda
        self.dtype = training_dtype(cfg)
        self.rng, self.gen = step_rngs(cfg, 0)  # element choices and dropouts; sigmas, noise, posteriors
        self.steplog = self.guard = None
        self.stop = {"signal": None}  # the loop's stop flag: never set here, but checked (a collective) each step
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.guard = NonFiniteGuard(cfg.train.skip_nonfinite, 0)
            # the loop's progress bar, writing where nobody reads (a terminal costs more: not ours)
            bar = tqdm(total=10**9, file=io.StringIO(), desc="train", mininterval=30)
            self.steplog = loop.StepLog(cfg, Log(log_dir, 0), bar, self.guard, world=1, data_parallel=1,
                                        flops=FlopCounter(parts.transformer, cfg),
                                        peak_tflops=device_peak_tflops(cfg.train.peak_tflops)[0])
        self.global_step = 0

    def phase_hook(self, phases: Phases):
        """The loop's phase hook for `phases`: every loop phase under its own name, except
        "conditioning", split into the cache's assembly, or the three encoders (timed apart) and
        the rest (`conditioning_other`)."""
        fns = {"encode_video": "vae_encode", "encode_text": "text_encode", "encode_clip_images": "clip_encode"}

        @contextlib.contextmanager
        def encoding():
            with timed_functions(conditioning, fns, phases), phases("encode_total"):
                yield
            inner = sum(phases.t.get(p, 0.0) for p in fns.values())
            phases.t["conditioning_other"] = phases.t.get("conditioning_other", 0.0) + phases.t.pop("encode_total") - inner

        def hook(name: str):
            if name != "conditioning":
                return phases(name)
            return phases("cache_assembly") if self.cfg.cache.enabled else encoding()

        return hook

    def train_step(self, model, batches, phases: Phases, scheduler=None):
        """One whole step from the loader (e2v.train.loop.train_step): -> (the step's conditions, its loss)."""
        t_step = time.perf_counter()
        hook = self.phase_hook(phases)
        rec = loop.train_step(model, batches, self.parts, self.cfg, step=self.global_step + 1, device=self.device,
                              dtype=self.dtype, rng=self.rng, gen=self.gen, guard=self.guard, phase=hook,
                              keep_conditions=True)
        self._bookkeeping(model, rec, scheduler, t_step, hook)
        return rec.conditions, rec.losses[-1]

    def step(self, model, c, phases: Phases, scheduler=None) -> float:
        """Everything after the conditions exist (e2v.train.loop.micro_step): flow draw, model
        input, forward, loss, backward, optimizer, and (with a log) the loop's per-step bookkeeping."""
        t_step = time.perf_counter()
        hook = self.phase_hook(phases)
        rec = loop.StepRecord()
        loop.micro_step(model, c, self.cfg, rec, step=self.global_step + 1, dtype=self.dtype, gen=self.gen,
                        guard=self.guard, phase=hook)
        self._bookkeeping(model, rec, scheduler, t_step, hook)
        return rec.losses[-1]

    def _bookkeeping(self, model, rec, scheduler, t_step: float, hook) -> None:
        """What the loop does after a step (checkpointing and validation aside), its functions."""
        if self.steplog is None:
            return
        self.global_step += 1
        self.steplog.record(self.global_step, rec, model, scheduler, time.perf_counter() - t_step, hook)
        loop.stop_requested(self.stop, hook)

    def close(self):
        if self.steplog is not None:
            self.steplog.log.close()
            self.steplog.bar.close()
