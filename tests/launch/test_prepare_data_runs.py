"""tools/prepare_data.py as the user runs it, killed with SIGKILL while it works and run again: the
finished video is kept as it was, the other one redone, no partial file left. The in-process runs
(truth, bad inputs, photographs, the learned backend) are in tests/unit/test_prepare_data.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT
from helpers_prepare import SMALL_SETS

from bench.make_raw_footage import generate


def _complete(out: Path) -> None:
    """Every video file in the folder is a whole sample: its references and caption are there."""
    for mp4 in out.glob("*.mp4"):
        for suffix in ("_person.png", "_background.png", ".txt"):
            assert mp4.with_name(mp4.stem + suffix).exists(), f"{mp4.name} without {suffix}"


def test_kill_mid_video_redoes_only_that_video(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    generate(raw, videos=2, shots=2, shot_seconds=4.5)
    cmd = [sys.executable, str(ROOT / "tools/prepare_data.py"), "--config", str(ROOT / "configs/prepare.yaml"),
           "--input", str(raw), "--output", str(out), "--no-caption"] + [a for s in SMALL_SETS for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = out / ".prepare/records"
    deadline = time.time() + 120
    while time.time() < deadline and not (records.exists() and any(records.glob("*.json"))):
        time.sleep(0.05)
    # killed at once: the second video is under way (or not begun), never finished
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {p.name: p.stat().st_mtime_ns for p in records.glob("*.json")}
    assert len(done_before) == 1, done_before
    _complete(out)
    finished = [json.loads(p.read_text()) for p in records.glob("*.json")]
    kept = {s["id"]: (out / f"{s['id']}.mp4").stat().st_mtime_ns for r in finished for s in r["samples"]}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 finished before, 1 to do" in res.stdout
    assert {p.name: p.stat().st_mtime_ns for p in records.glob("*.json") if p.name in done_before} == done_before
    assert {i: (out / f"{i}.mp4").stat().st_mtime_ns for i in kept} == kept  # finished samples untouched
    assert not list(out.rglob("*.part"))
    _complete(out)
    rows = (out / "prepare_manifest.jsonl").read_text().splitlines()
    assert len(rows) == len(list(out.glob("*.mp4"))) == 4
