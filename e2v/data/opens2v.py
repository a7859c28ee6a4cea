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

from e2v.config.schema import Dataset, Element, OpenS2V
from e2v.data.media import MediaError, read_frame
from e2v.data.opens2v_json import Entry, EntryError, decode_mask, mask_area, parse_entry
from e2v.data.prepare.fill import MAX_FOREGROUND_SHARE, fill_background
from e2v.data.sample import MetadataError, Problem, Sample, outside_problem, outside_root
from e2v.runtime.log import get_logger

log = get_logger("e2v.data")

RECIPE_VERSION = "1"  # bump when the cut itself changes: every reference is then written anew
SUBJECT, OBJECT = "subject", "object"
NEXUS_MAIN_IMAGE = "main_image.png"  # the generated-views folder also holds the frame they were made from






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
            if mask_area(fg) / (h * w) > MAX_FOREGROUND_SHARE:
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
    return (f"opens2v {ds.metadata_path}: {index.entries} entries -> {len(index.samples)} samples, "
            f"{len(index.problems)} problems; left out: {dropped}")


def discover_opens2v(ds: Dataset, elements: list[Element], allow_outside_root: bool = False
                     ) -> tuple[list[Sample], list[Problem]]:
    """e2v.data.elements.discover's `opens2v` source: the samples and problems, the drop counts printed once."""
    index = read_opens2v(ds, elements, allow_outside_root)
    log.info(summary_line(ds, index))
    return index.samples, index.problems
