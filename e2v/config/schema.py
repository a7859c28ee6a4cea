"""The config schema: every key a user can write is a field of the dataclasses below, its bounds
declared beside it (`bounded(..., min=1)`, checked by e2v.config.checks) and whether it shapes
the cached tensors (`cached(...)`, read by e2v/data/store.py's fingerprint). The
schema is one table a user reads through (about 650 lines, a section a dataclass); splitting it
would scatter the keys of one YAML across files.

The shape rules derived from these keys live in e2v/config/shapes.py, loading and `--set`
overrides in e2v/config/load.py, the cross-field checks in e2v/config/checks.py, foreign formats
in e2v/config/seed_formats.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]  # e2v/config/schema.py -> the repository


def resolve_repo_path(p: str) -> Path:
    """Paths like ds_configs/zero2.json resolve against the cwd first, then the repository."""
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


class ConfigError(ValueError):
    """A config problem, phrased for the user: which key, what is wrong, how to fix it."""


class ConfigProblems(ConfigError):
    """Every problem of one file at once (e2v/config/load.py's _build: unknown keys, wrong types,
    missing keys, in every section and list item; a seed JSON's unknown keys), so one run names them
    all instead of one per run. One problem reads exactly as its own ConfigError; several get a
    count, the file, and a line each."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems, self.source = problems, source
        where = f" in {source}" if source else ""
        super().__init__(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems{where}:\n" + "\n".join(f"  {q}" for q in problems))


def bounded(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, note: str = "",
            shapes_cache: bool = False, **bounds: float) -> Any:
    """A field with its allowed range beside it: min / max (inclusive), gt / lt (exclusive); on a
    list field each item is checked. `note` is appended to the error (why, or what 0 means)."""
    assert set(bounds) <= {"min", "max", "gt", "lt"}, bounds
    return field(default=default, default_factory=default_factory,
                 metadata={"bounds": bounds, "note": note, "shapes_cache": shapes_cache})


def cached(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field whose value shapes the tensors tools/precompute.py stores: the cache fingerprint
    (e2v/data/store.py) holds every such field, so changing one makes the entries stale, by name."""
    return field(default=default, default_factory=default_factory, metadata={"shapes_cache": True})


def cache_shaping_values(cfg: Any, prefix: str = "") -> dict[str, str]:
    """Dotted key -> JSON value of every field declared `cached` (or bounded with shapes_cache)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("shapes_cache"):
            plain = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else (
                [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
                if isinstance(value, list) else value)
            out[f"{prefix}{f.name}"] = json.dumps(plain, sort_keys=True)
        elif dataclasses.is_dataclass(value):
            out.update(cache_shaping_values(value, f"{prefix}{f.name}."))
    return out


# pad_white / center_crop: A2's arithmetic; fit_pad_white: SkyReels-V3's and Phantom's (fit inside,
# LANCZOS, centre-padded white); crop_bilinear: ComfyUI's (centre crop, bilinear): e2v/data/media.py
Preprocess = Literal["resize", "center_crop", "pad_white", "letterbox", "fit_pad_white", "crop_bilinear"]


@dataclass
class ElementVAE:
    repeat: int = bounded(1, min=1)  # frames this element occupies in the condition video (A2: 1, 4, 4)
    position: int = 0  # order in the condition video; missing optional elements are compacted
    preprocess: Optional[Preprocess] = None  # None -> processors.vae.default_preprocess


@dataclass
class ElementCLIP:
    preprocess: Optional[Preprocess] = None  # None -> processors.clip.default_preprocess


@dataclass
class Element:
    name: str
    suffixes: list[str]
    required: bool = True
    vae: Optional[ElementVAE] = field(default_factory=ElementVAE)  # None: not in the VAE stream
    clip: Optional[ElementCLIP] = field(default_factory=ElementCLIP)  # None: not in the CLIP stream


@dataclass
class OpenS2V:
    """How an `opens2v` dataset's entries become samples (e2v/data/opens2v.py; docs/formats.md, "OpenS2V-5M")."""
    caption_fields: list[str] = field(default_factory=lambda: ["face_cap_qwen", "cap"])  # first present wins
    frame_range_fields: list[str] = field(default_factory=lambda: ["face_cut", "cut"])  # valid [start, end)
    # class names (lower case, whole name) whose masks fill the subject elements; the rest fill objects
    subject_classes: list[str] = field(default_factory=lambda: [
        "person", "man", "woman", "boy", "girl", "child", "kid", "baby", "people", "human", "individual",
        "lady", "gentleman", "human head", "face"])
    # class names that are scene, not a reference (besides the entry's own word_tags.background)
    background_classes: list[str] = field(default_factory=lambda: [
        "background", "scene", "sky", "grass", "lawn", "park", "field", "wall", "floor", "ground", "road", "street",
        "room", "water", "sea", "beach", "forest", "building", "city"])
    # filled in order, best GME first; names the config has not are skipped (configs/e2v.yaml: subject,
    # the tiny configs: person)
    subject_elements: list[str] = field(default_factory=lambda: ["subject", "person"])
    object_elements: list[str] = field(default_factory=lambda: ["object"])
    background_element: Optional[str] = "background"  # null: no background reference
    min_aesthetic: float = 0.0  # a mask's aes_score below this: dropped (counted)
    min_gme: float = 0.0  # a mask's gme_score (text-image match of its class name) below this: dropped
    max_subjects: int = bounded(2, min=1, note="(references cut per sample, subjects and objects together)")
    background_root: Optional[str] = None  # the dataset's own backgrounds, <root>/<entry key>.png
    nexus_images_root: Optional[str] = None  # generated views, <root>/<entry key>/<n>_<class>.png
    cross_pairs_path: Optional[str] = None  # cross-video pairs JSON: references from another entry's frame
    references_dir: Optional[str] = None  # where the cut references are written (default <data_root>/.e2v_opens2v)


@dataclass
class Dataset:
    data_root: str = ""  # folder of ID.mp4 / ID.txt / ID<suffix> (e2v); csv / jsonl: metadata_path's base
    dataset_type: Literal["e2v", "csv", "jsonl", "opens2v"] = "e2v"
    # csv / jsonl file (relative to data_root if not absolute); opens2v: a JSON part or a glob of them
    metadata_path: Optional[str] = None
    # folder the csv / jsonl paths are relative to (default: the metadata file's folder)
    media_root: Optional[str] = None
    # sampling weight when several datasets are mixed
    weight: float = bounded(1.0, gt=0, note="(remove the dataset instead)")
    repeat: int = bounded(1, min=1)  # times each sample appears per epoch
    opens2v: OpenS2V = field(default_factory=OpenS2V)  # read by dataset_type opens2v only


# A real reference photo is at most a few tens of megapixels (a 50 MP camera: 8192 x 6144); a
# larger image costs seconds and GBs to decode per load and is more likely a mistake or a bomb.
MAX_IMAGE_PIXELS = 50_000_000


@dataclass
class Data:
    datasets: list[Dataset] = field(default_factory=list)
    elements: list[Element] = cached(default_factory=list)
    num_frames: int = 81  # F, must be 4k+1 (Wan's causal VAE: T = (F-1)/4 + 1 latent frames)
    resolution: list[int] = field(default_factory=lambda: [480, 832])  # [H, W] of the target video
    resolution_policy: Literal["error", "round"] = "error"  # sizes not a multiple of 16
    reshape_mode: Literal["bicubic", "bilinear", "area", "nearest"] = cached("bicubic")
    video_resize: Literal["center_crop", "resize"] = cached("center_crop")  # how clips reach resolution
    # take every n-th frame of the clip (with fps: every n-th sample)
    frame_stride: int = bounded(1, min=1, shapes_cache=True)
    # Sample frames by time at this rate from the container's timestamps (the frame nearest each
    # t0 + k / fps), so a variable-rate clip keeps its motion speed; null: by index. Not for .npz.
    fps: Optional[float] = bounded(None, gt=0, note="(null samples frames by index)", shapes_cache=True)
    # Video regression seed: each clip trains at its largest k * factor + 1 frames up to num_frames
    # (auto frame buckets in steps of factor, so a short clip trains shorter instead of failing).
    time_division_factor: Optional[int] = None
    # Per clip, the largest count of frame_buckets the clip supports (empty list: 17, 33, ... up to
    # num_frames); off: every clip gives num_frames frames (too short = a bad sample).
    auto_frame_buckets: bool = False
    frame_buckets: list[int] = field(default_factory=list)  # allowed 4k+1 counts for auto buckets
    resolution_buckets: list[list[int]] = field(default_factory=list)  # [[H, W], ...]: nearest aspect wins
    # A bucket with fewer samples than micro_batch_size x world size: error (named at start),
    # repeat (its samples repeat within a step) or drop (its samples leave training, listed).
    small_bucket: Literal["error", "repeat", "drop"] = "error"
    remove_common_llm_caption_prefixes: bool = False
    # DataLoader worker processes per rank; null = auto: with CUDA min(4, CPU cores per local rank)
    # (a sample's load at 81 x 480 x 832, bench/RESULTS.md section 3, on the main thread stalls the
    # GPU), without CUDA 0.
    num_workers: Optional[int] = bounded(None, min=0)
    prefetch_factor: int = bounded(2, min=1)
    on_bad_sample: Literal["error", "skip"] = "error"
    shuffle: bool = True
    # How a reference file becomes 8-bit RGB (e2v/data/media.py's READERS; docs/data.md, "How a
    # reference is read"): white composites transparency on white and scales 16-bit greys by 1/257
    # (A2's subjects are cut-outs on white); convert is Pillow's convert("RGB") alone, as diffusers'
    # load_image in SkyReels-V3's pipeline (the colour stored under transparency kept, 16-bit greys
    # clipped at 255); auto: convert in the sequence layout, white in the others.
    reference_read: Literal["auto", "white", "convert"] = cached("auto")
    # larger element images are bad samples, named
    max_image_pixels: int = bounded(MAX_IMAGE_PIXELS, min=1, note=f"(default {MAX_IMAGE_PIXELS}, a 50 MP photo)")
    # csv / jsonl paths (and e2v-folder symlinks) that resolve outside data_root (or media_root
    # when set) are bad samples unless true: a shared metadata file cannot read arbitrary files
    allow_outside_root: bool = False


@dataclass
class VAEProcessor:
    resolution: Optional[list[int]] = None  # must equal data.resolution when given (seed key)
    combine: Literal["before", "after"] = cached("before")  # one VAE pass over the condition video (A2)
    default_preprocess: Preprocess = cached("pad_white")
    frame_conditioning: Literal["full", "index", "prefix", "random", "first_and_last"] = cached("full")
    frame_index: int = cached(0)
    concatenate_mask: bool = True
    sample_mode: Literal["argmax", "sample"] = "argmax"


@dataclass
class CLIPProcessor:
    resolution: list[int] = field(default_factory=lambda: [512, 512])
    default_preprocess: Preprocess = "pad_white"


@dataclass
class Processors:
    vae: VAEProcessor = field(default_factory=VAEProcessor)
    clip: CLIPProcessor = cached(default_factory=CLIPProcessor)


@dataclass
class Sequence:
    """The sequence layout (`target_layout: sequence`; e2v/conditioning/sequence.py, docs/conditioning.md)."""
    # reference slots: SkyReels-V3 R2V pads to 4 with zero slots; null: as many as references (Phantom)
    slots: Optional[int] = bounded(4, min=1, note="(null: as many slots as references, Phantom's layout)")
    place: Literal["after", "before"] = "after"  # the slots after the video's frames (V3, Phantom) or before
    # Also train the slots' outputs (to velocity 0: a clean frame stays itself). Off by default: V3 and
    # Phantom drop those outputs at inference, and Concat-ID and BindWeave slice them off before the loss.
    loss_on_references: bool = False

    @property
    def after(self) -> bool:
        return self.place == "after"


@dataclass
class Conditioning:
    reference_dropout: float = bounded(0.0, min=0, max=1)  # A2: 0.1 (drops all: zero cond, zero mask, zero CLIP tokens)
    caption_dropout: float = bounded(0.0, min=0, max=1)  # A2: 0.3 (empty-prompt embedding)
    # overlay: the target is the clip; prepend: reference frames then the clip (docs/conditioning.md);
    # clean_prefix (Wan2.2 TI2V): each reference a clean latent frame before the clip's, timestep 0,
    # the loss on the clip's frames only (e2v/conditioning/ti2v.py)
    # sequence (SkyReels-V3 R2V, Phantom): each reference a clean latent slot after the video's frames,
    # the sample's timestep on every token, the loss on the video's frames (e2v/conditioning/sequence.py)
    target_layout: Literal["overlay", "prepend", "clean_prefix", "sequence"] = "overlay"
    target_sample_mode: Literal["argmax", "sample"] = "argmax"  # target latents: mean or sample
    sequence: Sequence = field(default_factory=Sequence)  # read by target_layout: sequence only


@dataclass
class LoRA:
    rank: int = bounded(16, min=1)
    alpha: float = 16.0
    dropout: float = bounded(0.0, min=0, lt=1)
    target_modules: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]
    )
    init_weights: Literal["gaussian", "default"] = "default"


@dataclass
class TinyShape:
    """The tiny preset's transformer size (e2v/models/tiny.py; its defaults are the tests' ~30k-parameter
    model). Width = heads x head_dim; Wan's rope splits head_dim into time / height / width parts
    of 2 * (head_dim // 6) each for height and width, so it must be even and at least 6."""
    layers: int = bounded(2, min=1)
    heads: int = bounded(2, min=1)
    head_dim: int = bounded(12, min=6, note="(even: Wan's rope splits it in pairs)")
    ffn_dim: int = bounded(32, min=1)


@dataclass
class Model:
    # random-weight parts built in code (CPU demo, tests): tiny (Wan2.1: I2V, or T2V with base t2v),
    # tiny_ti2v (Wan2.2 TI2V-5B's layout: 48-channel VAE, 16x space, no image attention),
    # tiny_wan22_a14b (Wan2.2 I2V-A14B's two experts)
    preset: Optional[Literal["tiny", "tiny_ti2v", "tiny_wan22_a14b"]] = cached(None)
    tiny: TinyShape = field(default_factory=TinyShape)  # a tiny preset's transformer size
    pretrained: Optional[str] = cached(None)  # diffusers folder or hub id (Wan2.1-*, Wan2.2-*-Diffusers)
    base: Literal["auto", "i2v", "t2v"] = "auto"  # t2v: widen patch embedding + add image attention
    image_encoder: Optional[str] = cached(None)  # CLIP folder for T2V bases (I2V folders carry image_encoder/)
    training_type: Literal["lora", "full"] = "lora"
    weight_dtype: Literal["fp32", "bf16"] = cached("bf16")  # frozen encoders (VAE and CLIP stay fp32 as in A2)
    # The VAE's dtype. fp32 as A2's inference encodes; bf16 halves its weights and speeds the two
    # encodes of an online step (bench/gpu_check.py measures the time and the latent error).
    vae_dtype: Literal["fp32", "bf16"] = cached("fp32")
    tiny_seed: int = cached(0)
    tiny_vae: Literal["informative", "random"] = cached("informative")
    zero3_init: bool = True  # ZeRO-3 + pretrained: partition the transformer at load, stream it from rank 0
    # The fp32 VAE's matmuls and convolutions in TF32 on Ampere+ GPUs (faster encodes for a small
    # relative rounding: bench/RESULTS.md, section 7: `vae_tf32`); false: full fp32. No effect without CUDA.
    vae_tf32: bool = True
    # A two-expert base (Wan2.2-I2V-A14B): the expert trained, high_noise (timesteps >= boundary_ratio x
    # 1000) or low_noise, alone; or both (memory doubles). Required there, an error elsewhere (e2v/config/experts.py).
    expert: Optional[Literal["high_noise", "low_noise", "both"]] = None
    # The frozen transformer weights: train (the training dtype, train.mixed_precision) or fp8: the
    # Linear layers of the blocks stored in float8 e4m3 with a per-channel scale, upcast per layer in
    # the forward (~1 byte per weight: 14B on a 24 GB card; LoRA only, ZeRO-2; docs/memory.md).
    base_dtype: Literal["train", "fp8"] = "train"
    # With base_dtype fp8: the last N blocks' fp8 weights stay in host RAM and are copied to the GPU
    # for each use of their block (forward, and its recompute under checkpointing): ~0.35 GB of GPU
    # per 14B block saved, 2 x that of PCIe traffic per step (docs/memory.md).
    fp8_blocks_on_host: int = bounded(0, min=0)
    # A CausVid / Self-Forcing generator checkpoint (a .pt holding {"generator": ..., "generator_ema": ...}
    # in the original Wan names) loaded into the transformer after model.pretrained and before the LoRA
    # or the full fine-tune (CausVid's generator_ckpt; e2v/models/causvid_ckpt.py, docs/causal.md)
    generator_ckpt: Optional[str] = None
    generator_ckpt_dict: Literal["generator", "generator_ema"] = "generator"  # which state dict of the file


@dataclass
class Flow:
    shift: float = bounded(5.0, gt=0)  # Wan scripts: 5 (3 for I2V 480p); A2 samples with 8
    sigma_sampling: Literal["uniform", "logit_normal"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = bounded(1.0, gt=0)
    weighting: Literal["none", "cosmap", "sigma_sqrt"] = "none"
    objective: Literal["flow", "x0"] = "flow"  # x0: video regression (clean-latent target)
    # timesteps [0, 1000] to train at; 0 marks clean frames (no noise, no loss: the context of later
    # blocks under task: causal); a list of zeros alone trains nothing (e2v/config/checks.py)
    denoising_step_list: list[float] = bounded(default_factory=list, min=0, max=1000,
                                               note="(a timestep; 0: a clean frame, no loss)")
    # CausVid's and Self-Forcing's warp_denoising_step: each listed t is replaced by the training grid's
    # timestep 1000 - t places from its start (the 1000-point grid of flow.shift, e2v/train/flow.py:
    # training_grid), so [1000, 750, 500, 250] at shift 8 trains at [1000, 960, 889, 727]
    warp_denoising_step: bool = False


@dataclass
class Train:
    max_steps: int = bounded(1000, min=1)
    lr: float = bounded(1e-4, gt=0)
    micro_batch_size: int = bounded(1, min=1)
    gradient_accumulation_steps: int = bounded(1, min=1)
    grad_clip: float = bounded(1.0, gt=0)
    warmup_steps: int = bounded(0, min=0)
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = bounded(0.0, min=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-8, gt=0)
    mixed_precision: Literal["bf16", "no"] = "bf16"
    gradient_checkpointing: bool = False
    trainable: list[str] = field(default_factory=list)  # module-name regexes trained in full
    checkpoint_every: int = bounded(500, min=0)  # 0: no periodic saves (the end-of-run and stop-signal saves stay)
    checkpoint_every_minutes: float = bounded(0.0, min=0)  # 0: off
    keep_last: int = bounded(3, min=0, note="(0: keep all)")
    log_every: int = bounded(1, min=1)
    # Where the scalars and images go: tensorboard (<run>/tb), wandb (Weights & Biases, `wandb:` below;
    # needs `pip install wandb`), or both. scalars.jsonl is written either way (docs/outputs.md).
    log_to: Literal["tensorboard", "wandb", "both"] = "tensorboard"
    # The GPU's dense bf16 peak for perf/mfu; null: looked up from the GPU's name (e2v/train/flops.py's
    # table; an unknown GPU or a CPU logs no MFU). Set it for a card the table lacks, or a clock-capped one.
    peak_tflops: Optional[float] = bounded(None, gt=0)
    skip_nonfinite: bool = False  # skip (and count) a micro-batch whose loss, or a step whose grad norm, is inf/nan
    # Offload the activations saved for backward to CPU RAM (torch.autograd.graph.save_on_cpu):
    # with gradient checkpointing only the per-block inputs are saved, ~13 GB bf16 for 14B at
    # 480p x 81 frames (tools/estimate_memory.py). CUDA only; on a CPU-only machine a no-op.
    activation_offload: bool = False
    # Also export the LoRA run's transformer, LoRA fused, as one ComfyUI diffusion-model file (a full
    # fine-tune always writes it): what ComfyUI needs when train.trainable holds scale_shift_table,
    # which its LoRA loader drops (docs/comfyui.md). Rank 0 holds the model in fp32 while fusing.
    export_comfyui_checkpoint: bool = False
    # An exponential moving average of the trained weights (e2v/train/ema.py; Self-Forcing's keys):
    # after each optimizer step from ema_start_step, ema = ema_weight * ema + (1 - ema_weight) * weights.
    # Validation samples with it, checkpoints carry it and the run exports it as lora_ema/. 0: off.
    ema_weight: float = bounded(0.0, min=0, lt=1, note="(0: no EMA; Self-Forcing uses 0.99)")
    ema_start_step: int = bounded(0, min=0, note="(the first optimizer step averaged)")


@dataclass
class Causal:
    """The causal (autoregressive) task, `task: causal` (e2v/models/causal.py, docs/causal.md): CausVid's
    block-causal Wan. The latent frames form blocks of `frames_per_block`; a token of block b attends to
    every token of blocks 0..b (its own block in full) and to nothing later; each latent frame has its
    own timestep, drawn per block. The same network and parameter names as the bidirectional model."""
    frames_per_block: int = bounded(3, min=1, note="(latent frames per block: CausVid's num_frame_per_block)")
    # latent frame 0 (the causal VAE encodes pixel frame 0 alone) as a block of its own, then blocks of
    # frames_per_block (Self-Forcing's independent_first_frame)
    independent_first_frame: bool = False
    # how the block mask is applied: flex (FlexAttention with a block mask), blocks (one exact attention
    # call per block: its queries against the keys of blocks 0..b), auto (flex where it runs, else blocks)
    attention: Literal["auto", "flex", "blocks"] = "auto"
    # sampling: how the x0 estimate goes on to the next listed t. fresh: with new noise (CausVid's and
    # Self-Forcing's inference, what their distilled models expect); predicted: with the noise the
    # prediction implies, (x_t - (1 - sigma) x0) / sigma, i.e. a deterministic DDIM step (an Euler step
    # of the flow ODE), which keeps what the earlier steps decided: sharper samples from a
    # regression-stage model (docs/causal.md, "The demo")
    renoise: Literal["fresh", "predicted"] = "fresh"


@dataclass
class DeepSpeed:
    config: str = "ds_configs/zero2.json"
    # torch_adamw: torch.optim.AdamW, fused where CUDA is (on the GPU, or on the CPU under optimizer
    # offload): in the wheel, nothing to build, bit-exact resume. deepspeed_adam: DeepSpeed's
    # FusedAdam (CPU Adam under offload), JIT-built unless prebuilt, in a preflight before any
    # weight loads; a resumed run drifts ~1e-4 (docs/gpu_runs.md). adamw_8bit: bitsandbytes'
    # AdamW8bit, 8-bit moments (2 bytes of state per trained weight instead of 8), CPU and CUDA,
    # nothing to build, exact resume (docs/memory.md).
    optimizer: Literal["torch_adamw", "deepspeed_adam", "adamw_8bit"] = "torch_adamw"


# Keys that were removed, with what replaces them (load_config names the replacement).
REMOVED_KEYS = {
    "deepspeed.torch_adam": "replaced by deepspeed.optimizer: torch_adamw (the default now; was torch_adam: true "
                            "or unset) or deepspeed_adam (was torch_adam: false); delete the line or rename it",
}


@dataclass
class Parallel:
    # Context parallelism (docs/context_parallel.md): one sample's video tokens split over
    # ulysses_degree x ring_degree ranks, which see the same micro-batch; the launched processes
    # form world / (U x R) data-parallel groups. 1 x 1: plain data parallelism.
    ulysses_degree: int = bounded(1, min=1, note="(DeepSpeed Ulysses: must divide the attention heads)")
    ring_degree: int = bounded(1, min=1, note="(ring attention over the Ulysses head shards)")


@dataclass
class WandB:
    """Weights & Biases, read when train.log_to is wandb or both (e2v/train/runlog.py)."""
    project: str = "e2v"
    entity: Optional[str] = None  # your user or team; null: wandb's default entity
    run_name: Optional[str] = None  # null: the run folder's name
    # online: synced as it runs (needs `wandb login` or WANDB_API_KEY); offline: written under
    # <run>/wandb only, `wandb sync <run>/wandb/offline-run-*` uploads it later. WANDB_MODE overrides.
    mode: Literal["online", "offline"] = "online"


# diffusers' attention backends a run may name (e2v/models/speed.py's BACKENDS says what each needs;
# docs/speed.md). The Hub-kernel ones (`*_hub`) are left out: they download a kernel at run time.
AttentionBackend = Literal["native", "flex", "_native_flash", "_native_cudnn", "flash", "_flash_3",
                           "_flash_varlen_3", "sage", "xformers"]


@dataclass
class Speed:
    """How the transformer runs, not what it computes (e2v/models/speed.py, docs/speed.md): the
    attention kernel, regional compilation of the repeated block, TF32 and cuDNN. No key here
    changes a parameter or checkpoint name; each changes the numbers by at most its kernel's
    rounding."""
    # diffusers' attention backend for every attention of the transformer in training and validation
    # losses. native: torch's scaled_dot_product_attention, which picks flash / efficient / cuDNN itself.
    attention_backend: AttentionBackend = "native"
    # The backend of generated videos (validation videos, tools/sample.py); null: attention_backend.
    # Where a backend without a backward (sage, _flash_3) goes: inference only.
    sampling_attention_backend: Optional[AttentionBackend] = None
    # torch.compile of each WanTransformerBlock in place (diffusers' compile_repeated_blocks): the
    # first steps pay the compile (~1 min on a 2-core CPU: bench/RESULTS.md, section 10), names stay.
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # How the compiled block meets new shapes (buckets): auto (torch's: the first shape static, the
    # second compiles one dynamic graph that serves every later one), dynamic (one dynamic graph from
    # the first call), static (one graph per shape: the fastest kernels, a compile per bucket).
    compile_shapes: Literal["auto", "dynamic", "static"] = "auto"
    # inductor generates kernels; aot_eager / eager stop before it (to find which stage breaks)
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # The transformer's fp32 matmuls (a mixed_precision: 'no' run, the modules kept in fp32) in TF32
    # on Ampere+ GPUs: ~1e-3 relative rounding for up to ~8x the fp32 throughput. torch's default: off.
    matmul_tf32: bool = False
    # cuDNN convolutions (the patch embedding) in TF32: torch's default, on.
    cudnn_tf32: bool = True
    # cuDNN tries its algorithms per new input shape and keeps the fastest: each bucket pays it once.
    cudnn_benchmark: bool = False


@dataclass
class Cache:
    enabled: bool = False
    dir: Optional[str] = None  # default <data_root>/.e2v_cache (one sub-folder per dataset)
    dtype: Literal["fp32", "bf16"] = cached("fp32")  # stored tensors; bf16 halves the disk, fp32 is exact


@dataclass
class ValidationSet:
    prompt: str
    elements: dict[str, str] = field(default_factory=dict)  # element name -> image path


@dataclass
class SubjectColour:
    """Which elements the subject-colour metrics read (e2v/eval/fidelity.py): data whose subject is one
    flat colour on white, such as the demo's."""
    subject: str  # the element whose reference holds the subject
    # the element seen behind it, at the video's framing; none: each place's median over the frames
    background: Optional[str] = None
    distractors: list[str] = field(default_factory=list)  # elements in view whose colour is not the subject's


@dataclass
class Validation:
    every_n_steps: int = bounded(0, min=0)  # 0: off. Also runs at step 0 and at the last step (e2v/eval/validation.py)
    # Fixed sigmas of the validation loss and the reference gaps; keep 0.9: references matter
    # most at high noise; at low sigma the noisy input already shows the scene (e2v/eval/validation.py).
    sigmas: list[float] = bounded(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], gt=0, lt=1)
    num_samples: int = bounded(4, min=0)  # sample ids held out of training (when every_n_steps > 0), validated on
    seed: int = 1234  # validation noise and sampling: its own generators, never the training RNG
    # Where the generated videos' generator lives (e2v/eval/sampling.py's noise_generator): cpu (the same
    # video on every machine) or device, the sampling device (SkyReels-V3's pipeline seeds a CUDA
    # generator: on CUDA the same seed then gives its noise). Validation's losses always draw on the CPU.
    generator_device: Literal["cpu", "device"] = "cpu"
    sets: list[ValidationSet] = field(default_factory=list)  # generate videos from these
    num_videos: int = bounded(1, min=0)  # without sets: generate from the first n held-out samples' references
    num_inference_steps: int = bounded(20, min=1)
    guidance_scale: float = 5.0
    # Phantom's dual guidance (three passes: the third with the negative prompt and no references, all
    # slots zero in the sequence layout) with this image scale; null: text-only CFG. Used when guidance_scale > 1.
    image_guidance_scale: Optional[float] = None
    sample_shift: float = 8.0  # UniPC flow shift at sampling (A2: 8, SkyReels-V3 R2V: 5)
    negative_prompt: str = ""
    # val/sample_reference_match|swap on the held-out videos (e2v/eval/fidelity.py); null: off. Each swap
    # video (sample i with sample i+1's references) is a second generation.
    subject_colour: Optional[SubjectColour] = None


@dataclass
class VisProcessor:
    type: Literal["latent_save", "vae_decode"]
    data: list[str] = field(default_factory=lambda: ["input_latents", "predicted_latents"])
    format: Optional[str] = None  # latent_save: pt | safetensors; vae_decode: png. None: the type's first
    frames: list[int] = field(default_factory=lambda: [0, -1])  # vae_decode: frames written as PNG
    video: bool = False  # vae_decode: also an mp4 per sample


# Visualization data names (docs/formats.md, "Visualization data names"); e2v/eval/viz.py documents
# each tensor.
VIS_DATA = ("input_latents", "noisy_latents", "conditioned_latents", "predicted_latents", "reference_images")
VIS_FORMATS = {"latent_save": ("pt", "safetensors"), "vae_decode": ("png",)}


@dataclass
class Visualization:
    enabled: bool = False
    output_dir: str = "visualizations"  # relative to the run folder; may contain {run_id}
    frequency: int = bounded(100, min=1)
    processors: list[VisProcessor] = field(default_factory=list)
    sheet_frames: list[int] = field(default_factory=lambda: [0, -1])  # contact sheet: target | prediction frames


@dataclass
class Config:
    e2v_type: Literal["dual", "vae", "clip", "none"] = cached("dual")
    # bidirectional: every token attends to every token, one timestep per sample (Wan as released);
    # causal: the block-causal model of `causal:` (CausVid's generator_task: causal_video)
    task: Literal["bidirectional", "causal"] = "bidirectional"
    output_dir: str = "runs"
    run_id: Optional[str] = None  # default: <config name>-<timestamp>
    seed: int = 42
    model: Model = field(default_factory=Model)
    lora: LoRA = field(default_factory=LoRA)
    data: Data = field(default_factory=Data)
    processors: Processors = field(default_factory=Processors)
    conditioning: Conditioning = field(default_factory=Conditioning)
    flow: Flow = field(default_factory=Flow)
    causal: Causal = field(default_factory=Causal)  # read by task: causal only
    train: Train = field(default_factory=Train)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    parallel: Parallel = field(default_factory=Parallel)
    speed: Speed = field(default_factory=Speed)
    cache: Cache = field(default_factory=Cache)
    validation: Validation = field(default_factory=Validation)
    visualization: Visualization = field(default_factory=Visualization)
    wandb: WandB = field(default_factory=WandB)

    # -- derived views used across modules ------------------------------------------------------
    @property
    def uses_vae_condition(self) -> bool:
        return self.e2v_type in ("dual", "vae")

    @property
    def uses_clip(self) -> bool:
        return self.e2v_type in ("dual", "clip")

    def reference_frames(self, names=None) -> int:
        """Condition-video frames the named elements (all of them by default) take at the start of
        the condition video: the sum of their vae.repeat; 0 without a VAE stream, and 0 in the
        clean_prefix and sequence layouts (the references are latent frames of their own, beside the
        clip's). The one place F_ref is counted (the mask, the prepend layout, the cache, the
        sampler's dropped frames)."""
        if not self.uses_vae_condition or self.conditioning.target_layout in ("clean_prefix", "sequence"):
            return 0
        return sum(e.vae.repeat for e in self.data.elements if e.vae is not None and (names is None or e.name in names))

    @property
    def reference_reading(self) -> str:
        """data.reference_read with `auto` resolved: `convert` (SkyReels-V3's pipeline reads its
        references so) in the sequence layout, `white` (A2's) in the others. The one place every
        reader of a reference (the loader, the start-up check, validation, tools/sample.py) asks."""
        if self.data.reference_read != "auto":
            return self.data.reference_read
        return "convert" if self.conditioning.target_layout == "sequence" else "white"

    def vae_preprocess(self, element: Element) -> str:
        """The element's VAE-pathway preprocess mode: its own `vae.preprocess`, else
        `processors.vae.default_preprocess`."""
        return element.vae.preprocess or self.processors.vae.default_preprocess

    def clip_preprocess(self, element: Element) -> str:
        """The element's CLIP-pathway preprocess mode: its own `clip.preprocess`, else
        `processors.clip.default_preprocess`."""
        return element.clip.preprocess or self.processors.clip.default_preprocess

    @property
    def vae_elements(self) -> list[Element]:
        """Elements in the VAE stream, in `vae.position` order."""
        return sorted((e for e in self.data.elements if e.vae is not None), key=lambda e: e.vae.position)

    @property
    def ordered_elements(self) -> list[Element]:
        """All elements in condition order: VAE position, then CLIP-only elements in config order."""
        order = sorted(enumerate(self.data.elements), key=lambda ie: (0, ie[1].vae.position) if ie[1].vae else (1, ie[0]))
        return [e for _, e in order]

    @property
    def clip_elements(self) -> list[Element]:
        """Elements in the CLIP stream, in condition order (their token blocks follow it)."""
        return [e for e in self.ordered_elements if e.clip is not None]




def schema_keys() -> dict[str, list[str]]:
    """Field name -> the dotted keys it has in the schema, shallowest first ("lr" -> ["train.lr"];
    a list of sections is written `data.elements[]`). Error hints for a key in the wrong section."""
    out: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            out.setdefault(f.name, []).append(key)
            sub = _section_type(cls, f.name)
            if sub is not None:
                walk(sub[0], f"{key}{'[]' if sub[1] else ''}.")

    walk(Config, "")
    return {name: sorted(keys, key=lambda k: k.count(".")) for name, keys in out.items()}


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints(cls), evaluated once per class: the annotations are strings (postponed
    evaluation), and evaluating them per field made loading a config take ~0.4 s of the start-up."""
    return typing.get_type_hints(cls)


def _section_type(cls: type, name: str) -> tuple[type, bool] | None:
    """(dataclass, is a list of them) when field `name` of cls holds sections, else None."""
    tp = type_hints(cls)[name]
    is_list = typing.get_origin(tp) is list
    for arg in (typing.get_args(tp) if is_list or typing.get_origin(tp) else (tp,)):
        if dataclasses.is_dataclass(arg):
            return arg, is_list
    return None
