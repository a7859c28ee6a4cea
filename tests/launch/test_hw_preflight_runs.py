"""The start-up check of what later phases need (e2v/eval/preflight_deps.py): a missing mp4 writer,
an unloadable tokenizer or an unwritable folder stops every rank before any weight is read, with
one line that names the fix.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_hw_preflight.py."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

from e2v.eval import preflight_deps as pd
from e2v.runtime.ports import free_port


def test_missing_writer_stops_every_rank_before_step_1(tmp_path, demo_data):
    """train_e2v.py itself, two ranks on gloo (the launcher's variables), rank 1 without
    imageio-ffmpeg (a stub earlier on its path that fails to import): both ranks stop before the
    data check and the model load, each with the same one line."""
    stub = tmp_path / "no_ffmpeg" / "imageio_ffmpeg"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    port = free_port()
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
