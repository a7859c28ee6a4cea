"""Train Wan2.1 to make video from elements (SkyReels-A2 style), or plain T2V / video regression.

    deepspeed train_e2v.py --config configs/e2v.yaml [--set train.lr=5e-5 ...] [--resume latest]

config -> models -> data -> deepspeed.initialize -> loop. Everything that is not the algorithm
lives in e2v/. Legend: B batch, C channels, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import signal
import time
from pathlib import Path

import torch

from e2v import checkpoint as ckpt
from e2v.conditioning import encode_batch
from e2v.config import ConfigError, load_config, resolve_deepspeed_config, save_config
from e2v.data import index_samples, make_loader
from e2v.flow import add_noise, loss_weighting, per_sample_mse, sample_sigmas, velocity_target, x0_from_velocity
from e2v.models import count_params, is_expanded, load_parts, setup_training

SIGMA_BUCKETS = (0.25, 0.5, 0.75, 1.0)  # loss by timestep bucket: where the model is weak


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, or a seed JSON dataset config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=5e-5")
    p.add_argument("--resume", default=None, help="'latest' (newest complete checkpoint of the run) or a path")
    p.add_argument("--dry_run", action="store_true", help="validate, index data, build on meta, print plan, exit")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args()


def run_dir_for(cfg, config_path: str, resume: str | None) -> Path:
    """<output_dir>/<run_id>; without run_id, a new timestamped id (or, for --resume latest, the
    newest run of this config)."""
    root = Path(cfg.output_dir)
    stem = Path(config_path).stem
    if cfg.run_id:
        return root / cfg.run_id
    if resume == "latest":
        runs = sorted(root.glob(f"{stem}-*"), key=lambda p: p.stat().st_mtime)
        if runs:
            return runs[-1]
    return root / f"{stem}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def broadcast(obj, rank: int):
    if torch.distributed.is_initialized():
        box = [obj if rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def lr_lambda(cfg):
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


class Log:
    """TensorBoard scalars on rank 0, plus the window averages the progress bar shows."""

    def __init__(self, run_dir: Path, rank: int):
        self.tb = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        self.first_losses: list[float] = []
        self.losses: list[float] = []

    def scalars(self, step: int, values: dict) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


def main():
    args = parse_args()
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")

    import deepspeed
    from tqdm import tqdm

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(args.local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")

    run_dir = Path(broadcast(str(run_dir_for(cfg, args.config, args.resume)), rank))
    if rank == 0:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed + rank)
    rng = random.Random(cfg.seed * 1000 + rank)  # element choices, dropouts
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # sigmas, noise, posterior samples

    # --- models ---
    parts = load_parts(cfg, device=str(device))
    full_names = setup_training(parts.transformer, cfg, expanded=is_expanded(cfg))
    if cfg.train.gradient_checkpointing:
        parts.transformer.enable_gradient_checkpointing()
    for m in (parts.vae, parts.text_encoder, parts.image_encoder):
        if m is not None:
            m.to(device).requires_grad_(False)
    if cfg.e2v_type == "none" and parts.transformer.config.in_channels != 16:
        raise SystemExit("e2v_type: none trains plain T2V: use a 16-channel T2V base (model.base: t2v)")

    samples = index_samples(cfg, verbose=rank == 0)
    ds_config = resolve_deepspeed_config(cfg, world, cuda)
    if rank == 0:
        import json

        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        print(f"[e2v] run folder {run_dir}\n[e2v] {len(samples)} samples; transformer "
              f"{count_params(parts.transformer) / 1e6:.2f}M params, "
              f"{count_params(parts.transformer, trainable_only=True) / 1e6:.3f}M trainable "
              f"({len(full_names)} tensors in full beside the LoRA)")
    if args.dry_run:
        return

    params = [p for p in parts.transformer.parameters() if p.requires_grad]
    engine, _, _, scheduler = deepspeed.initialize(
        model=parts.transformer, model_parameters=params, config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
    )
    dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float32

    # --- resume ---
    global_step, samples_seen = 0, 0
    resume_from = ckpt.find_resume(args.resume, run_dir) if args.resume else None
    if resume_from is not None:
        state = ckpt.load_checkpoint(engine, resume_from)
        global_step, samples_seen = state["global_step"], state["samples_seen"]
        ckpt.set_rng_state(state["rng"], rng, gen)
        if rank == 0:
            print(f"[e2v] resumed from {resume_from} at step {global_step}")

    loader = make_loader(cfg, samples, rank=rank, world=world, start_sample=samples_seen)
    data_iter = iter(loader)
    log = Log(run_dir, rank)
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stop.update(signal=s))

    def save(step):
        return ckpt.save_checkpoint(
            engine, run_dir / "checkpoints", step,
            {"global_step": step, "samples_seen": samples_seen, "rng": ckpt.rng_state(rng, gen)},
            keep_last=cfg.train.keep_last, rank=rank)

    accum, fl = cfg.train.gradient_accumulation_steps, cfg.flow
    bar = tqdm(total=cfg.train.max_steps, initial=global_step, disable=rank != 0, desc="train", dynamic_ncols=True)
    last_save = time.time()
    skipped_total = 0
    # --- the loop ---
    while global_step < cfg.train.max_steps:
        t_step, t_data, step_losses, bucket = time.perf_counter(), 0.0, [], {}
        for _ in range(accum):
            t0 = time.perf_counter()
            batch = next(data_iter)
            t_data += time.perf_counter() - t0
            skipped_total += len(batch["skipped"])
            samples_seen += len(batch["id"])
            with torch.no_grad():
                c = encode_batch(batch, parts, cfg, rng=rng, generator=gen)
            latents = c.latents_BCTHW
            sigma = sample_sigmas(latents.shape[0], generator=gen, mode=fl.sigma_sampling, shift=fl.shift,
                                  logit_mean=fl.logit_mean, logit_std=fl.logit_std,
                                  timestep_list=fl.denoising_step_list)
            noise = torch.randn(latents.shape, generator=gen)
            noisy_model_input = add_noise(latents, noise, sigma)
            model_input = noisy_model_input if c.cond_BCTHW is None else torch.cat([noisy_model_input, c.cond_BCTHW], 1)
            model_pred = engine(
                model_input.to(device, dtype), timestep=(1000 * sigma).to(device, dtype),
                encoder_hidden_states=c.text_BLD.to(device, dtype),
                encoder_hidden_states_image=None if c.clip_BLD is None else c.clip_BLD.to(device, dtype),
                return_dict=False,
            )[0].float().cpu()
            if fl.objective == "x0":  # video regression: the loss is on the clean-latent estimate
                model_pred, target = x0_from_velocity(noisy_model_input, model_pred, sigma), latents
            else:
                target = velocity_target(latents, noise)
            per_sample = per_sample_mse(model_pred, target)
            loss = (loss_weighting(sigma, fl.weighting) * per_sample).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at step {global_step + 1}, rank {rank}, "
                                         f"samples {batch['id']}")
            engine.backward(loss.to(device))
            engine.step()
            step_losses.append(loss.item())
            for s, l in zip(sigma.tolist(), per_sample.tolist()):
                bucket.setdefault(next(b for b in SIGMA_BUCKETS if s <= b), []).append(l)
        global_step += 1
        step_time = time.perf_counter() - t_step
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        mean_loss = sum(step_losses) / len(step_losses)
        if global_step % cfg.train.log_every == 0:
            log.scalars(global_step, {
                "train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0], "train/grad_norm": grad_norm,
                "perf/step_time_s": step_time, "perf/data_wait_share": t_data / step_time,
                "perf/samples_per_s": cfg.train.micro_batch_size * accum * world / step_time,
                "data/skipped_samples": skipped_total,
                **{f"train/loss_sigma_le_{b}": sum(v) / len(v) for b, v in bucket.items()},
            })
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
        every_min = cfg.train.checkpoint_every_minutes
        stopping = broadcast(stop["signal"], rank) is not None
        if (global_step % cfg.train.checkpoint_every == 0 or stopping
                or (every_min and time.time() - last_save > 60 * every_min)):
            save(global_step)
            last_save = time.time()
        if stopping:
            if rank == 0:
                print(f"\n[e2v] signal {stop['signal']}: checkpoint saved at step {global_step}; resume with --resume latest")
            break
    bar.close()

    if global_step >= cfg.train.max_steps:
        if global_step % cfg.train.checkpoint_every:
            save(global_step)
        out = ckpt.export_lora(parts.transformer, run_dir / "lora", full_names, rank=rank)
        if rank == 0:
            print(f"[e2v] done: {global_step} steps. LoRA: {out}\n[e2v] TensorBoard: tensorboard --logdir {run_dir / 'tb'}"
                  + (f"\n[e2v] skipped {skipped_total} bad sample(s)" if skipped_total else ""))
    log.close()


if __name__ == "__main__":
    main()
