"""The sequence layout under context parallelism (e2v/models/context_parallel.py): the video's noisy
frames and the reference slots are one token sequence, split over the ranks like any other, and the
prediction sliced back to the video's frames. Two processes spawned over gloo
(tests/helpers_context_parallel.py: `sequence_worker`) compare the split model with itself whole."""

from __future__ import annotations

import json

import pytest
from helpers import _free_port

TOL = 1e-5  # fp32: the split sums the same products in another order


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp
    from helpers_context_parallel import sequence_worker

    out = tmp_path_factory.mktemp("cp_sequence")
    mp.start_processes(sequence_worker, args=(2, _free_port(), str(out)), nprocs=2, start_method="fork")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_r2v_video_and_slots_split_over_ranks_equal_the_whole_sequence(spawned, kind):
    """5 video frames + 4 slots of 4 x 4 tokens (144 tokens, 72 a rank): every rank returns the
    video's 5 frames as the unsplit model does, and the ranks' gradients sum to its gradients."""
    for rank in spawned:
        r = rank[kind]
        assert r["shape"] == [2, 16, 5, 8, 8], r
        assert r["out"] < TOL and r["grads"] < TOL and r["grad_scale"] > 1e-2, r
