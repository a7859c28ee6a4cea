"""What one training sample is, whatever source it came from: its id, target video, prompt and
element files (`Sample`), its bucket, and the problems a source reports about it (`Problem`:
a bad sample is named, never a crash). Every source (e2v/data/elements.py's folder and tables,
e2v/data/opens2v.py) builds these."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2v.config.schema import Config


@dataclass
class Sample:
    id: str
    video: Path
    prompt: str
    elements: dict[str, Path] = field(default_factory=dict)  # element name -> image path
    dataset: int = 0  # index into data.datasets
    bucket: tuple[int, int, int] | None = None  # (F, H, W) it trains at (data.py); None: the config's
    # where the prompt came from, for messages: the ID.txt, or "<metadata file> line N"
    prompt_source: str = ""
    # A source whose clips hold more than the sample (e2v/data/opens2v.py): the source frames [start, end)
    # it may be sampled from, and the box (x1, y1, x2, y2) cut from every frame; None: the whole clip.
    frame_range: tuple[int, int] | None = None
    crop: tuple[int, int, int, int] | None = None
    # A source whose references live inside its metadata and clips: the recipe that writes the
    # element files on first use (`.ensure()`) and names what shaped them (`.stamps`, the cache key).
    make_elements: Any = None


def element_paths(s: Sample | Any) -> dict[str, Path]:
    """The sample's element files (name -> path), written first when its source cuts them on use
    (e2v/data/opens2v.py): every reader of element files goes through here. Also takes a
    `validation.sets` entry (element files only, nothing to cut)."""
    recipe = getattr(s, "make_elements", None)
    if recipe is not None:
        recipe.ensure()
    return {k: Path(v) for k, v in s.elements.items()}


def sample_bucket(s: Sample, cfg: Config) -> tuple[int, int, int]:
    """The (F, H, W) a sample trains at: its bucket, else the config's size. Here rather than in
    data.py because cache.py (imported by data.py) keys its fingerprint by it too."""
    return s.bucket or (cfg.data.num_frames, *cfg.data.resolution)


@dataclass
class Problem:
    sample: str
    file: str
    problem: str
    fix: str
    kind: str = "bad_sample"  # stable name (tools/check_dataset.py's report and tests)
    severity: str = "error"  # error: the sample would fail training; warning: it trains, maybe badly
    dataset: int = 0  # index into data.datasets of the sample's dataset (two datasets may share ids)

    def __str__(self) -> str:
        return f"{self.sample}: {self.file}: {self.problem} -> {self.fix}"


class MetadataError(ValueError):
    """A CSV / JSONL metadata file that cannot be read as a whole (no sample of it is usable)."""

    def __init__(self, file: str, problem: str, fix: str):
        super().__init__(f"{file}: {problem} -> {fix}")
        self.file, self.problem, self.fix = file, problem, fix


OUTSIDE_ROOT = "outside_root"


def printable(text: str) -> str:
    """Text read with errors="surrogateescape" -> text that prints (bad bytes become U+FFFD)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def has_bad_bytes(text: str) -> bool:
    """Whether text read with errors="surrogateescape" held bytes that are not UTF-8."""
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def outside_root(path: Path, root: Path) -> str | None:
    """Where `path` really leads (symlinks followed) when that is outside `root`, else None."""
    try:
        real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    except ValueError:  # a NUL in the path: no file has that name; loading it fails as a bad sample
        return None
    return None if real.is_relative_to(real_root) else str(real)


def outside_problem(sid: str, where: str, what: str, raw: str, real: str, root: Path) -> Problem:
    return Problem(sid, where, f"{what} {printable(raw)!r} resolves to {real}, outside the dataset root {root}",
                   f"move the file under {root}, or set data.allow_outside_root: true if this dataset is trusted",
                   OUTSIDE_ROOT)

