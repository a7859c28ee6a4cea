"""Which downloaded weights a config needs, and a one-line stop when they are not here.

Each shipped config names hub repos (`model.pretrained`, and `model.image_encoder` for a T2V base
that needs Wan's CLIP from the I2V repo). Before anything loads, a hub id must be in the local
Hugging Face cache, or a local folder must exist; when it is not, and the hub cannot be reached
(HF_HUB_OFFLINE set, or huggingface.co unreachable within a few seconds), the run stops with one
line naming the repo, where it was looked for and the download command, instead of diffusers'
retries and its "does not appear to have a file named config.json" (docs/weights.md).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from e2v.config.bases import resolve_pretrained
from e2v.runtime.log import get_logger

# repo -> what it holds (docs/weights.md has sizes and which config needs which)
REPOS = {
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": "I2V-14B: transformer, UMT5-XXL, CLIP ViT-H/14, VAE",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "T2V-1.3B: transformer, UMT5-XXL, VAE (no CLIP)",
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": "Wan2.2 I2V-A14B: two expert transformers, UMT5-XXL, VAE",
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "Wan2.2 TI2V-5B: transformer, UMT5-XXL, Wan2.2 VAE",
}
PROBE_HOST, PROBE_TIMEOUT_S = "huggingface.co", 3.0


def needed_repos(cfg) -> list[tuple[str, str]]:
    """(config key, hub id or folder) of every pretrained source the config loads."""
    if cfg.model.preset is not None:
        return []
    out = [("model.pretrained", cfg.model.pretrained)]
    if cfg.model.image_encoder and cfg.model.image_encoder != cfg.model.pretrained:
        out.append(("model.image_encoder", cfg.model.image_encoder))
    return [(k, v) for k, v in out if v]


# The CLI huggingface_hub >= 1.0 ships (requirements.txt) is `hf`; its `--include` takes one
# pattern per flag (a second pattern after one flag is read as a file name, and file names
# override the patterns), so each folder gets its own flag.
HF_CLI = "hf download"


def download_command(repo: str, key: str = "model.pretrained") -> str:
    """The download of a whole repo, or for model.image_encoder only its CLIP folders (the I2V
    repo is ~80 GB; its image_encoder/ and image_processor/ are what a T2V base takes from it)."""
    only = ' --include "image_encoder/*" --include "image_processor/*"' if key == "model.image_encoder" else ""
    return f"{HF_CLI} {repo}{only} --local-dir models/{repo.split('/')[-1]}"


def hub_cache_path(repo: str) -> Path:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        HF_HUB_CACHE = os.path.expanduser("~/.cache/huggingface/hub")
    return Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"


def offline_reason() -> str | None:
    """Why the hub cannot be used now (HF_HUB_OFFLINE, or no connection), None when it can."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection((PROBE_HOST, 443), timeout=PROBE_TIMEOUT_S).close()
        return None
    except OSError:
        return f"{PROBE_HOST} cannot be reached"


def is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def missing_weights(cfg) -> tuple[str | None, list[str]]:
    """(error line or None, notes); commands stop on it through require_weights. The error names each missing source, where it was looked for,
    and the command that downloads it; a hub id not cached while the hub is reachable is a note
    (from_pretrained downloads it into the cache)."""
    problems, notes, reason = [], [], None
    for key, name in needed_repos(cfg):
        if not is_hub_id(name):
            if not Path(name).expanduser().exists():
                problems.append(f"{key}: folder {name} does not exist; put a diffusers copy there: "
                                f"{HF_CLI} REPO --local-dir {name} (repos: docs/weights.md)")
            continue
        if resolve_pretrained(name) != name:  # in the local cache
            continue
        reason = reason or offline_reason() or ""
        if reason:
            problems.append(f"{key}: {name} is not downloaded (looked in {hub_cache_path(name)}) and {reason}; "
                            f"run `{download_command(name, key)}` and --set {key}=models/{name.split('/')[-1]}")
        else:
            notes.append(f"{key}: {name} is not in the local cache: from_pretrained downloads it now "
                         f"({REPOS.get(name, 'see docs/weights.md')}); to choose the folder: {download_command(name, key)}")
    return ("; ".join(problems) or None), notes


def require_weights(cfg, note=None) -> None:
    """The start of every command that reads weights (training, precompute, sample, the
    visualization dump): stop with the one line of missing_weights when a model is not here, before
    any loader runs; its notes (a hub id from_pretrained will download) are logged, or given to
    `note`. No torch: the line comes before the heavy imports."""
    error, notes = missing_weights(cfg)
    if error:
        raise SystemExit(f"weights: {error}")
    for n in notes:
        (note or get_logger("e2v").info)(f"note: {n}")
