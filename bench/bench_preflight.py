"""Start-up cost of the data check (e2v/data/preflight.py) on N clips, on this machine's CPU:
the first check (every clip decoded at both ends, every caption and reference read, in worker
processes) and a restart (everything from the fingerprint cache).

    python bench/bench_preflight.py [--clips 1000] [--workers N]   # -> bench/results/preflight.json

The clips are copies of the demo dataset's (64 x 64, 17 frames, H.264) with their captions and
three references each, under a temporary folder; the cache goes to a temporary $E2V_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clips", type=int, default=1000)
    p.add_argument("--workers", type=int, default=None, help="default: preflight.default_workers()")
    p.add_argument("--out", default=str(ROOT / "bench/results/preflight.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["E2V_CACHE_DIR"] = str(tmp / "cache")
        from e2v.config.load import load_config
        from e2v.data import preflight
        from e2v.data.dataset import index_samples
        from e2v.data.demo import main as make_demo

        make_demo([str(tmp / "demo"), "--num-samples", "8"])
        data = tmp / "data"
        data.mkdir()
        demo = sorted((tmp / "demo").glob("*.mp4"))
        for i in range(args.clips):  # real copies: the page cache holds them as a fresh dataset's would be
            src = demo[i % len(demo)]
            for f in src.parent.glob(src.stem + "*"):
                shutil.copyfile(f, data / f.name.replace(src.stem, f"{i:05d}", 1))
        cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={data}"])
        if args.workers is not None:
            preflight.default_workers = lambda: args.workers
        timings = {}
        for run in ("first", "restart"):
            t0 = time.perf_counter()
            samples = index_samples(cfg, verbose=False)
            timings[run] = time.perf_counter() - t0
        result = {"clips": args.clips, "usable": len(samples), "clip": "64x64, 17 frames, H.264 (demo data)",
                  "workers": preflight.default_workers(), "first_check_s": round(timings["first"], 2),
                  "restart_s": round(timings["restart"], 2),
                  "clips_per_s_first": round(args.clips / timings["first"], 1),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_avg": os.getloadavg()[0],
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
