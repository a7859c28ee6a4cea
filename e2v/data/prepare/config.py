"""The data-preparation config (configs/prepare.yaml documents every key): typed dataclasses
loaded with yaml.safe_load; an unknown key, a wrong type or an impossible value stops the load,
naming the key and the fix. Kept apart from the trainer's schema: preparing data never changes what
a training config means, and the two share only the meanings of fps / num_frames / resolution.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from e2v.config.load import build_dataclass
from e2v.config.schema import ConfigError


class PrepareConfigError(ConfigError):
    """A prepare-config problem, phrased for the user: which key, what is wrong, how to fix it."""


@dataclass
class Shots:
    # PySceneDetect ContentDetector threshold (mean HSV change between frames). Its default, 27,
    # missed a cut between two similar-looking generated shots (change 26.3; bench/RESULTS.md
    # section 6); 20 found every cut there with no false one on the panned and zoomed photo
    # footage. Raise it if fast motion gives false cuts.
    threshold: float = 20.0
    min_shot_frames: int = 2  # the detector's min_scene_len: cuts closer than this are merged
    # The second opinion, PySceneDetect's AdaptiveDetector: a frame's change over its neighbours'
    # mean (its default 3), counted only above adaptive_min_content levels (its default 15 missed a
    # cut between two textured photos of similar colours; shots.py).
    adaptive_threshold: float = 3.0
    adaptive_min_content: float = 8.0
    # Dissolves and fades (shots.py): the span's ends differ by at least dissolve_min_change levels,
    # correlate below dissolve_max_similarity, and blend into its middle within dissolve_max_residual.
    dissolves: bool = True
    dissolve_min_change: float = 10.0
    dissolve_max_similarity: float = 0.5
    dissolve_max_residual: float = 0.3


@dataclass
class Clips:
    fps: float = 16.0  # the trainer's data.fps: frames are taken by time at this rate
    num_frames: int = 81  # the trainer's data.num_frames (4k+1)
    resolution: list[int] = field(default_factory=lambda: [480, 832])  # [H, W], multiples of 16
    windows_per_shot: int = 1  # at most this many non-overlapping windows per shot
    min_scale: float = 1.0  # the source's cropped area must be at least this x the target per side
    max_crop: float = 0.5  # share of the frame the centre crop may cut (aspect filter)
    max_shot_seconds: float = 30.0  # a longer shot is analysed over its first this many seconds
    crf: int = 18  # H.264 quality of the written clips (0 lossless, 23 ffmpeg's default)
    # Each source keeps its own orientation: the allowed orientation nearest its aspect, at
    # resolution's pixel count (landscape [H, W], portrait [W, H], square); train with
    # data.resolution_buckets listing the same sizes (the summary prints them).
    orientations: list[str] = field(default_factory=lambda: ["landscape", "portrait"])
    crop: str = "subject"  # subject: the crop that keeps the subject and objects inside; centre


@dataclass
class Captions:
    mode: str = "auto"  # auto: sidecar, else model, else file name; sidecar / model / filename force one
    table: Optional[str] = None  # CSV or JSONL in the input folder with a caption per source file
    file_column: str = "file"
    caption_column: str = "caption"
    model: Optional[str] = None  # local folder or hub id of an AutoModelForImageTextToText
    prompt: str = ("Describe this video in one paragraph: the main subject (who they are, what they wear, what they "
                   "do), the main object they interact with, and the setting.")
    max_new_tokens: int = 120
    num_images: int = 1  # frames of the clip shown to the captioner


@dataclass
class Element:
    name: str  # the output suffix: ID_<name>.png
    role: str  # subject (RGBA cut-out), object (RGB crop on white), background (frame, foreground filled)
    prompt: str = ""  # the learned backend's text prompt


ROLES = ("subject", "object", "background")
ORIENTATIONS = ("landscape", "portrait", "square")


@dataclass
class Classical:
    diff_threshold: float = 30.0  # max-channel |frame - median| (levels) above which a pixel is foreground
    open_px: int = 1  # morphological opening radius (removes specks)
    close_px: int = 2  # closing radius (fills pinholes)
    median_frames: int = 48  # frames of the shot the temporal median is taken over
    object_kernel: int = 0  # median-filter size for the static-object estimate; 0: a third of the short side
    object_threshold: float = 40.0  # |background - its smoothed self| (levels) above which a pixel is object
    max_components: int = 1  # largest connected components kept as the subject
    # The median needs a still camera: the medians of the shot's two halves differ over more than
    # this share of the frame when it pans or zooms, and the shot is skipped (shots_moving_camera).
    max_camera_motion: float = 0.25
    # A camera that pans, zooms or turns a little is registered to the shot's middle frame
    # (ORB features, a RANSAC homography per frame) and the median taken there; a shot whose
    # registration leaves more than max_camera_motion of the frame differing is still skipped.
    register: bool = True
    # Objects need evidence: a second moving region present in min_object_presence of the frames,
    # or (static_objects) a still region standing out of its smoothed surround, for footage whose
    # props are flat-coloured (bench/make_raw_footage.py's); on photographs that finds eyes and rims.
    min_object_presence: float = 0.5
    static_objects: bool = False


@dataclass
class Elements:
    backend: str = "auto"  # auto: learned when sam_model is set, else classical
    sam_model: Optional[str] = None  # Sam3Model folder or hub id (text-prompted masks on a frame)
    sam_batch: int = 8  # key frames per Sam3Model image-backbone pass (its features serve every element)
    # The learned backend follows each element's best detection through the shot: sam3
    # (Sam3TrackerVideoModel, from the same checkpoint as the detector by default), sam2
    # (Sam2VideoModel, a SAM 2.1 tracker_model) or none (a detection on every track frame).
    tracker: str = "sam3"
    tracker_model: Optional[str] = None  # the tracker's folder or hub id; null: sam_model (sam3 only)
    detect_every: Optional[int] = None  # detect on every this-many-th track frame; null: 8 with a tracker, else 1
    items: list[Element] = field(default_factory=lambda: [
        Element("person", "subject", "person"), Element("object", "object", "object"),
        Element("background", "background", "background")])
    reference_gap_seconds: float = 0.5  # a reference frame lies at least this far outside its clip's window
    # OpenS2V's filter values: background skipped above 45% foreground; elements under 1% of the
    # frame, detections under 0.5 confidence and frames under Laplacian variance 100 are dropped.
    max_foreground_share: float = 0.45
    min_area_share: float = 0.01
    min_score: float = 0.5
    min_sharpness: float = 100.0  # Laplacian variance of the reference's grey pixels (at the target size)
    margin_px: int = 2  # around a cut-out's bounding box
    classical: Classical = field(default_factory=Classical)


@dataclass
class Identity:
    check: bool = True  # every reference is compared with its element in the clip's window (identity.py)
    model: Optional[str] = None  # local vision-model folder (CLIP / SigLIP / DINOv2); null: the colour/texture statistic
    # The statistic's histogram intersection: 0.87-1.0 for one subject across its shot, 0.64 for two
    # photographed subjects, 0.40-0.71 for a subject against the background it stood on
    # (bench/make_raw_footage.py's hard footage).
    statistic_threshold: float = 0.75
    model_threshold: float = 0.7  # the embedding's cosine similarity; calibrate on your footage


@dataclass
class Gates:
    """Quality gates on every sample (run.py's quality): a failing sample is dropped, or written
    and flagged in the manifest (action: flag); never written unmarked."""
    action: str = "drop"  # drop | flag
    # share of the window's frames in which the subject's mask covers elements.min_area_share: a
    # subject absorbed into the background shows as a mask that vanishes in most frames
    min_presence: float = 0.8
    # share of the window's background pixels (outside every mask) that differ from the background
    # reference by more than classical.diff_threshold levels: a subject left in the plate, a wrong
    # registration (good plates of the photographed test footage: 0.00-0.10; a failed pan 0.69)
    max_background_residue: float = 0.15
    # share of the background reference painted by the fill, not seen (test footage: 0.00-0.12 for
    # good plates, 0.29 under a subject 90% of the frame high, whose plate was 22 levels off)
    max_background_filled: float = 0.2


@dataclass
class Check:
    run: bool = True  # run tools/check_dataset.py on the output
    set: list[str] = field(default_factory=list)  # extra --set overrides for the check (e.g. train.micro_batch_size=1)
    config: str = "configs/e2v.yaml"  # the training config whose elements and buckets it checks against
    contact_sheets: bool = True  # one PNG per clip: frames | references


@dataclass
class PrepareConfig:
    shots: Shots = field(default_factory=Shots)
    clips: Clips = field(default_factory=Clips)
    captions: Captions = field(default_factory=Captions)
    elements: Elements = field(default_factory=Elements)
    identity: Identity = field(default_factory=Identity)
    gates: Gates = field(default_factory=Gates)
    check: Check = field(default_factory=Check)


def _check(cfg: PrepareConfig) -> None:
    c = cfg.clips
    if c.num_frames < 5 or (c.num_frames - 1) % 4:
        raise PrepareConfigError(f"clips.num_frames: {c.num_frames} is not 4k+1 (the VAE's time stride); use e.g. 17, 49 or 81")
    if len(c.resolution) != 2 or any(v <= 0 or v % 16 for v in c.resolution):
        raise PrepareConfigError(f"clips.resolution: {c.resolution} must be [H, W], each a positive multiple of 16")
    if c.fps <= 0 or c.windows_per_shot < 1 or not 0 <= c.max_crop < 1:
        raise PrepareConfigError("clips: fps > 0, windows_per_shot >= 1 and 0 <= max_crop < 1 are required")
    bad = [o for o in c.orientations if o not in ORIENTATIONS]
    if bad or not c.orientations:
        raise PrepareConfigError(f"clips.orientations: {c.orientations} must list one or more of {', '.join(ORIENTATIONS)}")
    if c.crop not in ("subject", "centre"):
        raise PrepareConfigError(f"clips.crop: {c.crop!r} is not one of subject, centre")
    if cfg.gates.action not in ("drop", "flag"):
        raise PrepareConfigError(f"gates.action: {cfg.gates.action!r} is not one of drop, flag")
    if cfg.captions.mode not in ("auto", "sidecar", "model", "filename"):
        raise PrepareConfigError(f"captions.mode: {cfg.captions.mode!r} is not one of auto, sidecar, model, filename")
    if cfg.captions.mode == "model" and not cfg.captions.model:
        raise PrepareConfigError("captions.mode: model needs captions.model (an AutoModelForImageTextToText folder or "
                                 "hub id, e.g. Qwen/Qwen2.5-VL-7B-Instruct)")
    e = cfg.elements
    if e.backend not in ("auto", "classical", "learned"):
        raise PrepareConfigError(f"elements.backend: {e.backend!r} is not one of auto, classical, learned")
    if e.backend == "learned" and not e.sam_model:
        raise PrepareConfigError("elements.backend: learned needs elements.sam_model (a Sam3Model folder or hub id)")
    _check_tracker(e)
    for i, it in enumerate(e.items):
        if it.role not in ROLES:
            raise PrepareConfigError(f"elements.items.{i}.role: {it.role!r} is not one of {', '.join(ROLES)}")
    roles = [it.role for it in e.items]
    if roles.count("background") > 1 or roles.count("subject") != 1:
        raise PrepareConfigError(f"elements.items: needs exactly one subject and at most one background, got {roles}")
    if len({it.name for it in e.items}) != len(e.items):
        raise PrepareConfigError("elements.items: two elements share a name (each is the file suffix ID_<name>.png)")


TRACKERS = ("none", "sam3", "sam2")


def _check_tracker(e: Elements) -> None:
    if e.tracker not in TRACKERS:
        raise PrepareConfigError(f"elements.tracker: {e.tracker!r} is not one of {', '.join(TRACKERS)}")
    if e.detect_every is not None and e.detect_every < 1:
        raise PrepareConfigError(f"elements.detect_every: {e.detect_every} must be at least 1 (1: every track frame)")
    if e.tracker == "none" and detect_every(e) > 1:
        raise PrepareConfigError(f"elements.detect_every: {e.detect_every} needs a tracker to fill the frames between "
                                 "detections; set elements.tracker to sam3 or sam2, or elements.detect_every=1")
    if e.tracker == "none" and e.tracker_model:
        raise PrepareConfigError(f"elements.tracker_model: {e.tracker_model} is set but elements.tracker is none; "
                                 "set elements.tracker to sam3 or sam2, or elements.tracker_model=null")
    if e.tracker == "sam2" and not e.tracker_model:
        raise PrepareConfigError("elements.tracker: sam2 needs elements.tracker_model (a SAM 2.1 checkpoint, e.g. "
                                 "facebook/sam2.1-hiera-large); sam3 tracks with the detector's own checkpoint")


def detect_every(e: Elements) -> int:
    """Track frames per detection: elements.detect_every, else 8 with a tracker (the detections
    only choose each element's prompt frame) and 1 without (every frame needs its own)."""
    if e.detect_every is not None:
        return e.detect_every
    return 1 if e.tracker == "none" else 8


def load_prepare_config(path: str | Path | None, sets: list[str] = ()) -> PrepareConfig:
    """configs/prepare.yaml (or the defaults when path is None) plus `--set key=value` overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise PrepareConfigError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
    try:
        cfg = build_dataclass(PrepareConfig, raw, list(sets), source=path and str(path))  # the trainer config's loader
    except ConfigError as e:
        raise PrepareConfigError(str(e)) from None
    _check(cfg)
    return cfg


def as_dict(cfg: PrepareConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_key(cfg: PrepareConfig) -> str:
    """A fingerprint of every setting that shapes the samples (all but the check's): a video's
    record made with another key is stale and the video is redone."""
    shaping = {k: v for k, v in as_dict(cfg).items() if k != "check"}
    return hashlib.sha1(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]
