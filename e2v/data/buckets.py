"""Frame and resolution buckets: which (frames, height, width) a clip trains at (`choose_bucket`,
from the frames the clip supports and its size), the repeats of small buckets, and the counts the
start-up table and the validator print. The start-up data check (e2v/data/preflight.py) and the
dataset (e2v/data/dataset.py) both use these rules."""

from __future__ import annotations

import math
from collections import Counter

from e2v.config.schema import Config
from e2v.config.shapes import frame_bucket_list
from e2v.data.media import TooShortError
from e2v.data.sample import Sample, sample_bucket

Bucket = tuple[int, int, int]  # (F, H, W)


def uses_buckets(cfg: Config) -> bool:
    return cfg.data.auto_frame_buckets or bool(cfg.data.resolution_buckets)


def choose_bucket(frames: int, height: int, width: int, cfg: Config) -> Bucket:
    """The clip's bucket; MediaError when the clip is too short for every frame bucket. `frames`
    is what the clip supports: media.supported_frames (with data.fps, its samples at that rate)."""
    d = cfg.data
    at = f" at data.fps {d.fps:g}" if d.fps is not None else ""

    def span(f: int) -> int:  # source frames (with fps: samples at that rate) a count of f needs at this stride
        return (f - 1) * d.frame_stride + 1

    if d.auto_frame_buckets:
        fits = [f for f in frame_bucket_list(cfg) if span(f) <= frames]
        if not fits:
            shortest = frame_bucket_list(cfg)[0]
            raise TooShortError(f"too short: {frames} frames{at}, the shortest frame bucket {shortest} needs "
                                f"{span(shortest)} (frame_stride {d.frame_stride})")
        f = fits[-1]
    else:
        f = d.num_frames
        if span(f) > frames:
            raise TooShortError(f"too short: {frames} frames{at}, data.num_frames {f} needs {span(f)} (frame_stride "
                                f"{d.frame_stride}); lower num_frames or turn on data.auto_frame_buckets")
    h, w = d.resolution
    if d.resolution_buckets:  # nearest aspect ratio, in log space (2:1 and 1:2 are equally far from 1:1)
        aspect = math.log(width / height)
        h, w = min(d.resolution_buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - aspect))
    return (f, h, w)


def bucket_name(b: Bucket) -> str:
    return f"{b[0]}x{b[1]}x{b[2]}"


def with_repeats(samples: list[Sample], cfg: Config) -> list[Sample]:
    """Each dataset's samples `repeat` times (the list repeated whole, the order index_samples has
    always used): what training indexes and what tools/check_dataset.py counts."""
    out = []
    for d, ds in enumerate(cfg.data.datasets):
        out += [s for s in samples if s.dataset == d] * ds.repeat
    return out


def bucket_counts(samples: list[Sample], cfg: Config) -> Counter:
    """Samples per bucket in one epoch as the sampler draws them: the indexed list (repeats
    included) times each dataset's weight, rounded (a fractional weight draws a random subset of
    the dataset, so a bucket's share varies a little between epochs)."""
    weighted = Counter()
    for s in samples:
        weighted[sample_bucket(s, cfg)] += cfg.data.datasets[s.dataset].weight
    return Counter({b: round(n) for b, n in weighted.items()})


def bucket_table(samples: list[Sample], cfg: Config, world: int) -> tuple[str, list[Bucket]]:
    """The printed table (bucket, samples, global batches per epoch, status) and the buckets too
    small for micro_batch x world."""
    need = cfg.train.micro_batch_size * world
    counts = bucket_counts(samples, cfg)
    small = sorted(b for b, n in counts.items() if n < need)
    rows = [f"  {'bucket FxHxW':>16} {'per epoch':>9} {'batches':>8}"]
    for b in sorted(counts):
        status = f"  < {need} (micro_batch_size x world): {cfg.data.small_bucket}" if b in small else ""
        rows.append(f"  {bucket_name(b):>16} {counts[b]:>9} {math.ceil(counts[b] / need):>8}{status}")
    return "\n".join(rows), small

