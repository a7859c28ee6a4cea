"""`--resume` says what it does (e2v/train/resume.py): latest with nothing to resume stops, auto
starts fresh saying so (run as `python train_e2v.py`, without the launcher: one process trains), a shape-changing key (LoRA rank) stops naming it, an optimizer setting
(lr) stops naming it, a schedule change (max_steps) is applied, named and recorded in config.yaml,
and without run_id auto passes over a newer folder that holds no checkpoint (a failed start's).

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_resume_modes.py."""

from __future__ import annotations

import shutil

import pytest
import yaml
from helpers import LAUNCHER_VARIABLES
from helpers_launch import launch_python, launch_train, run_train, wait_all


@pytest.fixture(scope="module")
def base_run(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_modes")
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "validation.every_n_steps=0",
            "train.checkpoint_every=2", "lora.rank=4")
    run_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=base", "train.max_steps=2")
    return out, sets


def test_four_resume_cases_each_say_one_line(base_run):
    out, sets = base_run
    for copy in ("base_rank", "base_lr"):  # one run folder each: a run folder takes one run at a time
        shutil.copytree(out / "base", out / copy)
    # without run_id: the 2-step run, and a newer folder a failed start left (config.yaml, no checkpoint)
    stems = out / "stems"
    shutil.copytree(out / "base", stems / "e2v_tiny_lora-20260101-000000")
    (stems / "e2v_tiny_lora-20260102-000000").mkdir()
    (stems / "e2v_tiny_lora-20260102-000000/config.yaml").write_text((out / "base/config.yaml").read_text())
    cases = {
        "nothing": launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=empty", "train.max_steps=2",
                                extra=("--resume", "latest")),
        "rank": launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=base_rank", "train.max_steps=3",
                             "lora.rank=8", extra=("--resume", "latest")),
        "lr": launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=base_lr", "train.max_steps=3",
                           "train.lr=1e-5", extra=("--resume", "latest")),
        # a schedule change is applied, named and recorded
        "steps": launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=base", "train.max_steps=3",
                              extra=("--resume", "latest")),
        # auto passes over the failed start's folder to the run that saved
        "past_empty": launch_train("configs/e2v_tiny_lora.yaml", *sets, f"output_dir={stems}", "train.max_steps=3",
                                   extra=("--resume", "auto")),
    }
    # meanwhile `--resume auto` with nothing to resume, in one process without the launcher
    cases["auto"] = launch_python("train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml",
                                  *[a for s in (*sets, "run_id=fresh", "train.max_steps=1") for a in ("--set", s)],
                                  "--resume", "auto", env=dict.fromkeys(LAUNCHER_VARIABLES))
    got = dict(zip(cases, wait_all(*cases.values(), check=False)))
    for name in ("nothing", "rank", "lr"):
        p = got[name]
        assert p.returncode != 0 and "Traceback" not in p.stderr, (name, p.stderr[-3000:])
    assert "resume error: --resume latest: nothing to resume (no intact checkpoint in" in got["nothing"].stderr
    assert "another model layout (lora.rank: 4 -> 8)" in got["rank"].stderr, got["rank"].stderr[-2000:]
    assert "changed optimizer setting (train.lr: 0.002 -> 1e-05)" in got["lr"].stderr, got["lr"].stderr[-2000:]
    assert got["auto"].returncode == 0, got["auto"].stderr[-2000:]
    assert "--resume auto: nothing to resume" in got["auto"].stdout and "starting at step 0" in got["auto"].stdout
    assert "[e2v] no launcher: one process (rank 0 of 1)" in got["auto"].stdout  # python train_e2v.py trains
    assert (out / "fresh/lora/pytorch_lora_weights.safetensors").is_file()
    # the refused runs left their record alone; the schedule change is applied, named and recorded
    assert yaml.safe_load((out / "base_rank/config.yaml").read_text())["lora"]["rank"] == 4
    p = got["steps"]
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"run {out / 'base'}: resumed from {out / 'base/checkpoints/step_000002'} at step 2" in p.stdout, p.stdout
    assert "applying the changed key(s) train.max_steps: 2 -> 3" in p.stdout
    assert yaml.safe_load((out / "base/config.yaml").read_text())["train"]["max_steps"] == 3
    assert (out / "base/checkpoints/step_000003").is_dir()
    p, run = got["past_empty"], stems / "e2v_tiny_lora-20260101-000000"
    assert p.returncode == 0, p.stderr[-2000:]
    assert (f"--resume auto: run {run}: of the runs of e2v_tiny_lora in {stems}/, the one that saved last "
            f"(step_000002); passed over 1 folder(s) without a checkpoint: {stems / 'e2v_tiny_lora-20260102-000000'}"
            in p.stdout), p.stdout
    assert f"resumed from {run / 'checkpoints/step_000002'} at step 2" in p.stdout
    assert (run / "checkpoints/step_000003").is_dir() and not (stems / "e2v_tiny_lora-20260102-000000/checkpoints").exists()
