"""A machine without decord (aarch64: GH200 / GB200 have no wheel) gets a clear error that names
the fix, at the first video read, instead of a bare ModuleNotFoundError."""

from __future__ import annotations

import sys

import pytest


def test_missing_decord_names_the_fix(tmp_path, monkeypatch):
    from e2v.data.media import MediaError, _reader

    monkeypatch.setitem(sys.modules, "decord", None)  # import decord -> ImportError
    with pytest.raises(MediaError, match=r"clip.mp4: decord is not installed .*aarch64 build it from source "
                                         r"\(docs/gpu_runs.md"):
        _reader(tmp_path / "clip.mp4")
