"""`make demo-prep`: generated raw footage -> tools/prepare_data.py -> tools/check_dataset.py (run by
the preparation) -> a short tiny training run on the prepared set, whose held-out
shuffled-reference gap (val/reference_gap_shuffle_rel, e2v/eval/validation.py) is printed at its last
validation: positive means the trained model reads the prepared references.

    python bench/demo_prep.py [--raw demo_raw] [--out demo_prep] [--videos 12] [--steps 300]

Every stage's seconds are printed; the raw footage and the prepared set are kept when complete
(a second run goes straight to training).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# bench/ is the maintainers' harness, not part of the installed package: `python bench/<script>.py`
# finds its sibling modules (bench.*) from the checkout's root.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.make_raw_footage import generate, write_hard_footage  # noqa: E402
from e2v.runtime.launch import read_scalars, train_command  # noqa: E402

# the demo's clip shape: configs/e2v_tiny_lora.yaml's (17 frames at 64 x 64), at 8 fps
PREP_SETS = ["clips.num_frames=17", "clips.fps=8", "clips.resolution=[64, 64]", "clips.windows_per_shot=2",
             "check.config=configs/e2v_tiny_lora.yaml"]


def last_gap(run_dir: Path) -> tuple[int, float, float]:
    """(step, shuffle gap, relative shuffle gap) at the run's last validation."""
    val = [r for _, r in sorted(read_scalars(run_dir).items()) if "val/reference_gap_shuffle_rel" in r]
    if not val:
        raise SystemExit(f"no validation scalars in {run_dir / 'scalars.jsonl'}")
    r = val[-1]
    return r["step"], r["val/reference_gap_shuffle"], r["val/reference_gap_shuffle_rel"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=ROOT / "demo_raw")
    p.add_argument("--out", type=Path, default=ROOT / "demo_prep")
    p.add_argument("--videos", type=int, default=12)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num_gpus", type=int, default=int(os.environ.get("NUM_GPUS", 1)))
    a = p.parse_args(argv)
    times = {}
    t0 = time.perf_counter()
    if not (a.raw / "truth_hard.json").exists():
        generate(a.raw, videos=a.videos, shots=3, shot_seconds=4.5)
        # what a user's footage holds beside the tripod shots: a pan then a zoom over photographs
        # (registered), and a phone held upright (kept portrait; square at this 64 x 64 size)
        write_hard_footage(a.raw, only=("pan_zoom", "portrait"))
    times["footage"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "tools/prepare_data.py"), "--config", str(ROOT / "configs/prepare.yaml"),
           "--input", str(a.raw), "--output", str(a.out)] + [x for s in PREP_SETS for x in ("--set", s)]
    if subprocess.call(cmd) != 0:
        raise SystemExit("prepare_data.py failed (its summary above says why)")
    times["prepare_and_check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runs = ROOT / "runs" / "demo_prep"
    before = set(runs.glob("*")) if runs.exists() else set()
    # on a free port: another run on this machine may hold deepspeed's default
    train = train_command(str(ROOT / "configs/e2v_tiny_lora.yaml"), f"data.datasets.0.data_root={a.out}",
                          f"output_dir={runs}", f"train.max_steps={a.steps}", f"train.checkpoint_every={a.steps}",
                          "visualization.enabled=false", "validation.num_videos=0", num_gpus=a.num_gpus)
    if subprocess.call(train) != 0:
        raise SystemExit("training failed (its log above says why)")
    times["train"] = time.perf_counter() - t0
    (run,) = set(runs.glob("*")) - before
    step, gap, rel = last_gap(run)
    print("[demo-prep] seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items())
          + f"; total {sum(times.values()):.0f}")
    print(f"[demo-prep] held-out shuffled-reference gap at step {step}: {gap:+.4f} ({rel * 100:+.1f}%) -> "
          f"{'the model reads the prepared references' if gap > 0 else 'NOT positive'}  (run {run})")
    return 0 if gap > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
