"""The denoising loop SkyReels-A2 and SkyReels-V3 R2V run at inference, on the conditioning code
training uses.

UniPC multistep with flow prediction and a configurable shift (A2: shift 8, 50 steps, CFG 5; V3
R2V: shift 5, 8 steps, guidance 1: one forward a step), text-only classifier-free guidance: the
unconditional pass uses the negative prompt with the SAME image tokens and VAE condition
(docs/conditioning.md, "Inference"). With `validation.image_guidance_scale` set, Phantom's (and
V3's pipeline's) three-pass dual guidance instead:
    v = v(neg, none) + s_img (v(neg, refs) - v(neg, none)) + s_txt (v(txt, refs) - v(neg, refs))
where "none" is the references-dropped input (all slots zero in the sequence layout). In the
sequence layout the references are re-attached at every step and the scheduler steps only the
video's frames (train/step.predict returns them alone). The conditions come from
`conditioning.layout.batch_conditions` on a batch shaped exactly like data.py's, so inference sees the
layouts training saw (element order, repeats, mask, zero-padded CLIP blocks, or Wan2.2 TI2V's
clean reference frames in front), for any number of elements, and for a T2V base (`e2v_type:
none`: no condition, no image tokens).

A causal run (`task: causal`, e2v/models/causal.py) samples as CausVid does instead, through the same
`denoise` (its `rollout` option, `causal_rollout(cfg)`): block by block over the few-step list
(`flow.denoising_step_list` without its trailing 0, warped as trained), each block from its own
noise; at each listed t the model (the block's tokens, the earlier blocks' keys and values from
the KV cache) predicts x0 = x_t - sigma v, which is re-noised to the next t with fresh noise (not
an Euler step; `causal.renoise: predicted`: with the noise the prediction implies, a DDIM step);
the finished block then runs once at t = 0 to write its clean keys and values into the cache. Guidance runs every pass with a cache of its own. With references in the clean_prefix
layout (docs/causal.md, "Elements to video") their block 0 is written into each cache first, at
t = 0, and every video block attends to it. The whole latent video is decoded at the end, by the
caller.

Legend: B batch, C latent channels (16; 48 for the Wan2.2 VAE), T latent frames, h/w latent size, F pixel frames,
H/W pixels, L tokens, D width.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from e2v.conditioning.encode import Conditions, decode_latents, encode_text
from e2v.conditioning.layout import batch_conditions, with_references
from e2v.config.shapes import latent_size
from e2v.data.dataset import collate, element_inputs
from e2v.models.causal import KVCache, block_spans, cached, ensure_causal
from e2v.models.context_parallel import whole_sequence
from e2v.models.speed import sampling_backend
from e2v.runtime.device import randn, to_device
from e2v.train.flow import frame_noise, frame_x0, timestep_sigmas, training_timesteps
from e2v.train.step import predict


def make_scheduler(shift: float, num_train_timesteps: int = 1000):
    """diffusers' UniPC in flow mode, as Wan's and A2's pipelines configure it."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                   num_train_timesteps=num_train_timesteps)


# --- conditions ----------------------------------------------------------------------------------


def element_item(cfg, prompt: str, images: dict, index: int = 0) -> dict:
    """One data.py item from in-memory element images (PIL RGB, read as media.load_image reads
    them by the config's rule), through the same `element_inputs` as `E2VDataset.load`.
    The target video is a mid-grey placeholder: batch_conditions encodes it too (one wasted VAE encode
    per generation; the price of sharing the exact training code path)."""
    d = cfg.data
    h, w = d.resolution
    known = {e.name for e in cfg.data.elements}
    unknown = sorted(set(images) - known)
    if unknown:
        raise ValueError(f"unknown element(s) {unknown}: the config's data.elements names are {sorted(known)}")
    return {"id": f"sample_{index}", "video": torch.full((3, d.num_frames, h, w), 128, dtype=torch.uint8),
            "prompt": prompt, "skipped": [],
            **element_inputs(cfg, images, h, w)}


def inference_config(cfg):
    """The training config with every training-only randomness off: all given elements are kept
    (frame_conditioning `full`) and nothing is dropped (batch_conditions(train=False))."""
    cfg = copy.deepcopy(cfg)
    cfg.processors.vae.frame_conditioning = "full"
    return cfg


@torch.no_grad()
def encode_conditions(parts, cfg, batch: dict, generator: torch.Generator | None = None) -> Conditions:
    """A raw batch -> Conditions via the training code (no dropout, all elements kept)."""
    return batch_conditions(batch, parts, inference_config(cfg), rng=random.Random(0), generator=generator, train=False)


@torch.no_grad()
def denoise(model, c: Conditions, negative_text_BLD: torch.Tensor | None, noise_BCTHW: torch.Tensor, *,
            num_steps: int, guidance_scale: float, shift: float, dtype=torch.float32,
            image_guidance_scale: float | None = None, on_step=None, rollout: CausalRollout | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """UniPC flow-prediction loop from `noise_BCTHW` (on the model's device, as the conditions);
    returns the clean latents (normalised) there. The schedule's timesteps stay on the CPU (the
    scheduler looks its step up by value; its 0-dim sigmas combine with any device).
    CFG (guidance_scale > 1, as diffusers decides) repeats the call with the negative text only;
    with `image_guidance_scale` also a third call with the negative text and no references (the
    module docstring's dual guidance).
    `rollout` (a causal run's, causal_rollout): CausVid's block-by-block sampler instead
    (causal_denoise; num_steps and shift are the UniPC loop's, unused there), its fresh noise from
    `generator`.
    `on_step(i, timestep, velocity)` sees every step's guided velocity (tests use it)."""
    passes = guidance_passes(c, negative_text_BLD, guidance_scale, image_guidance_scale)
    if rollout is not None:
        return causal_denoise(model, passes, noise_BCTHW, rollout, guidance_scale=guidance_scale,
                              image_guidance_scale=image_guidance_scale, dtype=dtype, generator=generator,
                              on_step=on_step)
    scheduler = make_scheduler(shift)
    scheduler.set_timesteps(num_steps, device="cpu")
    latents = noise_BCTHW.float()
    b = latents.shape[0]
    for i, t in enumerate(scheduler.timesteps):
        timestep = t.expand(b)  # int64, as the Wan pipelines pass it
        v = guided({name: predict(model, latents, timestep, cp, text, dtype) for name, (cp, text) in passes.items()},
                   guidance_scale, image_guidance_scale)
        if on_step is not None:
            on_step(i, t, v)
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    return latents


def guidance_passes(c: Conditions, negative_text_BLD: torch.Tensor | None, guidance_scale: float,
                    image_guidance_scale: float | None) -> dict[str, tuple[Conditions, torch.Tensor]]:
    """The transformer calls of one guided step, in call order: `cond` (the text), with CFG also
    `uncond` (the negative text, the same references), with dual guidance also `free` (the negative
    text, no references)."""
    passes = {"cond": (c, c.text_BLD)}
    if guidance_scale > 1.0:
        b = c.text_BLD.shape[0]
        neg = negative_text_BLD if negative_text_BLD.shape[0] == b else negative_text_BLD.expand(b, -1, -1)
        passes["uncond"] = (c, neg)
        if image_guidance_scale is not None:
            passes["free"] = (with_references(c, None), neg)
    return passes


def guided(v: dict[str, torch.Tensor], guidance_scale: float, image_guidance_scale: float | None) -> torch.Tensor:
    """The guided velocity from the passes' velocities (guidance_passes' names)."""
    if "uncond" not in v:
        return v["cond"]
    if "free" not in v:
        return v["uncond"] + guidance_scale * (v["cond"] - v["uncond"])
    return v["free"] + image_guidance_scale * (v["uncond"] - v["free"]) + guidance_scale * (v["cond"] - v["uncond"])


# --- the causal task's sampler -------------------------------------------------------------------


@dataclass(frozen=True)
class CausalRollout:
    """How a causal run samples: its block layout and attention path (`causal:`), the listed
    timesteps it denoises at (no trailing 0) and the shift of the training grid their sigmas come from."""

    frames_per_block: int
    independent_first_frame: bool
    attention: str
    timesteps: tuple[float, ...]
    shift: float
    renoise: str = "fresh"  # causal.renoise: fresh noise between steps, or the predicted noise (DDIM, eta 0)


def causal_rollout(cfg) -> CausalRollout | None:
    """The rollout of a `task: causal` config (None for a bidirectional one): the trained timesteps
    (flow.denoising_step_list, warped when flow.warp_denoising_step) without the trailing 0, which
    is the cache-writing pass, not a denoising step."""
    if cfg.task != "causal":
        return None
    steps = training_timesteps(cfg.flow).tolist()
    if steps and steps[-1] == 0:
        steps = steps[:-1]
    if not steps or 0 in steps:
        raise ValueError(f"flow.denoising_step_list {cfg.flow.denoising_step_list}: the causal sampler needs the "
                         "few-step list, decreasing timesteps above 0 with an optional trailing 0 "
                         "(CausVid's: [1000, 757, 522, 0])")
    c = cfg.causal
    return CausalRollout(c.frames_per_block, c.independent_first_frame, c.attention, tuple(steps), cfg.flow.shift,
                         c.renoise)


def causal_denoise(model, passes: dict, noise_BCTHW: torch.Tensor, r: CausalRollout, *, guidance_scale: float,
                   image_guidance_scale: float | None, dtype, generator: torch.Generator | None = None,
                   on_step=None) -> torch.Tensor:
    """CausVid's block-by-block sampling (module docstring) from `noise_BCTHW`; returns the clean
    latents [B,C,T,h,w]. Each guidance pass keeps its own KV cache. The fresh noise of the re-noising
    comes from `generator` (a fixed seed when None: the same video for the same noise). A
    context-parallel model samples unsplit (context_parallel.whole_sequence): every rank of a group
    runs the same whole forwards."""
    ensure_causal(model, r.frames_per_block, r.independent_first_frame, r.attention)
    with whole_sequence(model):  # under context parallelism, unsplit: a cached forward is one block
        generator = generator or torch.Generator().manual_seed(0)
        b, _, frames = noise_BCTHW.shape[:3]
        device = noise_BCTHW.device
        sigmas = timestep_sigmas(torch.tensor(r.timesteps), r.shift).tolist()
        caches = {name: KVCache() for name in passes}

        def run(name, x_BCThw, t, a, z, write=False, references=False):  # one pass over block [a, z) with its cache
            cp, text = passes[name]
            block = dataclasses.replace(cp, cond_BCTHW=None if cp.cond_BCTHW is None else cp.cond_BCTHW[:, :, a:z])
            if not references:  # the references are in the cache already (block 0), not in the block's input
                block = dataclasses.replace(block, ref_latents_BCNhw=None, ref_layout=None)
            with cached(model, caches[name], write=write):
                return predict(model, x_BCThw, torch.full((b, z - a), float(t), device=device), block, text, dtype)

        for name, (cp, _) in passes.items():  # clean_prefix: the references' block 0 into each cache first, at t = 0
            if cp.ref_latents_BCNhw is not None:  # a forward of no video frames: the references alone
                run(name, noise_BCTHW[:, :, :0], 0.0, 0, 0, write=True, references=True)
        out = []
        for a, z in block_spans(frames, r.frames_per_block, r.independent_first_frame):
            x_BCThw = noise_BCTHW[:, :, a:z].float()
            for i, (t, sigma) in enumerate(zip(r.timesteps, sigmas)):
                v_BCThw = guided({name: run(name, x_BCThw, t, a, z) for name in passes}, guidance_scale,
                                 image_guidance_scale)
                if on_step is not None:
                    on_step(i, t, v_BCThw)
                x0_BCThw = frame_x0(x_BCThw, v_BCThw, torch.full((b, z - a), sigma, device=device))
                if i + 1 < len(sigmas):  # to the next listed t: CausVid's add_noise, or (predicted) DDIM's
                    sigma_BT = torch.full((b, z - a), sigmas[i + 1], device=device)
                    noise = (randn(x0_BCThw.shape, generator, device) if r.renoise == "fresh"
                             else (x_BCThw - (1 - sigma) * x0_BCThw) / sigma)  # sigma > 0: no trailing 0 here
                    x_BCThw = frame_noise(x0_BCThw, noise, sigma_BT)
            for name in passes:  # the finished block at t = 0: its clean keys and values into each cache
                run(name, x0_BCThw, 0.0, a, z, write=True)
            out.append(x0_BCThw)
        return torch.cat(out, 2)


@torch.no_grad()
def decode(latents_BCTHW: torch.Tensor, vae) -> np.ndarray:
    """Normalised latents -> uint8 video [B,F,H,W,3] on the CPU, for files (the VideoProcessor
    arithmetic: /2 + 0.5, clamp)."""
    video_BCFHW = (decode_latents(latents_BCTHW, vae) / 2 + 0.5).clamp(0, 1).cpu()
    return (video_BCFHW.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8).numpy()


def latent_shape(cfg, vae, batch: int = 1) -> tuple[int, ...]:
    """The clip's latents under this VAE: [B,C,T,h,w] (the clean_prefix layout's reference frames
    are conditions, not sampled)."""
    return (batch, vae.config.z_dim, *latent_size(cfg.data.num_frames, *cfg.data.resolution, vae.config))


def noise_generator(seed: int, where: str = "cpu", device="cpu") -> torch.Generator:
    """The seeded generator a video is sampled from (validation.generator_device): `cpu`, its
    numbers moved to the device (the same video from a seed on every machine), or `device`, on the
    sampling device, as SkyReels-V3's pipeline seeds `torch.Generator(device="cuda")`: on CUDA the
    same seed then gives V3's noise and posterior samples (CUDA's numbers are not the CPU's); on a
    CPU device the two are one."""
    return torch.Generator(device=torch.device(device) if where == "device" else "cpu").manual_seed(seed)


def generate(model, parts, cfg, prompts: list[str], elements: list[dict] | None = None, *, seed: int = 0,
             num_steps: int = 50, guidance_scale: float = 5.0, shift: float = 8.0, negative_prompt: str = "",
             image_guidance_scale: float | None = None, device="cpu", dtype=torch.float32,
             generator_device: str = "cpu") -> torch.Tensor:
    """Prompts (+ one dict of element images per prompt) -> clean latents [B,C,T,h,w] of the clip.

    The noise is drawn first, then the conditions are encoded with the same generator
    (noise_generator): A2's and V3's order, so a `sample_mode: sample` posterior matches their
    pipelines bit for bit."""
    elements = elements or [{} for _ in prompts]
    generator = noise_generator(seed, generator_device, device)
    noise = randn(latent_shape(cfg, parts.vae, len(prompts)), generator, device)
    batch = to_device(collate([element_item(cfg, p, e, i) for i, (p, e) in enumerate(zip(prompts, elements))]), device)
    with torch.no_grad():
        c = encode_conditions(parts, cfg, batch, generator)
        negative = encode_text([negative_prompt], parts.tokenizer, parts.text_encoder) if guidance_scale > 1 else None
    with sampling_backend(model, cfg):  # speed.sampling_attention_backend, when it differs from training's
        return denoise(model, c, negative, noise, num_steps=num_steps, guidance_scale=guidance_scale, shift=shift,
                       image_guidance_scale=image_guidance_scale,
                       dtype=dtype, rollout=causal_rollout(cfg), generator=generator)


# --- trained weights -----------------------------------------------------------------------------


def load_trained(transformer, lora_dir: str | Path):
    """A run's `lora/` folder into a plain transformer: the diffusers LoRA (with its adapter
    metadata, so alpha is right) through diffusers' own Wan loader, then the modules trained in
    full beside it (checkpoint.load_extra_modules). A full fine-tune's `lora/transformer/` folder
    replaces the transformer. Wan2.2's experts (a TwoExperts): each expert from its folder
    (`lora/high_noise/`, `lora/low_noise/`); an expert the run did not train stays the base.
    Returns the transformer to use."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders import WanLoraLoaderMixin

    from e2v.models.experts import TwoExperts
    from e2v.models.precision import model_dtype
    from e2v.train.export import FULL_DIR, LORA_FILE, load_extra_modules

    lora_dir = Path(lora_dir)
    if isinstance(transformer, TwoExperts):
        found = {name: e for name, e in transformer.experts.items() if (lora_dir / name).is_dir()}
        if not found:
            raise FileNotFoundError(f"--lora {lora_dir}: no {' or '.join(transformer.experts)} folder: pass the "
                                    "lora/ folder of a run on a two-expert base")
        return TwoExperts({**transformer.experts, **{name: load_trained(e, lora_dir / name) for name, e in found.items()}},
                          transformer.boundary_ratio)
    if (lora_dir / FULL_DIR / "config.json").exists():
        # in the base's dtype (bf16 for sampling; diffusers keeps its fp32 modules fp32), not fp32: half
        # the host memory, and sampled as the base is
        return WanTransformer3DModel.from_pretrained(str(lora_dir / FULL_DIR), torch_dtype=model_dtype(transformer))
    if not (lora_dir / LORA_FILE).exists():
        raise FileNotFoundError(f"--lora {lora_dir}: no {LORA_FILE} (nor {FULL_DIR}/); pass a run's lora/ folder")

    # What WanLoraLoaderMixin.load_lora_weights does, without a pipeline object: read the LoRA and
    # its metadata, zero-fill the image projections of a T2V LoRA, attach it to the transformer.
    state_dict, metadata = WanLoraLoaderMixin.lora_state_dict(str(lora_dir), return_lora_metadata=True)
    state_dict = WanLoraLoaderMixin._maybe_expand_t2v_lora_for_i2v(transformer=transformer, state_dict=state_dict)
    with warnings.catch_warnings():
        # On an image-attention transformer the zero-fill adds LoRA weights for add_k_proj /
        # add_v_proj that the adapter metadata does not target (an expanded base trains them in
        # full): peft leaves them out, which is right (they are zeros), and says so at length.
        warnings.filterwarnings("ignore", message="While injecting the PEFT adapters, an inconsistency",
                                category=RuntimeWarning)
        WanLoraLoaderMixin.load_lora_into_transformer(state_dict, transformer=transformer, metadata=metadata)
    load_extra_modules(transformer, lora_dir)
    return transformer
