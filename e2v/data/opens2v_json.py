"""OpenS2V-5M's JSON, read and checked: an entry's clip, valid frame range, crop box, captions and
scores (`parse_entry` -> `Entry`), and its COCO RLE masks, decoded only after their run lengths
have been checked to cover the frame exactly (pycocotools' decoder trusts its input). What the
entries become (samples and their references): e2v/data/opens2v.py; the field mapping:
docs/formats.md, "OpenS2V-5M".

Legend: H/W height/width of the cropped frame; mask_HW bool (True = the class).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from e2v.config.schema import OpenS2V


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


def mask_area(rles: list[dict]) -> int:
    from pycocotools import mask as mask_util

    if not rles:
        return 0
    return int(mask_util.area(mask_util.merge(rles, intersect=False) if len(rles) > 1 else rles[0]))


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
                        rle, mask_area([rle])))
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

