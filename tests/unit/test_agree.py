"""One decision for all ranks (e2v/models/agree.py): two gloo ranks on this CPU, each reading its own
copy of a Wan2.2 pipeline folder as two nodes would, end with the same decision or with the same
clear error on both, never a hang: the processes are time-limited, and the process group's own
timeout turns a rank left waiting into an error well within it."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed  # noqa: F401  (the ranks fork from here: their imports are done once)
from helpers_agree import two_ranks

import e2v.models.agree  # noqa: F401

RANK_SCRIPT = """
import datetime, json, os, sys
from types import SimpleNamespace
import torch.distributed as dist
from e2v.models.agree import agree_on_local_facts
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
for case in json.loads(sys.argv[1]):  # [[rank 0's folder, rank 1's folder], ...]: one group, every case
    folder = case[dist.get_rank()]
    cfg = SimpleNamespace(model=SimpleNamespace(preset=None, pretrained=folder, zero3_init=True, expert="high_noise"))
    try:
        facts = agree_on_local_facts(cfg, {"zero_optimization": {"stage": 3}})
        print("AGREED " + json.dumps(facts, sort_keys=True), flush=True)
    except SystemExit as e:
        print(f"STOPPED {e}", flush=True)
"""


def pipeline(root: Path, boundary: float = 0.9, shards: int = 2, present: int = 2) -> Path:
    """A Wan2.2 two-expert pipeline folder as the loader sees it before reading weights: the index,
    `present` of its `shards` shard files, the transformers' configs."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "WanTransformer3DModel"],
                                                       "transformer_2": ["diffusers", "WanTransformer3DModel"],
                                                       "boundary_ratio": boundary}))
    for sub in ("transformer", "transformer_2"):
        (root / sub).mkdir()
        (root / sub / "config.json").write_text(json.dumps({"num_layers": 2}))
        names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        (root / sub / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
        for n in names[:present]:
            (root / sub / n).write_bytes(b"\0" * 64)
    return root


CASES = {
    "same_copy": (dict(), "AGREED"),
    "shard_missing_on_rank_1": (dict(present=1), "STOPPED rank 1: .* lacks "
                                                 "transformer/diffusion_pytorch_model-00002-of-00002.safetensors"),
    "other_boundary_on_rank_1": (dict(boundary=0.875), "STOPPED the ranks read different models .*boundary_ratio: "
                                                       "rank 0 0.9, rank 1 0.875"),
}


def test_two_ranks_with_different_local_copies_decide_alike_or_stop_alike(tmp_path):
    import re

    cases = [(pipeline(tmp_path / name / "node0"), pipeline(tmp_path / name / "node1", **rank1))
             for name, (rank1, _) in CASES.items()]
    rank0, rank1 = two_ranks(RANK_SCRIPT, json.dumps([[str(a), str(b)] for a, b in cases]))
    assert len(rank0) == len(rank1) == len(CASES), (rank0, rank1)  # every case ended on both ranks
    for (name, (_, expect)), line0, line1 in zip(CASES.items(), rank0, rank1):
        assert line0 == line1, (name, line0, line1)  # the same decision, or the same message, on both
        assert re.match(expect, line0), (name, line0)
    facts = json.loads(rank0[0].split(" ", 1)[1])
    assert facts["boundary_ratio"] == 0.9 and facts["_where"].endswith("same_copy/node0")
    assert facts["boundary_ratio"] == 0.9 and facts["transformer: load"] == "partitioned (ZeRO-3)"
