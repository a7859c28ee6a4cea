"""One decision for all ranks: what each rank reads from its own disk that decides how the run
loads (whether the transformer is partitioned at load, Wan2.2's expert boundary, which weight files
there are), compared before anything loads, rank 0's taken as the run's.

Ranks on different nodes read different disks. A rank whose copy of the model differs (a shard
missing, another model_index.json, a hub id in one node's cache only) would take another path
through the load: one rank inside zero.Init's collectives while another loads whole, or one rank
failing on a missing file while the others wait on it, forever. So every rank states its facts,
all of them are gathered (one collective), and either every rank agrees with rank 0 or every rank
stops with the same message naming the rank, the fact, both values and the fix.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from e2v.config.bases import resolve_pretrained
from e2v.config.experts import EXPERTS, SUBFOLDERS, boundary_ratio, trained_experts
from e2v.config.schema import Config
from e2v.models.zero3_load import _safetensors_files, zero3_load_blocker
from e2v.runtime.distributed import gather_all


def _subfolders(cfg: Config) -> list[str]:
    """The transformer folders a training run loads."""
    if boundary_ratio(cfg) is None:
        return ["transformer"]
    return [SUBFOLDERS[name] for name in EXPERTS if name in trained_experts(cfg)]


def weight_files(folder: Path) -> dict:
    """{file name: bytes, or "missing"} of the weight files a transformer folder's index names (or its
    one file), plus a digest of its config.json: what every rank must see alike."""
    out = {f.name: f.stat().st_size if f.is_file() else "missing" for f in _safetensors_files(folder)}
    config = folder / "config.json"
    out["config.json"] = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else "missing"
    return out


def local_facts(cfg: Config, ds_config: dict | None) -> dict:
    """What this rank reads from its own disk that decides the load. JSON-like, for the gather."""
    facts = {"boundary_ratio": boundary_ratio(cfg), "_where": cfg.model.pretrained or f"model.preset {cfg.model.preset}"}
    if cfg.model.preset is not None:
        return facts  # built in code from the seed: nothing on disk
    root = Path(resolve_pretrained(cfg.model.pretrained))
    facts["_where"] = str(root)  # named in the messages, not compared (a path may differ between nodes)
    for sub in _subfolders(cfg):
        blocker = zero3_load_blocker(cfg, ds_config, sub)
        facts[f"{sub}: load"] = "partitioned (ZeRO-3)" if blocker is None else "whole"  # the why: the files
        if (root / sub).is_dir():
            facts[f"{sub}: files"] = weight_files(root / sub)
    return facts


def _missing(facts: dict) -> list[str]:
    return [f"{key.split(':')[0]}/{name}" for key, files in facts.items() if key.endswith(": files")
            for name, size in files.items() if size == "missing"]


def agree_on_local_facts(cfg: Config, ds_config: dict | None) -> dict:
    """Rank 0's facts, once every rank has been checked against them; a collective, called by every
    rank before anything loads. Stops every rank alike (SystemExit) when a rank lacks a file or sees
    another fact than rank 0."""
    every = gather_all(local_facts(cfg, ds_config))
    for rank, facts in enumerate(every):
        missing = _missing(facts)
        if missing:
            raise SystemExit(f"rank {rank}: model.pretrained {facts['_where']} lacks {', '.join(missing)} (named by its index): the "
                             "download or copy is incomplete on that node; complete it (hf download "
                             "resumes) and start again")
    first = every[0]
    for rank, facts in enumerate(every[1:], start=1):
        differ = sorted(k for k in set(first) | set(facts) if first.get(k) != facts.get(k) and k != "_where")
        if differ:
            what = "; ".join(f"{k}: rank 0 {first.get(k)!r}, rank {rank} {facts.get(k)!r}" for k in differ)
            raise SystemExit(f"the ranks read different models from model.pretrained ({what}): every node must hold the same "
                             "copy of model.pretrained (and the same HF_HOME cache for a hub id; .deepspeed_env "
                             "forwards it to every node, docs/gpu_runs.md)")
    return first
