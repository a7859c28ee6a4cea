"""Sample discovery: which files make one training sample.

A sample is an id that links a target video, its prompt and its element images. Sources:
- `e2v`: a folder `ID.mp4 ID.txt ID<suffix>` (first suffix in an element's list that exists wins);
- `csv`: columns `video`, `prompt`, optionally one column per element name;
- `jsonl`: one object per line, `path` (video or .npz) and `prompt`, optionally element paths;
- `opens2v`: OpenS2V-5M's JSON parts, references cut from their RLE masks (e2v/data/opens2v.py).
Relative paths in a CSV / JSONL are relative to the metadata file's folder, or to the dataset's
`media_root` when set (the video-regression seed's `dataset_base_path`).

Hostile input is a bad sample, named, never a crash or a silent read: a prompt that is not UTF-8
(the file, and the line of a manifest), and a path that resolves outside the dataset's root
(absolute, `..`, or a symlink; the root is `media_root` when set, else `data_root`) unless
`data.allow_outside_root` is on. A metadata file shared with a team could otherwise make
training read, and the validator print, any file the trainer can read.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from e2v.config.schema import Dataset, Element
from e2v.data.opens2v import discover_opens2v
from e2v.data.sample import MetadataError, Problem, Sample, has_bad_bytes, outside_problem, outside_root, printable

VIDEO_EXTS = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".npz")

# Openers that captioning LLMs put before nearly every caption; they carry no information and
# dominate the first text tokens. Removed when `remove_common_llm_caption_prefixes` is on.
COMMON_LLM_CAPTION_PREFIXES = (
    "The video shows",
    "The video depicts",
    "The video features",
    "The video captures",
    "The video showcases",
    "This video shows",
    "This video depicts",
    "In this video,",
    "In the video,",
    "The clip shows",
    "The footage shows",
    "The scene shows",
    "The image shows",
)


def strip_caption_prefix(prompt: str) -> str:
    text = prompt.strip()
    for prefix in COMMON_LLM_CAPTION_PREFIXES:
        if text.lower().startswith(prefix.lower()):
            rest = text[len(prefix):].lstrip(" ,:")
            return rest[:1].upper() + rest[1:] if rest else rest
    return text


def find_element(stem: Path, element: Element) -> Path | None:
    """First existing `<stem><suffix>` in the element's suffix order."""
    for suffix in element.suffixes:
        p = stem.parent / f"{stem.name}{suffix}"
        if p.exists():
            return p
    return None


def _resolve(root: Path, p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else root / path


NOT_UTF8 = "not_utf8"


def _read_prompt(prompt_file: Path) -> str:
    """An ID.txt's text ('' when absent); UnicodeDecodeError when it is not UTF-8."""
    return prompt_file.read_text(encoding="utf-8").strip() if prompt_file.exists() else ""


def _discover_folder(ds: Dataset, elements: list[Element], allow_outside_root: bool = False
                     ) -> tuple[list[Sample], list[Problem]]:
    root = Path(ds.data_root)
    videos = sorted(p for p in root.iterdir() if p.suffix.lower() in VIDEO_EXTS and p.is_file())
    samples, problems = [], []
    by_id: dict[str, Path] = {}
    for video in videos:
        if video.stem in by_id:  # 001.mp4 and 001.mov: one prompt and one set of elements for two clips
            problems.append(Problem(video.stem, str(video), f"duplicate id: {by_id[video.stem].name} has the same id",
                                    "rename or remove one of the two videos", "duplicate_id"))
            samples = [s for s in samples if s.id != video.stem]
            continue
        by_id[video.stem] = video
        stem = video.with_suffix("")
        prompt_file = stem.with_suffix(".txt")
        try:
            prompt = _read_prompt(prompt_file)
        except UnicodeDecodeError as e:
            problems.append(Problem(video.stem, str(prompt_file), f"prompt is not UTF-8 text ({e.reason} at byte "
                                    f"{e.start})", "save it as UTF-8, e.g. iconv -f latin1 -t utf-8", NOT_UTF8))
            continue
        found = {}
        for el in elements:
            p = find_element(stem, el)
            if p is not None:
                found[el.name] = p
            elif el.required:
                problems.append(Problem(
                    video.stem, str(video), f"required element '{el.name}' missing",
                    f"add one of {', '.join(video.stem + s for s in el.suffixes)}", "element_missing",
                ))
                break
        else:
            files = [("video", video), ("prompt", prompt_file), *((f"element '{n}'", p) for n, p in found.items())]
            leaks = [] if allow_outside_root else [
                (what, p, real) for what, p in files if p.exists() and (real := outside_root(p, root))]
            if leaks:  # a symlink in the folder
                problems += [outside_problem(video.stem, str(p), f"{what} symlink", p.name, real, root)
                             for what, p, real in leaks]
                continue
            samples.append(Sample(video.stem, video, prompt, found, prompt_source=str(prompt_file)))
    return samples, problems


def orphan_files(ds: Dataset, elements: list[Element]) -> list[Path]:
    """Files of an `e2v` folder that belong to no sample id: a prompt or element image whose id
    has no video, or a name no element suffix matches (a typo'd suffix is the usual cause)."""
    root = Path(ds.data_root)
    files = [p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")]
    ids = {p.stem for p in files if p.suffix.lower() in VIDEO_EXTS}
    suffixes = [sfx for el in elements for sfx in el.suffixes] + [".txt"]
    orphans = []
    for p in sorted(files):
        if p.suffix.lower() in VIDEO_EXTS:
            continue
        if not any(p.name.endswith(sfx) and p.name[: -len(sfx)] in ids for sfx in suffixes):
            orphans.append(p)
    return orphans


JSONL_FIX = 'make each line one JSON object, e.g. {"path": "clips/a.npz", "prompt": "..."}'


def _rows_csv(path: Path) -> list[tuple[int, dict]]:
    """(line number, row): the line a row ends on, so messages point into the file."""
    try:
        # bad bytes survive as surrogates, so one bad row is one bad sample (named by its line)
        with path.open(newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.DictReader(f)
            return [(reader.line_num, row) for row in reader]
    except (csv.Error, UnicodeDecodeError) as e:
        raise MetadataError(str(path), f"not a readable CSV ({e})",
                            "save it as UTF-8 CSV with a header row video,prompt[,<element>...]") from None


def _rows_jsonl(path: Path) -> list[tuple[int, dict]]:
    lines = path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MetadataError(f"{path} line {n}", f"not JSON ({printable(str(e))})", JSONL_FIX) from None
            if not isinstance(row, dict):
                raise MetadataError(f"{path} line {n}", f"a JSON {type(row).__name__}, not an object", JSONL_FIX)
            rows.append((n, row))
    return rows


def _discover_table(ds: Dataset, elements: list[Element], allow_outside_root: bool = False
                    ) -> tuple[list[Sample], list[Problem]]:
    meta = _resolve(Path(ds.data_root), ds.metadata_path)
    if not meta.is_file():
        raise MetadataError(str(meta), "metadata file does not exist",
                            "fix data.datasets[].metadata_path (relative to data_root)")
    base = Path(ds.media_root) if ds.media_root else meta.parent
    root = Path(ds.media_root or ds.data_root)  # what paths may not leave (module docstring)
    rows = _rows_csv(meta) if ds.dataset_type == "csv" else _rows_jsonl(meta)
    video_key = "video" if ds.dataset_type == "csv" else "path"
    path_keys = {video_key, *(el.name for el in elements)}
    samples, problems = [], []
    for i, (line, row) in enumerate(rows):
        where = f"{meta} line {line}"
        if not row.get(video_key) or "prompt" not in row:
            raise MetadataError(where, f"row {i + 1} needs '{video_key}' and 'prompt' (has "
                                       f"{sorted(printable(str(k)) for k in row)})",
                                f"give every row a '{video_key}' path and a 'prompt'")
        # a JSON number or list where a path belongs: its text, which then names a missing file
        row = {k: str(v) if k in path_keys and v else v for k, v in row.items()}
        video = _resolve(base, row[video_key])
        sid = printable(f"{i:06d}_{Path(row[video_key]).stem}")
        bad_text = [str(k) for k, v in row.items() if isinstance(v, str) and has_bad_bytes(v)]
        if bad_text:
            problems.append(Problem(sid, where, f"{', '.join(map(repr, map(printable, bad_text)))} not UTF-8 text",
                                    f"save {meta.name} as UTF-8, e.g. iconv -f latin1 -t utf-8", NOT_UTF8))
            continue
        paths = [(f"'{video_key}'", row[video_key])] + [(f"'{el.name}'", row[el.name]) for el in elements
                                                         if row.get(el.name)]
        leaks = [] if allow_outside_root else [
            (what, raw, real) for what, raw in paths if (real := outside_root(_resolve(base, raw), root))]
        if leaks:
            problems += [outside_problem(sid, where, f"{what} path", raw, real, root) for what, raw, real in leaks]
            continue
        if not video.is_file():  # named here, with its line: a decoder's "cannot open" would hide the cause
            problems.append(Problem(sid, where, f"video {row[video_key]!r} not found (looked for {video})",
                                    f"fix the '{video_key}' path (relative to {base}) or add the clip",
                                    "video_missing"))
            continue
        found = {}
        for el in elements:
            value = row.get(el.name)
            if value:
                found[el.name] = _resolve(base, value)
            elif el.required:
                problems.append(Problem(sid, where, f"required element '{el.name}' has no column value",
                                        f"add a '{el.name}' column/field with the image path", "element_missing"))
                break
        else:
            samples.append(Sample(sid, video, str(row["prompt"] or ""), found, prompt_source=where))
    return samples, problems


def discover(ds: Dataset, elements: list[Element], strip_prefixes: bool = False,
             dataset_index: int = 0, allow_outside_root: bool = False) -> tuple[list[Sample], list[Problem]]:
    """All samples of one dataset, plus the problems that exclude a sample (reported, never silent)."""
    if ds.dataset_type == "e2v":
        samples, problems = _discover_folder(ds, elements, allow_outside_root)
    elif ds.dataset_type == "opens2v":
        samples, problems = discover_opens2v(ds, elements, allow_outside_root)
    else:
        samples, problems = _discover_table(ds, elements, allow_outside_root)
    for p in problems:
        p.dataset = dataset_index
    for s in samples:
        s.dataset = dataset_index
        if strip_prefixes:
            s.prompt = strip_caption_prefix(s.prompt)
    return samples, problems
