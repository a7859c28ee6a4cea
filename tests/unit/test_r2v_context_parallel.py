"""The sequence layout under context parallelism (e2v/models/context_parallel.py): the video's noisy
frames and the reference slots are one token sequence, split over the ranks like any other, and the
prediction sliced back to the video's frames. Two processes spawned over gloo
(tests/helpers_context_parallel.py: `sequence_worker`) compare the split model with itself whole."""

from __future__ import annotations

import pytest
from helpers_context_parallel import TOL


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    from helpers_context_parallel import sequence_worker, spawn

    return spawn(sequence_worker, tmp_path_factory.mktemp("cp_sequence"))


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_r2v_video_and_slots_split_over_ranks_equal_the_whole_sequence(spawned, kind):
    """5 video frames + 4 slots of 4 x 4 tokens (144 tokens, 72 a rank): every rank returns the
    video's 5 frames as the unsplit model does, and the ranks' gradients sum to its gradients."""
    for rank in spawned:
        r = rank[kind]
        assert r["shape"] == [2, 16, 5, 8, 8], r
        assert r["out"] < TOL and r["grads"] < TOL and r["grad_scale"] > 1e-2, r
