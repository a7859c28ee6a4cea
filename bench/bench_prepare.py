"""Benchmark of tools/prepare_data.py on generated footage with known truth (the full case of
tests/unit/test_prepare_data.py's small one): cuts, subject IoU, background error, outside-window
references, and CPU seconds per minute of footage by stage; then the hard footage
(bench/make_raw_footage.py write_hard_footage) per case -> bench/results/prepare.json and the
data-preparation section of bench/RESULTS.md.

    python bench/bench_prepare.py [--videos 6] [--shots 4] [--set shots.threshold=20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

# bench/ is the maintainers' harness, not part of the installed package: `python bench/<script>.py`
# finds its sibling modules (bench.*) from the checkout's root.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchlib.common import BENCH_DIR, load1  # noqa: E402
from bench.benchlib.report import render  # noqa: E402
from bench.make_raw_footage import generate, write_hard_footage  # noqa: E402
from e2v.data.prepare.config import load_prepare_config  # noqa: E402
from e2v.data.prepare.run import prepare  # noqa: E402
from e2v.data.prepare.truth import score, score_hard  # noqa: E402
from e2v.eval.dataset_check import main as check_dataset  # noqa: E402

CASE = {"source_hw": [144, 256], "source_fps": 24.0, "shot_seconds": 7.0, "num_frames": 33, "fps": 8.0,
        "target_hw": [128, 224]}


def hard_cases(work: Path) -> dict:
    """tests/unit/test_prepare_hard.py's footage and settings (write_hard_footage, 96x160 clips of 17
    frames at 8 fps), scored per case, with the seconds per footage minute by stage."""
    raw, out = work / "hard_raw", work / "hard_prepared"
    shutil.rmtree(out, ignore_errors=True)
    write_hard_footage(raw)
    cfg = load_prepare_config(ROOT / "configs/prepare.yaml", [
        "clips.num_frames=17", "clips.fps=8", "clips.resolution=[96, 160]", "check.config=configs/e2v_tiny.yaml",
        "check.set=[train.micro_batch_size=1]"])
    t0 = time.perf_counter()
    summary = prepare(cfg, raw, out, no_caption=True, check=check_dataset)
    return {"cases": score_hard(raw, out), "wall_s": time.perf_counter() - t0, "check_exit_code":
            summary.get("check_exit_code"), "footage_minutes": summary["counts"]["footage_seconds"] / 60,
            "seconds_per_footage_minute": summary["seconds_per_footage_minute"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", type=int, default=6)
    p.add_argument("--shots", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="prepare config overrides")
    p.add_argument("--keep", type=Path, default=None, help="keep the footage and the prepared set here")
    a = p.parse_args(argv)
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    raw, out = work / "raw", work / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    c = dict(CASE, videos=a.videos, shots=a.shots)
    generate(raw, videos=a.videos, shots=a.shots, shot_seconds=c["shot_seconds"], height=c["source_hw"][0],
             width=c["source_hw"][1], fps=c["source_fps"])
    cfg = load_prepare_config(ROOT / "configs/prepare.yaml", [
        f"clips.num_frames={c['num_frames']}", f"clips.fps={c['fps']}", f"clips.resolution={c['target_hw']}",
        "check.config=configs/e2v_tiny.yaml", "check.set=[train.micro_batch_size=1]", *a.set])
    load_before, t0 = load1(), time.perf_counter()
    summary = prepare(cfg, raw, out, no_caption=True, check=check_dataset)
    wall = time.perf_counter() - t0
    s = score(raw, out, tuple(c["target_hw"]))
    stage_s = sum(v for v in summary["seconds_per_footage_minute"].values()) * summary["counts"]["footage_seconds"] / 60
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "case": c, "overrides": a.set, "score": s, "counts": summary["counts"], "check_exit_code": summary.get("check_exit_code"),
              "footage_minutes": summary["counts"]["footage_seconds"] / 60, "wall_s": wall, "check_s": wall - stage_s,
              "seconds_per_footage_minute": summary["seconds_per_footage_minute"], "load_before": load_before,
              "load_after": load1()}
    result["hard"] = hard_cases(work)
    (BENCH_DIR / "results").mkdir(parents=True, exist_ok=True)
    (BENCH_DIR / "results" / "prepare.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"score": s, "seconds_per_footage_minute": result["seconds_per_footage_minute"],
                      "wall_s": round(wall, 1)}, indent=1))
    print(f"-> {BENCH_DIR / 'results/prepare.json'}, {render()}")
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
