"""Hostile and odd checkpoints and run folders: a pickled payload in a checkpoint is refused (by
`--resume` and by tools/export_lora.py) before it runs; a file changed in place (same size) or an
unreadable `latest` makes `--resume latest` fall back, naming the file; the RNG state is stored as
data and restores exactly; a second run in a live run's folder stops naming the holder, a dead
holder's lock is taken over; a resumed run logs each step once."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers_launch import launch_train, run_train

from e2v.runtime.integrity import UnsafeCheckpoint, load_rng, save_rng, weights_only_load
from e2v.train import checkpoint as ckpt


class Payload:
    """Unpickling calls `Path(marker).touch()`: proof that a loader ran the file's code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (Path(self.marker),)


def _folder_files(folder):
    """A manifest's files for a folder as found (what an attacker, or a test, writes)."""
    from e2v.runtime.integrity import record_file

    return {str(p.relative_to(folder)): record_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _tamper(checkpoint, marker, name="zero_pp_rank_0_mp_rank_00_optim_states.pt", fix_manifest=True):
    """Put a payload into a DeepSpeed file of the checkpoint (its real content kept) and, like an
    attacker with write access would, record the new file in the manifest."""
    f = checkpoint / name
    state = weights_only_load(f)
    state["extra"] = Payload(marker)
    torch.save(state, f)
    if fix_manifest:
        manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
        manifest["files"] = _folder_files(checkpoint)
        manifest["files"].pop(ckpt.MANIFEST)
        (checkpoint / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return f


# --- unit level ----------------------------------------------------------------------------------


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


HOLD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from e2v.runtime.runlock import RunLock
lock = RunLock(sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT), str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


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
    resumed = Log(tmp_path, rank=0, first_step=4)
    for step in (4, 5, 6):
        resumed.scalars(step, {"train/loss": 10.0 * step})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == [1, 2, 3, 4, 5, 6]
    assert [d["train/loss"] for d in lines] == [1, 2, 3, 40, 50, 60]
    events = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60)]
    fresh = Log(tmp_path, rank=0)  # a fresh start in the folder (no checkpoint to resume from)
    fresh.scalars(1, {"train/loss": 7.0})
    fresh.close()
    assert [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()] == \
        [{"step": 1, "train/loss": 7.0}]
    events = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 7)]


# --- the real entry point (one process, the tiny T2V LoRA recipe) ---------------------------------


def _sets(data, out, run_id):
    return ["model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}", "data.num_frames=9",
            "data.resolution=[32,32]", "data.shuffle=false", "train.mixed_precision=no",
            "train.gradient_checkpointing=false", "train.gradient_accumulation_steps=1", "train.micro_batch_size=1",
            "train.max_steps=4", "train.checkpoint_every=2", f"output_dir={out}", f"run_id={run_id}"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4. Tests work on copies of its folder."""
    from helpers_t2v import make_npz_manifest

    out = tmp_path_factory.mktemp("trust")
    make_npz_manifest(out / "data", num_clips=4, num_frames=9, height=32, width=32)
    run_train(str(ROOT / "configs/t2v_lora.yaml"), *_sets(out / "data", out, "run"))
    return out


def _copy(small_run, tmp_path):
    shutil.copytree(small_run / "run", tmp_path / "run")
    return tmp_path / "run", _sets(small_run / "data", tmp_path, "run")


def test_resume_and_export_refuse_a_checkpoint_with_a_payload(small_run, tmp_path):
    run, sets = _copy(small_run, tmp_path)
    marker = tmp_path / "pwned"
    bad = _tamper(run / "checkpoints/step_000004", marker)
    assert ckpt.checkpoint_problem(run / "checkpoints/step_000004") is None, "the manifest was rewritten too"
    proc = run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, extra=("--resume", "latest"), check=False)
    assert proc.returncode != 0
    assert f"refusing to load {bad}" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "the payload ran"
    tool = subprocess.run([sys.executable, str(ROOT / "tools/export_lora.py"), str(run / "checkpoints/latest"),
                           "--out", str(tmp_path / "export")], capture_output=True, text=True, timeout=300)
    assert tool.returncode != 0 and f"refusing to load {bad}" in tool.stderr, tool.stderr[-3000:]
    assert not marker.exists(), "the payload ran"


def test_a_second_run_in_a_live_run_folder_stops_naming_the_holder(small_run, tmp_path):
    run, sets = _copy(small_run, tmp_path)
    before = {f: (run / f).read_bytes() for f in ("scalars.jsonl", "config.yaml", "checkpoints/latest")}
    holder = _holder(run)
    try:
        t0 = time.time()
        proc = run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "train.lr=1e-3", extra=("--resume", "latest"),
                         check=False)
        took = time.time() - t0
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    assert f"{run / 'run.lock'} is held by pid {holder.pid} on host {socket.gethostname()}" in proc.stdout + proc.stderr
    assert {f: (run / f).read_bytes() for f in before} == before, "the second run wrote into the folder"
    print(f"refused after {took:.1f} s")


def test_resume_from_an_older_checkpoint_logs_each_step_once(small_run, tmp_path):
    run, sets = _copy(small_run, tmp_path)
    proc = run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets,
                     extra=("--resume", str(run / "checkpoints/step_000002")))
    assert "taken over from pid" in proc.stdout  # the fixture's run left its details in run.lock
    lines = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == [1, 2, 3, 4]
    first = {json.loads(line)["step"]: json.loads(line) for line in (small_run / "run/scalars.jsonl").read_text().splitlines()}
    for d in lines:  # and the resumed steps 3-4 repeat the first run's losses exactly
        assert d["train/loss"] == first[d["step"]]["train/loss"], d["step"]


# train_e2v.py with one test-only hold: after the save of step HOLD_AFTER the rank waits (at most
# 120 s) instead of training on, so the test's SIGKILL lands between saves whatever the machine's speed.
HOLD_AFTER = 2
KILL_HOLD_WRAPPER = r"""
import runpy, sys, time
sys.path.insert(0, {root!r})
from e2v.train import checkpoint

real_save = checkpoint.save_checkpoint


def save_then_hold(engine, ckpt_root, step, *args, **kwargs):
    out = real_save(engine, ckpt_root, step, *args, **kwargs)
    if step == {hold}:
        time.sleep(120)
    return out


checkpoint.save_checkpoint = save_then_hold
runpy.run_path({train!r}, run_name="__main__")
"""


def test_resume_after_kill_9_from_a_lean_checkpoint(small_run, tmp_path):
    """SIGKILL (no handler runs, nothing is saved) after step 2's checkpoint: that checkpoint holds
    the trained tensors only (the frozen base stays in the model folder), and `--resume latest`
    continues from it with the uninterrupted run's losses."""
    sets = _sets(small_run / "data", tmp_path, "killed")
    run = tmp_path / "killed"
    wrapper = tmp_path / "train_with_hold.py"
    wrapper.write_text(KILL_HOLD_WRAPPER.format(root=str(ROOT), train=str(ROOT / "train_e2v.py"), hold=HOLD_AFTER))
    launch = launch_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, script=wrapper)
    deadline, killed = time.time() + 600, False
    while launch.proc.poll() is None and time.time() < deadline:
        if (run / "checkpoints/latest").is_file():
            for procs in launch.ranks().values():
                for p in procs:
                    p.kill()  # SIGKILL
            killed = True
            break
        time.sleep(0.05)
    proc = launch.wait(check=False)
    assert killed and proc.returncode != 0, proc.stdout[-2000:]
    saved = run / f"checkpoints/step_{HOLD_AFTER:06d}"
    assert ckpt.find_resume("latest", run) == saved

    meta = json.loads((saved / ckpt.EXPORT_META).read_text())
    module = weights_only_load(saved / "mp_rank_00_model_states.pt")["module"]
    trained = [k for k in module if "lora_" in k or k in meta["full_names"]]
    assert trained and trained == list(module), f"frozen tensors saved: {sorted(set(module) - set(trained))[:3]}"

    run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, extra=("--resume", "latest"))
    first = {json.loads(line)["step"]: json.loads(line) for line in (small_run / "run/scalars.jsonl").read_text().splitlines()}
    lines = [json.loads(line) for line in (run / "scalars.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == [1, 2, 3, 4]
    for d in lines:
        assert d["train/loss"] == first[d["step"]]["train/loss"], d["step"]


def test_a_real_checkpoint_changed_in_place_falls_back(small_run, tmp_path, capsys):
    """DeepSpeed's own files: one flipped byte in the newest checkpoint, same size."""
    run, _ = _copy(small_run, tmp_path)
    manifest = json.loads((run / "checkpoints/step_000004" / ckpt.MANIFEST).read_text())
    assert {"mp_rank_00_model_states.pt", "rng_rank_0000.safetensors", "e2v_export.json"} <= set(manifest["files"])
    victim = run / "checkpoints/step_000004/mp_rank_00_model_states.pt"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert ckpt.find_resume("latest", run) == run / "checkpoints/step_000002"
    assert f"{victim} does not match the sha256" in capsys.readouterr().out
