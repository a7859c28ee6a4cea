"""Where tensors live, from the loader to the loss (docs/architecture.md, "Devices").

The convention, one rule per stage:
- The DataLoader yields CPU tensors; the clip is uint8 [B,3,F,H,W] (a quarter of the float32 bytes
  through the worker queue: 93 MB instead of 370 MB for 81 x 480 x 832).
- `to_device` moves the whole batch to the accelerator once, at the start of the step; the
  pixels become float [-1, 1] there (`as_pixels`).
- Every model (the VAE, UMT5, CLIP, the transformer) sits on that device, and every tensor
  derived from the batch (latents, conditions, masks, text and image tokens, noise, sigmas,
  predictions, losses) is made on it or moved there where it is made.
- Random draws come from CPU `torch.Generator`s (the same numbers on any device, and resumable:
  their state is a CPU tensor): draw on the CPU, then move (`randn`).
- Only scalars come back (`.item()` / `.tolist()` for the progress bar, the logs and the
  non-finite guard); files are written from CPU copies.

Tests hold the code to it on a CPU-only machine by putting the models on the meta device: any op
that mixes a CPU tensor with a meta one raises, as a CPU/CUDA mix would on a GPU.
"""

from __future__ import annotations

import contextlib

import torch

PIXEL_SCALE = 127.5  # uint8 -> [-1, 1]: x / 127.5 - 1, the diffusers VaeImageProcessor arithmetic


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (frozen encoders live on one device)."""
    return next(module.parameters()).device


def as_pixels(video: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1], on the tensor's device; float pixels pass unchanged."""
    if video.dtype == torch.uint8:
        return video.float() / PIXEL_SCALE - 1.0
    return video


def to_device(obj, device: torch.device | str):
    """Every tensor of a batch (nested dicts, lists and tuples) on `device`; anything else as it is.
    Pinned CPU memory (the loader's `pin_memory` on CUDA) makes the copy asynchronous."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def randn(shape, generator: torch.Generator | None, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian noise drawn where the generator lives, then moved to `device`, as diffusers'
    randn_tensor draws: from a CPU generator (training's, and sampling's by default) the numbers
    do not depend on the device, and a resumed run (which restores the generator) draws them
    again; a CUDA generator (validation.generator_device: device) draws CUDA's numbers."""
    where = generator.device if generator is not None else "cpu"
    return torch.randn(shape, generator=generator, device=where, dtype=dtype).to(device)


def accelerator_device() -> torch.device:
    """The device DeepSpeed's engine puts this rank's module on (cuda:<local rank>, or cpu)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


TF32_ATTR = "e2v_tf32"  # set on a loaded VAE from model.vae_tf32 (models.load)


@contextlib.contextmanager
def vae_tf32(vae):
    """TF32 for the VAE's fp32 matmuls and cuDNN convolutions while it runs, on Ampere+ GPUs, when
    its model.vae_tf32 (the attribute TF32_ATTR) asks; the process's settings are restored after,
    so the transformer's fp32 matmuls are untouched."""
    on = (getattr(vae, TF32_ATTR, False) and torch.cuda.is_available()
          and torch.cuda.get_device_capability()[0] >= 8)
    if not on:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
