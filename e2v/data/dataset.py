"""Dataset, bucket sampler and collate: sample files -> a raw batch for conditioning.layout.batch_conditions,
or (cache.enabled) the sample's precomputed tensors for the same entry.

One item: the target video_CFHW in [-1,1], the prompt, and per element (position order) the
VAE-path image at the video size and the CLIP-path image at the CLIP resolution. Element images
are preprocessed here so DataLoader workers do it in parallel with the step.

Buckets: every sample trains at a (F, H, W) bucket: F is `data.num_frames`, or with
`auto_frame_buckets` the largest of `frame_buckets` the clip supports (`time_division_factor`:
every k * factor + 1 up to num_frames), counting the clip's frames at `data.fps` when set
(media.supported_frames, as tools/check_dataset.py does); (H, W) is
`data.resolution`, or the `resolution_buckets` entry nearest the clip's aspect ratio. A batch
holds one bucket, and all ranks take the same bucket at every step (the global batch is drawn
first, then split by rank), so nothing waits on a rank with a different shape.

Bad samples (`data.on_bad_sample`): `error` stops with the file named; `skip` takes the next
sample of the same bucket instead and reports the skipped one in the batch the first time this
worker meets it, so the loop counts it once; the worker then remembers it and never decodes it
again. Index-time problems (missing required element, unreadable, truncated or too-short clip,
empty caption, unreadable reference: e2v.data.preflight) are reported the same way before the
first step, so a mid-run failure is rare (a file changed while training).
"""

from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from e2v.config.schema import Config, ConfigError
from e2v.data import preflight
from e2v.data.buckets import Bucket, bucket_name, bucket_table, with_repeats
from e2v.data.elements import discover
from e2v.data.media import (
    MediaError,
    NoClockError,
    check_clock,
    load_image,
    load_video,
    preprocess_image,
    reference_tensor,
)
from e2v.data.sample import Sample, element_paths, sample_bucket
from e2v.data.store import CacheStore
from e2v.runtime.log import EVERY_RANK, get_logger
from e2v.runtime.threads import local_ranks, one_thread_worker

log = get_logger("e2v.data")


class BadSampleError(RuntimeError):
    pass


# --- buckets -----------------------------------------------------------------------------------


# --- indexing ----------------------------------------------------------------------------------


def require_clocks(samples: list[Sample]) -> None:
    """data.fps samples by time: a clip without timestamps (.npz) is a config error, not a bad
    sample to skip (the config asks for what the files cannot give), named with its fix."""
    for s in samples:
        try:
            check_clock(s.video)
        except NoClockError as e:
            raise ConfigError(f"sample {s.id}: {e}") from None


def index_samples(cfg: Config, verbose: bool = True, excluded: list | None = None,
                  stop_on_bad: bool | None = None, warnings: list | None = None) -> list[Sample]:
    """Every sample of every dataset, checked (e2v.data.preflight: every clip decoded at both
    ends and its usable frames counted, every caption and element read) and given its bucket.
    Bad samples are named, one line each: with on_bad_sample error (or stop_on_bad) they stop the
    run here, before any weight is loaded; with skip they are left out, listed, and appended to
    `excluded` (the run counts them beside the samples skipped while loading). Warnings (a tiny
    reference, a missing optional element) are printed summarized and appended to `warnings`."""
    found_all, problems = [], []
    for i, ds in enumerate(cfg.data.datasets):
        found, probs = discover(ds, cfg.data.elements, cfg.data.remove_common_llm_caption_prefixes, i,
                                cfg.data.allow_outside_root)
        if cfg.data.fps is not None:
            require_clocks(found)
        found_all += found
        problems += probs
    problems += preflight.check_samples(cfg, found_all, progress=verbose)
    errors = [p for p in problems if p.severity == "error"]
    notes = [p for p in problems if p.severity != "error"]
    bad = set(preflight.unusable(errors))  # those discovery refused too: the count named in every message
    samples = with_repeats([s for s in found_all if (s.dataset, s.id) not in bad], cfg)
    if warnings is not None:
        warnings.extend(notes)
    if verbose and notes:
        log.info("warnings (they train; tools/check_dataset.py writes the full list):\n  "
                 + "\n  ".join(preflight.summarize(notes)))
    if errors:
        lines = "\n  ".join(preflight.summarize(errors))  # a kind met often: once, counted, its first files named
        msg = f"{len(bad)} sample(s) unusable ({len(errors)} problem(s)):\n  {lines}"
        if cfg.data.on_bad_sample == "error" if stop_on_bad is None else stop_on_bad:
            raise BadSampleError(msg + f"\n({len({(s.dataset, s.id) for s in samples})} usable; set "
                                       "data.on_bad_sample: skip to train without them; tools/check_dataset.py "
                                       "lists every problem)")
        if verbose:
            log.info(f"left out: {msg}")
        if excluded is not None:
            excluded.extend(errors)
    if not samples:
        roots = ", ".join(d.data_root for d in cfg.data.datasets)
        raise BadSampleError(f"no usable samples in {roots}")
    return samples


# --- dataset -----------------------------------------------------------------------------------


def element_inputs(cfg: Config, images: dict, height: int, width: int) -> dict:
    """One sample's reference images (name -> PIL, absent optional elements left out) -> the
    per-element inputs collate stacks: the VAE references at the video size (image_CHW in
    [-1, 1]) with their repeats, and the CLIP references as uint8 HWC at the CLIP resolution, in
    element order (absent elements compact the positions)."""
    d, pc = cfg.data, cfg.processors.clip
    out = {"element_names": [], "vae_refs": {}, "vae_repeats": {}, "clip_refs": {}}
    for el in cfg.ordered_elements if cfg.e2v_type != "none" else []:
        img = images.get(el.name)
        if img is None:
            continue
        out["element_names"].append(el.name)
        if el.vae is not None:
            out["vae_refs"][el.name] = reference_tensor(img, height, width, cfg.vae_preprocess(el), d.reshape_mode)
            out["vae_repeats"][el.name] = el.vae.repeat
        if el.clip is not None:
            out["clip_refs"][el.name] = np.asarray(preprocess_image(img, *pc.resolution, cfg.clip_preprocess(el),
                                                                    d.reshape_mode))
    return out


def load_element_inputs(cfg: Config, files: dict, height: int, width: int) -> dict:
    """element_inputs of a sample's element files (name -> path), read by the config's rule
    (Config.reference_reading)."""
    return element_inputs(cfg, {name: load_image(path, cfg.data.max_image_pixels, cfg.reference_reading)
                                for name, path in files.items()}, height, width)


class E2VDataset(torch.utils.data.Dataset):
    def __init__(self, cfg: Config, samples: list[Sample], cache: CacheStore | None = None):
        self.cfg = cfg
        self.samples = samples
        self.cache = cache
        # ids found bad in this process (each DataLoader worker has its own copy): skipped without
        # decoding again, and reported only the first time, so one bad clip counts once, not per epoch
        self.known_bad: dict[tuple[int, str], str] = {}  # (dataset, id): two datasets may share ids
        self.elements = cfg.ordered_elements if cfg.e2v_type != "none" else []
        groups: dict[Bucket, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(sample_bucket(s, cfg), []).append(i)
        # a replacement for a bad sample comes from the same bucket: the batch keeps one shape
        self.same_bucket = {i: (g, pos) for g in groups.values() for pos, i in enumerate(g)}

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, s: Sample) -> dict:
        if not s.prompt.strip():
            raise MediaError(f"{s.prompt_source or s.video}: empty prompt")
        f, h, w = sample_bucket(s, self.cfg)
        paths = element_paths(s)
        files = {el.name: paths[el.name] for el in self.elements if el.name in paths}
        if self.cache is not None:  # the element files ride along: the visualizer shows the references
            return {**self.cache.load(s), "element_files": files, "size": (h, w)}
        d = self.cfg.data
        video = load_video(s.video, f, h, w, stride=d.frame_stride, fps=d.fps,
                           resize_mode=d.video_resize, reshape_mode=d.reshape_mode, frame_range=s.frame_range,
                           crop=s.crop)
        return {"id": s.id, "video": video, "prompt": s.prompt, **load_element_inputs(self.cfg, files, h, w)}

    def __getitem__(self, index: int) -> dict:
        skipped = []
        group, start = self.same_bucket[index]
        for attempt in range(len(group)):
            s = self.samples[group[(start + attempt) % len(group)]]
            if (s.dataset, s.id) in self.known_bad:
                continue
            try:
                item = self.load(s)
                item["skipped"] = skipped
                return item
            except (MediaError, OSError, ValueError) as e:
                if self.cfg.data.on_bad_sample == "error":
                    raise BadSampleError(
                        f"sample {s.id}: {e}\n(set data.on_bad_sample: skip to skip and count bad samples)"
                    ) from e
                self.known_bad[s.dataset, s.id] = str(e)
                skipped.append((s.id, str(e)))
                log.warning(f"skipped bad sample {s.id}: {e}", extra=EVERY_RANK)  # counted by the loop too
        first = [(sid, err) for (_, sid), err in self.known_bad.items()][:3]
        raise BadSampleError(f"every sample of bucket {bucket_name(sample_bucket(self.samples[index], self.cfg))} "
                             f"failed to load; first: {first}")


def collate(items: list[dict]) -> dict:
    batch = {k: [it[k] for it in items] for k in items[0] if k != "video"}
    if "video" in items[0]:
        batch["video"] = torch.stack([it["video"] for it in items])  # [B,3,F,H,W]
    batch["skipped"] = [s for it in items for s in it["skipped"]]
    return batch


# --- sampler -----------------------------------------------------------------------------------


class BucketBatchSampler(Sampler):
    """Yields this rank's micro-batches (lists of dataset indices), forever.

    Per epoch (seed + epoch): each dataset contributes round(n x weight) samples (weight 2 = each
    sample twice, 0.5 = a different half every epoch); each bucket is shuffled and cut into global
    batches of micro_batch x world (the tail wraps around to the bucket's start: repeated, never
    dropped); the global batches are shuffled; rank r takes every world-th index of each. The
    generator is seeded identically on every rank, so all ranks agree on the bucket of each step.
    `start_sample` (samples this rank already consumed) skips ahead, so a resumed run continues
    the same order. With one bucket and unit weights the order is the plain seeded shuffle."""

    def __init__(self, buckets: list[Bucket], datasets: list[int], weights: list[float], *, batch_size: int,
                 rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True, start_sample: int = 0):
        self.buckets, self.datasets, self.weights = buckets, datasets, weights
        self.batch_size, self.rank, self.world, self.seed, self.shuffle = batch_size, rank, world, seed, shuffle
        self.start_sample = start_sample

    def epoch_indices(self, epoch: int) -> list[int]:
        """The weighted multiset of sample indices of one epoch."""
        out = []
        g = torch.Generator().manual_seed(self.seed + epoch + 7919)  # its own stream: unit weights draw nothing
        for d, w in enumerate(self.weights):
            members = [i for i, ds in enumerate(self.datasets) if ds == d]
            whole, frac = divmod(w, 1.0)
            out += members * int(whole)
            extra = round(frac * len(members))
            if extra:
                out += [members[j] for j in torch.randperm(len(members), generator=g)[:extra].tolist()]
        return sorted(out)

    def global_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        by_bucket: dict[Bucket, list[int]] = {}
        for i in self.epoch_indices(epoch):
            by_bucket.setdefault(self.buckets[i], []).append(i)
        size = self.batch_size * self.world
        batches = []
        for key in sorted(by_bucket):
            idx = by_bucket[key]
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
            idx = idx * math.ceil(size / len(idx)) if len(idx) < size else idx
            idx = idx + idx[: (-len(idx)) % size]
            batches += [idx[k:k + size] for k in range(0, len(idx), size)]
        if self.shuffle and len(by_bucket) > 1:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def __iter__(self):
        skip, epoch = self.start_sample // self.batch_size, 0
        while True:  # infinite: the loop stops at max_steps
            batches = self.global_batches(epoch)
            for gb in batches[skip:]:
                yield gb[self.rank::self.world]
            skip = max(0, skip - len(batches))
            epoch += 1

    def __len__(self) -> int:
        return len(self.global_batches(0))


def make_loader(cfg: Config, samples: list[Sample], *, rank: int, world: int, start_sample: int = 0) -> DataLoader:
    table, small = bucket_table(samples, cfg, world)
    if small and cfg.data.small_bucket == "error":
        raise BadSampleError(
            f"bucket(s) {', '.join(bucket_name(b) for b in small)} hold fewer samples than micro_batch_size "
            f"{cfg.train.micro_batch_size} x world {world}:\n{table}\nfix: add clips of that size, change "
            "data.frame_buckets / data.resolution_buckets, or set data.small_bucket: repeat (samples repeat "
            "within a step) or drop (they leave training)")
    if small and cfg.data.small_bucket == "drop":
        samples = [s for s in samples if sample_bucket(s, cfg) not in small]
        if not samples:
            raise BadSampleError(f"data.small_bucket: drop left no samples:\n{table}")
    log.info(f"{len(samples)} samples in {len(Counter(sample_bucket(s, cfg) for s in samples))} bucket(s):\n{table}")
    cache = CacheStore(cfg) if cfg.cache.enabled else None
    if cache is not None:
        cache.verify_all(samples)  # a missing or stale entry fails now, not hours in
    dataset = E2VDataset(cfg, samples, cache)
    sampler = BucketBatchSampler(
        [sample_bucket(s, cfg) for s in samples], [s.dataset for s in samples],
        [d.weight for d in cfg.data.datasets], batch_size=cfg.train.micro_batch_size, rank=rank, world=world,
        seed=cfg.seed, shuffle=cfg.data.shuffle, start_sample=start_sample)
    workers = loader_workers(cfg)
    return DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate,
        num_workers=workers, pin_memory=torch.cuda.is_available(), worker_init_fn=one_thread_worker if workers else None,
        prefetch_factor=cfg.data.prefetch_factor if workers else None, persistent_workers=workers > 0,
    )


def loader_workers(cfg: Config) -> int:
    """data.num_workers, or (null) 4 worker processes per rank with CUDA, as many as the cores per
    local rank allow, and none on a CPU-only machine (the training itself needs the cores)."""
    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    if not torch.cuda.is_available():
        return 0
    return max(0, min(4, (os.cpu_count() or 1) // local_ranks() - 1))
