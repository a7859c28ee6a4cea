"""OpenS2V-5M as a data source (`dataset_type: opens2v`): its JSON parts and RLE masks -> samples.

The dataset stores no reference images for its regular part: each entry names a clip, the clip's
valid frame range (a jump-cut-free span) and watermark-free crop box, captions, and on one
annotated frame a COCO RLE mask per detected class with the class name and aesthetic / GME scores.
Here every entry becomes a `Sample` whose video is the clip restricted to that range and crop, and
whose element files are cut from the annotated frame on first use (`ReferenceRecipe.ensure`, called
by the dataset loader, the validator and tools/import_opens2v.py alike): the subject as an RGBA
cut-out (alpha = mask), other classes as crops on white, the background as the frame with the
masks filled by e2v.data.prepare.fill (left out when the foreground covers more than
MAX_FOREGROUND_SHARE). The field mapping and the variants seen are in docs/formats.md, "OpenS2V-5M".

Reading is from the JSON alone (no clip is decoded while indexing): mask areas and the foreground
share come from the RLEs. A sample's references are written once to `references_dir`, named by a
hash of everything that shaped them (clip file, frame, crop box, mask, cut kind), so a changed
entry writes new files and the cache (keyed by the same hash) goes stale by name.

Memory: each sample keeps the RLEs of the masks it uses (a few kB); for millions of entries prefer
converting once with tools/import_opens2v.py, or one dataset per JSON part.

Legend: H/W height/width of the cropped frame; frame_HW3 uint8 RGB; mask_HW bool (True = the class).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from e2v.data.sample import MetadataError, Problem, Sample, outside_problem, outside_root
from e2v.data.media import MediaError, read_frame
from e2v.data.prepare.fill import MAX_FOREGROUND_SHARE, fill_background
from e2v.config.schema import Dataset, Element, OpenS2V

RECIPE_VERSION = "1"  # bump when the cut itself changes: every reference is then written anew
SUBJECT, OBJECT = "subject", "object"
NEXUS_MAIN_IMAGE = "main_image.png"  # the generated-views folder also holds the frame they were made from


# --- RLE ---------------------------------------------------------------------------------------


class RLEError(ValueError):
    pass


def rle_counts(counts: str) -> list[int]:
    """COCO's compressed RLE string -> run lengths (pycocotools' rleFrString, in Python). Read here
    first because pycocotools decodes without bounds checks: runs summing past H x W would write
    past its buffer, so a bad string must be refused before it reaches the C code."""
    runs: list[int] = []
    p = 0
    while p < len(counts):
        x, k, more = 0, 0, True
        while more:
            if p >= len(counts):
                raise RLEError("the string ends inside a run length")
            c = ord(counts[p]) - 48
            if not 0 <= c < 64:
                raise RLEError(f"character {counts[p]!r} at {p} is not an RLE digit")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(runs) > 2:
            x += runs[-2]
        runs.append(x)
    return runs


def checked_rle(rle: object) -> dict:
    """A mask's RLE as pycocotools takes it ({"size": [H, W], "counts": bytes}), after checking
    that its runs are non-negative and cover exactly H x W pixels; RLEError says what is wrong."""
    if not isinstance(rle, dict) or "size" not in rle or "counts" not in rle:
        raise RLEError("not an RLE object with 'size' and 'counts'")
    size = rle["size"]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise RLEError(f"size {size!r} is not [height, width]")
    counts = rle["counts"]
    if isinstance(counts, list):  # uncompressed RLE: plain run lengths
        runs = counts
        if not all(isinstance(v, int) for v in runs):
            raise RLEError("uncompressed counts hold non-integers")
    elif isinstance(counts, str):
        runs = rle_counts(counts)
    else:
        raise RLEError(f"counts is a {type(counts).__name__}, not a string")
    if any(r < 0 for r in runs):
        raise RLEError("a run length is negative")
    h, w = size
    if sum(runs) != h * w:
        raise RLEError(f"runs cover {sum(runs)} pixels, the {h}x{w} mask has {h * w}")
    if isinstance(counts, list):
        from pycocotools import mask as mask_util

        return mask_util.frPyObjects({"size": size, "counts": runs}, h, w)
    return {"size": size, "counts": counts.encode("ascii")}


def decode_mask(rle: dict) -> np.ndarray:
    """A checked RLE -> mask_HW (bool), decoded by pycocotools (column-major, as COCO stores it)."""
    from pycocotools import mask as mask_util

    return mask_util.decode(rle).astype(bool)


def _area(rles: list[dict]) -> int:
    from pycocotools import mask as mask_util

    if not rles:
        return 0
    return int(mask_util.area(mask_util.merge(rles, intersect=False) if len(rles) > 1 else rles[0]))


# --- entries -----------------------------------------------------------------------------------


class EntryError(ValueError):
    """One entry that cannot become a sample: `kind` names the problem (the validator's report)."""

    def __init__(self, kind: str, problem: str, fix: str):
        super().__init__(problem)
        self.kind, self.problem, self.fix = kind, problem, fix


@dataclass
class Mask:
    index: str  # the annotation id: "1" is annotations[0], mask_map["1"], mask_annotation[frame]["1"]
    class_name: str
    aes: float | None
    gme: float | None
    rle: dict  # checked
    area: int


@dataclass
class Entry:
    key: str
    part: str  # the JSON file's stem (`{part}` in media_root)
    where: str  # "<json file> entry <key>", for messages
    video: Path
    frame_range: tuple[int, int]
    crop: tuple[int, int, int, int]  # (x1, y1, x2, y2): the dataset's [s_x, e_x, s_y, e_y] reordered
    caption: str
    ann_frame: int | None
    masks: list[Mask] = field(default_factory=list)
    background_tags: set[str] = field(default_factory=set)


def _int_pair(value, name: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise EntryError("bad_frame_range", f"'metadata.{name}' is {value!r}, not [start, end]",
                         f"give metadata.{name} as two frame indices [start, end)")
    start, end = value
    if not 0 <= start < end:
        raise EntryError("bad_frame_range", f"'metadata.{name}' [{start}, {end}] is empty or negative",
                         "fix the range, or remove the entry")
    return start, end


def _crop(value) -> tuple[int, int, int, int]:
    if not (isinstance(value, list) and len(value) == 4 and all(isinstance(v, int) for v in value)):
        raise EntryError("bad_crop", f"'metadata.crop' is {value!r}, not [s_x, e_x, s_y, e_y]",
                         "give metadata.crop as four pixel bounds [s_x, e_x, s_y, e_y]")
    s_x, e_x, s_y, e_y = value  # the maintainers' loader: frame[s_y:e_y, s_x:e_x]
    if not (0 <= s_x < e_x and 0 <= s_y < e_y):
        raise EntryError("bad_crop", f"'metadata.crop' [s_x, e_x, s_y, e_y] = {value} is an empty or negative box",
                         "fix the crop box, or remove the entry")
    return s_x, s_y, e_x, e_y


def _caption(meta: dict, fields: list[str]) -> str:
    for name in fields:
        value = meta.get(name)
        if isinstance(value, list):  # `cap` is a list of captions: the first
            value = value[0] if value else None
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise EntryError("caption_missing", f"none of the caption fields {fields} holds text",
                     "set data.datasets[].opens2v.caption_fields to the fields this JSON has")


def _score(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _masks(entry_raw: dict, ann_frame: int, crop_hw: tuple[int, int]) -> list[Mask]:
    ann = entry_raw.get("annotation") or {}
    per_frame = (ann.get("mask_annotation") or {}).get(str(ann_frame))
    if not isinstance(per_frame, dict):
        raise EntryError("mask_missing", f"'annotation.mask_annotation' has no masks for the annotated frame "
                         f"{ann_frame}", "re-export the entry's annotation, or remove the entry")
    names = ann.get("mask_map") or {}
    boxes = (ann.get("ann_frame_data") or {}).get("annotations") or []
    out = []
    for index, raw in per_frame.items():
        try:
            rle = checked_rle(raw)
        except RLEError as e:
            raise EntryError("bad_rle", f"mask {index} (annotation.mask_annotation.{ann_frame}.{index}): bad RLE: {e}",
                             "re-encode the mask with pycocotools.mask.encode, or remove the entry") from None
        if tuple(rle["size"]) != crop_hw:
            raise EntryError("mask_outside_frame", f"mask {index} is {rle['size'][0]}x{rle['size'][1]} (HxW), the "
                             f"cropped frame is {crop_hw[0]}x{crop_hw[1]}: it does not cover the frame it cuts",
                             "the masks must be made on the frame after metadata.crop; fix the crop or the mask")
        i = int(index) - 1 if str(index).isdigit() else -1
        box = boxes[i] if 0 <= i < len(boxes) and isinstance(boxes[i], dict) else {}
        name = (names.get(str(index)) or {}).get("class_name") or box.get("class_name") or ""
        out.append(Mask(str(index), str(name).strip(), _score(box.get("aes_score")), _score(box.get("gme_score")),
                        rle, _area([rle])))
    return out


def parse_entry(key: str, raw: object, source: Path, opts: OpenS2V, media_root: Path) -> Entry:
    """One JSON entry -> Entry; EntryError names the field and the fix."""
    where = f"{source} entry {key}"
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise EntryError("metadata_missing", "the entry has no 'metadata' object",
                         "each entry needs metadata.path / cut / crop and a caption")
    meta = raw["metadata"]
    if not isinstance(meta.get("path"), str) or not meta["path"]:
        raise EntryError("metadata_missing", "'metadata.path' (the clip inside the video part) is missing",
                         "give metadata.path, relative to media_root")
    range_field = next((f for f in opts.frame_range_fields if f in meta), None)
    if range_field is None:
        raise EntryError("bad_frame_range", f"none of {opts.frame_range_fields} is in the metadata",
                         "set data.datasets[].opens2v.frame_range_fields to the range this JSON has")
    frame_range = _int_pair(meta[range_field], range_field)
    crop = _crop(meta.get("crop"))
    caption = _caption(meta, opts.caption_fields)
    part = source.stem
    video = Path(str(media_root).replace("{part}", part)) / meta["path"]
    entry = Entry(key, part, where, video, frame_range, crop, caption, None)
    ann = raw.get("annotation")
    if isinstance(ann, dict) and ann.get("ann_frame_data") is not None:
        ann_frame = (ann.get("ann_frame_data") or {}).get("ann_frame_idx")
        if not isinstance(ann_frame, int) or ann_frame < 0:
            raise EntryError("bad_annotation", f"'annotation.ann_frame_data.ann_frame_idx' is {ann_frame!r}",
                             "give the annotated frame's index in the clip (an integer)")
        entry.ann_frame = ann_frame
        entry.masks = _masks(raw, ann_frame, (crop[3] - crop[1], crop[2] - crop[0]))
    tags = raw.get("word_tags") or {}
    entry.background_tags = {str(t).strip().lower() for t in tags.get("background") or []}
    return entry


# --- references --------------------------------------------------------------------------------


@dataclass
class Cut:
    """One reference cut from an annotated frame (possibly another entry's: cross-video pairs)."""
    kind: str  # SUBJECT: RGBA, alpha = mask; OBJECT: RGB on white
    video: Path
    frame: int
    crop: tuple[int, int, int, int]
    rle: dict


@dataclass
class BackgroundFill:
    video: Path
    frame: int
    crop: tuple[int, int, int, int]
    rles: list[dict]  # every foreground mask (kept or not): nothing of a subject stays in the background


def _stamp(*parts) -> str:
    text = json.dumps([RECIPE_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def _video_stamp(video: Path) -> str:
    st = video.stat()
    return f"{video} size={st.st_size} mtime_ns={st.st_mtime_ns}"


def _rle_key(rle: dict) -> list:
    return [rle["size"], rle["counts"].decode("ascii") if isinstance(rle["counts"], bytes) else rle["counts"]]


def cut_reference(frame_HW3: np.ndarray, mask_HW: np.ndarray, kind: str) -> Image.Image:
    """The mask's bounding box of the frame: SUBJECT as RGBA (alpha = mask, white under alpha 0, so
    a reader that drops alpha still sees white), OBJECT as RGB with white outside the mask (the
    maintainers' loader's subject image)."""
    if mask_HW.shape != frame_HW3.shape[:2]:
        raise MediaError(f"mask {mask_HW.shape} does not match the cropped frame {frame_HW3.shape[:2]}")
    rows, cols = np.flatnonzero(mask_HW.any(1)), np.flatnonzero(mask_HW.any(0))
    if not len(rows):
        raise MediaError("the mask is empty")
    box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
    rgb_HW3, m_HW = frame_HW3[box], mask_HW[box]
    out_HW3 = np.where(m_HW[..., None], rgb_HW3, np.uint8(255)).astype(np.uint8)
    if kind == SUBJECT:
        alpha_HW = (m_HW * 255).astype(np.uint8)
        return Image.fromarray(np.dstack([out_HW3, alpha_HW]), "RGBA")
    return Image.fromarray(out_HW3, "RGB")


def _save_atomic(img: Image.Image, path: Path) -> None:
    """Written under a temporary name and renamed: a reader (another DataLoader worker, a second
    rank) sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)


@dataclass
class ReferenceRecipe:
    """What a sample's element files are made of; `ensure()` writes the missing ones. Plain data,
    so it travels to DataLoader worker processes with the Sample."""
    out: dict[str, Path]  # element -> the file ensure() writes (or, for given files, reads)
    stamps: dict[str, str]  # element -> what shaped it (the cache fingerprint's element field)
    cuts: dict[str, Cut] = field(default_factory=dict)
    background: tuple[str, BackgroundFill] | None = None

    def ensure(self) -> None:
        todo = {n: c for n, c in self.cuts.items() if not self.out[n].exists()}
        fill = self.background if self.background and not self.out[self.background[0]].exists() else None
        if not todo and fill is None:
            return
        frames: dict[tuple, np.ndarray] = {}

        def frame(video: Path, index: int, crop) -> np.ndarray:
            if (video, index, crop) not in frames:
                full_HW3 = read_frame(video, index)
                x1, y1, x2, y2 = crop
                h, w = full_HW3.shape[:2]
                if not (x2 <= w and y2 <= h):
                    raise MediaError(f"{video}: crop box (x1, y1, x2, y2) {crop} lies outside the {w}x{h} frame")
                frames[video, index, crop] = np.ascontiguousarray(full_HW3[y1:y2, x1:x2])
            return frames[video, index, crop]

        for name, c in todo.items():
            _save_atomic(cut_reference(frame(c.video, c.frame, c.crop), decode_mask(c.rle), c.kind), self.out[name])
        if fill is not None:
            name, b = fill
            frame_HW3 = frame(b.video, b.frame, b.crop)
            hole_HW = np.zeros(frame_HW3.shape[:2], bool)
            for rle in b.rles:
                hole_HW |= decode_mask(rle)
            _save_atomic(Image.fromarray(fill_background(frame_HW3, hole_HW)), self.out[name])


# --- entries -> samples ------------------------------------------------------------------------


@dataclass
class ClassRules:
    """Which element kind a class name fills: lower-case whole names (the dataset's tags are lower
    case; GroundingDINO's phrases too)."""
    subjects: set[str]
    scene: set[str]

    @classmethod
    def of(cls, opts: OpenS2V) -> ClassRules:
        return cls({c.lower() for c in opts.subject_classes}, {c.lower() for c in opts.background_classes})

    def kind(self, name: str, background_tags: set[str]) -> str | None:
        """SUBJECT, OBJECT, or None for a scene class (the entry's word_tags.background included)."""
        n = name.lower()
        if n in background_tags or n in self.scene:
            return None
        return SUBJECT if n in self.subjects else OBJECT


def _nexus_images(root: Path, key: str) -> list[tuple[str, Path]]:
    """(class name, file) of an entry's generated views: <root>/<key>/<n>_<class with _ for spaces>.png."""
    folder = root / key
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("*.png")):
        n, _, tag = p.stem.partition("_")
        if p.name != NEXUS_MAIN_IMAGE and n.isdigit() and tag:
            out.append((tag.replace("_", " "), p))
    return out


def _cross_pairs(path: Path) -> dict[tuple[str, str], tuple[str, str, float]]:
    """(entry key, annotation id) -> (other entry key, its annotation id, image similarity), the
    best-matching pair of each mask; ids in the file are "<part>/<key>" (either side may be ours)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MetadataError(str(path), f"cannot read the cross-video pairs ({e})",
                            "fix data.datasets[].opens2v.cross_pairs_path") from None
    rows = [r for group in (raw.values() if isinstance(raw, dict) else [raw]) for r in group if isinstance(r, dict)]
    best: dict[tuple[str, str], tuple[str, str, float]] = {}
    for r in rows:
        try:
            a, b = str(r["cur_id"]).rsplit("/", 1)[-1], str(r["aft_id"]).rsplit("/", 1)[-1]
            ca, cb, sim = str(r["cur_class_id"]), str(r["aft_class_id"]), float(r.get("image_similarity", 0))
        except (KeyError, ValueError, TypeError):
            continue
        for mine, c_mine, other, c_other in ((a, ca, b, cb), (b, cb, a, ca)):
            if other != mine and sim > best.get((mine, c_mine), ("", "", -1.0))[2]:
                best[mine, c_mine] = (other, c_other, sim)
    return best


@dataclass
class OpenS2VIndex:
    samples: list[Sample]
    problems: list[Problem]
    entries: int  # read from the JSON, parsed or not
    dropped: Counter  # reason -> masks (or backgrounds) left out, for the summary line


def _metadata_files(ds: Dataset) -> list[Path]:
    pattern = ds.metadata_path if Path(ds.metadata_path).is_absolute() else str(Path(ds.data_root) / ds.metadata_path)
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise MetadataError(pattern, "no OpenS2V JSON file matches", "fix data.datasets[].metadata_path "
                            "(a JSON part such as Jsons/total_part1.json, or a glob like Jsons/total_part*.json)")
    return files


def _load_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MetadataError(str(path), f"not readable JSON ({str(e)[:200]})",
                            "download the part again (a cut-off file does not parse)") from None
    if not isinstance(raw, dict):
        raise MetadataError(str(path), f"a JSON {type(raw).__name__}, not an object of entries",
                            "point metadata_path at a part's JSON ({entry key: {metadata, annotation, ...}})")
    return raw


def read_opens2v(ds: Dataset, elements: list[Element], allow_outside_root: bool = False) -> OpenS2VIndex:
    """Every entry of the dataset's JSON part(s) -> samples, problems (one per entry that cannot
    train, by kind) and the count of masks each rule dropped."""
    opts = ds.opens2v
    media_root = Path(ds.media_root or ds.data_root)
    refs_dir = Path(opts.references_dir) if opts.references_dir else Path(ds.data_root) / ".e2v_opens2v"
    names = {el.name for el in elements}
    entries: dict[str, Entry] = {}
    problems: list[Problem] = []
    read = 0
    for path in _metadata_files(ds):
        for key, raw in _load_json(path).items():
            read += 1
            where = f"{path} entry {key}"
            if key in entries:
                problems.append(Problem(key, where, f"duplicate entry key (also in {entries[key].where})",
                                        "keep one of the two entries", "duplicate_id"))
                continue
            try:
                entries[key] = parse_entry(key, raw, path, opts, media_root)
            except EntryError as e:
                problems.append(Problem(key, where, e.problem, e.fix, e.kind))
    cross = _cross_pairs(Path(opts.cross_pairs_path)) if opts.cross_pairs_path else {}
    dropped: Counter = Counter()
    rules = ClassRules.of(opts)
    usable: dict[str, Entry] = {}  # entries whose clip is there and inside media_root (cross pairs use only these)
    for e in entries.values():
        root = Path(str(media_root).replace("{part}", e.part))
        real = None if allow_outside_root else outside_root(e.video, root)
        if real:
            problems.append(outside_problem(e.key, e.where, "'metadata.path'", str(e.video), real, root))
        elif not e.video.is_file():
            problems.append(Problem(e.key, e.where, f"video {e.video} does not exist",
                                    "unpack the entry's video part into media_root (cat <part>.tar.split.* | tar -x)",
                                    "video_missing"))
        else:
            usable[e.key] = e
    samples = []
    for e in usable.values():
        sample, problem = _sample(e, opts, rules, elements, names, refs_dir, usable, cross, dropped)
        if problem is not None:
            problems.append(problem)
        else:
            samples.append(sample)
    return OpenS2VIndex(samples, problems, read, dropped)


def _sample(e: Entry, opts: OpenS2V, rules: ClassRules, elements: list[Element], names: set[str], refs_dir: Path,
            entries: dict[str, Entry], cross: dict, dropped: Counter) -> tuple[Sample | None, Problem | None]:
    """One entry's sample: its masks (or generated views) assigned to elements by class, the
    background, and the recipe that writes them."""
    video_stamp = _video_stamp(e.video)
    candidates: list[tuple[str, float, int, object]] = []  # (kind, gme, area, Mask | Path)
    nexus = _nexus_images(Path(opts.nexus_images_root), e.key) if opts.nexus_images_root else []
    if nexus:  # generated views replace the cuts: read as the references, as they are
        for class_name, path in nexus:
            kind = rules.kind(class_name, e.background_tags)
            if kind is None:
                dropped["background class"] += 1
            else:
                candidates.append((kind, 0.0, 0, path))
    for m in [] if nexus else e.masks:
        kind = rules.kind(m.class_name, e.background_tags)
        if kind is None:
            dropped["background class"] += 1
        elif m.area == 0:
            dropped["empty mask"] += 1
        elif opts.min_aesthetic > 0 and (m.aes is None or m.aes < opts.min_aesthetic):
            dropped["aes_score below min_aesthetic"] += 1
        elif opts.min_gme > 0 and (m.gme is None or m.gme < opts.min_gme):
            dropped["gme_score below min_gme"] += 1
        else:
            candidates.append((kind, m.gme or 0.0, m.area, m))
    candidates.sort(key=lambda c: (-c[1], -c[2]))  # best text-image match first, then the larger
    slots = {SUBJECT: [n for n in opts.subject_elements if n in names],
             OBJECT: [n for n in opts.object_elements if n in names]}
    files: dict[str, Path] = {}
    recipe = ReferenceRecipe({}, {})
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in e.key)
    taken = 0
    for kind, _, _, ref in candidates:
        if taken >= opts.max_subjects:
            dropped["over max_subjects"] += 1
            continue
        free = next((n for n in slots[kind] if n not in files), None)
        if free is None:
            dropped[f"no free {kind} element"] += 1
            continue
        taken += 1
        if isinstance(ref, Path):
            files[free] = ref
            continue
        src, m = e, ref
        if (e.key, ref.index) in cross:  # the same subject seen in another clip: cut it from there
            other, other_index, _ = cross[e.key, ref.index]
            o = entries.get(other)
            om = next((x for x in o.masks if x.index == other_index), None) if o is not None else None
            if om is not None and om.area > 0:
                src, m = o, om
        cut = Cut(kind, src.video, src.ann_frame, src.crop, m.rle)
        stamp = _stamp(_video_stamp(src.video), cut.frame, cut.crop, _rle_key(m.rle), kind)
        files[free] = recipe.out[free] = refs_dir / stamp[:2] / f"{safe}-{stamp[:12]}_{free}.png"
        recipe.stamps[free] = f"opens2v {stamp}"
        recipe.cuts[free] = cut
    background_left_out = False
    bg = opts.background_element
    if bg and bg in names:
        given = Path(opts.background_root) / f"{e.key}.png" if opts.background_root else None
        if given is not None and given.is_file():
            files[bg] = given
        elif e.ann_frame is not None:
            fg = [m.rle for m in e.masks if rules.kind(m.class_name, e.background_tags) is not None]
            h, w = e.crop[3] - e.crop[1], e.crop[2] - e.crop[0]
            if _area(fg) / (h * w) > MAX_FOREGROUND_SHARE:
                dropped[f"background left out (foreground over {MAX_FOREGROUND_SHARE:.0%})"] += 1
                background_left_out = True
            else:
                stamp = _stamp(video_stamp, e.ann_frame, e.crop, sorted(map(str, map(_rle_key, fg))), "fill")
                files[bg] = recipe.out[bg] = refs_dir / stamp[:2] / f"{safe}-{stamp[:12]}_{bg}.png"
                recipe.stamps[bg] = f"opens2v {stamp}"
                recipe.background = (bg, BackgroundFill(e.video, e.ann_frame, e.crop, fg))
    for el in elements:
        if el.required and el.name not in files and not (el.name == bg and background_left_out):
            why = ("no generated view" if nexus else "no mask") + f" of a class that fills '{el.name}' is left " \
                  f"after the rules ({len(e.masks)} masks)"
            return None, Problem(e.key, e.where, f"required element '{el.name}': {why}",
                                 "lower opens2v.min_aesthetic / min_gme, extend opens2v.subject_classes, or make "
                                 "the element optional", "element_missing")
    sample = Sample(e.key, e.video, e.caption, files, prompt_source=e.where, frame_range=e.frame_range,
                    crop=e.crop, make_elements=recipe if recipe.out else None)
    return sample, None


def summary_line(ds: Dataset, index: OpenS2VIndex) -> str:
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(index.dropped.items())) or "none"
    return (f"[e2v data] opens2v {ds.metadata_path}: {index.entries} entries -> {len(index.samples)} samples, "
            f"{len(index.problems)} problems; left out: {dropped}")


def discover_opens2v(ds: Dataset, elements: list[Element], allow_outside_root: bool = False
                     ) -> tuple[list[Sample], list[Problem]]:
    """e2v.data.elements.discover's `opens2v` source: the samples and problems, the drop counts printed once."""
    index = read_opens2v(ds, elements, allow_outside_root)
    print(summary_line(ds, index), flush=True)
    return index.samples, index.problems
