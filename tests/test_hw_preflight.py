"""The start-up check of what later phases need (e2v/eval/preflight_deps.py): a missing mp4 writer,
an unloadable tokenizer or an unwritable folder stops every rank before any weight is read, with
one line that names the fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from e2v.config.load import load_config
from e2v.eval import preflight_deps as pd

ROOT = Path(__file__).resolve().parent.parent


def _cfg(*sets: str):
    return load_config(str(ROOT / "configs/e2v_tiny.yaml"), ["validation.every_n_steps=2", *sets], check_paths=False)


def _hide_writer(monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # `import imageio_ffmpeg` raises ImportError


def test_the_writer_writes_when_present(tmp_path):
    assert pd.writes_mp4(_cfg())
    assert pd.mp4_writer_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the probe clip is cleaned up


def test_missing_writer_is_one_line_with_the_fix(tmp_path, monkeypatch):
    _hide_writer(monkeypatch)
    with pytest.raises(SystemExit) as e:
        pd.check_later_phases(_cfg(), tmp_path / "run", rank=0)
    msg = str(e.value)
    assert msg.count("\n") == 0 and msg.startswith("start-up check: rank 0: the mp4 writer is missing")
    assert "pip install imageio imageio-ffmpeg" in msg


def test_no_video_no_writer_needed(tmp_path, monkeypatch):
    _hide_writer(monkeypatch)
    cfg = _cfg("validation.every_n_steps=0")
    assert not pd.writes_mp4(cfg)
    pd.check_later_phases(cfg, tmp_path / "run", rank=0)  # nothing to write: no stop


def test_unwritable_run_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    problems = pd.local_problems(_cfg(), blocker / "run", rank=3)
    assert len(problems) == 1 and "is not writable" in problems[0] and "--set output_dir=" in problems[0]


def test_tokenizer_missing_names_the_folder(tmp_path):
    (tmp_path / "transformer").mkdir()
    cfg = SimpleNamespace(model=SimpleNamespace(preset=None, pretrained=str(tmp_path)))
    problem = pd.tokenizer_problem(cfg)
    assert problem is not None and "tokenizer/" in problem and str(tmp_path) in problem
    assert pd.tokenizer_problem(_cfg()) is None  # the tiny preset's tokenizer


def test_tokenizer_needed_only_when_prompts_are_encoded():
    assert pd.encodes_prompts(_cfg("cache.enabled=false"))
    assert not pd.encodes_prompts(_cfg("cache.enabled=true"))  # held-out text and "" come from the cache
    assert pd.encodes_prompts(_cfg("cache.enabled=true", "validation.negative_prompt=blurry",
                                   "validation.guidance_scale=5"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.train
def test_missing_writer_stops_every_rank_before_step_1(tmp_path, demo_data):
    """train_e2v.py itself, two ranks on gloo (the launcher's variables), rank 1 without
    imageio-ffmpeg (a stub earlier on its path that fails to import): both ranks stop before the
    data check and the model load, each with the same one line."""
    stub = tmp_path / "no_ffmpeg" / "imageio_ffmpeg"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(([str(stub.parent)] if rank == 1 else []) + [str(ROOT)])}
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train_e2v.py"), "--config", str(ROOT / "configs/e2v_tiny.yaml"),
             "--set", f"data.datasets.0.data_root={demo_data}", "--set", f"output_dir={tmp_path / 'runs'}",
             "--set", "run_id=r", "--set", "validation.every_n_steps=2", "--set", "cache.enabled=false"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, out
        lines = [ln for ln in out.splitlines() if ln.startswith("start-up check:")]
        assert lines == ["start-up check: rank 1: the mp4 writer is missing (ImportError: hidden by the test); "
                         f"fix: {pd.FFMPEG_FIX}"], out
        assert "Traceback" not in out and "samples; transformer" not in out, out  # stopped before the model
        assert "[e2v data]" not in out
    assert not any((tmp_path / "runs" / "r" / "checkpoints").iterdir())  # nothing trained, nothing saved
