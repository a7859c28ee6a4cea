"""What a new user meets on a second first day, each checked at the point it is decided:
`--resume latest|auto` passes over a run folder a failed start left (e2v/train/resume.py), a
hold-out that leaves nothing to train stops in one line (e2v/eval/validation.py)."""

from __future__ import annotations

from helpers_firstday import HOLD_ALL


def test_training_refuses_a_hold_out_of_every_sample_in_one_line(demo_data, tmp_path):
    """The real entry point (one process, no launcher): the same line, no traceback, and nothing
    built: the optimizer and model lines come after the check and are never printed."""
    from helpers import LAUNCHER_VARIABLES
    from helpers_launch import launch_python

    p = launch_python("train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml",
                      *[a for s in (f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}",
                                    "validation.every_n_steps=2", "validation.num_samples=8") for a in ("--set", s)],
                      env=dict.fromkeys(LAUNCHER_VARIABLES)).wait(check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == f"config error: {HOLD_ALL}"
    assert "[e2v] optimizer" not in p.stdout and "frozen encoders loaded" not in p.stdout
