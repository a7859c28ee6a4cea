"""One training step's arithmetic, shared by everything that runs one: train_e2v.py, the benchmark
(bench/bench.py), validation and the sampler (the transformer call).

    sigma_B, noise  <- flow.sample_sigmas / randn, from the step's CPU generator, then moved
    x_t             =  (1 - sigma) x0 + sigma noise
    model_input     =  cat([x_t, cond], channels)           (16 + 20 = 36 for the I2V layout)
                    or cat([ref_latents, x_t], frames)      (Wan2.2 TI2V's clean_prefix layout: the
                                                             references' tokens at timestep 0, e2v/conditioning/ti2v.py)
                    or cat([x_t, ref_slots], frames)        (SkyReels-V3's sequence layout: the sample's one
                                                             timestep on every token, e2v/conditioning/sequence.py)
    model_pred      =  transformer(model_input, t = 1000 sigma, text, image tokens)   (clip frames only)
    loss            =  weighting(sigma) * mse(model_pred, v = noise - x0)      (flow objective)
                    or mse(x_t - sigma * model_pred, x0)                       (x0 objective)
                    (sequence.loss_on_references: the slots' outputs join the mse, target 0)
                    (a sample at a listed timestep 0 is clean: no loss; a micro-batch of them is redrawn)

`task: causal` (CausVid's regression, docs/causal.md) is the same step with a timestep per latent frame:

    index_BT        one index into flow.denoising_step_list per block (`draw_block_timesteps`)
    sigma_BT        the training grid's sigma of each frame's timestep, 0 where t = 0 (clean context)
    x_t             =  (1 - sigma_BT) x0 + sigma_BT noise, per frame, one noise draw for all frames
    model_pred      =  causal transformer(x_t, t per token = the frame's listed timestep, text)
                       (clean_prefix: the references in front at t = 0, the model's block 0; one index
                        per block of the video's frames, the loss on them alone)
    loss            =  mse(x_t - sigma_BT * model_pred, x0) over the frames whose t is not 0, fp32

Every tensor stays on the device of the conditions (e2v/runtime/device.py); only the logged scalars come
back to the CPU. Legend: B batch, C channels, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import numpy as np
import torch

from e2v.conditioning.encode import Conditions
from e2v.conditioning.layout import place_references, split_prediction
from e2v.config.experts import EXPERTS, boundary_ratio, expert_for, sigma_range, trained_experts
from e2v.config.schema import Causal, Config
from e2v.models.causal import block_ids, reference_block
from e2v.runtime.device import randn
from e2v.runtime.distributed import mean_over_ranks
from e2v.train.flops import StepFlops, perf_scalars
from e2v.train.flow import (
    add_noise,
    frame_noise,
    frame_x0,
    latent_stats,
    loss_weighting,
    per_frame_mse,
    per_sample_mse,
    sample_sigmas,
    seed_time_bucket,
    time_bucket,
    timestep_sigmas,
    training_timesteps,
    velocity_target,
    x0_from_velocity,
)


def model_input(noisy_BCTHW: torch.Tensor, cond_BCTHW: torch.Tensor | None) -> torch.Tensor:
    """The transformer's input: x_t, then the condition channels when the model has any."""
    return noisy_BCTHW if cond_BCTHW is None else torch.cat([noisy_BCTHW, cond_BCTHW], 1)


def predict(model, noisy_BCTHW: torch.Tensor, timestep_B: torch.Tensor, c: Conditions, text_BLD: torch.Tensor,
            dtype: torch.dtype, *, with_references: bool = False):
    """One transformer call -> the fp32 velocity of the clip's frames on the model input's device.
    The timestep stays fp32 (or int64, as the sampler passes it) for the fp32 time embedder. With
    reference frames in the sequence (clean_prefix: in front, timestep 0 on theirs; sequence: the
    slots, the sample's timestep) their prediction is dropped, so the loss sees the clip's frames
    only; `with_references` also returns it (None without reference frames)."""
    x, timestep = model_input(noisy_BCTHW, c.cond_BCTHW), timestep_B.to(noisy_BCTHW.device)
    x, timestep, n_ref = place_references(c, x, timestep)  # also per latent frame (task: causal) -> per token
    reference_block(model, n_ref)  # a causal model's block 0: the clean_prefix references (none: 0)
    out = model(
        x.to(dtype), timestep=timestep, encoder_hidden_states=text_BLD.to(dtype),
        encoder_hidden_states_image=None if c.clip_BLD is None else c.clip_BLD.to(dtype),
        return_dict=False,
    )[0].float()
    video, refs = split_prediction(c, out, n_ref)
    return (video, refs) if with_references else video


def draw_flow(c: Conditions, fl, generator: torch.Generator, sigma_range: tuple[float, float] | None = None,
              causal: Causal | None = None):
    """Flow matching's draw for one micro-batch: sigma_B (per sample; within `sigma_range` when
    given: a Wan2.2 expert's, experts.expert_sigma_range) and the noise, from the CPU generator and
    moved to the latents' device, and x_t. With `causal` (the task's blocks: frame_rule) sigma is
    sigma_BT, one per latent frame, drawn per block (draw_block_timesteps). A draw where nothing is
    noisy (every timestep a listed 0) is drawn again: it has no loss (CausVid's loss is NaN there)."""
    latents = c.latents_BCTHW
    if causal is not None:
        t_BT = draw_block_timesteps(latents.shape[0], latents.shape[2], fl, causal, generator)
        sigma = timestep_sigmas(t_BT, fl.shift).to(latents.device)
        noise = randn(latents.shape, generator, latents.device)
        return sigma, noise, frame_noise(latents, noise, sigma)
    steps = listed_timesteps(fl)
    if sigma_range is not None and steps and not any(sigma_range[0] <= t / 1000 <= sigma_range[1] for t in steps if t):
        raise ValueError(f"flow.denoising_step_list {fl.denoising_step_list}: no timestep above 0 in the expert's sigma "
                         f"range {sigma_range}: every draw would be clean; list a noisy timestep of that expert")
    while True:  # ends: a noisy listed timestep (config.checks) in range (above) has a positive chance each draw
        sigma = sample_sigmas(latents.shape[0], generator=generator, mode=fl.sigma_sampling, shift=fl.shift,
                              logit_mean=fl.logit_mean, logit_std=fl.logit_std,
                              timestep_list=steps, sigma_range=sigma_range)
        if sigma.any():
            break
    sigma = sigma.to(latents.device)
    noise = randn(latents.shape, generator, latents.device)
    return sigma, noise, add_noise(latents, noise, sigma)


def frame_rule(cfg: Config) -> Causal | None:
    """The causal section when the step draws per block (task: causal), else None (one sigma a sample)."""
    return cfg.causal if cfg.task == "causal" else None


def listed_timesteps(fl) -> list[float]:
    """flow.denoising_step_list as a bidirectional run draws it: the list itself (sigma = t / 1000,
    unchanged since before the causal task), or its warp (training_timesteps)."""
    return training_timesteps(fl).tolist() if fl.warp_denoising_step else fl.denoising_step_list


def draw_block_timesteps(batch: int, frames: int, fl, causal: Causal, generator: torch.Generator) -> torch.Tensor:
    """CausVid's rule (its `_process_timestep`, with Self-Forcing's independent_first_frame): an index into
    the trained timesteps (training_timesteps) for every sample and latent frame, drawn uniformly from
    `generator` in one [B, T] call, then every frame takes the index of its block's first frame.
    Redrawn while every timestep is 0. Returns the timesteps t_BT (float32, the listed values)."""
    steps = training_timesteps(fl)
    ids_T = block_ids(frames, causal.frames_per_block, causal.independent_first_frame)
    first_T = torch.searchsorted(ids_T, ids_T)  # the first frame of each frame's block
    while True:
        t_BT = steps[torch.randint(len(steps), (batch, frames), generator=generator)[:, first_T]]
        if t_BT.any():
            return t_BT


def listed_timestep(sigma_BT: torch.Tensor, fl) -> torch.Tensor:
    """The listed timestep each frame's sigma was drawn for (timestep_sigmas maps each listed t to one
    sigma), on sigma's device: what the model is given, as CausVid gives its listed value (757), not
    1000 x its grid sigma."""
    steps = training_timesteps(fl)
    sigmas = timestep_sigmas(steps, fl.shift).to(sigma_BT.device)
    return steps.to(sigma_BT.device)[(sigma_BT[..., None] == sigmas).int().argmax(-1)]


def prediction_and_target(fl, model_pred, noisy_BCTHW, sigma_B, latents_BCTHW, noise_BCTHW):
    """What the loss compares: the velocity and `noise - x0`, or (video regression, objective x0)
    the clean-latent estimate `x_t - sigma * v` and the latents."""
    if fl.objective == "x0":
        return x0_from_velocity(noisy_BCTHW, model_pred, sigma_B), latents_BCTHW
    return model_pred, velocity_target(latents_BCTHW, noise_BCTHW)


def forward_loss(model, c: Conditions, sigma, noise, noisy_model_input, cfg, dtype):
    """The transformer on the micro-batch and the weighted loss. Returns (loss, per-sample loss,
    prediction, target), all on the conditions' device, fp32 (prediction and target: the clip's)."""
    fl = cfg.flow
    if sigma.ndim == 2:  # per frame (task: causal): CausVid's regression
        with activation_context(cfg.train.activation_offload):
            v = predict(model, noisy_model_input, listed_timestep(sigma, fl), c, c.text_BLD, dtype)
        x0_hat = frame_x0(noisy_model_input, v, sigma)
        per_frame = per_frame_mse(x0_hat, c.latents_BCTHW)
        # CausVid's F.mse_loss(pred[mask], target[mask]): every noisy frame counts once, whichever sample
        return per_frame[sigma != 0].mean(), per_frame.mean(1), x0_hat, c.latents_BCTHW
    on_refs = cfg.conditioning.target_layout == "sequence" and cfg.conditioning.sequence.loss_on_references
    with activation_context(cfg.train.activation_offload):
        model_pred, ref_pred = predict(model, noisy_model_input, 1000 * sigma, c, c.text_BLD, dtype,
                                       with_references=True)
    model_pred, target = prediction_and_target(fl, model_pred, noisy_model_input, sigma, c.latents_BCTHW, noise)
    if on_refs and ref_pred is not None:  # a clean slot's velocity target is 0: x0 = x_t - sigma v stays the slot
        per_sample = per_sample_mse(torch.cat([model_pred, ref_pred], 2),
                                    torch.cat([target, torch.zeros_like(ref_pred)], 2))
    else:
        per_sample = per_sample_mse(model_pred, target)
    weighted = loss_weighting(sigma, fl.weighting) * per_sample
    if 0 in fl.denoising_step_list:  # a sample at timestep 0 is clean: no loss (draw_flow keeps one noisy)
        weighted = weighted[sigma != 0]
    return weighted.mean(), per_sample, model_pred, target


# --- what a step logs --------------------------------------------------------------------------


PENDING = "_pending"  # add_step_stats' device tensors, read back by step_scalars


def add_step_stats(stats: dict[str, list], sigma, per_sample, target, model_pred, fl,
                   boundary: float | None = None) -> None:
    """One micro-batch's values for the logged means: the loss by timestep bucket (where the model
    is weak), for a two-expert base (`boundary`: its boundary_ratio) the loss by expert
    (`train/loss_high_noise`), and, for video regression, the latent statistics. Kept on the
    device, detached: called right after engine.step(), a read-back here would make the host wait
    for the whole backward every micro-batch; step_scalars reads them once per logged step."""
    latent = latent_stats(target, model_pred) if fl.objective == "x0" else None
    if sigma.ndim == 2:  # per frame: the seed's bucket of each sample's mean listed timestep
        when, bucket = listed_timestep(sigma, fl).mean(1), seed_time_bucket
    else:
        steps = listed_timesteps(fl)
        when, bucket = sigma, lambda s: time_bucket(s, steps)
    stats.setdefault(PENDING, []).append((when.detach(), per_sample.detach(), latent, bucket, boundary))


def read_step_stats(stats: dict[str, list]) -> dict[str, list[float]]:
    """add_step_stats' values as the logged lists, read back from the device in one copy."""
    stats = dict(stats)
    pending = stats.pop(PENDING, [])
    if not pending:
        return stats
    flat = [t for sigma, per_sample, latent, _, _ in pending
            for t in (sigma.float().flatten(), per_sample.float().flatten(), *(
                [torch.stack(list(latent.values()))] if latent else []))]
    values = torch.cat(flat).tolist()  # the one host sync of the logged statistics
    at = 0
    for sigma, per_sample, latent, bucket, boundary in pending:
        n = sigma.numel()
        sigmas, losses = values[at:at + n], values[at + n:at + 2 * n]
        at += 2 * n
        for s, l in zip(sigmas, losses):
            stats.setdefault(f"train/loss_at_time_{bucket(s)}", []).append(l)
        if boundary is not None:
            sigma_B = torch.tensor(sigmas, dtype=sigma.dtype)  # the drawn values, on the host: no sync
            stats.setdefault(f"train/loss_{expert_for(1000 * sigma_B, boundary)}", []).extend(losses)
        if latent:
            for k, v in zip(latent, values[at:at + len(latent)]):
                stats.setdefault(f"train/{k}", []).append(v)
            at += len(latent)
    return stats


def step_scalars(cfg, world: int, *, lr: float, grad_norm: float, step_time: float, data_time: float,
                 step_losses: list[float], stats: dict, skipped_ids: set, excluded: int, nonfinite: int,
                 data_parallel: int | None = None, flops: StepFlops | None = None,
                 peak_tflops: float | None = None) -> dict:
    """The TensorBoard scalars of a logged step, every rank's micro-batches included (a collective).
    `data_parallel`: the ranks that load distinct micro-batches (world / the context-parallel
    degree; default world). The ranks of a context-parallel group log the same loss, so the mean
    over all ranks is still the mean over the global batch. `flops`: this rank's FLOPs of the step
    (e2v/train/flops.py), giving perf/tokens_per_s, perf/tflops_per_gpu and, with the GPU's
    `peak_tflops`, perf/mfu and perf/hfu."""
    stats = read_step_stats(stats)
    ranks = mean_over_ranks({"train/loss": step_losses, "data/skipped_ids": sorted(skipped_ids), **stats}, world)
    samples = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * (data_parallel or world)
    return {
        "train/lr": lr, "train/grad_norm": grad_norm,
        "perf/step_time_s": step_time, "perf/data_wait_share": data_time / step_time,
        "perf/samples_per_s": samples / step_time,
        **perf_scalars(flops, step_time, data_parallel or world, peak_tflops),
        "data/skipped_samples": ranks.pop("data/skipped_ids"), "data/excluded_samples": excluded,
        "train/nonfinite_skipped": nonfinite, **ranks,
    }


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """The tensors saved for backward that the forward made (those with a grad_fn: activations,
    with gradient checkpointing the block inputs) go to host memory and come back for backward.
    Leaves stay where they are: a parameter (trained or frozen, also under ZeRO-3 while gathered)
    or an input is held by its owner anyway, so a copy would free nothing and cost a transfer per
    use. torch's save_on_cpu copies every saved tensor, weights included, with a blocking copy
    each; here the copies are non-blocking into pinned memory (`pin_memory`, with CUDA), ordered on
    the current stream: the device-to-host copy runs before anything reuses the source's memory,
    the host-to-device copy before backward reads it. `offloaded`: (shape, dtype) of each copy."""

    def __init__(self, pin_memory: bool):
        self.offloaded: list[tuple[tuple[int, ...], torch.dtype]] = []

        def pack(t: torch.Tensor):
            if not offloads(t):
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
            host.copy_(t, non_blocking=pin_memory)
            self.offloaded.append((tuple(t.shape), t.dtype))
            return t.device, host

        def unpack(packed):
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device, non_blocking=pin_memory)
            return packed

        super().__init__(pack, unpack)


def offloads(t: torch.Tensor) -> bool:
    """Whether ActivationOffload moves this saved tensor: made by the forward (a grad_fn), not a
    parameter, nor a view of a leaf (a transposed weight)."""
    if isinstance(t, torch.nn.Parameter) or t.grad_fn is None:
        return False
    return t._base is None or t._base.grad_fn is not None


def activation_context(offload: bool):
    """Where the tensors saved for backward live. With `train.activation_offload` and CUDA the
    forward's activations go to pinned CPU memory (ActivationOffload) and come back for backward;
    with gradient checkpointing those are only the block boundaries. Costs a host<->device copy
    of each, overlapped with the compute. Without CUDA there is nothing to offload: a no-op."""
    import contextlib

    if offload and torch.cuda.is_available():
        return ActivationOffload(pin_memory=True)
    return contextlib.nullcontext()


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
    from e2v.train.flow import sigma_mass

    fl = cfg.flow
    mass = {e: sigma_mass(*sigma_range(e, boundary), mode=fl.sigma_sampling, shift=fl.shift, logit_mean=fl.logit_mean,
                          logit_std=fl.logit_std, timestep_list=listed_timesteps(fl)) for e in EXPERTS}
    p_high = mass["high_noise"] / (mass["high_noise"] + mass["low_noise"])
    pick = np.random.default_rng([cfg.seed, step, micro_batch]).random()
    return sigma_range("high_noise" if pick < p_high else "low_noise", boundary)
