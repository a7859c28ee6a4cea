"""A conditioning config and batch of the tiny preset (`make_cfg`, `make_batch`), shared by
tests/unit/test_conditioning_options.py, test_devices.py and test_activation_offload.py."""

from __future__ import annotations

import torch

from e2v.config.load import load_config

F, S = 17, 32  # frames, square size of the test videos (latents [.,16,5,4,4])


NAMES = ["subject", "object", "background", "extra"]


REPEATS = {"subject": 1, "object": 4, "background": 4, "extra": 4}


def make_cfg(**over):
    """A tiny-preset config with four elements (A2's three plus one), repeats 1, 4, 4, 4."""
    raw = {
        "model": {"preset": "tiny"},
        "data": {"datasets": [{"data_root": "."}], "num_frames": F, "resolution": [S, S],
                 "elements": [{"name": n, "suffixes": [f"_{n}.png"], "required": n == "subject",
                               "vae": {"repeat": REPEATS[n], "position": i}} for i, n in enumerate(NAMES)]},
        "processors": {"clip": {"resolution": [S, S]}},
    }
    for path, value in over.items():
        node, keys = raw, path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return load_config(raw=raw, check_paths=False)


def make_batch(counts: list[int], seed: int = 0, clip_names=None) -> dict:
    """A raw batch as data.collate builds it: sample i has the first counts[i] elements."""
    g = torch.Generator().manual_seed(seed)
    b = len(counts)
    batch = {"id": [f"s{i}" for i in range(b)], "video": torch.rand(b, 3, F, S, S, generator=g) * 2 - 1,
             "prompt": ["a shape moves across a patterned background"] * b, "element_names": [], "vae_refs": [],
             "vae_repeats": [], "clip_refs": [], "skipped": []}
    for n in counts:
        names = NAMES[:n]
        batch["element_names"].append(names)
        batch["vae_refs"].append({k: torch.rand(3, S, S, generator=g) * 2 - 1 for k in names})
        batch["vae_repeats"].append({k: REPEATS[k] for k in names})
        clip = {k: (torch.rand(S, S, 3, generator=g) * 255).to(torch.uint8).numpy() for k in names}
        batch["clip_refs"].append({k: v for k, v in clip.items() if clip_names is None or k in clip_names})
    return batch
