"""Dataset, resumable sampler and collate: sample files -> a raw batch for conditioning.encode_batch.

One item: the target video_CFHW in [-1,1], the prompt, and per element (position order) the
VAE-path image at the video size and the CLIP-path image at the CLIP resolution. Element images
are preprocessed here so DataLoader workers do it in parallel with the step.

Bad samples (`data.on_bad_sample`): `error` stops with the file named; `skip` takes the next
sample instead and reports the skipped one in the batch, so the loop counts and logs it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from e2v.config import Config
from e2v.elements import Sample, discover
from e2v.media import MediaError, image_to_tensor, load_image, load_video, preprocess_image


class BadSampleError(RuntimeError):
    pass


def ordered_elements(cfg: Config):
    """All elements in condition order: VAE position, then CLIP-only elements in config order."""
    def key(ie):
        i, e = ie
        return (0, e.vae.position) if e.vae is not None else (1, i)
    return [e for _, e in sorted(enumerate(cfg.data.elements), key=key)]


def index_samples(cfg: Config, verbose: bool = True) -> list[Sample]:
    samples, problems = [], []
    for i, ds in enumerate(cfg.data.datasets):
        found, probs = discover(ds, cfg.data.elements, cfg.data.remove_common_llm_caption_prefixes, i)
        samples.extend(found * ds.repeat)
        problems.extend(probs)
    if problems:
        lines = "\n  ".join(str(p) for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        msg = f"{len(problems)} sample(s) excluded:\n  {lines}{more}"
        if cfg.data.on_bad_sample == "error":
            raise BadSampleError(msg + "\n(set data.on_bad_sample: skip to train without them; "
                                       "tools/check_dataset.py lists every problem)")
        if verbose:
            print(f"[e2v data] {msg}")
    if not samples:
        roots = ", ".join(d.data_root for d in cfg.data.datasets)
        raise BadSampleError(f"no samples found in {roots}")
    return samples


class E2VDataset(torch.utils.data.Dataset):
    def __init__(self, cfg: Config, samples: list[Sample]):
        self.cfg = cfg
        self.samples = samples
        self.elements = ordered_elements(cfg) if cfg.e2v_type != "none" else []

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, s: Sample) -> dict:
        d, pv, pc = self.cfg.data, self.cfg.processors.vae, self.cfg.processors.clip
        h, w = d.resolution
        video = load_video(s.video, d.num_frames, h, w, stride=d.frame_stride,
                           resize_mode=d.video_resize, reshape_mode=d.reshape_mode)
        if not s.prompt.strip() and d.on_bad_sample == "error":
            raise MediaError(f"{s.video.with_suffix('.txt')}: empty prompt")
        item = {"id": s.id, "video": video, "prompt": s.prompt, "element_names": [],
                "vae_refs": {}, "vae_repeats": {}, "clip_refs": {}}
        for el in self.elements:
            path = s.elements.get(el.name)
            if path is None:
                continue  # optional and absent: positions compact
            img = load_image(path)
            item["element_names"].append(el.name)
            if el.vae is not None:
                mode = el.vae.preprocess or pv.default_preprocess
                item["vae_refs"][el.name] = image_to_tensor(preprocess_image(img, h, w, mode, d.reshape_mode))
                item["vae_repeats"][el.name] = el.vae.repeat
            if el.clip is not None:
                mode = el.clip.preprocess or pc.default_preprocess
                ch, cw = pc.resolution
                item["clip_refs"][el.name] = np.asarray(preprocess_image(img, ch, cw, mode, d.reshape_mode))
        return item

    def __getitem__(self, index: int) -> dict:
        skipped = []
        for attempt in range(len(self.samples)):
            s = self.samples[(index + attempt) % len(self.samples)]
            try:
                item = self.load(s)
                item["skipped"] = skipped
                return item
            except (MediaError, OSError, ValueError) as e:
                if self.cfg.data.on_bad_sample == "error":
                    raise BadSampleError(
                        f"sample {s.id}: {e}\n(set data.on_bad_sample: skip to skip and count bad samples)"
                    ) from e
                skipped.append((s.id, str(e)))
        raise BadSampleError(f"every sample failed to load; first: {skipped[:3]}")


def collate(items: list[dict]) -> dict:
    batch = {k: [it[k] for it in items] for k in items[0] if k != "video"}
    batch["video"] = torch.stack([it["video"] for it in items])  # [B,3,F,H,W]
    batch["skipped"] = [s for it in items for s in it["skipped"]]
    return batch


class ResumableSampler(Sampler):
    """Seeded shuffle per epoch, sharded by rank, with an offset so a resumed run continues the
    same order. Every rank gets the same number of samples (the tail is wrapped, not dropped)."""

    def __init__(self, n: int, *, rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True,
                 start_sample: int = 0):
        self.n, self.rank, self.world, self.seed, self.shuffle = n, rank, world, seed, shuffle
        self.per_rank = math.ceil(n / world)
        self.start_sample = start_sample  # samples of this rank already consumed

    def order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
        else:
            perm = list(range(self.n))
        total = self.per_rank * self.world
        perm = (perm * math.ceil(total / self.n))[:total]
        return perm[self.rank::self.world]

    def __iter__(self):
        consumed = self.start_sample
        epoch, offset = divmod(consumed, self.per_rank)
        while True:  # infinite: the loop stops at max_steps
            yield from self.order(epoch)[offset:]
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:
        return self.per_rank


def make_loader(cfg: Config, samples: list[Sample], *, rank: int, world: int, start_sample: int = 0) -> DataLoader:
    dataset = E2VDataset(cfg, samples)
    sampler = ResumableSampler(len(dataset), rank=rank, world=world, seed=cfg.seed, shuffle=cfg.data.shuffle,
                               start_sample=start_sample)
    workers = cfg.data.num_workers
    return DataLoader(
        dataset, batch_size=cfg.train.micro_batch_size, sampler=sampler, collate_fn=collate,
        num_workers=workers, pin_memory=torch.cuda.is_available(),
        prefetch_factor=cfg.data.prefetch_factor if workers else None, persistent_workers=workers > 0,
    )


def sample_paths(samples: list[Sample]) -> list[Path]:
    return [s.video for s in samples]
