"""How long each command takes to answer a question that needs no model: `--help`, a config error
(a YAML with two unknown keys: both must be named, in one run) and, for train_e2v.py, the first
line of a dry run. What a user waits for between editing a YAML and reading the verdict.

    python bench/bench_cli_start.py --label after [--repeats 3]   # -> bench/results/cli_start.json, RESULTS.md
    python bench/bench_cli_start.py --label before --root /tmp/old_tree # the same commands of another tree

Each command runs as a fresh process of this Python, from a temporary folder, with PYTHONPATH set to
the tree timed (`--root`), the way a user starts it from the checkout (`python tools/precompute.py ...`).
The time is the wall time until the process exits (for the dry run: until its first line of
output); the figure is the median of `--repeats` runs, with the min; the output's first and last
lines are kept (a traceback shows as its first line, `Traceback ...`, and its last). The 1-minute load average is
recorded before and after: on a shared machine the figures scale with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench.benchlib, for RESULTS.md (the commands timed get PYTHONPATH=--root)
BAD_CONFIG = "typo_key: 1\ntrain:\n  lr_typo: 1.0e-4\n"  # two unknown keys, in two sections
BAD_PREPARE = "clips_typo: 1\nshots:\n  detector_typo: x\n"


def cases(tmp: Path) -> list[tuple[str, str, list[str]]]:
    """(command, case, arguments): every tool's --help and config error, and train_e2v.py's dry run."""
    bad, bad_prep = tmp / "bad.yaml", tmp / "bad_prepare.yaml"
    bad.write_text(BAD_CONFIG)
    bad_prep.write_text(BAD_PREPARE)
    c = str(bad)
    config_error = {
        "train_e2v.py": ["--config", c, "--dry_run"],
        "tools/precompute.py": ["--config", c],
        "tools/sample.py": ["--config", c, "--prompt", "x", "--out", str(tmp / "v.mp4")],
        "tools/check_dataset.py": ["--config", c, "--json", str(tmp / "r.json")],
        "tools/estimate_memory.py": ["--config", c],
        "tools/dump_visualizations.py": ["--config", c, str(tmp)],
        "tools/import_opens2v.py": ["--config", c, "--metadata", "m.json", "--media-root", ".",
                                    "--output", str(tmp / "o")],
        "tools/prepare_data.py": ["--config", str(bad_prep), "--input", str(tmp), "--output", str(tmp / "p")],
        "tools/export_lora.py": [str(tmp / "no_such_checkpoint"), "--out", str(tmp / "e")],  # its input error
    }
    out = []
    for script in ["train_e2v.py", *sorted(f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")
                                           if p.stem != "__init__" and not p.stem.startswith("_"))]:
        out.append((script, "--help", ["--help"]))
        if script in config_error:
            out.append((script, "config error", config_error[script]))
    out.append(("train_e2v.py", "dry run, first line", ["--config", str(ROOT / "configs/e2v_tiny.yaml"), "--dry_run",
                                                         "--set", f"data.datasets.0.data_root={tmp / 'none'}"]))
    return out


def time_once(root: Path, script: str, args: list[str], cwd: Path, first_line: bool) -> tuple[float, int, list[str]]:
    """(seconds, exit code, the output's non-empty lines) of one start of `script` from `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(root / script), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = proc.stdout.readline()
    if first_line:
        dt = time.perf_counter() - t0
        proc.kill()
        proc.communicate()
        return dt, 0, [line.strip()]
    rest, _ = proc.communicate()
    dt = time.perf_counter() - t0
    return dt, proc.returncode, [x.strip() for x in (line + rest).splitlines() if x.strip()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="the key the figures go under: before, after, ...")
    p.add_argument("--root", type=Path, default=ROOT, help="the tree whose commands are timed")
    p.add_argument("--commit", default=None, help="what --root holds (default: this checkout's HEAD)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="commands to time (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/cli_start.json")
    args = p.parse_args(argv)
    root = args.root.resolve()
    commit = args.commit or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    load_before, t_start = os.getloadavg()[0], time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for script, case, cmd_args in cases(tmp):
            if args.only and script not in args.only:
                continue
            runs = [time_once(root, script, cmd_args, tmp, case.startswith("dry run")) for _ in range(args.repeats)]
            secs = [r[0] for r in runs]
            said = runs[-1][2] or [""]
            rows.append({"command": script, "case": case, "median_s": round(statistics.median(secs), 2),
                         "min_s": round(min(secs), 2), "exit_code": runs[-1][1], "said": said[0][:200],
                         "last": said[-1][:200], "lines": len(said)})
            print(f"{script:32s} {case:22s} {rows[-1]['median_s']:6.2f} s (min {rows[-1]['min_s']:.2f})  "
                  f"rc {rows[-1]['exit_code']}: {rows[-1]['said'][:90]}", flush=True)
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result[args.label] = {"commit": commit, "rows": rows, "repeats": args.repeats,
                          "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                          "took_s": round(time.time() - t_start), "python": platform.python_version(),
                          "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.out == ROOT / "bench/results/cli_start.json":  # bench/RESULTS.md, section 9
        from bench.benchlib.report import render

        render()
    return result


if __name__ == "__main__":
    main()
