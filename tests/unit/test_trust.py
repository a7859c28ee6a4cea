"""Hostile and odd checkpoints and run folders: a pickled payload in a checkpoint is refused (by
`--resume` and by tools/export_lora.py) before it runs; a file changed in place (same size) or an
unreadable `latest` makes `--resume latest` fall back, naming the file; the RNG state is stored as
data and restores exactly; a second run in a live run's folder stops naming the holder, a dead
holder's lock is taken over; a resumed run logs each step once.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_trust_runs.py."""

import json
import os
import random
import signal
import socket

import numpy as np
import pytest
import torch
from helpers_trust import Payload, _folder_files, _holder

from e2v.runtime.integrity import UnsafeCheckpoint, load_rng, save_rng, weights_only_load
from e2v.train import checkpoint as ckpt


def test_rng_states_are_stored_as_data_and_restore_exactly(tmp_path):
    rng, gen = random.Random(3), torch.Generator().manual_seed(4)
    rng.gauss(0, 1), np.random.standard_normal()  # cached gaussians are part of both states
    state = ckpt.rng_state(rng, gen)
    save_rng(state, tmp_path / "rng.safetensors")
    assert (tmp_path / "rng.safetensors").read_bytes()[8:9] == b"{", "a safetensors file (JSON header), no pickle"
    want = (rng.random(), rng.gauss(0, 1), torch.rand(3), np.random.standard_normal(2), torch.rand(2, generator=gen))
    rng2, gen2 = random.Random(0), torch.Generator()
    torch.manual_seed(0), np.random.seed(0)
    ckpt.set_rng_state(load_rng(tmp_path / "rng.safetensors"), rng2, gen2)
    got = (rng2.random(), rng2.gauss(0, 1), torch.rand(3), np.random.standard_normal(2), torch.rand(2, generator=gen2))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2]) and np.array_equal(got[3], want[3])
    assert torch.equal(got[4], want[4])
    torch.save(state, tmp_path / "rng_rank_0000.pt")  # a checkpoint saved before: read weights-only
    assert ckpt.set_rng_state(load_rng(tmp_path / "rng_rank_0000.pt"), rng2, gen2) is None


def test_a_pickled_payload_is_refused_naming_the_file(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"module": {"w": torch.ones(2)}, "x": Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the oracle: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpoint, match=r"refusing to load .*evil\.pt: .*it asks for getattr"):
        weights_only_load(tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpoint, match="evil.pt"):
        load_rng(tmp_path / "evil.pt")
    assert not marker.exists()


def _intact(root, name, files):
    d = root / name
    d.mkdir(parents=True)
    for f, data in files.items():
        (d / f).parent.mkdir(parents=True, exist_ok=True)
        (d / f).write_bytes(data)
    (d / ckpt.MANIFEST).write_text(json.dumps({"step": ckpt._step(d), "files": _folder_files(d)}))
    return d


def test_same_size_corruption_falls_back_naming_the_file(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    old = _intact(root, "step_000001", {"a.pt": b"a" * 100, "sub/b.pt": b"b" * 50})
    new = _intact(root, "step_000002", {"a.pt": b"a" * 100, "sub/b.pt": b"b" * 50})
    (root / "latest").write_text(new.name)
    assert json.loads((new / ckpt.MANIFEST).read_text())["files"]["sub/b.pt"]["sha256"]
    assert ckpt.find_resume("latest", tmp_path) == new
    raw = bytearray((new / "sub/b.pt").read_bytes())
    raw[10] ^= 1  # one bit: the size is unchanged
    (new / "sub/b.pt").write_bytes(bytes(raw))
    assert "sub/b.pt does not match the sha256" in ckpt.checkpoint_problem(new)
    assert ckpt.checkpoint_problem(new, checksums=False) is None
    assert ckpt.find_resume("latest", tmp_path) == old
    assert f"skipping {new} (named by {root / 'latest'}): {new / 'sub/b.pt'} does not match" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="does not match the sha256"):
        ckpt.find_resume(str(new), tmp_path)
    (root / "latest").unlink()  # no pointer: newest by step, checked the same way
    assert ckpt.find_resume("latest", tmp_path) == old
    (old / "a.pt").write_bytes(b"A" * 100)
    assert ckpt.find_resume("latest", tmp_path) is None


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00step_\x80", b"", b"../../etc", b"step_000002\n\n"])
def test_a_latest_pointer_of_any_bytes_falls_back(tmp_path, capsys, pointer):
    root = tmp_path / "checkpoints"
    _intact(root, "step_000001", {"a.pt": b"a"})
    (root / "latest").write_bytes(pointer)
    assert ckpt.find_resume("latest", tmp_path) == root / "step_000001"
    assert ckpt.prune_checkpoints(root, keep_last=1) == []
    if pointer != b"step_000002\n\n":  # a name of a missing folder: the folder is named instead
        assert f"ignoring {root / 'latest'}" in capsys.readouterr().out


def test_a_manifest_of_sizes_only_still_resumes(tmp_path):
    """Checkpoints saved before checksums were recorded."""
    d = tmp_path / "checkpoints/step_000003"
    d.mkdir(parents=True)
    (d / "a.pt").write_bytes(b"x" * 10)
    (d / ckpt.MANIFEST).write_text(json.dumps({"step": 3, "files": {"a.pt": 10}}))
    assert ckpt.find_resume("latest", tmp_path) == d
    (d / ckpt.MANIFEST).write_text(json.dumps({"step": 3, "files": {"a.pt": "ten"}}))
    assert "unreadable COMPLETE" in ckpt.checkpoint_problem(d)


def test_live_holder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    from e2v.runtime.runlock import RunFolderBusy, RunLock

    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunFolderBusy, match=rf"{tmp_path / 'run.lock'} is held by pid {proc.pid} on host "
                                                rf"{socket.gethostname()}"):
            RunLock(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)  # dies without cleaning up: the file still names it
        proc.wait()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == proc.pid
    lock = RunLock(tmp_path)
    assert lock.previous["pid"] == proc.pid and lock.holder()["pid"] == os.getpid()
    lock.release()


def _next_second() -> None:
    """TensorBoard orders a folder's event files by name: whole seconds, then a per-process counter
    that sorts as text (writer 10 before writer 9). A real resume starts seconds later; so does a
    writer here (it failed when a worker's 10th writer shared a second with its 9th)."""
    import time

    time.sleep(1.01 - time.time() % 1)


def test_resumed_log_holds_each_step_once(tmp_path):
    """scalars.jsonl cut and TensorBoard purged after the resumed step; a torn last line goes too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train_e2v import Log

    first = Log(tmp_path, rank=0)
    for step in range(1, 6):
        first.scalars(step, {"train/loss": float(step)})
    first.close()
    with open(tmp_path / "scalars.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # killed mid-write
    _next_second()
    resumed = Log(tmp_path, rank=0, first_step=4)
    for step in (4, 5, 6):
        resumed.scalars(step, {"train/loss": 10.0 * step})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == [1, 2, 3, 4, 5, 6]
    assert [d["train/loss"] for d in lines] == [1, 2, 3, 40, 50, 60]
    events = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60)]
    _next_second()
    fresh = Log(tmp_path, rank=0)  # a fresh start in the folder (no checkpoint to resume from)
    fresh.scalars(1, {"train/loss": 7.0})
    fresh.close()
    assert [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()] == \
        [{"step": 1, "train/loss": 7.0}]
    events = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 7)]
