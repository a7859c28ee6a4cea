"""The start-up check of what later phases need (e2v/eval/preflight_deps.py): a missing mp4 writer,
an unloadable tokenizer or an unwritable folder stops every rank before any weight is read, with
one line that names the fix.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_hw_preflight_runs.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT

from e2v.config.load import load_config
from e2v.eval import preflight_deps as pd


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
