"""Preemption and resume, end to end, 2 processes under ZeRO-3 + CPU offload (torch AdamW):
SIGTERM to the whole job saves a checkpoint (the only one: no periodic save is due) and exits;
`--resume latest` continues from the signalled step with exactly the losses of the uninterrupted
run, removing a stale `.partial` save, and its exported LoRA reproduces in plain diffusers the
live engine's output at the end of training; a truncated newest checkpoint is detected and the
previous one used. The interrupted part runs with gradient checkpointing, which must not change
the losses. Checkpoint housekeeping (prune by step, `latest` over an abandoned branch) is tested
on folders made here.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_resume_runs.py."""

import json

import pytest

# The real entry point with one test-only step: before the end-of-run export every rank runs the
# live engine on a fixed probe (a collective under ZeRO-3), rank 0 saves the output (the wrapper
# make smoke-real uses too).
from e2v.train.checkpoint import MANIFEST, checkpoint_problem, find_resume, prune_checkpoints, remove_stale_saves


def _make(root, name, files, manifest=True, truncate=None):
    d = root / name
    d.mkdir(parents=True)
    for f, n in files.items():
        (d / f).write_bytes(b"x" * n)
    if manifest:
        (d / MANIFEST).write_text(json.dumps({"step": 0, "files": files}))
    if truncate:
        (d / truncate).write_bytes(b"x")


def test_find_resume_takes_newest_intact_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _make(root, "step_000001", {"a.pt": 10})
    _make(root, "step_000002", {"a.pt": 10, "b.pt": 20})
    _make(root, "step_000003", {"a.pt": 10, "b.pt": 20}, truncate="b.pt")
    _make(root, "step_000004", {"a.pt": 10}, manifest=False)  # killed before COMPLETE
    _make(root, "step_000005.partial", {"a.pt": 10})  # killed during DeepSpeed's save
    assert find_resume("latest", tmp_path) == root / "step_000002"
    assert "truncated" in checkpoint_problem(root / "step_000003")
    with pytest.raises(FileNotFoundError, match="no COMPLETE"):
        find_resume(str(root / "step_000004"), tmp_path)
    (root / "step_000002/b.pt").unlink()
    assert find_resume("latest", tmp_path) == root / "step_000001"
    assert find_resume("latest", tmp_path / "elsewhere") is None


def test_latest_pointer_wins_over_an_abandoned_branch_and_survives_pruning(tmp_path):
    """A run resumed from the path of step 999998 and saved again: the folders of steps 999999..1000001
    belong to the abandoned branch. Steps cross a digit boundary, where name order is not step order."""
    root = tmp_path / "checkpoints"
    for step in (999997, 999998, 999999, 1000000, 1000001):
        _make(root, f"step_{step:06d}", {"a.pt": 10})
    (root / "latest").write_text("step_999998")
    assert find_resume("latest", tmp_path) == root / "step_999998"
    assert prune_checkpoints(root, keep_last=2) == [root / "step_999997", root / "step_999999"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1000000", "step_1000001", "step_999998"]
    (root / "step_999998/a.pt").write_bytes(b"x")  # `latest` damaged: the newest intact one by step
    assert find_resume("latest", tmp_path) == root / "step_1000001"
    (root / "latest").write_text("step_000042")  # names a folder that is gone
    assert find_resume("latest", tmp_path) == root / "step_1000001"
    assert prune_checkpoints(root, keep_last=0) == []


def test_stale_partial_saves_are_removed_and_completed_ones_kept(tmp_path):
    root = tmp_path / "checkpoints"
    _make(root, "step_000001", {"a.pt": 10})
    _make(root, "step_000002.partial", {"a.pt": 10}, manifest=False)
    _make(root, "step_000003.partial", {"a.pt": 10})  # even with a manifest: never renamed, never resumed
    assert remove_stale_saves(root) == [root / "step_000002.partial", root / "step_000003.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
    assert checkpoint_problem(root / "step_000001") is None
