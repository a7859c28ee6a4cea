"""One typed config: YAML (or a seed JSON dataset config) -> dataclasses, `--set` overrides,
validation that names the key and the fix, and the resolved YAML written to the run folder.

Every key a user can write is a dataclass field below; anything else is an error that names the
dotted path and the nearest valid name (diffusion-pipe silently ignores typos; we do not).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from e2v.device import choose_adam


class ConfigError(ValueError):
    """A config problem, phrased for the user: which key, what is wrong, how to fix it."""


Preprocess = Literal["resize", "center_crop", "pad_white", "letterbox"]


@dataclass
class ElementVAE:
    repeat: int = 1  # frames this element occupies in the condition video (A2: 1, 4, 4)
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
class Dataset:
    data_root: str = ""  # folder of ID.mp4 / ID.txt / ID<suffix> (e2v); csv / jsonl: metadata_path's base
    dataset_type: Literal["e2v", "csv", "jsonl"] = "e2v"
    metadata_path: Optional[str] = None  # csv / jsonl file (relative to data_root if not absolute)
    # folder the csv / jsonl paths are relative to (default: the metadata file's folder)
    media_root: Optional[str] = None
    weight: float = 1.0  # sampling weight when several datasets are mixed
    repeat: int = 1  # times each sample appears per epoch


# A real reference photo is at most a few tens of megapixels (a 50 MP camera: 8192 x 6144); a
# larger image costs seconds and GBs to decode per load and is more likely a mistake or a bomb.
MAX_IMAGE_PIXELS = 50_000_000


@dataclass
class Data:
    datasets: list[Dataset] = field(default_factory=list)
    elements: list[Element] = field(default_factory=list)
    num_frames: int = 81  # F, must be 4k+1 (Wan's causal VAE: T = (F-1)/4 + 1 latent frames)
    resolution: list[int] = field(default_factory=lambda: [480, 832])  # [H, W] of the target video
    resolution_policy: Literal["error", "round"] = "error"  # sizes not a multiple of 16
    reshape_mode: Literal["bicubic", "bilinear", "area", "nearest"] = "bicubic"
    video_resize: Literal["center_crop", "resize"] = "center_crop"  # how clips reach resolution
    frame_stride: int = 1  # take every n-th frame of the clip
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
    # (decoding 81 x 480 x 832 takes ~1 s: on the main thread it stalls the GPU), without CUDA 0.
    num_workers: Optional[int] = None
    prefetch_factor: int = 2
    on_bad_sample: Literal["error", "skip"] = "error"
    shuffle: bool = True
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger element images are bad samples, named
    # csv / jsonl paths (and e2v-folder symlinks) that resolve outside data_root (or media_root
    # when set) are bad samples unless true: a shared metadata file cannot read arbitrary files
    allow_outside_root: bool = False


@dataclass
class VAEProcessor:
    resolution: Optional[list[int]] = None  # must equal data.resolution when given (seed key)
    combine: Literal["before", "after"] = "before"  # one VAE pass over the condition video (A2)
    default_preprocess: Preprocess = "pad_white"
    frame_conditioning: Literal["full", "index", "prefix", "random", "first_and_last"] = "full"
    frame_index: int = 0
    concatenate_mask: bool = True
    sample_mode: Literal["argmax", "sample"] = "argmax"


@dataclass
class CLIPProcessor:
    resolution: list[int] = field(default_factory=lambda: [512, 512])
    default_preprocess: Preprocess = "pad_white"


@dataclass
class Processors:
    vae: VAEProcessor = field(default_factory=VAEProcessor)
    clip: CLIPProcessor = field(default_factory=CLIPProcessor)


@dataclass
class Conditioning:
    reference_dropout: float = 0.0  # A2: 0.1 (drops all: zero cond, zero mask, zero CLIP tokens)
    caption_dropout: float = 0.0  # A2: 0.3 (empty-prompt embedding)
    target_layout: Literal["overlay", "prepend"] = "overlay"
    target_sample_mode: Literal["argmax", "sample"] = "argmax"  # target latents: mean or sample


@dataclass
class LoRA:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]
    )
    init_weights: Literal["gaussian", "default"] = "default"


@dataclass
class Model:
    preset: Optional[Literal["tiny"]] = None  # random-weight parts built in code (CPU demo, tests)
    pretrained: Optional[str] = None  # diffusers folder or hub id (Wan2.1-*-Diffusers)
    base: Literal["auto", "i2v", "t2v"] = "auto"  # t2v: widen patch embedding + add image attention
    image_encoder: Optional[str] = None  # CLIP folder for T2V bases (I2V folders carry image_encoder/)
    training_type: Literal["lora", "full"] = "lora"
    weight_dtype: Literal["fp32", "bf16"] = "bf16"  # frozen encoders (VAE and CLIP stay fp32 as in A2)
    tiny_seed: int = 0
    tiny_vae: Literal["informative", "random"] = "informative"
    zero3_init: bool = True  # ZeRO-3 + pretrained: partition the transformer at load, stream it from rank 0


@dataclass
class Flow:
    shift: float = 5.0  # Wan scripts: 5 (3 for I2V 480p); A2 samples with 8
    sigma_sampling: Literal["uniform", "logit_normal"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    weighting: Literal["none", "cosmap", "sigma_sqrt"] = "none"
    objective: Literal["flow", "x0"] = "flow"  # x0: video regression (clean-latent target)
    denoising_step_list: list[float] = field(default_factory=list)  # timesteps (0..1000) to train at


@dataclass
class Train:
    max_steps: int = 1000
    lr: float = 1e-4
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    mixed_precision: Literal["bf16", "no"] = "bf16"
    gradient_checkpointing: bool = False
    trainable: list[str] = field(default_factory=list)  # module-name regexes trained in full
    checkpoint_every: int = 500
    checkpoint_every_minutes: float = 0.0
    keep_last: int = 3
    log_every: int = 1
    skip_nonfinite: bool = False  # skip (and count) a micro-batch whose loss, or a step whose grad norm, is inf/nan
    # Offload the activations saved for backward to CPU RAM (torch.autograd.graph.save_on_cpu):
    # with gradient checkpointing only the per-block inputs are saved, ~13 GB bf16 for 14B at
    # 480p x 81 frames (tools/estimate_memory.py). CUDA only; on a CPU-only machine a no-op.
    activation_offload: bool = False


@dataclass
class DeepSpeed:
    config: str = "ds_configs/zero2.json"
    # true: torch.optim.AdamW, bit-exact resume. false: DeepSpeed's C++ Adam (DeepSpeedCPUAdam with
    # offload), faster on GPUs but a resumed run drifts ~1e-4 (README). Unset: torch's on a
    # CPU-only machine (DeepSpeed's JIT-compiles ~45 s there), DeepSpeed's with CUDA.
    torch_adam: Optional[bool] = None


@dataclass
class Cache:
    enabled: bool = False
    dir: Optional[str] = None  # default <data_root>/.e2v_cache (one sub-folder per dataset)
    dtype: Literal["fp32", "bf16"] = "fp32"  # stored tensors; bf16 halves the disk, fp32 is exact


@dataclass
class ValidationSet:
    prompt: str
    elements: dict[str, str] = field(default_factory=dict)  # element name -> image path


@dataclass
class Validation:
    every_n_steps: int = 0  # 0: off. Also runs at step 0 and at the last step (e2v/validation.py)
    # Fixed sigmas of the validation loss and the reference gaps; keep 0.9: references matter
    # most at high noise; at low sigma the noisy input already shows the scene (e2v/validation.py).
    sigmas: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    num_samples: int = 4  # sample ids held out of training (when every_n_steps > 0), validated on
    seed: int = 1234  # validation noise and sampling: its own generators, never the training RNG
    sets: list[ValidationSet] = field(default_factory=list)  # generate videos from these
    num_videos: int = 1  # without sets: generate from the first n held-out samples' references
    num_inference_steps: int = 20
    guidance_scale: float = 5.0
    sample_shift: float = 8.0  # UniPC flow shift at sampling (A2: 8)
    negative_prompt: str = ""


@dataclass
class VisProcessor:
    type: Literal["latent_save", "vae_decode"]
    data: list[str] = field(default_factory=lambda: ["input_latents", "predicted_latents"])
    format: Optional[str] = None  # latent_save: pt | safetensors; vae_decode: png. None: the type's first
    frames: list[int] = field(default_factory=lambda: [0, -1])  # vae_decode: frames written as PNG
    video: bool = False  # vae_decode: also an mp4 per sample


# Visualization data names (docs/formats.md, "Visualization data names"); e2v/viz.py documents
# each tensor.
VIS_DATA = ("input_latents", "noisy_latents", "conditioned_latents", "predicted_latents", "reference_images")
VIS_FORMATS = {"latent_save": ("pt", "safetensors"), "vae_decode": ("png",)}


@dataclass
class Visualization:
    enabled: bool = False
    output_dir: str = "visualizations"  # relative to the run folder; may contain {run_id}
    frequency: int = 100
    processors: list[VisProcessor] = field(default_factory=list)
    sheet_frames: list[int] = field(default_factory=lambda: [0, -1])  # contact sheet: target | prediction frames


@dataclass
class Config:
    e2v_type: Literal["dual", "vae", "clip", "none"] = "dual"
    output_dir: str = "runs"
    run_id: Optional[str] = None  # default: <config name>-<timestamp>
    seed: int = 42
    model: Model = field(default_factory=Model)
    lora: LoRA = field(default_factory=LoRA)
    data: Data = field(default_factory=Data)
    processors: Processors = field(default_factory=Processors)
    conditioning: Conditioning = field(default_factory=Conditioning)
    flow: Flow = field(default_factory=Flow)
    train: Train = field(default_factory=Train)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    cache: Cache = field(default_factory=Cache)
    validation: Validation = field(default_factory=Validation)
    visualization: Visualization = field(default_factory=Visualization)

    # -- derived views used across modules ------------------------------------------------------
    @property
    def uses_vae_condition(self) -> bool:
        return self.e2v_type in ("dual", "vae")

    @property
    def uses_clip(self) -> bool:
        return self.e2v_type in ("dual", "clip")

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


# ---------------------------------------------------------------------------------------------
# dict -> dataclass, with errors that name the key
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        # `clip: false` means "not in this stream" for Optional element sub-configs.
        if value is False and type(None) in args and any(dataclasses.is_dataclass(a) for a in args):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if len(errors) == 1 else f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads `no`/`off`/`yes`/`on` as booleans
            spelled = [a for a in (("no", "off", "false") if not value else ("yes", "on", "true")) if a in allowed]
            value = spelled[0] if spelled else value
        if value not in allowed:
            near = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, allowed))}{hint}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-4" as a string; accept numeric strings explicitly.
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")


# Names other trainers use for our keys: an unknown key close to one gets our name as the hint.
KEY_ALIASES = {"learning_rate": "lr", "batch_size": "micro_batch_size", "train_batch_size": "micro_batch_size",
               "max_train_steps": "max_steps", "num_train_steps": "max_steps", "lr_warmup_steps": "warmup_steps",
               "max_grad_norm": "grad_clip", "lora_alpha": "alpha", "lora_rank": "rank", "height_width": "resolution"}


def _build(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            aliases = {a: f for a, f in KEY_ALIASES.items() if f in fields}
            near = difflib.get_close_matches(str(key), list(fields) + list(aliases), n=1, cutoff=0.5)
            near = [aliases.get(n, n) for n in near]
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key '{where}'{hint}")
        kwargs[key] = _convert(value, hints[key], where)
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{path or 'config'}: missing required key(s) {', '.join(missing)}")
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# loading, overrides, validation
# ---------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (['a', 'b'], yaml-parsed c). Values are YAML, so lists work: `x=[1,2]`."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. --set train.lr=5e-5")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def _list_index(node: list, k: str, keys: list[str], i: int) -> int:
    """`data.datasets.0.x`: the list position k names, or an error naming the key and the range."""
    where = ".".join(keys[:i])
    if not k.lstrip("-").isdigit() or not -len(node) <= int(k) < len(node):
        raise ConfigError(f"--set {'.'.join(keys)}: '{where}' is a list of {len(node)}; "
                          f"use an index 0..{len(node) - 1} after it, e.g. {where}.0.{'.'.join(keys[i + 1:]) or 'key'}")
    return int(k)


def _apply_override(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = node[_list_index(node, k, keys, i)]
            continue
        node = node.setdefault(k, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {'.'.join(keys)}: '{'.'.join(keys[: i + 1])}' is not a section")
    if isinstance(node, list):
        node[_list_index(node, keys[-1], keys, len(keys) - 1)] = value
    else:
        node[keys[-1]] = value


# The video-regression seed's top-level keys (docs/formats.md, "The video-regression seed keys")
# and where they live here.
# dataset_base_path / metadata_path / height / width are mapped by hand below.
SEED_REGRESSION_KEYS = {
    "num_frames": "data.num_frames",
    "time_division_factor": "data.time_division_factor",
    "batch_size": "train.micro_batch_size",
    "lr": "train.lr",
    "max_steps": "train.max_steps",
    "save_interval": "train.checkpoint_every",
    "denoising_step_list": "flow.denoising_step_list",
}
_SEED_REGRESSION_DATA_KEYS = ("dataset_base_path", "metadata_path", "height", "width")


def map_seed_regression(raw: dict) -> tuple[dict, list[str]]:
    """A YAML written with the regression seed's top-level keys -> our schema, plus one note per key.
    The seed trains plain T2V (e2v_type: none) with the x0 objective at its denoising_step_list
    (flow.objective: x0), unless the file sets them. Its metadata_path is read as the seed's
    scripts read it, relative to the working directory."""
    seed = {k: raw.pop(k) for k in list(raw) if k in SEED_REGRESSION_KEYS or k in _SEED_REGRESSION_DATA_KEYS}
    if not seed:
        return raw, []
    notes = []

    def put(section: str, name: str, value: Any, key: str) -> None:
        node = raw.setdefault(section, {})
        if name in node:
            raise ConfigError(f"seed key '{key}' and {section}.{name} are both set: keep one")
        node[name] = value
        notes.append(f"seed key '{key}' -> {section}.{name} = {value!r}")

    if "dataset_base_path" in seed or "metadata_path" in seed:
        # the seed's video paths are relative to dataset_base_path, wherever the CSV lives
        ds = {"data_root": seed.pop("dataset_base_path", ""), "dataset_type": "csv"}
        ds["media_root"] = ds["data_root"] or None
        if "metadata_path" in seed:
            ds["metadata_path"] = str(Path(seed.pop("metadata_path")).absolute())
        put("data", "datasets", [ds], "dataset_base_path/metadata_path")
    if "height" in seed or "width" in seed:
        h, w = Data().resolution
        put("data", "resolution", [seed.pop("height", h), seed.pop("width", w)], "height/width")
    for key, value in seed.items():
        put(*SEED_REGRESSION_KEYS[key].split("."), value, key)
    if "denoising_step_list" in seed and "objective" not in raw["flow"]:
        raw["flow"]["objective"] = "x0"
        notes.append("seed regression config: flow.objective = x0 (loss on the clean-latent estimate)")
    if "e2v_type" not in raw:
        raw["e2v_type"] = "none"
        notes.append("seed regression config: e2v_type = none (plain T2V, no elements)")
    return raw, notes


def load_raw(path: str | Path) -> dict:
    """Read a YAML config, or a seed JSON dataset config mapped onto the YAML schema."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            seed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        raw, notes = map_seed_json(seed, source=str(path))
        for note in notes:
            print(f"[e2v config] {note}")
        return raw
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    raw, notes = map_seed_regression(raw)
    for note in notes:
        print(f"[e2v config] {note}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                raw: dict | None = None, check_paths: bool = True) -> Config:
    raw = dict(raw) if raw is not None else load_raw(path)
    for text in overrides or []:
        keys, value = parse_override(text)
        _apply_override(raw, keys, value)
    cfg = _build(Config, raw, "")
    validate(cfg, base_dir=Path(path).parent if path else Path("."), check_paths=check_paths)
    return cfg


def nearest_valid_sizes(x: int, multiple: int = 16) -> tuple[int, int]:
    lo = (x // multiple) * multiple
    return lo, lo + multiple


def nearest_valid_size(x: int, multiple: int = 16) -> int:
    """The multiple of 16 nearest x (a tie rounds down: less upscaling)."""
    lo, hi = nearest_valid_sizes(x, multiple)
    return lo if x - lo <= hi - x else hi


def validate(cfg: Config, base_dir: Path = Path("."), check_paths: bool = True) -> None:
    """Cross-field checks: everything that would otherwise fail deep inside the VAE or the loop."""
    d = cfg.data
    f = d.num_frames
    if f < 1 or (f - 1) % 4:
        lo = (f - 1) // 4 * 4 + 1
        raise ConfigError(
            f"data.num_frames={f}: Wan's VAE needs 4k+1 frames (T=(F-1)/4+1 latent frames); "
            f"use {max(lo, 1)} or {lo + 4}"
        )
    for fb in d.frame_buckets:
        if fb < 1 or (fb - 1) % 4:
            raise ConfigError(f"data.frame_buckets: {fb} is not 4k+1")
    if len(d.resolution) != 2:
        raise ConfigError(f"data.resolution: expected [height, width], got {d.resolution}")
    fixed = []
    for name, x in zip(("height", "width"), d.resolution):
        if x % 16:
            lo, hi = nearest_valid_sizes(x)
            if d.resolution_policy == "round":
                x = nearest_valid_size(x)
            else:
                raise ConfigError(
                    f"data.resolution: {name} {x} is not a multiple of 16 (VAE /8, then patch 2); "
                    f"nearest valid sizes are {lo} and {hi}, or set data.resolution_policy: round"
                )
        fixed.append(x)
    d.resolution = fixed
    for res in d.resolution_buckets:
        if len(res) != 2 or res[0] % 16 or res[1] % 16:
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
        d.auto_frame_buckets = True  # the factor's counts are frame buckets (data.frame_bucket_list)
    if d.max_image_pixels < 1:
        raise ConfigError(f"data.max_image_pixels={d.max_image_pixels} must be >= 1 (default "
                          f"{MAX_IMAGE_PIXELS}, a 50 MP photo)")
    if not d.datasets:
        raise ConfigError("data.datasets: at least one dataset is needed, e.g. [{data_root: path/to/data}]")
    for i, ds in enumerate(d.datasets):
        if not ds.data_root:
            raise ConfigError(f"data.datasets[{i}].data_root is missing: the folder with the samples")
        if check_paths:
            root = Path(ds.data_root)
            if not root.is_absolute():
                root = (Path.cwd() / root)
            if not root.exists():
                raise ConfigError(
                    f"data.datasets[{i}].data_root: {ds.data_root} does not exist "
                    "(for the demo: python tools/make_demo_dataset.py <dir>)"
                )
        if ds.dataset_type in ("csv", "jsonl") and not ds.metadata_path:
            raise ConfigError(f"data.datasets[{i}].metadata_path: a {ds.dataset_type} dataset needs its file")
    names = [e.name for e in d.elements]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"data.elements: duplicate element name(s) {sorted(dup)}")
    for i, e in enumerate(d.elements):
        if not e.suffixes and d.datasets[0].dataset_type == "e2v":
            raise ConfigError(f"data.elements[{i}] ({e.name}): suffixes is empty")
        if e.vae is not None and e.vae.repeat < 1:
            raise ConfigError(f"data.elements[{i}].vae.repeat must be >= 1")
    positions = [e.vae.position for e in d.elements if e.vae is not None]
    if len(set(positions)) != len(positions):
        raise ConfigError(f"data.elements: vae.position values must be distinct, got {positions}")
    if cfg.e2v_type != "none" and not d.elements:
        raise ConfigError(f"e2v_type={cfg.e2v_type} needs data.elements (or set e2v_type: none)")
    ref_frames = sum(e.vae.repeat for e in d.elements if e.vae is not None)
    if cfg.uses_vae_condition and ref_frames > f:
        raise ConfigError(
            f"the elements take {ref_frames} condition frames (sum of vae.repeat) but data.num_frames is {f}"
        )
    if not pv.concatenate_mask and cfg.model.base != "t2v":
        raise ConfigError(
            "processors.vae.concatenate_mask: false needs a 32-channel model: set model.base: t2v "
            "(expanded to 32 input channels)"
        )
    if (cfg.model.preset is None) == (cfg.model.pretrained is None):
        raise ConfigError("model: set exactly one of model.preset (tiny) or model.pretrained (a diffusers folder)")
    for name in ("reference_dropout", "caption_dropout"):
        p = getattr(cfg.conditioning, name)
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"conditioning.{name}={p} must be within [0, 1]")
    if pv.frame_conditioning == "index" and cfg.uses_vae_condition:
        n_vae = sum(e.vae is not None for e in d.elements)
        if not 0 <= pv.frame_index < n_vae:
            raise ConfigError(f"processors.vae.frame_index={pv.frame_index}: frame_conditioning: index keeps the "
                              f"element at that place in vae.position order; use 0..{n_vae - 1}")
    if len(cfg.processors.clip.resolution) != 2:
        raise ConfigError(f"processors.clip.resolution: expected [height, width], got {cfg.processors.clip.resolution}")
    if cfg.conditioning.target_layout == "prepend" and not cfg.uses_vae_condition:
        raise ConfigError(f"conditioning.target_layout: prepend puts the VAE reference frames before the clip, but "
                          f"e2v_type={cfg.e2v_type} has no VAE condition: use target_layout: overlay")
    t = cfg.train
    for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "checkpoint_every", "log_every"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 1")
    for name in ("lr", "grad_clip", "eps"):
        if not (math.isfinite(getattr(t, name)) and getattr(t, name) > 0):
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a positive number")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0) or t.warmup_steps < 0 or t.keep_last < 0:
        raise ConfigError("train.weight_decay, train.warmup_steps and train.keep_last (0: keep all) must be >= 0")
    for ts in cfg.flow.denoising_step_list:
        if not 0 < ts <= 1000:
            raise ConfigError(f"flow.denoising_step_list: {ts} must be a timestep in (0, 1000]")
    _validate_validation(cfg)
    _validate_buckets_and_cache(cfg)
    ds_path = resolve_repo_path(cfg.deepspeed.config)
    if not ds_path.exists():
        raise ConfigError(
            f"deepspeed.config: {cfg.deepspeed.config} not found; shipped: "
            f"{', '.join(sorted(p.name for p in (REPO_ROOT / 'ds_configs').glob('*.json')))}"
        )


def _validate_buckets_and_cache(cfg: Config) -> None:
    """Frame buckets must hold the references; the cache must be able to hold what a step needs."""
    d, pv = cfg.data, cfg.processors.vae
    ref_frames = sum(e.vae.repeat for e in d.elements if e.vae is not None)
    if cfg.uses_vae_condition and d.auto_frame_buckets:
        short = [fb for fb in d.frame_buckets if fb < ref_frames]
        if short:
            raise ConfigError(f"data.frame_buckets {short}: shorter than the {ref_frames} condition frames the "
                              "elements take (sum of vae.repeat); remove them")
    for i, ds in enumerate(d.datasets):
        if ds.weight <= 0:
            raise ConfigError(f"data.datasets[{i}].weight={ds.weight} must be > 0 (remove the dataset instead)")
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
    if cfg.validation.every_n_steps > 0 or cfg.visualization.enabled:
        raise ConfigError("cache.enabled: training from the cache loads no VAE, text encoder or CLIP, which "
                          "validation and visualization need: set validation.every_n_steps: 0 and "
                          "visualization.enabled: false (or cache.enabled: false)")


def _validate_validation(cfg: Config) -> None:
    """validation: and visualization: keys."""
    v, vis = cfg.validation, cfg.visualization
    if v.every_n_steps < 0 or v.num_samples < 0 or v.num_videos < 0 or v.num_inference_steps < 1:
        raise ConfigError("validation.every_n_steps, num_samples, num_videos must be >= 0 and "
                          "validation.num_inference_steps >= 1")
    if v.every_n_steps and not v.num_samples and not v.sets:
        raise ConfigError("validation.every_n_steps > 0 with num_samples 0 and no validation.sets: nothing to "
                          "validate; hold out samples (num_samples >= 2), give sets, or set every_n_steps: 0")
    if v.every_n_steps and cfg.e2v_type != "none" and v.num_samples == 1:
        raise ConfigError("validation.num_samples must be >= 2 (or 0 for videos from validation.sets only): "
                          "the shuffled-reference gap swaps references between held-out samples")
    for s in v.sigmas:
        if not 0 < s < 1:
            raise ConfigError(f"validation.sigmas: {s} must be within (0, 1)")
    names = {e.name for e in cfg.data.elements}
    for i, st in enumerate(v.sets):
        unknown = sorted(set(st.elements) - names)
        if unknown:
            raise ConfigError(f"validation.sets[{i}].elements: unknown element(s) {unknown}; "
                              f"data.elements names are {sorted(names)}")
    if vis.frequency < 1:
        raise ConfigError(f"visualization.frequency={vis.frequency} must be >= 1")
    for i, p in enumerate(vis.processors):
        p.format = p.format or VIS_FORMATS[p.type][0]  # a seed vae_decode entry often names no format
        bad = [d for d in p.data if d not in VIS_DATA]
        if bad:
            raise ConfigError(f"visualization.processors[{i}].data: unknown {bad}; valid: {', '.join(VIS_DATA)}")
        if p.format not in VIS_FORMATS[p.type]:
            raise ConfigError(f"visualization.processors[{i}].format: {p.format!r} is not valid for {p.type}; "
                              f"use {' or '.join(VIS_FORMATS[p.type])}")
    # Both index the decoded pixel frames of a training batch; with auto buckets the shortest batch
    # can have fewer than num_frames. The counts follow data.frame_bucket_list (config may not import
    # data: keep the two in step): frame_buckets, else 1 + step, 1 + 2 step, ..., none below F_ref.
    d = cfg.data
    short = d.num_frames
    if d.auto_frame_buckets:
        step = d.time_division_factor or 16
        counts = d.frame_buckets or [*range(1 + step, d.num_frames + 1, step), d.num_frames]
        ref = sum(e.vae.repeat for e in d.elements if e.vae is not None) if cfg.uses_vae_condition else 1
        short = min((f for f in counts if f >= ref), default=d.num_frames)
    lists = [("visualization.sheet_frames", vis.sheet_frames)]
    lists += [(f"visualization.processors[{i}].frames", p.frames) for i, p in enumerate(vis.processors)
              if p.type == "vae_decode"]
    for key, frames in lists:
        bad = [f for f in frames if not -short <= f < short]
        if bad:
            raise ConfigError(f"{key}: {bad} out of range for {short} decoded frames (the shortest training "
                              f"video, data.num_frames / frame_buckets); valid indexes are {-short}..{short - 1}")


REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_repo_path(p: str) -> Path:
    """Paths like ds_configs/zero2.json resolve against the cwd first, then the repository."""
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def optimizer_offloaded(ds_config: dict) -> bool:
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"


def adam_choice(cfg: Config, ds_config: dict, cuda: bool) -> tuple[bool, str]:
    """(torch's AdamW rather than DeepSpeed's, why) for this DeepSpeed config on this machine."""
    return choose_adam(cfg.deepspeed.torch_adam, cuda, optimizer_offloaded(ds_config))


def resolve_deepspeed_config(cfg: Config, world_size: int, cuda: bool) -> dict:
    """Fill the "auto" fields of the chosen ds_configs/*.json from the YAML.

    The LR schedule is not DeepSpeed's (its WarmupLR forbids 0 warmup steps and starts at lr 0);
    train_e2v.py passes a torch LambdaLR, which DeepSpeed checkpoints with the engine.
    Which Adam: e2v.device.choose_adam (DeepSpeed's where it can be built, else torch's AdamW)."""
    ds = json.loads(resolve_repo_path(cfg.deepspeed.config).read_text())
    t = cfg.train
    torch_adam, _ = adam_choice(cfg, ds, cuda)
    offload = optimizer_offloaded(ds)
    auto = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "lr": t.lr,
        "betas": list(t.betas),
        "eps": t.eps,
        "weight_decay": t.weight_decay,
        "torch_adam": torch_adam,
        "pin_memory": cuda,  # offload_*.pin_memory: page-locked buffers exist only with CUDA
    }

    def fill(node, key=None):
        if isinstance(node, dict):
            return {k: fill(v, k) for k, v in node.items()}
        if node == "auto":
            if key == "enabled":  # bf16.enabled
                return t.mixed_precision == "bf16"
            if key not in auto:
                raise ConfigError(f"{cfg.deepspeed.config}: no YAML value fills the \"auto\" field '{key}'")
            return auto[key]
        return node

    ds = fill(ds)
    if torch_adam and cuda and not offload and "optimizer" in ds:
        ds["optimizer"].setdefault("params", {})["fused"] = True  # torch's one-kernel AdamW on the GPU
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    return ds


# ---------------------------------------------------------------------------------------------
# seed formats (docs/formats.md): the JSON dataset configs and the finetrainers-style flags
# users already have, mapped onto the YAML schema with a printed note of every mapping
# ---------------------------------------------------------------------------------------------

# The seed JSON is a dataset config only (finetrainers took the model and the optimiser from its
# command line), so model / lora / flow / train / deepspeed come from this YAML: the A2 recipe.
SEED_BASE_CONFIG = "configs/e2v.yaml"

# JSON dataset key -> dotted YAML path ("datasets.N" is this dataset's entry in data.datasets).
SEED_DATASET_KEYS = {
    "data_root": "datasets.N.data_root",
    "dataset_type": "datasets.N.dataset_type",
    "metadata_path": "datasets.N.metadata_path",
    "target_resolution": "data.resolution",
    "auto_frame_buckets": "data.auto_frame_buckets",
    "reshape_mode": "data.reshape_mode",
    "remove_common_llm_caption_prefixes": "data.remove_common_llm_caption_prefixes",
    "num_frames": "data.num_frames",
    "elements": "data.elements",
    "processors": "processors",
    "visualization": "visualization",
    "clip_resolution": "processors.clip.resolution",  # flat style
    "vae_combine": "processors.vae.combine",  # flat style
}
# Flat-style element keys -> nested element keys.
SEED_FLAT_ELEMENT_KEYS = {
    "vae_repeat": ("vae", "repeat"),
    "position": ("vae", "position"),
    "vae_preprocess": ("vae", "preprocess"),
    "clip_process": ("clip", "preprocess"),
}


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    node = raw
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _seed_element(el: Any, where: str, notes: list[str]) -> dict:
    """One element, nested or flat style -> our element mapping (unknown keys fail later, in _build,
    with the element's path)."""
    if not isinstance(el, dict):
        raise ConfigError(f"{where}: expected an element mapping, got {el!r}")
    out = {k: v for k, v in el.items() if k not in SEED_FLAT_ELEMENT_KEYS}
    for key, (section, field_name) in SEED_FLAT_ELEMENT_KEYS.items():
        if key in el:
            sub = out.setdefault(section, {})
            if sub is False or not isinstance(sub, dict):
                raise ConfigError(f"{where}: '{key}' given but '{section}' is {sub!r}")
            sub[field_name] = el[key]
            notes.append(f"{where}.{key} -> data.elements[].{section}.{field_name}")
    return out


def map_seed_json(raw: dict, source: str) -> tuple[dict, list[str]]:
    """A seed E2V dataset JSON (docs/formats.md, "The seed JSON dataset config"; nested or flat
    element style) -> (raw YAML mapping, notes). Keys we have no place for fail here, naming the JSON path."""
    if not isinstance(raw, dict) or not isinstance(raw.get("datasets"), list) or not raw["datasets"]:
        raise ConfigError(f"{source}: a seed JSON config needs a non-empty \"datasets\" list (docs/formats.md)")
    extra_top = sorted(set(raw) - {"datasets"})
    if extra_top:
        raise ConfigError(f"{source}: unknown top-level key(s) {extra_top}; a seed JSON holds only \"datasets\"")
    base_path = REPO_ROOT / SEED_BASE_CONFIG
    out = yaml.safe_load(base_path.read_text())
    out["data"]["datasets"] = []
    notes = [f"{source}: seed JSON dataset config; model, lora, flow, train and deepspeed come from "
             f"{SEED_BASE_CONFIG} (the A2 recipe): change them with --set"]
    shared: dict[str, tuple[Any, int]] = {}  # YAML path -> (value, dataset that set it)
    for i, ds in enumerate(raw["datasets"]):
        where = f"{source}: datasets[{i}]"
        if not isinstance(ds, dict):
            raise ConfigError(f"{where}: expected a mapping, got {ds!r}")
        entry: dict = {}
        for key, value in ds.items():
            if key not in SEED_DATASET_KEYS:
                near = difflib.get_close_matches(key, list(SEED_DATASET_KEYS), n=1, cutoff=0.5)
                hint = f"; did you mean '{near[0]}'?" if near else f"; known keys: {', '.join(SEED_DATASET_KEYS)}"
                raise ConfigError(f"unknown key '{where}.{key}'{hint}")
            dotted = SEED_DATASET_KEYS[key]
            if key == "elements":
                if not isinstance(value, list):
                    raise ConfigError(f"{where}.elements: expected a list of elements")
                value = [_seed_element(el, f"{where}.elements[{j}]", notes) for j, el in enumerate(value)]
            if dotted.startswith("datasets.N."):
                entry[dotted.split(".")[-1]] = value
                continue
            if dotted in shared and shared[dotted][0] != value:
                raise ConfigError(
                    f"{where}.{key} differs from datasets[{shared[dotted][1]}].{key}: our schema has one "
                    f"{dotted} for all datasets; write one config per element layout")
            shared.setdefault(dotted, (value, i))
        out["data"]["datasets"].append(entry)
        notes.append(f"{where} -> data.datasets[{i}] ({', '.join(f'{k}={v!r}' for k, v in entry.items())})")
    for dotted, (value, _) in shared.items():
        if dotted == "processors":  # merge: a flat-style clip_resolution may sit beside it
            for section, body in (value or {}).items():
                if not isinstance(body, dict):
                    raise ConfigError(f"{source}: processors.{section}: expected a mapping")
                for k, v in body.items():
                    _set_dotted(out, f"processors.{section}.{k}", v)
        elif dotted == "visualization":
            out["visualization"] = value
        else:
            _set_dotted(out, dotted, value)
        notes.append(f"{source}: {next(k for k, d in SEED_DATASET_KEYS.items() if d == dotted)} -> {dotted}")
    pv = out.get("processors", {}).get("vae", {})
    if pv.get("resolution") is not None and pv["resolution"] == out["data"].get("resolution"):
        del pv["resolution"]  # implied by data.resolution; keeping it would block the rounding below
        notes.append(f"{source}: processors.vae.resolution equals target_resolution -> dropped (the condition "
                     "video always has the target's size)")
    # Seed configs were written for 854-wide video (480p at 16:9); Wan needs multiples of 16. A
    # foreign config rounds, saying so; our own YAML keeps data.resolution_policy: error.
    res = out["data"].get("resolution")
    if isinstance(res, list) and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in res):
        rounded = [nearest_valid_size(x) for x in res]
        if rounded != res:
            out["data"]["resolution"] = rounded
            changed = ", ".join(f"{x} -> {r}" for x, r in zip(res, rounded) if x != r)
            notes.append(f"{source}: target_resolution {res} -> data.resolution {rounded} ({changed}: Wan needs "
                         "multiples of 16, VAE /8 then patch 2)")
    return out, notes


# Old finetrainers flags (docs/formats.md, "The old command-line flags") -> the --set they mean.
# A value of None in the template means "a switch without a value".
SEED_FLAGS = {
    "--model_name": "model.pretrained={}",
    "--pretrained_model_name_or_path": "model.pretrained={}",
    "--training_type": "model.training_type={}",
    "--output_dir": "output_dir={}",
    "--e2v_type": "e2v_type={}",
    "--frame_conditioning_type": "processors.vae.frame_conditioning={}",
    "--frame_conditioning_index": "processors.vae.frame_index={}",
    "--frame_conditioning_concatenate_mask": "processors.vae.concatenate_mask=true",
    "--mixed_precision": "train.mixed_precision={}",
    "--rank": "lora.rank={}",
    "--lora_alpha": "lora.alpha={}",
    "--target_modules": "lora.target_modules=[{}]",
    "--lr": "train.lr={}",
    "--learning_rate": "train.lr={}",
    "--train_steps": "train.max_steps={}",
    "--max_train_steps": "train.max_steps={}",
    "--batch_size": "train.micro_batch_size={}",
    "--train_batch_size": "train.micro_batch_size={}",
    "--gradient_accumulation_steps": "train.gradient_accumulation_steps={}",
    "--gradient_checkpointing": "train.gradient_checkpointing=true",
    "--checkpointing_steps": "train.checkpoint_every={}",
    "--lr_warmup_steps": "train.warmup_steps={}",
    "--max_grad_norm": "train.grad_clip={}",
    "--seed": "seed={}",
    "--flow_shift": "flow.shift={}",
    "--flow_weighting_scheme": "flow.weighting={}",
    "--lr_scheduler": "train.lr_scheduler={}",
    "--weight_decay": "train.weight_decay={}",
    "--caption_dropout_p": "conditioning.caption_dropout={}",
    "--dataloader_num_workers": "data.num_workers={}",
}
SEED_FLAG_VALUES = {  # finetrainers spellings whose value differs in our schema ("k=v": a whole --set)
    "--training_type": {"e2v-lora": "lora", "lora": "lora", "e2v-full": "full", "full-finetune": "full"},
    "--mixed_precision": {"bf16": "bf16", "no": "'no'", "fp32": "'no'"},
    "--lr_scheduler": {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
                       "cosine": "cosine"},
    # finetrainers' logit_normal is a way of drawing sigmas here, not a loss weighting
    "--flow_weighting_scheme": {"none": "none", "sigma_sqrt": "sigma_sqrt", "cosmap": "cosmap",
                                "logit_normal": "flow.sigma_sampling=logit_normal"},
}


def map_seed_flags(argv: list[str]) -> tuple[Optional[str], list[str], list[str]]:
    """Old command-line flags -> (config path from --dataset_configs, --set overrides, notes).
    A flag we cannot map fails with the nearest equivalent spelled out."""
    config, sets, notes = None, [], []
    i = 0
    while i < len(argv):
        flag, value = argv[i], None
        start = i
        if "=" in flag:
            flag, value = flag.split("=", 1)
        template = SEED_FLAGS.get(flag)
        takes_value = template is not None and "{}" in template
        if flag == "--dataset_configs":
            takes_value = True
        if takes_value and value is None:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{flag} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if flag == "--dataset_configs":
            config = value
            notes.append(f"{flag} {value} -> --config {value}")
            continue
        if template is None:
            near = difflib.get_close_matches(flag, list(SEED_FLAGS) + ["--dataset_configs", "--config", "--set"], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown flag {flag}{hint}: pass settings as --set section.key=value "
                              "(every key is listed in configs/e2v.yaml)")
        if flag in SEED_FLAG_VALUES:
            allowed = SEED_FLAG_VALUES[flag]
            if value not in allowed:
                raise ConfigError(f"{flag} {value}: no equivalent; use one of {', '.join(allowed)}")
            value = allowed[value]
        s = value if value is not None and "=" in value else template.format(value) if takes_value else template
        sets.append(s)
        notes.append(f"{' '.join(argv[start:i])} -> --set {s}")
        if template == "model.pretrained={}" and "T2V" in value:
            # finetrainers expanded a T2V base for e2v implicitly; our config says so explicitly
            sets.append("model.base=t2v")
            notes.append(f"{flag} {value} is a text-to-video model -> --set model.base=t2v")
    return config, sets, notes
