"""Hostile and odd checkpoints and run folders: a pickled payload in a checkpoint is refused (by
`--resume` and by tools/export_lora.py) before it runs; a file changed in place (same size) or an
unreadable `latest` makes `--resume latest` fall back, naming the file; the RNG state is stored as
data and restores exactly; a second run in a live run's folder stops naming the holder, a dead
holder's lock is taken over; a resumed run logs each step once.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_trust.py."""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT
from helpers_launch import launch_train, run_train
from helpers_trust import Payload, _folder_files, _holder

from e2v.runtime.integrity import weights_only_load
from e2v.train import checkpoint as ckpt


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
