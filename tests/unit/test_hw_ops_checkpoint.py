"""Checkpoint manifests from the writers' own records (e2v/train/checkpoint.py: gather_records,
e2v/runtime/integrity.py: record_write): each rank counts and hashes the bytes it writes, the
records are gathered, and rank 0 writes COMPLETE from them. Shown against an NFS-like view in which
the files being saved look short (stat) and the folder looks empty (listings): the manifest still
holds every file with its true size and SHA-256 (read back afterwards, by hashlib, as the oracle),
under ZeRO-2 and ZeRO-3, and the checkpoint resumes. Two gloo ranks: each one's file is in the
manifest with the writing rank; two ranks that recorded one file differently stop the save on both."""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
from pathlib import Path

import pytest
import torch
from helpers_agree import two_ranks
from helpers_resume import _engine, _step

from e2v.train import checkpoint as ckpt


def _nfs_view(monkeypatch, marker: str) -> None:
    """Inside folders whose path holds `marker`: every regular file stats as 1 byte, and listings
    are empty (what another node can see of files just written, on NFS with attribute caching)."""
    real_stat, real_glob, real_rglob, real_iterdir = Path.stat, Path.glob, Path.rglob, Path.iterdir
    real_listdir = os.listdir

    def short(self, *a, **k):
        st = real_stat(self, *a, **k)
        if marker in str(self) and stat.S_ISREG(st.st_mode):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 1,
                                   int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))
        return st

    def hide(real):
        def listing(self, *a, **k):
            return iter(()) if marker in str(self) else real(self, *a, **k)
        return listing

    monkeypatch.setattr(Path, "stat", short)
    monkeypatch.setattr(Path, "glob", hide(real_glob))
    monkeypatch.setattr(Path, "rglob", hide(real_rglob))
    monkeypatch.setattr(Path, "iterdir", hide(real_iterdir))
    monkeypatch.setattr(os, "listdir", lambda p=".": [] if marker in str(p) else real_listdir(p))


def _on_disk(folder: Path) -> dict:
    """The oracle: every file of the folder, read back by hashlib after the save."""
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ckpt.MANIFEST}


def test_the_manifest_is_the_writers_record_not_what_a_listing_sees(tmp_path, monkeypatch, one_rank_group):
    for stage in (2, 3):  # one test: DeepSpeed keeps the first process group it saw
        run = tmp_path / f"z{stage}"
        (run / "checkpoints").mkdir(parents=True)
        (run / ckpt.BASE_FILE).write_bytes(b"base" * 100)  # the export's base file, linked in
        engine = _engine(stage)
        _step(engine)
        with monkeypatch.context() as m:
            _nfs_view(m, ckpt.PARTIAL)
            final = ckpt.save_checkpoint(engine, run / "checkpoints", 1,
                                         {"step": 1, "rng": ckpt.rng_state(random.Random(0), torch.Generator())})
        manifest = json.loads((final / ckpt.MANIFEST).read_text())
        files = {n: {k: v for k, v in r.items() if k != "rank"} for n, r in manifest["files"].items()}
        assert files == _on_disk(final), f"ZeRO-{stage}: every file, its true size and digest"
        assert {r["rank"] for r in manifest["files"].values()} == {0}
        names = set(files)
        assert {"rng_rank_0000.safetensors", ckpt.OPTIMIZER_FILE, ckpt.EXPORT_META, ckpt.BASE_FILE} <= names
        assert any(n.endswith("optim_states.pt") for n in names) and any(n.endswith("model_states.pt") for n in names)
        assert ckpt.checkpoint_problem(final) is None
        assert ckpt.find_resume("latest", run) == final
        before = _step(engine)
        ckpt.load_checkpoint(engine, final)  # the recorded files load as DeepSpeed wrote them
        assert _step(engine) == pytest.approx(before)


def test_pruning_reads_manifests_not_the_files(tmp_path, monkeypatch):
    """Right after a save, rank 0 prunes: files that look short to it (NFS) do not make a completed
    checkpoint count as missing; the oldest beyond keep_last go."""
    from e2v.runtime.integrity import record_write

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        d = root / f"step_{step:06d}"
        d.mkdir(parents=True)
        rec = record_write(d / "a.pt", lambda f: f.write(b"x" * 100))
        (d / ckpt.MANIFEST).write_text(json.dumps({"step": step, "files": {"a.pt": {**rec, "rank": 0}}}))
    (root / "latest").write_text("step_000003")
    with monkeypatch.context() as m:
        _nfs_view(m, "step_000003")
        assert ckpt.prune_checkpoints(root, keep_last=2) == [root / "step_000001"]
    assert ckpt.checkpoint_problem(root / "step_000003") is None


RANK_SCRIPT = """
import datetime, json, os, stat, sys
from pathlib import Path
import torch.distributed as dist
from e2v.runtime.integrity import record_write
from e2v.train.checkpoint import gather_records
folder = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mine = {str(folder / f"zero_pp_rank_{rank}_optim_states.pt"): None}
for path in mine:
    mine[path] = record_write(path, lambda f: f.write(bytes([rank]) * (1000 + rank)))
if rank == 0:  # what rank 0's NFS client shows of rank 1's new file: too short
    real = Path.stat
    Path.stat = lambda self, *a, **k: (os.stat_result((stat.S_IFREG | 0o644,) + (0,) * 5 + (1, 0, 0, 0))
                                       if "rank_1" in str(self) else real(self, *a, **k))
print("FILES " + json.dumps(gather_records(folder, mine)), flush=True)
clash = {str(folder / "shared.json"): {"bytes": 10 + rank, "sha256": str(rank)}}
try:
    gather_records(folder, clash)
except RuntimeError as e:
    print(f"REFUSED {e}", flush=True)
dist.destroy_process_group()
"""


def test_two_ranks_records_are_gathered_with_their_writer(tmp_path):
    import e2v.train.checkpoint  # noqa: F401  (before the fork)

    ranks = two_ranks(RANK_SCRIPT, str(tmp_path), marks=("FILES", "REFUSED", "Traceback"), timeout=120)
    assert [len(r) for r in ranks] == [2, 2], ranks
    files = [json.loads(r[0].split(" ", 1)[1]) for r in ranks]
    assert files[0] == files[1], "every rank holds the same manifest"
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_optim_states.pt"
        data = (tmp_path / name).read_bytes()
        assert files[0][name] == {"bytes": 1000 + rank, "sha256": hashlib.sha256(data).hexdigest(), "rank": rank}
    for r in ranks:
        assert "ranks 0 and 1 both wrote shared.json, with different bytes" in r[1]
