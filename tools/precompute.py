"""Fill the conditioning cache of a config (e2v/data/store.py): target latents (mean and std), text
embeddings, per-element CLIP tokens and the VAE condition(s), one safetensors file per sample.

    python tools/precompute.py --config configs/e2v.yaml [--set ...]
    deepspeed --num_gpus 8 tools/precompute.py --config configs/e2v.yaml     # sharded across ranks

Resumable: valid entries are skipped, so an interrupted run continues where it stopped. Each
rank takes every world-th sample (no communication needed); DataLoader workers decode while the
encoders run. Bad samples follow data.on_bad_sample: error stops naming the file, skip records the
sample as bad in the cache (training then skips and counts it). Train with `--set cache.enabled=true`.
"""

from __future__ import annotations

import argparse
import sys
import time

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.models.weights import require_weights
from e2v.runtime.hostmem import return_freed_memory
from e2v.runtime.slurm import launch_ranks


class _Pixels:
    """(sample index, item or the error text): a failure is reported, never replaced by another
    sample. A map-style dataset (what DataLoader indexes: __len__, __getitem__), defined without
    torch so the command's --help and config errors come before torch's import."""

    def __init__(self, dataset, todo: list[int]):
        self.dataset, self.todo = dataset, todo

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, j: int):
        from e2v.data.media import MediaError

        i = self.todo[j]
        try:
            return i, self.dataset.load(self.dataset.samples[i])
        except (MediaError, OSError, ValueError) as e:
            return i, str(e)


def _as_is(x):
    return x  # no default_convert: CLIP images stay uint8 numpy, as data.collate leaves them


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--local_rank", type=int, default=launch_ranks()[2])
    args = p.parse_args(argv)
    return_freed_memory()
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    require_weights(cfg)  # the encoders' weights: one line, not diffusers' traceback
    # the stages, once the config and the weights are known good (torch, diffusers: 15-25 s to import)
    import torch

    from e2v.conditioning.cached import compute_entry, shared_entry
    from e2v.data.dataset import BadSampleError, E2VDataset, index_samples, loader_workers
    from e2v.data.store import CacheStore, bad_entries_message
    from e2v.models.load import load_parts

    rank, world, _ = launch_ranks()  # deepspeed's or torchrun's variables, or srun's tasks
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":  # this rank's GPU for everything that takes the current device (cuDNN, pinned copies)
        torch.cuda.set_device(device)
    from tqdm import tqdm

    samples = list({(s.dataset, s.id): s for s in index_samples(cfg, verbose=rank == 0)}.values())
    mine = samples[rank::world]
    store = CacheStore(cfg)
    todo = [i for i, s in enumerate(mine) if store.problem(s)]
    if cfg.data.on_bad_sample == "error":  # entries a skip run recorded as bad would stop training
        pending = set(todo)
        bad = store.bad_entries([s for i, s in enumerate(mine) if i not in pending])
        if bad:
            raise BadSampleError(bad_entries_message(bad))
    print(f"[precompute rank {rank}/{world}] {len(mine)} samples: {len(mine) - len(todo)} cached and valid, "
          f"{len(todo)} to compute -> {store.path(mine[0]).parent if mine else '-'}")
    if not todo and (rank != 0 or store.shared_path().exists()):
        return 0
    parts = load_parts(cfg, device=device, with_transformer=False)  # the transformer's config is all it reads
    if rank == 0:
        store.write_shared(*shared_entry(parts))
    dataset = E2VDataset(cfg, mine)
    workers = loader_workers(cfg)
    loader = torch.utils.data.DataLoader(_Pixels(dataset, todo), batch_size=None, collate_fn=_as_is, num_workers=workers,
                                         prefetch_factor=cfg.data.prefetch_factor if workers else None)
    t0, bad = time.perf_counter(), 0
    for i, item in tqdm(loader, total=len(todo), desc=f"precompute rank {rank}", position=rank, dynamic_ncols=True,
                        mininterval=1 if sys.stderr.isatty() else 30):
        s = mine[i]
        if isinstance(item, str):
            if cfg.data.on_bad_sample == "error":
                raise BadSampleError(f"sample {s.id}: {item}\n(set data.on_bad_sample: skip to record it as bad "
                                     "and go on; training then skips and counts it)")
            store.write_bad(s, item)
            bad += 1
            continue
        store.write(s, compute_entry(item, parts, cfg), item["element_names"])
    dt = time.perf_counter() - t0
    print(f"[precompute rank {rank}/{world}] wrote {len(todo) - bad} entries ({bad} bad samples recorded) in "
          f"{dt:.1f} s: {(len(todo)) / max(dt, 1e-9):.1f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
