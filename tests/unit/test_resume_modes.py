"""`--resume` says what it does (e2v/train/resume.py): latest with nothing to resume stops, auto
starts fresh saying so (run as `python train_e2v.py`, without the launcher: one process trains), a shape-changing key (LoRA rank) stops naming it, an optimizer setting
(lr) stops naming it, a schedule change (max_steps) is applied, named and recorded in config.yaml,
and without run_id auto passes over a newer folder that holds no checkpoint (a failed start's).

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_resume_modes_runs.py."""

from __future__ import annotations


def test_config_changes_sorted_by_what_they_touch():
    from e2v.train.resume import config_changes

    saved = {"lora": {"rank": 4}, "train": {"lr": 1e-3, "max_steps": 2, "trainable": []}, "run_id": "a",
             "data": {"num_workers": 0}}
    now = {"lora": {"rank": 8}, "train": {"lr": 5e-4, "max_steps": 3, "trainable": []}, "run_id": "b",
           "data": {"num_workers": 1}}
    structural, optimizer, applied = config_changes(saved, now)
    assert structural == ["lora.rank: 4 -> 8"]
    assert optimizer == ["train.lr: 0.001 -> 0.0005"]
    assert applied == ["data.num_workers: 0 -> 1", "train.max_steps: 2 -> 3"]  # run_id is not compared
