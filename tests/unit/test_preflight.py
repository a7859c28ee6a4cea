"""The data check before the first step (e2v/data/preflight.py): a copy of the demo data with a
truncated mp4, an empty caption and a 9-frame clip. Training with the defaults stops before
step 1 naming all three (2 ranks stop together), `skip` trains without them and counts them,
`--dry_run` and tools/check_dataset.py report them; the facts are cached by file fingerprint.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_preflight_runs.py."""

from __future__ import annotations

import faulthandler
import gc
import os
import shutil
import signal

import pytest
from helpers_preflight import BAD, _cfg


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


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


class _DiesInAChild:
    """A finaliser that aborts when it runs in any process but the one that made the object, as a
    C++ handle (a process group's) can when a forked child frees it."""

    def __init__(self):
        self.pid, self.cycle = os.getpid(), self

    def __del__(self):
        if os.getpid() != self.pid:
            os.abort()


def _collect_quietly():
    faulthandler.disable()  # pytest's, inherited: the abort is expected here, not a traceback to print
    gc.collect()


def _collect_and_return(job):
    gc.collect()  # the worker collects what it can reach: the parent's garbage, if it is not frozen
    return job


def test_the_check_workers_never_collect_the_parents_garbage():
    """The check's workers fork from a process that may hold unreachable cycles (a test's or a
    library's); collected in a worker, such an object's finaliser runs there. Oracle: the same
    garbage made in a forked child (not through map_samples) kills it; through map_samples every
    job comes back."""
    import multiprocessing

    from e2v.data.preflight import map_samples

    gc.disable()  # the garbage stays until the workers fork
    try:
        _DiesInAChild()
        child = multiprocessing.get_context("fork").Process(target=_collect_quietly)
        child.start()
        child.join()
        assert child.exitcode == -signal.SIGABRT  # the negative control: a plain fork collects it and dies
        assert list(map_samples(_collect_and_return, list(range(8)), workers=2)) == list(range(8))
    finally:
        gc.enable()
        gc.collect()
