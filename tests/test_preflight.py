"""The data check before the first step (e2v/data/preflight.py): a copy of the demo data with a
truncated mp4, an empty caption and a 9-frame clip. Training with the defaults stops before
step 1 naming all three (2 ranks stop together), `skip` trains without them and counts them,
`--dry_run` and tools/check_dataset.py report them; the facts are cached by file fingerprint."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers_launch import launch_python, launch_train, wait_all

BAD = {"001": "truncated", "002": "empty caption", "003": "9 frames"}


@pytest.fixture(scope="module")
def bad_data(demo_data, tmp_path_factory) -> Path:
    """One shared copy: 001's mp4 cut in half, 002's caption empty, 003 a 9-frame clip (the tiny
    configs need 17)."""
    from e2v.data.demo import write_video
    from e2v.data.media import load_video

    out = tmp_path_factory.mktemp("bad") / "data"
    shutil.copytree(demo_data, out)
    mp4 = (out / "001.mp4").read_bytes()
    (out / "001.mp4").write_bytes(mp4[: len(mp4) // 2])
    (out / "002.txt").write_text("")
    video = load_video(out / "003.mp4", 9, 64, 64)  # uint8 [3, F, H, W]
    write_video(out / "003.mp4", np.ascontiguousarray(video.permute(1, 2, 3, 0).numpy()))
    return out


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cfg(data, *sets):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={data}", *sets])


def test_index_stops_naming_all_three_and_skip_leaves_them_out(bad_data, cache_dir):
    from e2v.data.dataset import BadSampleError, index_samples

    with pytest.raises(BadSampleError) as e:
        index_samples(_cfg(bad_data), verbose=False)
    msg = str(e.value)
    assert "3 sample(s) unusable" in msg and "5 usable" in msg, msg
    assert "001.mp4" in msg and "truncated" in msg, msg
    assert "002.txt: empty caption" in msg, msg
    assert "003.mp4" in msg and "too short: 9 frames" in msg, msg
    excluded = []
    samples = index_samples(_cfg(bad_data, "data.on_bad_sample=skip"), verbose=False, excluded=excluded)
    assert sorted(s.id for s in samples) == ["000", "004", "005", "006", "007"]
    assert sorted(p.sample for p in excluded) == sorted(BAD)


def test_facts_are_cached_by_fingerprint(bad_data, cache_dir, monkeypatch, tmp_path):
    """A second check reads no file; a file that changes (size / mtime) is read again."""
    from e2v.data import preflight
    from e2v.data.dataset import index_samples

    cfg = _cfg(bad_data, "data.on_bad_sample=skip")
    index_samples(cfg, verbose=False)
    assert len(list(cache_dir.rglob("*.json"))) == 1
    read = []
    real = preflight.sample_facts
    monkeypatch.setattr(preflight, "sample_facts", lambda job: read.append(job[0]) or real(job))
    monkeypatch.setattr(preflight, "default_workers", lambda: 1)  # in-process: the patch sees the calls
    index_samples(cfg, verbose=False)
    assert read == []
    copy = tmp_path / "copy"
    shutil.copytree(bad_data, copy)
    (copy / "000.mp4").write_bytes((copy / "001.mp4").read_bytes())  # now truncated too
    cfg = _cfg(copy, "data.on_bad_sample=skip")
    index_samples(cfg, verbose=False)
    read.clear()
    (copy / "004_person.png").write_bytes(b"not a png")
    excluded = []
    index_samples(cfg, verbose=False, excluded=excluded)
    assert read == [str(copy / "004.mp4")], read  # only the sample whose file changed
    assert sorted(p.sample for p in excluded) == ["000", *sorted(BAD), "004"]


def test_warnings_are_summarized(bad_data):
    from e2v.data.preflight import summarize
    from e2v.data.sample import Problem

    many = [Problem(f"{i:03d}", f"{i:03d}.txt", "duplicate caption", "describe", "duplicate_caption", "warning")
            for i in range(10)]
    lines = summarize(many + many[:1] + [Problem("x", "x.png", "tiny", "bigger", "element_small", "warning")])
    assert len(lines) == 2, lines
    assert "11 samples, e.g. 000.txt: duplicate caption; 001.txt" in lines[0] and "009" not in lines[0]
    assert "x.png: tiny -> bigger" in lines[1]


@pytest.mark.train
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
