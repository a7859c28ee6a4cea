"""The data check before the first step (e2v/data/preflight.py): a copy of the demo data with a
truncated mp4, an empty caption and a 9-frame clip. Training with the defaults stops before
step 1 naming all three (2 ranks stop together), `skip` trains without them and counts them,
`--dry_run` and tools/check_dataset.py report them; the facts are cached by file fingerprint.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_preflight.py."""

from __future__ import annotations

from helpers_launch import launch_python, launch_train, wait_all


def test_training_stops_before_step_1_on_two_ranks_and_skip_trains(bad_data, tmp_path):
    """Defaults: both ranks stop at start (before any weight is read) naming the three samples;
    `--dry_run` lists them and counts the usable; skip trains and counts them at the end."""
    out = tmp_path / "runs"
    sets = (f"data.datasets.0.data_root={bad_data}", f"output_dir={out}", "validation.every_n_steps=0",
            "train.max_steps=2", "train.checkpoint_every=100")
    stop = launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=stop", num_gpus=2)
    skip = launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=skip", "data.on_bad_sample=skip")
    dry = launch_python("train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml",
                        "--set", f"data.datasets.0.data_root={bad_data}", "--set", "validation.every_n_steps=0",
                        "--dry_run")
    stopped, skipped, dried = wait_all(stop, skip, dry, check=False)
    dry_out, dry_err = dried.stdout, dried.stderr
    text = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert text.count("data error: 3 sample(s) unusable") == 2, text[-3000:]  # each rank, the same verdict
    for name in ("001.mp4", "002.txt: empty caption", "003.mp4"):
        assert name in text
    assert not (out / "stop" / "checkpoints" / "step_000001").exists()
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "left out 3 bad sample(s) at the start" in skipped.stdout, skipped.stdout[-2000:]
    for line in (f"Outputs in {out / 'skip'}", f"LoRA: {out / 'skip/lora'}", f"TensorBoard: tensorboard --logdir {out / 'skip/tb'}",
                 f"checkpoints: {out / 'skip/checkpoints'}", f"config: {out / 'skip/config.yaml'}"):
        assert line in skipped.stdout, line  # the last lines name every output folder
    assert dried.returncode == 0, dry_err[-2000:]
    assert "5 usable samples" in dry_out and "3 unusable" in dry_out, dry_out[-2000:]
    assert "002.txt: empty caption" in dry_out
