"""One typed config: YAML (or a seed format, e2v/config/seed_formats.py) -> the dataclasses of
e2v/config/schema.py, `--set` overrides, the defaults one key implies for another (`normalise`),
validation that names the key and the fix, and the resolved YAML written to the run folder.

Every key a user can write is a schema field; anything else is an error that names the dotted
path and where the key belongs (diffusion-pipe silently ignores typos; we do not). The schema's
names live in e2v/config/schema.py: `from e2v.config.schema import Config`, `from e2v.config.load import load_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

# Config and ConfigError are also imported from here by the rest of the tree (the loader's types).
from e2v.config import schema
from e2v.config.checks import validate
from e2v.config.schema import REMOVED_KEYS, VIS_FORMATS, Config, ConfigError, ConfigProblems, resolve_repo_path  # noqa: F401
from e2v.config.seed_formats import (
    OLD_KEYS,
    SEED_REGRESSION_KEYS,
    SEED_REGRESSION_MARK,
    is_regression_seed,
    key_homes,
    map_seed_json,
    map_seed_regression,
)
from e2v.config.shapes import nearest_valid_size
from e2v.runtime.log import get_logger

log = get_logger("e2v.config")

# ---------------------------------------------------------------------------------------------
# dict -> dataclass, with errors that name the key
# ---------------------------------------------------------------------------------------------


SCHEMA_MODULE = schema.__name__


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
                errors.append(e)
        if len(errors) == 1:  # Optional[X]: X's own error (all of a nested mapping's problems)
            raise errors[0]
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
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
        out, problems = [], []
        for i, v in enumerate(value):  # every item's problems, not the first item's alone
            try:
                out.append(_convert(v, item, f"{path}[{i}]"))
            except ConfigError as e:
                problems += _problems(e)
        if problems:
            raise ConfigProblems(problems)
        return out
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


def _unknown_key(key: str, path: str, fields: dict) -> ConfigError:
    """The error for a key that is not a field of the section at `path`: where it belongs when it
    is an old name or a key of another section, else the nearest field of this section."""
    section = re.sub(r"\[\d+\]", "[]", path)
    here = f"{section}.{key}" if section else str(key)
    homes = [h for h in key_homes(str(key)) if h != here]
    own = {old: home.rsplit(".", 1)[-1] for old, home in OLD_KEYS.items()  # old names of this section's keys
           if (home.rsplit(".", 1)[0] if "." in home else "") == section}
    where = f"{path}.{key}" if path else str(key)
    if here in REMOVED_KEYS:
        return ConfigError(f"'{where}' was {REMOVED_KEYS[here]}")
    seed = (f" ('{key}' is a video-regression seed key: a seed file is recognised by its top-level "
            f"{SEED_REGRESSION_MARK}, docs/formats.md)") if not path and key in SEED_REGRESSION_KEYS else ""
    if key in own:
        return ConfigError(f"unknown key '{where}'; did you mean '{own[key]}'?{seed}")
    if homes:
        return ConfigError(f"{where}: not a {'key of ' + path if path else 'top-level key'}; "
                           f"did you mean {' or '.join(homes)}?{seed}")
    near = difflib.get_close_matches(str(key), list(fields) + list(own), n=1, cutoff=0.5)
    near = [own.get(n, n) for n in near]
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
    return ConfigError(f"unknown key '{where}'{hint}")


def _problems(e: ConfigError) -> list[str]:
    return e.problems if isinstance(e, ConfigProblems) else [str(e)]


def _build(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = schema.type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, problems = {}, []
    for key, value in data.items():
        if key not in fields:
            if cls.__module__ == SCHEMA_MODULE:  # the trainer's keys: old names and other sections' keys too
                problems.append(str(_unknown_key(key, path, fields)))
                continue
            where = f"{path}.{key}" if path else str(key)
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            problems.append(f"unknown key '{where}'" + (f"; did you mean '{near[0]}'?" if near
                                                        else f"; valid keys: {', '.join(fields)}"))
            continue
        try:
            kwargs[key] = _convert(value, hints[key], f"{path}.{key}" if path else str(key))
        except ConfigError as e:  # named with the others: the rest of the mapping is still read
            problems += _problems(e)
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        and n not in data  # given but wrong: already named
        and not difflib.get_close_matches(n, [str(k) for k in data if k not in fields], n=1, cutoff=0.5)  # misspelt
    ]
    if missing:
        problems.append(f"{path or 'config'}: missing required key(s) {', '.join(missing)}")
    if problems:
        raise ConfigProblems(problems)
    return cls(**kwargs)


def build_dataclass(cls: type, data: dict, overrides: list[str] = (), source: str | None = None) -> Any:
    """A YAML mapping (read from `source`) plus `--set key=value` overrides -> the dataclass `cls`,
    with the trainer config's rules: types converted and checked, unknown keys named with the
    nearest field, all of a file's problems at once. Other configs (the data preparation's) load
    through here too."""
    raw = dict(data)
    for text in overrides:
        _apply_override(raw, *parse_override(text))
    try:
        return _build(cls, raw, "")
    except ConfigProblems as e:  # several: say which file (and --set) they are in
        raise ConfigProblems(e.problems, f"{source}" + (" and --set" if overrides else "") if source else None) from None


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


def load_raw(path: str | Path) -> dict:
    """Read a YAML config, or a seed format (docs/formats.md) mapped onto the YAML schema: a `.json`
    file is a seed JSON dataset config, a YAML with a top-level dataset_base_path a video-regression
    seed config; any other YAML is ours, every key checked by _build."""
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
    else:
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
        raw, notes = map_seed_regression(raw, str(path)) if is_regression_seed(raw) else (raw, [])
    for note in notes:
        log.info(note)
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                raw: dict | None = None, check_paths: bool = True) -> Config:
    raw = dict(raw) if raw is not None else load_raw(path)
    for text in overrides or []:
        keys, value = parse_override(text)
        _apply_override(raw, keys, value)
    try:
        cfg = _build(Config, raw, "")
    except ConfigProblems as e:  # several: say which file (and --set) they are in
        raise ConfigProblems(e.problems, f"{path}" + (" and --set" if overrides else "") if path else None) from None
    normalise(cfg)
    validate(cfg, base_dir=Path(path).parent if path else Path("."), check_paths=check_paths)
    return cfg


def normalise(cfg: Config) -> None:
    """The defaults one key implies for another, filled in at load, before validate (which only
    reads): each is written to the run folder's config.yaml as it was used."""
    d = cfg.data
    if d.resolution_policy == "round" and all(isinstance(x, int) for x in d.resolution):
        d.resolution = [nearest_valid_size(x) for x in d.resolution]
    if d.time_division_factor is not None:
        d.auto_frame_buckets = True  # the factor's counts are frame buckets (shapes.frame_bucket_list)
    for p in cfg.visualization.processors:
        p.format = p.format or VIS_FORMATS[p.type][0]  # a seed vae_decode entry often names no format
    if cfg.conditioning.target_layout in ("clean_prefix", "sequence"):
        # The layout encodes each reference on its own (e2v/conditioning/layout.py), which is what combine: after
        # names; the cache then stores them per element, and its fingerprint tells the layouts apart.
        cfg.processors.vae.combine = "after"


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


