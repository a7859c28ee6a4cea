"""Config validation (e2v.config.load.load_config runs it after loading and `normalise`): the bounds
declared beside each field (schema.bounded), then the cross-field checks, each failing with the
key, the problem and the fix. It reads the config and never changes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from e2v.config.experts import check_expert_config
from e2v.config.schema import REPO_ROOT, VIS_DATA, VIS_FORMATS, Config, ConfigError, TinyShape, resolve_repo_path
from e2v.config.shapes import (
    PATCH,
    PIXELS_PER_TOKEN,
    VAE_T,
    frame_bucket_list,
    latent_size,
    nearest_valid_sizes,
    sequence_slots_of,
    whole_block_frames,
    whole_blocks,
)


def _bound_problem(value: float, bounds: dict) -> str | None:
    """What `value` must be under a field's declared bounds (schema.bounded), or None if it is."""
    lo = ("[", bounds["min"]) if "min" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    hi = ("]", bounds["max"]) if "max" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    ok = (math.isfinite(value) and (lo is None or (value >= lo[1] if lo[0] == "[" else value > lo[1]))
          and (hi is None or (value <= hi[1] if hi[0] == "]" else value < hi[1])))
    if ok:
        return None
    if lo and hi:
        return f"within {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return "a positive number" if lo == ("(", 0) else f"{'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    return f"{'<=' if hi[0] == ']' else '<'} {hi[1]:g}"


def check_bounds(node: Any, path: str = "") -> None:
    """Every field declared with bounds (schema.bounded), in every section and list of sections."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{key}.")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                check_bounds(item, f"{key}[{i}].")
        elif "bounds" in f.metadata and value is not None:
            for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
                problem = _bound_problem(v, f.metadata["bounds"])
                if problem:
                    at = f"{key}: {v}" if i is not None else f"{key}={v}"
                    note = f" {f.metadata['note']}" if f.metadata["note"] else ""
                    raise ConfigError(f"{at} must be {problem}{note}")


def validate(cfg: Config, base_dir: Path = Path("."), check_paths: bool = True) -> None:
    """Cross-field checks, after the per-field bounds: everything that would otherwise fail deep
    inside the VAE or the loop. Reads the config, never changes it (normalise fills defaults)."""
    check_bounds(cfg)
    d = cfg.data
    f = d.num_frames
    if f < 1 or (f - 1) % VAE_T:
        lo = (f - 1) // VAE_T * VAE_T + 1
        raise ConfigError(
            f"data.num_frames={f}: Wan's VAE needs 4k+1 frames (T=(F-1)/4+1 latent frames); "
            f"use {max(lo, 1)} or {lo + 4}"
        )
    for fb in d.frame_buckets:
        if fb < 1 or (fb - 1) % VAE_T:
            raise ConfigError(f"data.frame_buckets: {fb} is not 4k+1")
    if len(d.resolution) != 2:
        raise ConfigError(f"data.resolution: expected [height, width], got {d.resolution}")
    for name, x in zip(("height", "width"), d.resolution):
        if x % PIXELS_PER_TOKEN:
            lo, hi = nearest_valid_sizes(x)
            raise ConfigError(f"data.resolution: {name} {x} is not a multiple of 16 (VAE /8, then patch 2); "
                              f"nearest valid sizes are {lo} and {hi}, or set data.resolution_policy: round")
    for res in d.resolution_buckets:
        if len(res) != 2 or res[0] % PIXELS_PER_TOKEN or res[1] % PIXELS_PER_TOKEN:
            raise ConfigError(f"data.resolution_buckets: {res} must be [H, W], multiples of 16")
    pv = cfg.processors.vae
    if pv.resolution is not None and list(pv.resolution) != list(d.resolution):
        raise ConfigError(
            f"processors.vae.resolution {pv.resolution} differs from data.resolution {d.resolution}: "
            "the condition video has the target's size; drop the key or make them equal"
        )
    if d.time_division_factor is not None:
        if d.time_division_factor != 4:
            raise ConfigError("data.time_division_factor: Wan's VAE compresses time by 4; only 4 is valid")
        if d.frame_buckets:
            raise ConfigError("data.time_division_factor and data.frame_buckets both set the frame counts: keep one")
    if not d.datasets:
        raise ConfigError("data.datasets: at least one dataset is needed, e.g. [{data_root: path/to/data}]")
    for i, ds in enumerate(d.datasets):
        if not ds.data_root:
            raise ConfigError(f"data.datasets[{i}].data_root is missing: the folder with the samples")
        if check_paths and not (Path.cwd() / ds.data_root).exists():  # an absolute data_root stays itself
            raise ConfigError(f"data.datasets[{i}].data_root: {ds.data_root} does not exist "
                              "(for the demo: python tools/make_demo_dataset.py <dir>)")
        if ds.dataset_type in ("csv", "jsonl", "opens2v") and not ds.metadata_path:
            raise ConfigError(f"data.datasets[{i}].metadata_path: a {ds.dataset_type} dataset needs its file")
    _validate_elements(cfg)
    ckpt = cfg.model.generator_ckpt
    if ckpt is not None and check_paths and not Path(ckpt).is_file():
        raise ConfigError(f"model.generator_ckpt: {ckpt} is not a file (a CausVid / Self-Forcing .pt with a "
                          f"'{cfg.model.generator_ckpt_dict}' state dict); give its path, or remove the key")
    if not pv.concatenate_mask and cfg.model.base != "t2v":
        raise ConfigError("processors.vae.concatenate_mask: false needs a 32-channel model: set model.base: t2v "
                          "(expanded to 32 input channels)")
    if (cfg.model.preset is None) == (cfg.model.pretrained is None):
        raise ConfigError("model: set exactly one of model.preset (tiny) or model.pretrained (a diffusers folder)")
    if cfg.model.tiny.head_dim % 2:
        raise ConfigError(f"model.tiny.head_dim={cfg.model.tiny.head_dim} must be even (Wan's rope rotates pairs)")
    if cfg.model.preset is None and cfg.model.tiny != TinyShape():
        raise ConfigError("model.tiny sizes a tiny preset's transformer; with model.pretrained the folder's "
                          "transformer/config.json does: remove model.tiny")
    check_expert_config(cfg)
    if pv.frame_conditioning == "index" and cfg.uses_vae_condition:
        n_vae = len(cfg.vae_elements)
        if not 0 <= pv.frame_index < n_vae:
            raise ConfigError(f"processors.vae.frame_index={pv.frame_index}: frame_conditioning: index keeps the "
                              f"element at that place in vae.position order; use 0..{n_vae - 1}")
    if len(cfg.processors.clip.resolution) != 2:
        raise ConfigError(f"processors.clip.resolution: expected [height, width], got {cfg.processors.clip.resolution}")
    if cfg.conditioning.target_layout in ("prepend", "clean_prefix", "sequence") and not cfg.uses_vae_condition:
        raise ConfigError(f"conditioning.target_layout: {cfg.conditioning.target_layout} puts the VAE reference "
                          f"frames before the clip, but e2v_type={cfg.e2v_type} has no VAE condition: use "
                          "target_layout: overlay")
    _validate_sequence(cfg)
    _validate_timesteps(cfg)
    _validate_causal(cfg)
    _validate_validation(cfg)
    _validate_cache(cfg)
    _validate_parallel(cfg)
    ds_path = resolve_repo_path(cfg.deepspeed.config)
    if not ds_path.exists():
        raise ConfigError(
            f"deepspeed.config: {cfg.deepspeed.config} not found; shipped: "
            f"{', '.join(sorted(p.name for p in (REPO_ROOT / 'ds_configs').glob('*.json')))}"
        )
    zero_stage = json.loads(ds_path.read_text()).get("zero_optimization", {}).get("stage", 0)
    _validate_fp8_base(cfg, zero_stage)
    _validate_generator_ckpt(cfg, zero_stage)
    _validate_ema(cfg, zero_stage)
    _validate_speed(cfg)


def _validate_ema(cfg: Config, zero_stage: int) -> None:
    """train.ema_weight averages whole parameters on every rank (e2v/train/ema.py), which ZeRO-3 partitions."""
    if cfg.train.ema_weight > 0 and zero_stage == 3:
        raise ConfigError(f"train.ema_weight averages whole weights on every rank, but {cfg.deepspeed.config} "
                          "(ZeRO-3) partitions them: use ds_configs/zero2.json (or zero2_offload.json), or set "
                          "train.ema_weight: 0")


def _validate_generator_ckpt(cfg: Config, zero_stage: int) -> None:
    """model.generator_ckpt is read into one whole transformer (e2v/models/causvid_ckpt.py) before
    the LoRA and DeepSpeed: not into ZeRO-3's partitioned load, nor into two experts."""
    m = cfg.model
    if m.generator_ckpt is None:
        return
    if m.expert is not None:
        raise ConfigError("model.generator_ckpt holds one transformer's weights (CausVid's generator), but model.expert "
                          "names a two-expert base: use a one-transformer base (Wan2.1), or remove generator_ckpt")
    if zero_stage == 3 and m.pretrained is not None and m.zero3_init:
        raise ConfigError(f"model.generator_ckpt loads into whole weights, but {cfg.deepspeed.config} (ZeRO-3) with "
                          "model.zero3_init partitions the transformer as it loads: set model.zero3_init: false "
                          "(every rank reads the base whole, then the checkpoint), or use ds_configs/zero2.json")


def _validate_elements(cfg: Config) -> None:
    """data.elements against each other, e2v_type and the frame counts."""
    d = cfg.data
    names = [e.name for e in d.elements]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"data.elements: duplicate element name(s) {sorted(dup)}")
    for i, e in enumerate(d.elements):
        if not e.suffixes and d.datasets[0].dataset_type == "e2v":
            raise ConfigError(f"data.elements[{i}] ({e.name}): suffixes is empty")
    positions = [e.vae.position for e in d.elements if e.vae is not None]
    if len(set(positions)) != len(positions):
        raise ConfigError(f"data.elements: vae.position values must be distinct, got {positions}")
    if cfg.e2v_type != "none" and not d.elements:
        raise ConfigError(f"e2v_type={cfg.e2v_type} needs data.elements (or set e2v_type: none)")
    ref = cfg.reference_frames()
    if ref > d.num_frames:
        raise ConfigError(f"the elements take {ref} condition frames (sum of vae.repeat) but data.num_frames is "
                          f"{d.num_frames}")
    short = [fb for fb in d.frame_buckets if fb < ref]
    if d.auto_frame_buckets and short:
        raise ConfigError(f"data.frame_buckets {short}: shorter than the {ref} condition frames the "
                          "elements take (sum of vae.repeat); remove them")


def _validate_sequence(cfg: Config) -> None:
    """The sequence layout (e2v/conditioning/sequence.py): no image tokens, every VAE element a slot."""
    cd = cfg.conditioning
    if cd.target_layout != "sequence":
        return
    if cfg.uses_clip:
        raise ConfigError(f"conditioning.target_layout: sequence carries each reference as a latent slot and feeds no "
                          f"CLIP tokens (SkyReels-V3 R2V and Phantom have no image encoder), but e2v_type is "
                          f"{cfg.e2v_type}: set e2v_type: vae")
    n = len(cfg.vae_elements)
    if cd.sequence.slots is not None and n > cd.sequence.slots:
        raise ConfigError(f"conditioning.sequence.slots: {cd.sequence.slots}, but data.elements has {n} elements in "
                          f"the VAE stream ({', '.join(e.name for e in cfg.vae_elements)}): a sample could bring more "
                          f"references than slots; set slots: {n} (or null: as many as references), or give fewer elements")
    if cd.sequence.loss_on_references and cfg.flow.objective != "flow":
        raise ConfigError("conditioning.sequence.loss_on_references trains the slots' velocity (target 0), which needs "
                          "flow.objective: flow; remove loss_on_references or the x0 objective")


def _validate_timesteps(cfg: Config) -> None:
    """flow.denoising_step_list and its warp: a 0 is a clean frame that carries no loss, so a list of
    zeros alone trains nothing; the warp indexes the 1001 places of the training grid (its 1000
    timesteps and 0) by 1000 - t, so it needs whole timesteps."""
    fl = cfg.flow
    steps = fl.denoising_step_list
    if steps and not any(steps):
        raise ConfigError(f"flow.denoising_step_list: {steps} has no timestep above 0: a 0 marks a clean frame, "
                          "which carries no loss; add the noisy timesteps to train at, e.g. [1000, 757, 522, 0]")
    if fl.warp_denoising_step:
        if not steps:
            raise ConfigError("flow.warp_denoising_step maps flow.denoising_step_list through the training grid, "
                              "but the list is empty: give the list, or remove warp_denoising_step")
        odd = [t for t in steps if t != int(t)]
        if odd:
            raise ConfigError(f"flow.warp_denoising_step: flow.denoising_step_list entries {odd} are not whole "
                              "timesteps; the warp takes the training grid's timestep 1000 - t places from its "
                              "start: give whole numbers 0..1000, or set warp_denoising_step: false")


def _validate_causal(cfg: Config) -> None:
    """task: causal trains CausVid's regression rule (e2v/train/step.py): per-block timesteps from
    flow.denoising_step_list, the x0 estimate against the clean latents, no weighting, on clips
    whose latent frames split into whole blocks. What the model cannot serve (layouts, ring
    attention, two experts) is its own refusal, e2v.models.causal.causal_refusal, asked at start
    by train_e2v.py (this stage imports no torch)."""
    if cfg.task != "causal":
        return
    fl, c = cfg.flow, cfg.causal
    if not fl.denoising_step_list:
        raise ConfigError("task: causal draws each block's timestep from flow.denoising_step_list (CausVid's rule), "
                          "which is empty: set it, e.g. flow.denoising_step_list: [1000, 757, 522, 0]")
    if fl.objective != "x0":
        raise ConfigError(f"task: causal trains CausVid's regression, the x0 estimate x_t - sigma v against the clean "
                          f"latents, but flow.objective is {fl.objective}: set flow.objective: x0")
    if fl.weighting != "none":
        raise ConfigError(f"task: causal averages its loss over the noisy frames unweighted, as CausVid does, but "
                          f"flow.weighting is {fl.weighting}: set flow.weighting: none")
    d = cfg.data
    frames = [d.num_frames] + (d.frame_buckets if d.auto_frame_buckets else [])
    for key, f in zip(["data.num_frames"] + ["data.frame_buckets"] * (len(frames) - 1), frames):
        if not whole_blocks(f, c.frames_per_block, c.independent_first_frame):
            t = (f - 1) // VAE_T + 1
            near = " or ".join(map(str, whole_block_frames(f, c.frames_per_block, c.independent_first_frame)))
            first = " after frame 0's own block" if c.independent_first_frame else ""
            raise ConfigError(f"{key}: {f} frames make {t} latent frames, which do not split into whole blocks of "
                              f"causal.frames_per_block={c.frames_per_block}{first}: use {near} frames, or another "
                              "causal.frames_per_block")


def _validate_cache(cfg: Config) -> None:
    """The cache must be able to hold what a step needs."""
    pv = cfg.processors.vae
    if not cfg.cache.enabled:
        return
    if cfg.uses_vae_condition and pv.combine == "before" and pv.frame_conditioning in ("prefix", "random"):
        raise ConfigError(
            f"cache.enabled with processors.vae.frame_conditioning: {pv.frame_conditioning} and combine: before: "
            "the condition video depends on a random element choice each step, so one cached encode cannot "
            "hold it. Use combine: after (each element cached on its own), frame_conditioning full / index / "
            "first_and_last, or cache.enabled: false")
    if cfg.conditioning.target_layout == "prepend":
        raise ConfigError("cache.enabled with conditioning.target_layout: prepend: the target then depends on the "
                          "references chosen each step; use target_layout: overlay or cache.enabled: false")


def _validate_parallel(cfg: Config) -> None:
    """Context parallelism splits the video tokens of every clip evenly over ulysses x ring ranks,
    so every shape the run can meet (each frame bucket at each resolution bucket, and the
    validation videos at data.num_frames x data.resolution) must divide. The heads (a model
    property) and the world size (a launch property) are checked at start: e2v.models.context_parallel."""
    p = cfg.parallel
    degree = p.ulysses_degree * p.ring_degree
    if degree == 1:
        return
    if p.ring_degree > 1 and cfg.train.mixed_precision == "no" and _has_cuda():
        # On CUDA the ring's attention is torch's flash-attention op, which takes bf16 / fp16 only
        # (e2v/models/context_parallel.py); the CPU's flash op takes fp32, so CPU runs are let through.
        raise ConfigError(f"parallel.ring_degree: {p.ring_degree} with train.mixed_precision: 'no' (fp32): on CUDA ring "
                          "attention runs the flash-attention op, which takes bf16 or fp16 only; set "
                          "train.mixed_precision: bf16, or split the tokens with parallel.ulysses_degree instead "
                          "(ring_degree: 1)")
    from e2v.config.bases import vae_config  # the model's VAE strides (plan loads after this module)

    cd = cfg.conditioning
    if cd.target_layout == "sequence" and cd.sequence.slots is None:
        raise ConfigError(f"parallel: {degree} ranks share each sample's tokens evenly, but conditioning.sequence.slots: "
                          "null gives each sample as many reference slots as it has references, so the token count "
                          "changes from step to step: set slots to a fixed count (4: SkyReels-V3) or parallel degrees 1")
    slots = sequence_slots_of(cfg)  # the sequence layout's reference slots are split with the video's frames
    d, vae = cfg.data, vae_config(cfg)
    frames = set(frame_bucket_list(cfg) if d.auto_frame_buckets else []) | {d.num_frames}
    for f in sorted(frames):
        for h, w in d.resolution_buckets or [d.resolution]:
            t, lh, lw = latent_size(f, h, w, vae)
            t += slots
            n = t * (lh // PATCH) * (lw // PATCH)
            if n % degree:
                fits = [k for k in range(2, 17) if n % k == 0]
                raise ConfigError(
                    f"parallel: ulysses_degree {p.ulysses_degree} x ring_degree {p.ring_degree} = {degree} ranks "
                    f"share each clip's video tokens evenly, but {f} frames at {h} x {w} make {n} tokens "
                    f"({t} latent frames x {lh // PATCH} x {lw // PATCH}), not a multiple of {degree}: use a degree "
                    f"that divides {n} ({', '.join(map(str, fits)) or 'none up to 16'}) or change data.num_frames / "
                    "data.resolution / the buckets")


def _validate_validation(cfg: Config) -> None:
    """validation: and visualization: keys."""
    v, vis = cfg.validation, cfg.visualization
    if v.every_n_steps and not v.num_samples and not v.sets:
        raise ConfigError("validation.every_n_steps > 0 with num_samples 0 and no validation.sets: nothing to "
                          "validate; hold out samples (num_samples >= 2), give sets, or set every_n_steps: 0")
    if v.every_n_steps and cfg.e2v_type != "none" and v.num_samples == 1:
        raise ConfigError("validation.num_samples must be >= 2 (or 0 for videos from validation.sets only): "
                          "the shuffled-reference gap swaps references between held-out samples")
    if v.image_guidance_scale is not None and v.guidance_scale <= 1:  # one pass: nothing for it to scale
        raise ConfigError(f"validation.image_guidance_scale {v.image_guidance_scale:g} cannot act at "
                          f"validation.guidance_scale {v.guidance_scale:g}: Phantom's dual guidance runs its three "
                          "passes only above guidance 1; raise guidance_scale, or set image_guidance_scale: null")
    names = {e.name for e in cfg.data.elements}
    for i, st in enumerate(v.sets):
        unknown = sorted(set(st.elements) - names)
        if unknown:
            raise ConfigError(f"validation.sets[{i}].elements: unknown element(s) {unknown}; "
                              f"data.elements names are {sorted(names)}")
    sc = v.subject_colour
    if sc is not None:
        unknown = sorted({sc.subject, *([sc.background] if sc.background else []), *sc.distractors} - names)
        if unknown:
            raise ConfigError(f"validation.subject_colour: unknown element(s) {unknown}; data.elements names are "
                              f"{sorted(names)}")
        if v.sets or v.num_samples < 2 or not v.num_videos:
            raise ConfigError("validation.subject_colour measures videos generated from held-out samples: it needs "
                              "num_samples >= 2, num_videos >= 1 and no validation.sets (remove it, or those)")
    for i, p in enumerate(vis.processors):
        bad = [d for d in p.data if d not in VIS_DATA]
        if bad:
            raise ConfigError(f"visualization.processors[{i}].data: unknown {bad}; valid: {', '.join(VIS_DATA)}")
        if p.format not in VIS_FORMATS[p.type]:
            raise ConfigError(f"visualization.processors[{i}].format: {p.format!r} is not valid for {p.type}; "
                              f"use {' or '.join(VIS_FORMATS[p.type])}")
    # Both index the decoded pixel frames of a training batch; with auto buckets the shortest batch
    # can have fewer than num_frames.
    short = min(frame_bucket_list(cfg)) if cfg.data.auto_frame_buckets else cfg.data.num_frames
    lists = [("visualization.sheet_frames", vis.sheet_frames)]
    lists += [(f"visualization.processors[{i}].frames", p.frames) for i, p in enumerate(vis.processors)
              if p.type == "vae_decode"]
    for key, frames in lists:
        bad = [f for f in frames if not -short <= f < short]
        if bad:
            raise ConfigError(f"{key}: {bad} out of range for {short} decoded frames (the shortest training "
                              f"video, data.num_frames / frame_buckets); valid indexes are {-short}..{short - 1}")


def _validate_fp8_base(cfg: Config, zero_stage: int) -> None:
    """model.base_dtype: fp8 stores frozen weights (e2v/models/fp8.py): nothing of a full fine-tune is
    frozen, and ZeRO-3 partitions parameters, not the fp8 buffers, so its offload would leave the fp8
    base whole on every GPU while promising otherwise."""
    if cfg.model.base_dtype != "fp8":
        if cfg.model.fp8_blocks_on_host:
            raise ConfigError("model.fp8_blocks_on_host keeps fp8 blocks in host RAM: set model.base_dtype: fp8, "
                              "or remove the key")
        return
    if cfg.model.training_type != "lora":
        raise ConfigError("model.base_dtype: fp8 stores the frozen base; a full fine-tune trains every weight: "
                          "set model.training_type: lora or model.base_dtype: train")
    if cfg.train.export_comfyui_checkpoint:
        raise ConfigError("train.export_comfyui_checkpoint fuses the LoRA into the base weights, which an fp8 base "
                          "holds rounded: set it false (the exported LoRA applies to the bf16 base) or "
                          "model.base_dtype: train")
    if cfg.model.fp8_blocks_on_host and cfg.model.expert is not None:
        raise ConfigError("model.fp8_blocks_on_host hooks the blocks of one transformer; a two-expert base "
                          "(model.expert) is not supported: remove model.fp8_blocks_on_host")
    if zero_stage == 3:
        raise ConfigError(f"model.base_dtype: fp8 keeps the fp8 base as buffers, whole on every GPU, which ZeRO-3 "
                          f"({cfg.deepspeed.config}) does not partition: use deepspeed.config: ds_configs/zero2.json "
                          "(or zero2_offload.json)")


# Backends whose diffusers kernel has no backward (e2v/models/speed.py's BACKENDS: backward=False), and
# those that take bf16 / fp16 only (half=True); the table itself imports torch, so the two facts the
# config stage needs are restated here and tests/unit/test_speed.py holds them to the table.
NO_BACKWARD = {"sage": "SageAttention's quantised kernels", "_flash_3": "diffusers' FlashAttention-3 forward op"}
HALF_ONLY = ("_native_flash", "_native_cudnn", "flash", "_flash_3", "_flash_varlen_3", "sage")


def _validate_speed(cfg: Config) -> None:
    """speed: what can be decided without the machine (the rest is e2v/models/speed.py's preflight):
    a backend without a backward cannot train, the causal mask and ring attention bring their own
    attention, a half-precision kernel cannot take an fp32 run, and what compilation is not built for."""
    s, p = cfg.speed, cfg.parallel
    name = s.attention_backend
    if name in NO_BACKWARD:
        raise ConfigError(f"speed.attention_backend: {name} cannot train: {NO_BACKWARD[name]} have no backward in "
                          f"diffusers; set speed.sampling_attention_backend: {name} (validation videos, "
                          "tools/sample.py) and speed.attention_backend: native")
    for key, value in (("speed.attention_backend", name), ("speed.sampling_attention_backend", s.sampling_attention_backend)):
        if value not in (None, "native") and cfg.task == "causal":
            raise ConfigError(f"{key}: {value} with task: causal: the causal mask sets its own attention "
                              "(causal.attention); set it to native")
    if name != "native" and p.ring_degree > 1:
        raise ConfigError(f"speed.attention_backend: {name} with parallel.ring_degree {p.ring_degree}: ring attention "
                          "runs its own attention op (torch's flash op, merged by log-sum-exp); set "
                          "speed.attention_backend: native, or split the tokens with parallel.ulysses_degree alone")
    if name in HALF_ONLY and cfg.train.mixed_precision == "no":
        raise ConfigError(f"speed.attention_backend: {name} takes bf16 / fp16 only and train.mixed_precision: 'no' "
                          "runs fp32: set train.mixed_precision: bf16, or speed.attention_backend: native")
    v = cfg.validation
    if (s.sampling_attention_backend in HALF_ONLY and cfg.train.mixed_precision == "no" and v.every_n_steps
            and (v.sets or v.num_videos)):
        raise ConfigError(f"speed.sampling_attention_backend: {s.sampling_attention_backend} takes bf16 / fp16 only "
                          "and validation's videos run in the training dtype, fp32 (train.mixed_precision: 'no'): "
                          "set train.mixed_precision: bf16, or sampling_attention_backend: null")
    if not s.compile:
        return
    refused = {  # compilation with what it is not built or tested for: the key and why
        "model.fp8_blocks_on_host": (cfg.model.fp8_blocks_on_host > 0, "its hooks move each block's weights to the "
                                     "GPU around the block's call, which the compiled call would trace"),
        "train.activation_offload": (cfg.train.activation_offload, "not tested with compiled blocks (CUDA only, and "
                                     "no GPU ran it yet)"),
        "parallel": (p.ulysses_degree * p.ring_degree > 1, "the context-parallel exchange inside a compiled block is "
                     "not tested"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise ConfigError(f"speed.compile with {key}: {why}; set speed.compile: false, or turn {key} off")


def _has_cuda() -> bool:
    """torch.cuda.is_available(), imported here only: the rest of the config loads without torch,
    so a config error answers before torch's import (bench/RESULTS.md, section 9)."""
    import torch

    return torch.cuda.is_available()
