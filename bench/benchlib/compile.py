"""Section 10: the compiled block (`speed.compile`) against eager, on the CPU presets, in one run of
`python bench/bench.py --sections compile`. Each configuration trains in a fresh child process with
an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so the first steps pay the whole compile, as a
user's first run does. Two frame buckets (9 and 17 frames: clips of both lengths, auto frame
buckets), so the count of graphs is the one docs/speed.md states for two buckets.

Per configuration: every step's wall time and phases (train_e2v.py's step through the loop's phase
hook, bench/benchlib/step.py), its loss, and the graphs torch.compile made by then. The compile
time is the extra time of the steps that made a graph, over the median of the steps that made none;
the step ratio compares those medians (compiled / eager, and the transformer's forward + backward
alone). Legend: B batch, T latent frames."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib.common import BENCH_DIR, PRESETS, ROOT, Phases, make_config

MODES = {"eager": [], "compiled": ["speed.compile=true"]}
COMPILED_PHASES = ("forward_and_loss", "backward")  # where the transformer's blocks run


def two_bucket_data(preset: str) -> tuple[Path, Path]:
    """The preset's clips at its frame count and at 9 frames (the shortest bucket the tiny config's
    elements allow: their 9 condition frames), the same size."""
    p = PRESETS[preset]
    roots = []
    for frames in (p["frames"], 9):
        root = BENCH_DIR / "tmp" / f"demo_{preset}_{frames}f"
        subprocess.run([sys.executable, str(ROOT / "tools/make_demo_dataset.py"), str(root), "--num-samples", "8",
                        "--size", str(p["size"]), "--frames", str(frames)], check=True, capture_output=True)
        roots.append(root)
    return roots[0], roots[1]


def bucket_sets(preset: str, roots: tuple[Path, Path]) -> list[str]:
    frames = sorted({PRESETS[preset]["frames"], 9})
    return [f"data.datasets=[{{data_root: {roots[0]}}}, {{data_root: {roots[1]}}}]", "data.auto_frame_buckets=true",
            f"data.frame_buckets={frames}", "train.gradient_checkpointing=true"]


def section_compile(args, run_child, presets) -> dict:
    """Eager and compiled children per preset; losses compared, ratios and compile time derived."""
    out = {"presets": {}}
    for preset in presets:
        roots = two_bucket_data(preset)
        runs = {}
        for mode, sets in MODES.items():
            cache = tempfile.mkdtemp(prefix="inductor_", dir=BENCH_DIR / "tmp")  # a cold compile
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                runs[mode] = run_child("compile", args, preset=preset, mode=mode, data_root=roots[0],
                                       data_root_2=roots[1])
            finally:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
                shutil.rmtree(cache, ignore_errors=True)
        out["presets"][preset] = {**runs, **compare(runs["eager"], runs["compiled"])}
    return out


def compare(eager: dict, compiled: dict) -> dict:
    """The step ratio over the steps that compiled nothing, the compile time, the loss difference."""
    def steady(run, key):
        return statistics.median(s[key] for s in run["steps"] if not s["new_graphs"])

    compile_s = sum(s["step_s"] - steady(compiled, "step_s") for s in compiled["steps"] if s["new_graphs"])
    diffs = [abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])]
    return {"step_ratio": round(steady(compiled, "step_s") / steady(eager, "step_s"), 3),
            "blocks_ratio": round(steady(compiled, "blocks_s") / steady(eager, "blocks_s"), 3),
            "compile_s": round(compile_s, 1), "graphs": compiled["steps"][-1]["graphs"],
            "max_loss_rel_diff": max(diffs)}


def child_compile(a) -> dict:
    """One configuration in this process: a.steps + a.warmup steps of train_e2v.py's step over two buckets."""
    import torch

    from bench.benchlib.step import init_single_rank
    from bench.benchlib.steps import setup
    from e2v.models.speed import compiled_graphs

    init_single_rank()
    sets = bucket_sets(a.preset, (Path(a.data_root), Path(a.data_root_2))) + MODES[a.mode] + list(a.set)
    cfg = make_config(a.preset, Path(a.data_root), None, sets)
    parts, runner, engine, scheduler, batches, _ = setup(a.preset, cfg, False, BENCH_DIR / "tmp" / f"log_compile_{a.preset}")
    start, steps, losses = compiled_graphs(), [], []
    for _ in range(a.warmup + a.steps):
        before = compiled_graphs()
        ph = Phases(False)
        t0 = time.perf_counter()
        c, loss = runner.train_step(engine, batches, ph, scheduler)
        step_s = time.perf_counter() - t0
        losses.append(loss)
        steps.append({"step_s": step_s, "blocks_s": sum(ph.t.get(p, 0.0) for p in COMPILED_PHASES),
                      "frames": c.latents_BCTHW.shape[2], "graphs": compiled_graphs() - start,
                      "new_graphs": compiled_graphs() - before})
    runner.close()
    return {"preset": a.preset, "mode": a.mode, "batch": cfg.train.micro_batch_size,
            "latent_frames": sorted({s["frames"] for s in steps}), "torch_threads": torch.get_num_threads(),
            "steps": steps, "losses": losses}


def render_compile(res: dict) -> list[str]:
    lines = ["## 10. The compiled block against eager (`--sections compile`, CPU)", "",
             "`speed.compile: true` (inductor, `compile_shapes: auto`, regional: every WanTransformerBlock) against "
             "eager, each in a fresh process with an empty inductor cache, two frame buckets, gradient checkpointing "
             "on, fp32, the tiny config's LoRA (e2v_tiny_lora.yaml). Step ratio: median of the steps that compiled "
             "nothing, compiled / eager (below 1: faster); blocks: the forward + backward phases alone. Compile time: "
             "the extra time of the steps that made a graph.", "",
             "| preset | latent frames | steps | step ratio | blocks ratio | compile s | graphs | max loss rel. diff | "
             "eager step ms | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for preset, r in res["presets"].items():
        e, c = r["eager"], r["compiled"]
        eager_ms = 1e3 * statistics.median(s["step_s"] for s in e["steps"])
        lines.append(f"| {preset} | {', '.join(map(str, c['latent_frames']))} | {len(c['steps'])} | {r['step_ratio']} | "
                     f"{r['blocks_ratio']} | {r['compile_s']} | {r['graphs']} | {r['max_loss_rel_diff']:.1e} | "
                     f"{eager_ms:.0f} | {e.get('load1_before', '?')} -> {c.get('load1_after', '?')} |")
    return lines + [""]
