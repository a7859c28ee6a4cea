"""One typed config: YAML (or a seed JSON dataset config) -> dataclasses, `--set` overrides,
validation that names the key and the fix, and the resolved YAML written to the run folder.

Every key a user can write is a dataclass field below; anything else is an error that names the
dotted path and the nearest valid name (diffusion-pipe silently ignores typos; we do not).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


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
    data_root: str = ""  # folder of ID.mp4 / ID.txt / ID<suffix> (e2v), base path for csv / jsonl
    dataset_type: Literal["e2v", "csv", "jsonl"] = "e2v"
    metadata_path: Optional[str] = None  # csv / jsonl file (relative to data_root if not absolute)
    weight: float = 1.0  # sampling weight when several datasets are mixed
    repeat: int = 1  # times each sample appears per epoch


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
    time_division_factor: int = 4  # frames are trimmed to k * factor + 1 (video regression seed)
    auto_frame_buckets: bool = False
    frame_buckets: list[int] = field(default_factory=list)  # allowed 4k+1 counts for auto buckets
    resolution_buckets: list[list[int]] = field(default_factory=list)  # [[H, W], ...] by aspect
    remove_common_llm_caption_prefixes: bool = False
    num_workers: int = 0
    prefetch_factor: int = 2
    on_bad_sample: Literal["error", "skip"] = "error"
    shuffle: bool = True


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
    skip_nonfinite: bool = False


@dataclass
class DeepSpeed:
    config: str = "ds_configs/zero2.json"
    torch_adam: bool = False  # exact resume (DeepSpeed's C++ Adam drifts ~1e-4 after a load)


@dataclass
class Cache:
    enabled: bool = False
    dir: Optional[str] = None  # default <data_root>/.e2v_cache


@dataclass
class ValidationSet:
    prompt: str
    elements: dict[str, str] = field(default_factory=dict)  # element name -> image path


@dataclass
class Validation:
    every_n_steps: int = 0  # 0: off
    sigmas: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    num_samples: int = 4  # held-out samples used for validation loss and reference gaps
    seed: int = 1234
    sets: list[ValidationSet] = field(default_factory=list)  # generate videos from these
    num_inference_steps: int = 20
    guidance_scale: float = 5.0
    sample_shift: float = 8.0
    negative_prompt: str = ""


@dataclass
class VisProcessor:
    type: Literal["latent_save", "vae_decode"]
    data: list[str] = field(default_factory=lambda: ["input_latents", "predicted_latents"])
    format: str = "pt"
    frames: list[int] = field(default_factory=lambda: [0, -1])


@dataclass
class Visualization:
    enabled: bool = False
    output_dir: str = "visualizations"  # relative to the run folder; may contain {run_id}
    frequency: int = 100
    processors: list[VisProcessor] = field(default_factory=list)


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
    def clip_elements(self) -> list[Element]:
        """Elements in the CLIP stream, in the same (position) order as the VAE stream."""
        pos = {e.name: (e.vae.position if e.vae else i) for i, e in enumerate(self.data.elements)}
        return sorted((e for e in self.data.elements if e.clip is not None), key=lambda e: pos[e.name])


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
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
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


def _apply_override(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = node[int(k)]
            continue
        node = node.setdefault(k, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {'.'.join(keys)}: '{'.'.join(keys[: i + 1])}' is not a section")
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value


def load_raw(path: str | Path) -> dict:
    """Read a YAML config, or a seed JSON dataset config mapped onto the YAML schema."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        from e2v.legacy import map_seed_json  # seed formats: SEED_FORMATS.md sections 1-2

        raw, notes = map_seed_json(json.loads(text), source=str(path))
        for note in notes:
            print(f"[e2v config] {note}")
        return raw
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
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
                x = lo if x - lo <= hi - x else hi
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
    if d.time_division_factor != 4:
        raise ConfigError("data.time_division_factor: Wan's VAE compresses time by 4; only 4 is valid")
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
    t = cfg.train
    if t.max_steps < 1 or t.micro_batch_size < 1 or t.gradient_accumulation_steps < 1:
        raise ConfigError("train.max_steps, train.micro_batch_size and train.gradient_accumulation_steps must be >= 1")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    for ts in cfg.flow.denoising_step_list:
        if not 0 < ts <= 1000:
            raise ConfigError(f"flow.denoising_step_list: {ts} must be a timestep in (0, 1000]")
    ds_path = resolve_repo_path(cfg.deepspeed.config)
    if not ds_path.exists():
        raise ConfigError(
            f"deepspeed.config: {cfg.deepspeed.config} not found; shipped: "
            f"{', '.join(sorted(p.name for p in (REPO_ROOT / 'ds_configs').glob('*.json')))}"
        )


REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_repo_path(p: str) -> Path:
    """Paths like ds_configs/zero2.json resolve against the cwd first, then the repository."""
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def resolve_deepspeed_config(cfg: Config, world_size: int, cuda: bool) -> dict:
    """Fill the "auto" fields of the chosen ds_configs/*.json from the YAML.

    The LR schedule is not DeepSpeed's (its WarmupLR forbids 0 warmup steps and starts at lr 0);
    train_e2v.py passes a torch LambdaLR, which DeepSpeed checkpoints with the engine.
    DeepSpeed's fused Adam is a CUDA/C++ op that JIT-compiles for ~45 s on CPU; without CUDA we use
    torch's AdamW (it also resumes bit-exactly)."""
    ds = json.loads(resolve_repo_path(cfg.deepspeed.config).read_text())
    t = cfg.train
    torch_adam = cfg.deepspeed.torch_adam or not cuda
    auto = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "lr": t.lr,
        "betas": list(t.betas),
        "eps": t.eps,
        "weight_decay": t.weight_decay,
        "torch_adam": torch_adam,
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
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * world_size
    return ds
