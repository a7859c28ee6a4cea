"""Precomputed conditioning tensors, keyed by sample id plus a fingerprint of everything that
shaped them (never by loader position: diffusers' scripts paired cached latents with the wrong
captions for years that way).

One safetensors file per sample, `<root>/<id>.safetensors`, holding what conditioning.py computes
before anything random happens:
    latents_mean, latents_std    [16,T,h,w]  target posterior, normalised (std kept: `sample` mode works)
    text                         [L_true,D]  UMT5 hidden state up to the prompt's length (zero-padded
                                             to 512 on load, exactly encode_text's output)
    clip.<element>               [L,D]       CLIP penultimate tokens, per element
    cond_mean, cond_std          [16,T,h,w]  combine before: ONE encode of the condition video of the
                                             elements the mode keeps (full / index / first_and_last
                                             keep a fixed set, so one encode per sample is exact)
    vae.<element>.mean / .std    [16,t,h,w]  combine after: each element encoded on its own; any
                                             mode, the random subset is assembled per step (also
                                             the clean_prefix layout's references, e2v/conditioning/ti2v.py)
and, in the safetensors metadata, the fingerprint (`fp.<field>`) and the element names. Not
cacheable (config.py refuses at start): combine before with prefix / random (the condition video
depends on the choice of the step) and target_layout prepend. `<root>/_shared.safetensors` holds
the empty-prompt embedding (caption dropout) and the CLIP token shape.

The random part of a step (element choice, dropouts: `rng`; posterior samples: `generator`) is
drawn here with conditioning.draw_choices and in the same order as an encoding run (conditioning/layout.py), so a cached and
an encoding run with the same seed see the same choices, sigmas and noise.

Memory: training from the cache never builds the VAE, UMT5 or CLIP. For the real models that is
UMT5-XXL's encoder (5.7 B params, 11.4 GB in bf16), CLIP ViT-H/14 (0.63 B, 2.5 GB fp32) and the
Wan VAE (0.13 B, 0.5 GB fp32, plus its activations at 480p x 81 frames): ~14.4 GB of weights per GPU.

Legend: B batch, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from e2v.config.schema import Config, cache_shaping_values
from e2v.data.media import MediaError
from e2v.data.sample import Sample, sample_bucket
from e2v.runtime.files import replacing

CACHE_VERSION = "2"  # 2: the config part of the fingerprint is one field per declared key
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CacheError(RuntimeError):
    """A missing or stale entry: never a bad sample to skip, the cache must be rebuilt."""


def dataset_root(cfg: Config, index: int) -> Path:
    """One folder per dataset: two datasets may share a data_root (a CSV and a JSONL) and ids."""
    ds = cfg.data.datasets[index]
    base = Path(cfg.cache.dir) if cfg.cache.dir else Path(ds.data_root) / ".e2v_cache"
    key = json.dumps([str(Path(ds.data_root).resolve()), ds.dataset_type, ds.metadata_path])
    return base / f"{Path(ds.data_root).resolve().name}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def _file_stamp(path: Path) -> str:
    st = path.stat()
    return f"{path} size={st.st_size} mtime_ns={st.st_mtime_ns}"


def fingerprint(s: Sample, cfg: Config, bucket: tuple[int, int, int]) -> dict[str, str]:
    """Every input that shapes the cached tensors, one named field each (the stale-entry error
    names the field that changed): the sample's files and caption, its bucket, and every config
    field the schema declares as shaping the cache (e2v.config.schema.cached)."""
    fp = {
        "version": CACHE_VERSION,
        "video": _file_stamp(s.video) if s.video.exists() else f"{s.video} missing",
        "prompt": s.prompt,
        "frames_resolution": f"{bucket[0]}x{bucket[1]}x{bucket[2]}",
        **cache_shaping_values(cfg),
    }
    if s.frame_range is not None:
        fp["frame_range"] = json.dumps(list(s.frame_range))
    if s.crop is not None:
        fp["crop"] = json.dumps(list(s.crop))
    # references a source cuts on first use are named by what shaped them (their recipe's stamps),
    # not by the written file's mtime: re-cutting the same references keeps the entry valid
    stamps = s.make_elements.stamps if s.make_elements is not None else {}
    for name in sorted(s.elements):
        p = s.elements[name]
        fp[f"element.{name}"] = stamps.get(name) or (_file_stamp(p) if p.exists() else f"{p} missing")
    return fp


def _safe_name(sample_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in sample_id)


class CacheStore:
    """Reads and writes the entries of every dataset of a config."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._shared: dict | None = None

    def path(self, s: Sample) -> Path:
        return dataset_root(self.cfg, s.dataset) / f"{_safe_name(s.id)}.safetensors"

    def shared_path(self) -> Path:
        return dataset_root(self.cfg, 0) / "_shared.safetensors"

    # -- checking ---------------------------------------------------------------------------------

    def problem(self, s: Sample) -> str | None:
        """None when the entry is valid, else what is wrong (missing, or the first changed field)."""
        path = self.path(s)
        if not path.exists():
            return f"sample {s.id}: no cache entry {path}"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        want = fingerprint(s, self.cfg, sample_bucket(s, self.cfg))
        for key, value in want.items():
            old = meta.get(f"fp.{key}")
            if old != value:
                return f"sample {s.id}: cache entry {path} is stale: '{key}' changed (cached {old!r}, now {value!r})"
        extra = sorted(k[3:] for k in meta if k.startswith("fp.") and k[3:] not in want)
        if extra:
            return f"sample {s.id}: cache entry {path} is stale: '{extra[0]}' changed (cached, now absent)"
        return None

    def verify_all(self, samples: list[Sample], workers: int = 8) -> None:
        unique = list({(s.dataset, s.id): s for s in samples}.values())
        with ThreadPoolExecutor(workers) as pool:
            problems = [p for p in pool.map(self.problem, unique) if p]
        if not self.shared_path().exists():
            problems.insert(0, f"no shared cache file {self.shared_path()} (empty-prompt embedding)")
        if problems:
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise CacheError(f"{len(problems)} cache entr{'y is' if len(problems) == 1 else 'ies are'} missing or "
                             "stale:\n  " + "\n  ".join(problems[:10]) + more +
                             "\nfix: python tools/precompute.py --config <this config> (it recomputes only these)")
        if self.cfg.data.on_bad_sample == "error":
            bad = self.bad_entries(unique, workers)
            if bad:
                raise CacheError(bad_entries_message(bad))

    def bad_entries(self, samples: list[Sample], workers: int = 8) -> list[str]:
        """'sample <id>: <failure>' for each existing entry precompute recorded as bad (it ran with
        on_bad_sample: skip); with on_bad_sample: error training would stop on the first of them."""
        def bad(s: Sample) -> str | None:
            path = self.path(s)
            if not path.exists():
                return None
            with safe_open(str(path), "pt") as f:
                message = (f.metadata() or {}).get("bad")
            return f"sample {s.id}: {message}" if message is not None else None

        with ThreadPoolExecutor(workers) as pool:
            return [m for m in pool.map(bad, samples) if m]

    # -- reading ----------------------------------------------------------------------------------

    def shared(self) -> dict:
        if self._shared is None:
            path = self.shared_path()
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
            self._shared = {"empty_text": tensors["empty_text"].float(),
                            "clip_shape": tuple(json.loads(meta["clip_shape"]))}
        return self._shared

    def load(self, s: Sample) -> dict:
        """A data.py item holding the cached tensors (fp32). A sample precompute marked bad raises
        MediaError, so on_bad_sample applies as it does to raw files."""
        problem = self.problem(s)
        if problem:
            raise CacheError(problem + "\nfix: python tools/precompute.py --config <this config>")
        path = self.path(s)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        if "bad" in meta:
            raise MediaError(meta["bad"])
        tensors = {k: v.float() for k, v in load_file(str(path)).items()}
        return {"id": s.id, "prompt": s.prompt, "element_names": json.loads(meta["element_names"]),
                "cached": tensors, "shared": self.shared()}

    # -- writing ----------------------------------------------------------------------------------

    def _write(self, path: Path, tensors: dict, meta: dict) -> None:
        """Atomic (temp file + rename): an interrupted precompute never leaves a valid-looking entry."""
        path.parent.mkdir(parents=True, exist_ok=True)
        dtype = DTYPES[self.cfg.cache.dtype]
        with replacing(path) as tmp:
            save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)

    def write(self, s: Sample, tensors: dict, element_names: list[str]) -> None:
        meta = {f"fp.{k}": v for k, v in fingerprint(s, self.cfg, sample_bucket(s, self.cfg)).items()}
        meta["element_names"] = json.dumps(element_names)
        self._write(self.path(s), tensors, meta)

    def write_bad(self, s: Sample, message: str) -> None:
        """Remember a sample that failed (on_bad_sample: skip): training skips and counts it."""
        meta = {f"fp.{k}": v for k, v in fingerprint(s, self.cfg, sample_bucket(s, self.cfg)).items()}
        meta.update(bad=message, element_names="[]")
        self._write(self.path(s), {"_": torch.zeros(1)}, meta)

    def write_shared(self, empty: torch.Tensor, clip_shape: tuple[int, int]) -> None:
        """The empty-prompt embedding (caption dropout) and the CLIP token shape of the encoders
        (e2v/conditioning/cached.py: shared_entry)."""
        self._write(self.shared_path(), {"empty_text": empty}, {"clip_shape": json.dumps(clip_shape)})


def bad_entries_message(bad: list[str]) -> str:
    more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
    return (f"{len(bad)} cache entr{'y is' if len(bad) == 1 else 'ies are'} recorded as bad samples (precompute ran "
            "with data.on_bad_sample: skip) and data.on_bad_sample is error:\n  " + "\n  ".join(bad[:10]) + more +
            "\nfix: repair or replace those files (precompute recomputes an entry whose files changed), or set "
            "data.on_bad_sample: skip to train without them")


# --- precompute ---------------------------------------------------------------------------------


# --- a step from the cache ----------------------------------------------------------------------


