"""Preemption and resume, end to end, 2 processes under ZeRO-3 + CPU offload (torch AdamW):
SIGTERM to the whole job saves a checkpoint and exits; a truncated newest checkpoint is detected
and the previous one used; `--resume latest` then gives exactly the losses of the uninterrupted
run. The interrupted part runs with gradient checkpointing, which must not change the losses."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import ROOT, ZERO3_OFFLOAD_RUN, read_scalars, run_train, train_command
from e2v.checkpoint import MANIFEST, checkpoint_problem, find_resume


@pytest.fixture(scope="module")
def interrupted(demo_data, tmp_path_factory):
    """The same run as zero3_offload_run, with checkpoints every step and gradient checkpointing,
    preempted once step 2 is logged: SIGTERM to every rank, as a scheduler sends it. (Signalling
    the deepspeed launcher too also works, but the launcher kills the ranks 30 s later, which a
    heavily loaded 2-core machine can exceed.)"""
    out = tmp_path_factory.mktemp("resume")
    run = out / "r"
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=r", "train.checkpoint_every=1",
            *ZERO3_OFFLOAD_RUN)
    proc = subprocess.Popen(train_command("configs/e2v_tiny.yaml", *sets, "train.gradient_checkpointing=true",
                                          num_gpus=2),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if (run / "scalars.jsonl").exists() and max(read_scalars(run), default=0) >= 2:
            for rank in psutil.Process(proc.pid).children(recursive=True):
                if any(a.startswith("--local_rank") for a in rank.cmdline()):  # not the launcher processes
                    rank.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    log, _ = proc.communicate(timeout=300)
    return run, log, sets


def test_sigterm_saves_a_checkpoint_and_exits(interrupted):
    run, log, _ = interrupted
    assert "checkpoint saved at step" in log, log[-3000:]
    stopped = int(log.split("checkpoint saved at step ")[1].split(";")[0])
    assert 2 <= stopped < 8, "the signal must stop the run before its end"
    assert "exits successfully" in log, "every rank must exit cleanly (code 0) after the save"
    assert (run / "checkpoints/latest").read_text() == f"step_{stopped:06d}"
    assert checkpoint_problem(run / f"checkpoints/step_{stopped:06d}") is None
    assert not list((run / "checkpoints").glob("*.partial")) and "lora" not in os.listdir(run)
    assert max(read_scalars(run)) == stopped


def test_resume_skips_truncated_checkpoint_and_matches_uninterrupted_losses(interrupted, zero3_offload_run):
    run, log, sets = interrupted
    stopped = max(read_scalars(run))
    newest = run / f"checkpoints/step_{stopped:06d}"
    victim = max((p for p in newest.iterdir() if p.suffix == ".pt"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a save cut short by a full disk
    assert "truncated" in checkpoint_problem(newest)
    previous = run / f"checkpoints/step_{stopped - 1:06d}"
    assert find_resume("latest", run) == previous

    proc = run_train("configs/e2v_tiny.yaml", *sets, num_gpus=2, extra=("--resume", "latest"))
    assert f"resumed from {previous} at step {stopped - 1}" in proc.stdout
    reference = read_scalars(zero3_offload_run)
    resumed = read_scalars(run)  # steps 1..stopped-1: the interrupted run (with checkpointing); then the resumed one
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step]["train/loss"] == reference[step]["train/loss"], step
        assert resumed[step]["train/lr"] == reference[step]["train/lr"], step
    assert (run / "lora/pytorch_lora_weights.safetensors").exists()


def test_find_resume_takes_newest_intact_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"

    def make(name, files, manifest=True, truncate=None):
        d = root / name
        d.mkdir(parents=True)
        for f, n in files.items():
            (d / f).write_bytes(b"x" * n)
        if manifest:
            (d / MANIFEST).write_text(json.dumps({"step": 0, "files": files}))
        if truncate:
            (d / truncate).write_bytes(b"x")

    make("step_000001", {"a.pt": 10})
    make("step_000002", {"a.pt": 10, "b.pt": 20})
    make("step_000003", {"a.pt": 10, "b.pt": 20}, truncate="b.pt")
    make("step_000004", {"a.pt": 10}, manifest=False)  # killed before COMPLETE
    make("step_000005.partial", {"a.pt": 10})  # killed during DeepSpeed's save
    assert find_resume("latest", tmp_path) == root / "step_000002"
    assert "truncated" in checkpoint_problem(root / "step_000003")
    with pytest.raises(FileNotFoundError, match="no COMPLETE"):
        find_resume(str(root / "step_000004"), tmp_path)
    (root / "step_000002/b.pt").unlink()
    assert find_resume("latest", tmp_path) == root / "step_000001"
    assert find_resume("latest", tmp_path / "elsewhere") is None


def test_error_mid_run_saves_the_last_finished_step_and_resumes(tmp_path):
    """One process, a clip that indexes (its header is fine) but fails to load at step 4
    (on_bad_sample: error): the run stops naming the file, after saving step 3 although no
    periodic checkpoint was due; once the file is fixed, `--resume latest` finishes from step 3
    with the losses of a run that never failed."""
    from helpers_t2v import make_npz_manifest

    def corrupt(path):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)  # inside the frame data: the zip CRC fails on load
        path.write_bytes(bytes(raw))

    data = tmp_path / "data"
    make_npz_manifest(data, num_clips=5, num_frames=9, height=32, width=32)
    victim = data / "clips/clip_0003.npz"
    good = victim.read_bytes()
    corrupt(victim)
    sets = ["model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}", "data.num_frames=9",
            "data.resolution=[32,32]", "data.shuffle=false", "train.mixed_precision=no",
            "train.gradient_checkpointing=false", "train.gradient_accumulation_steps=1", "train.micro_batch_size=1",
            "train.max_steps=5", "train.checkpoint_every=100", f"output_dir={tmp_path}"]
    proc = run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=crash", check=False)
    assert proc.returncode != 0
    assert "clip_0003.npz" in proc.stdout + proc.stderr and "saving step 3 first" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "crash"
    assert find_resume("latest", run) == run / "checkpoints/step_000003"
    assert max(read_scalars(run)) == 3

    victim.write_bytes(good)
    run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=crash", extra=("--resume", "latest"))
    run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=clean")
    resumed, clean = read_scalars(run), read_scalars(tmp_path / "clean")
    assert sorted(resumed) == sorted(clean) == [1, 2, 3, 4, 5]
    for step in clean:
        assert resumed[step]["train/loss"] == clean[step]["train/loss"], step
