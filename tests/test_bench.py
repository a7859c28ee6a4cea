"""tools/bench.py measures what it says: one online tiny step split into phases that add up to its
wall time, and a bare PyTorch loop that does the same work as the DeepSpeed engine step (the
overhead ratio compares like with like). The benchmarks themselves are not tests (`make bench`)."""

import json
import subprocess
import sys

from conftest import ROOT


def test_bench_phases_and_same_work(demo_data):
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench.py"), "--child", "check", "--data-root",
                           str(demo_data)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("BENCH_JSON ")][-1][len("BENCH_JSON "):])

    phases, wall = out["phases_s"], out["wall_s"]
    for p in ("data_wait", "vae_encode", "text_encode", "clip_encode", "forward_and_loss", "backward", "optimizer",
              "logging"):
        assert phases[p] > 0, p
    # top-level phases partition the step: nothing counted twice (sub-phases like logging/... are
    # inside their parent), nothing of substance left out
    top = sum(v for k, v in phases.items() if "/" not in k)
    assert 0.9 * wall < top <= wall, (top, wall)
    assert sum(v for k, v in phases.items() if k.startswith("logging/")) <= phases["logging"]

    eq = out["equivalence"]
    assert len(eq["losses_engine"]) == 3
    assert eq["max_abs_diff"] < 1e-6, eq  # same init, batch, sigmas, noise -> same losses step for step
    assert len(set(eq["losses_bare"])) == 3  # the optimizer steps happen (losses move)
