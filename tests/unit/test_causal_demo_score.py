"""bench/causal_demo.py's per-block reading: which pixel frames each causal block decodes to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("frames, per_block, first_alone, expected", [
    (21, 3, False, [range(0, 9), range(9, 21)]),            # 6 latent frames: 0-2 -> pixels 0-8, 3-5 -> 9-20
    (21, 5, True, [range(0, 1), range(1, 21)]),             # frame 0 alone, then latent 1-5 -> pixels 1-20
    (13, 1, False, [range(0, 1), range(1, 5), range(5, 9), range(9, 13)]),
])
def test_block_frames_follow_the_vaes_four_frames_per_latent_frame(frames, per_block, first_alone, expected):
    from bench.causal_demo import block_frames

    cfg = SimpleNamespace(causal=SimpleNamespace(frames_per_block=per_block, independent_first_frame=first_alone))
    assert block_frames(cfg, frames) == expected
