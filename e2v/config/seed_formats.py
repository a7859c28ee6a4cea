"""Seed formats (docs/formats.md): the configs users already have, mapped onto our schema
(e2v/config/schema.py) in this one place, each mapped key printed once as a note by e2v.config.load.load_raw.

- the seed JSON dataset config (`map_seed_json`), read for any `--config *.json`;
- the old finetrainers-style command-line flags (`map_seed_flags`), read by train_e2v.py;
- the video-regression seed's top-level keys (`map_seed_regression`), read only for a YAML that
  `is_regression_seed` recognises: one with a top-level `dataset_base_path`.

Where an old name lives here is answered by one table, OLD_KEYS, plus our schema itself: a name
that is already one of our field names (lr, num_frames, rank) is found in the schema
(`schema_keys`), so only names that differ need an entry. The same lookup gives the hint for a
key written in the wrong section of our YAML (e2v.config.load).
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from e2v.config.schema import REPO_ROOT, Config, ConfigError, ConfigProblems, Data, schema_keys, type_hints
from e2v.config.shapes import nearest_valid_size

# Old name (JSON key, flag without its dashes, seed YAML key) -> our dotted key. The one alias table.
OLD_KEYS = {
    "target_resolution": "data.resolution",
    "height_width": "data.resolution",
    "clip_resolution": "processors.clip.resolution",
    "vae_combine": "processors.vae.combine",
    "vae_repeat": "data.elements[].vae.repeat",
    "vae_preprocess": "data.elements[].vae.preprocess",
    "clip_process": "data.elements[].clip.preprocess",
    "model_name": "model.pretrained",
    "pretrained_model_name_or_path": "model.pretrained",
    "frame_conditioning_type": "processors.vae.frame_conditioning",
    "frame_conditioning_index": "processors.vae.frame_index",
    "frame_conditioning_concatenate_mask": "processors.vae.concatenate_mask",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "learning_rate": "train.lr",
    "train_steps": "train.max_steps",
    "max_train_steps": "train.max_steps",
    "num_train_steps": "train.max_steps",
    "batch_size": "train.micro_batch_size",
    "train_batch_size": "train.micro_batch_size",
    "checkpointing_steps": "train.checkpoint_every",
    "save_interval": "train.checkpoint_every",
    "lr_warmup_steps": "train.warmup_steps",
    "max_grad_norm": "train.grad_clip",
    "flow_shift": "flow.shift",
    "flow_weighting_scheme": "flow.weighting",
    "caption_dropout_p": "conditioning.caption_dropout",
    "dataloader_num_workers": "data.num_workers",
    "generator_task": "task",  # CausVid: causal_video / bidirectional_video (SEED_TASKS)
    "num_frame_per_block": "causal.frames_per_block",
    "generator_ckpt": "model.generator_ckpt",
}
_SCHEMA_KEYS = schema_keys()


def key_homes(name: str) -> list[str]:
    """Our dotted key(s) for an old or misplaced name, shallowest first; [] when it has none."""
    name = name.lstrip("-")
    return [OLD_KEYS[name]] if name in OLD_KEYS else _SCHEMA_KEYS.get(name, [])


def key_home(name: str) -> str:
    return key_homes(name)[0]


# ---------------------------------------------------------------------------------------------
# the seed JSON dataset config
# ---------------------------------------------------------------------------------------------

# The seed JSON is a dataset config only (finetrainers took the model and the optimiser from its
# command line), so model / lora / flow / train / deepspeed come from this YAML: the A2 recipe.
SEED_BASE_CONFIG = "configs/e2v.yaml"
SEED_PER_DATASET_KEYS = ("data_root", "dataset_type", "metadata_path")  # -> data.datasets[i].<key>
# Keys outside the per-dataset three: one value for all datasets (our schema has one of each).
SEED_DATASET_KEYS = ("target_resolution", "auto_frame_buckets", "reshape_mode", "remove_common_llm_caption_prefixes",
                     "num_frames", "elements", "processors", "visualization", "clip_resolution", "vae_combine")
SEED_FLAT_ELEMENT_KEYS = ("vae_repeat", "position", "vae_preprocess", "clip_process")  # flat element style


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
    for key in SEED_FLAT_ELEMENT_KEYS:
        if key in el:
            section, field_name = key_home(key).removeprefix("data.elements[].").split(".")
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
    out = yaml.safe_load((REPO_ROOT / SEED_BASE_CONFIG).read_text())
    out["data"]["datasets"] = []
    notes = [f"{source}: seed JSON dataset config; model, lora, flow, train and deepspeed come from "
             f"{SEED_BASE_CONFIG} (the A2 recipe): change them with --set"]
    known = SEED_PER_DATASET_KEYS + SEED_DATASET_KEYS
    shared: dict[str, tuple[Any, int, str]] = {}  # YAML key -> (value, dataset that set it, JSON key)
    unknown: list[str] = []  # every unknown key of the file, named together
    for i, ds in enumerate(raw["datasets"]):
        where = f"{source}: datasets[{i}]"
        if not isinstance(ds, dict):
            raise ConfigError(f"{where}: expected a mapping, got {ds!r}")
        entry: dict = {}
        for key, value in ds.items():
            if key not in known:
                near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
                hint = f"; did you mean '{near[0]}'?" if near else f"; known keys: {', '.join(known)}"
                unknown.append(f"unknown key '{where}.{key}'{hint}")
                continue
            if key in SEED_PER_DATASET_KEYS:
                entry[key] = value
                continue
            if key == "elements":
                if not isinstance(value, list):
                    raise ConfigError(f"{where}.elements: expected a list of elements")
                value = [_seed_element(el, f"{where}.elements[{j}]", notes) for j, el in enumerate(value)]
            dotted = key_home(key)
            if dotted in shared and shared[dotted][0] != value:
                raise ConfigError(
                    f"{where}.{key} differs from datasets[{shared[dotted][1]}].{key}: our schema has one "
                    f"{dotted} for all datasets; write one config per element layout")
            shared.setdefault(dotted, (value, i, key))
        out["data"]["datasets"].append(entry)
        notes.append(f"{where} -> data.datasets[{i}] ({', '.join(f'{k}={v!r}' for k, v in entry.items())})")
    if unknown:
        raise ConfigProblems(unknown, source)
    for dotted, (value, _, key) in shared.items():
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
        notes.append(f"{source}: {key} -> {dotted}")
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


# ---------------------------------------------------------------------------------------------
# the old finetrainers command-line flags
# ---------------------------------------------------------------------------------------------

# The flags finetrainers took (docs/formats.md, "The old command-line flags"); each sets
# key_home(flag). A switch takes no value and sets its key to true; a list key wraps its value.
SEED_FLAGS = ("--model_name", "--pretrained_model_name_or_path", "--training_type", "--output_dir", "--e2v_type",
              "--frame_conditioning_type", "--frame_conditioning_index", "--frame_conditioning_concatenate_mask",
              "--mixed_precision", "--rank", "--lora_alpha", "--target_modules", "--lr", "--learning_rate",
              "--train_steps", "--max_train_steps", "--batch_size", "--train_batch_size",
              "--gradient_accumulation_steps", "--gradient_checkpointing", "--checkpointing_steps",
              "--lr_warmup_steps", "--max_grad_norm", "--seed", "--flow_shift", "--flow_weighting_scheme",
              "--lr_scheduler", "--weight_decay", "--caption_dropout_p", "--dataloader_num_workers")
SEED_SWITCHES = ("--frame_conditioning_concatenate_mask", "--gradient_checkpointing")
SEED_FLAG_VALUES = {  # finetrainers spellings whose value differs in our schema ("k=v": a whole --set)
    "--training_type": {"e2v-lora": "lora", "lora": "lora", "e2v-full": "full", "full-finetune": "full"},
    "--mixed_precision": {"bf16": "bf16", "no": "'no'", "fp32": "'no'"},
    "--lr_scheduler": {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
                       "cosine": "cosine"},
    # finetrainers' logit_normal is a way of drawing sigmas here, not a loss weighting
    "--flow_weighting_scheme": {"none": "none", "sigma_sqrt": "sigma_sqrt", "cosmap": "cosmap",
                                "logit_normal": "flow.sigma_sampling=logit_normal"},
}


def _is_list_key(dotted: str) -> bool:
    cls: Any = Config
    *sections, name = dotted.split(".")
    for s in sections:
        cls = type_hints(cls)[s]
    return typing.get_origin(type_hints(cls)[name]) is list


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
        known = flag in SEED_FLAGS
        takes_value = flag == "--dataset_configs" or (known and flag not in SEED_SWITCHES)
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
        if not known:
            near = difflib.get_close_matches(flag, list(SEED_FLAGS) + ["--dataset_configs", "--config", "--set"], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown flag {flag}{hint}: pass settings as --set section.key=value "
                              "(every key is listed in configs/e2v.yaml)")
        key = key_home(flag)
        if flag in SEED_FLAG_VALUES:
            allowed = SEED_FLAG_VALUES[flag]
            if value not in allowed:
                raise ConfigError(f"{flag} {value}: no equivalent; use one of {', '.join(allowed)}")
            value = allowed[value]
        if not takes_value:
            s = f"{key}=true"
        elif "=" in value:
            s = value
        else:
            s = f"{key}=[{value}]" if _is_list_key(key) else f"{key}={value}"
        sets.append(s)
        notes.append(f"{' '.join(argv[start:i])} -> --set {s}")
        if key == "model.pretrained" and "T2V" in value:
            # finetrainers expanded a T2V base for e2v implicitly; our config says so explicitly
            sets.append("model.base=t2v")
            notes.append(f"{flag} {value} is a text-to-video model -> --set model.base=t2v")
    return config, sets, notes


# ---------------------------------------------------------------------------------------------
# the video-regression seed's YAML keys
# ---------------------------------------------------------------------------------------------

SEED_REGRESSION_KEYS = ("num_frames", "time_division_factor", "batch_size", "lr", "max_steps", "save_interval",
                        "denoising_step_list", "generator_task", "num_frame_per_block", "independent_first_frame",
                        "warp_denoising_step", "generator_ckpt", "max_grad_norm",
                        "gradient_checkpointing", "ema_weight", "ema_start_step")  # each -> key_home(key)
SEED_TASKS = {"causal_video": "causal", "bidirectional_video": "bidirectional"}  # generator_task -> task
# CausVid's Wan wrapper trains on the 1000-point grid of a FlowMatchScheduler with shift 8 (Self-Forcing:
# its timestep_shift, 8 by default): the grid a listed timestep's sigma is read from, and warped through.
CAUSVID_GRID_SHIFT = 8.0
SEED_REGRESSION_DATA_KEYS = ("dataset_base_path", "metadata_path", "height", "width")  # mapped by hand below
SEED_REGRESSION_MARK = "dataset_base_path"  # where the seed's videos are: every seed file has it, our YAML never


def is_regression_seed(raw: dict) -> bool:
    """A YAML is a video-regression seed config when its top level has `dataset_base_path`; any
    other YAML is ours and its seed-style keys are errors that name where they belong."""
    return SEED_REGRESSION_MARK in raw


def map_seed_regression(raw: dict, source: str) -> tuple[dict, list[str]]:
    """A YAML written with the regression seed's top-level keys -> our schema, plus one note per key.
    The seed trains plain T2V (e2v_type: none) with the x0 objective at its denoising_step_list
    (flow.objective: x0), unless the file sets them; both are printed. Its metadata_path is read as
    the seed's scripts read it, relative to the working directory."""
    names = SEED_REGRESSION_KEYS + SEED_REGRESSION_DATA_KEYS
    seed = {k: raw.pop(k) for k in list(raw) if k in names}
    notes = [f"{source}: video-regression seed config (top-level {SEED_REGRESSION_MARK}; docs/formats.md)"]

    def put(dotted: str, value: Any, key: str) -> None:
        *section, name = dotted.split(".")
        node = raw.setdefault(section[0], {}) if section else raw
        if name in node:
            raise ConfigError(f"{source}: seed key '{key}' and {dotted} are both set: keep one")
        node[name] = value
        notes.append(f"seed key '{key}' -> {dotted} = {value!r}")

    if "generator_task" in seed:
        task = seed.pop("generator_task")
        if task not in SEED_TASKS:
            raise ConfigError(f"{source}: generator_task: {task!r} is not one e2v trains; use "
                              f"{' or '.join(SEED_TASKS)} (task: {' or '.join(SEED_TASKS.values())})")
        put(key_home("generator_task"), SEED_TASKS[task], "generator_task")
        if "shift" not in raw.setdefault("flow", {}):
            raw["flow"]["shift"] = CAUSVID_GRID_SHIFT
            notes.append(f"seed regression config: flow.shift = {CAUSVID_GRID_SHIFT:g} (CausVid's training grid, the "
                         "sigmas of its timesteps and warp_denoising_step; set flow.shift to change it)")

    # the seed's video paths are relative to dataset_base_path, wherever the CSV lives
    ds = {"data_root": seed.pop("dataset_base_path") or "", "dataset_type": "csv"}
    ds["media_root"] = ds["data_root"] or None
    if "metadata_path" in seed:
        ds["metadata_path"] = str(Path(seed.pop("metadata_path")).absolute())
    put("data.datasets", [ds], "dataset_base_path/metadata_path")
    if "height" in seed or "width" in seed:
        h, w = Data().resolution
        put("data.resolution", [seed.pop("height", h), seed.pop("width", w)], "height/width")
    for key, value in seed.items():
        put(key_home(key), value, key)
    if "denoising_step_list" in seed and "objective" not in raw["flow"]:
        raw["flow"]["objective"] = "x0"
        notes.append("seed regression config: flow.objective = x0 (loss on the clean-latent estimate)")
    if "training_type" not in raw.setdefault("model", {}):
        raw["model"]["training_type"] = "full"  # CausVid's generator_grad {model: true}: every weight
        notes.append("seed regression config: model.training_type = full (the seed trains the whole transformer, "
                     "as CausVid trains its generator; set model.training_type: lora for a LoRA)")
    if "e2v_type" not in raw:
        if raw.get("data", {}).get("elements"):
            raise ConfigError(f"{source}: a video-regression seed config trains plain T2V (e2v_type: none) but "
                              "data.elements is set: set e2v_type (dual, vae, clip) to train with the elements, "
                              "or drop data.elements")
        raw["e2v_type"] = "none"
        notes.append("seed regression config: e2v_type = none (plain T2V, no elements; set e2v_type to change it)")
    return raw, notes
