"""Per-video records: the unit of resumption. A record (OUTPUT/.prepare/records/<key>.json) is
written, atomically, only when its source video is finished (samples written, or the video found
bad), so an interrupted run redoes only the video it was in, after removing that video's partial
samples. prepare_manifest.jsonl and prepare_summary.json are rebuilt from all records at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from pathlib import Path

STATE = ".prepare"
MANIFEST, SUMMARY = "prepare_manifest.jsonl", "prepare_summary.json"
# The preparer's own files beside the samples: the dataset check counts them as no sample's orphans.
PREPARE_FILES = (MANIFEST, SUMMARY)


def video_key(rel: str) -> str:
    """A stable short key for a source path (relative to the input folder)."""
    return hashlib.sha1(rel.encode("utf-8", "surrogateescape")).hexdigest()[:10]


def sample_prefix(rel: str) -> str:
    """The ASCII prefix of a video's sample ids: its name's words (accents folded, spaces and other
    characters as '_', 40 at most) and its key, so two videos never share an id."""
    stem = Path(rel).stem
    ascii_stem = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9]+", "_", ascii_stem).strip("_")[:40] or "video"
    return f"{slug}_{video_key(rel)}"


def write_json_atomic(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def record_path(out: Path, rel: str) -> Path:
    return out / STATE / "records" / f"{video_key(rel)}.json"


def read_record(out: Path, rel: str) -> dict | None:
    path = record_path(out, rel)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or torn (cannot be: written atomically) -> the video is redone


def all_records(out: Path) -> list[dict]:
    folder = out / STATE / "records"
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def remove_partial(out: Path, rel: str) -> int:
    """Remove the files of an unfinished video's samples (a killed run's): its id prefix."""
    prefix = sample_prefix(rel) + "_"
    gone = 0
    sheets = out / "contact_sheets"
    for p in [*out.iterdir(), *(sheets.iterdir() if sheets.exists() else ())]:
        if p.is_file() and p.name.startswith(prefix):
            p.unlink()
            gone += 1
    return gone


def write_manifest(out: Path, records: list[dict]) -> int:
    rows = [s for r in records for s in r.get("samples", [])]
    tmp = out / (MANIFEST + ".part")
    tmp.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in rows), encoding="utf-8")
    os.replace(tmp, out / MANIFEST)
    return len(rows)
