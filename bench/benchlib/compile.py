"""Section 10: the compiled block (`speed.compile`) against eager, on the CPU presets, in one run of
`python bench/bench.py --sections compile`. One child process per preset, with an empty inductor
cache (TORCHINDUCTOR_CACHE_DIR), so the compile is the whole compile a user's first run pays. Two
frame buckets (the preset's frames and 9: clips of both lengths, auto frame buckets), so the count
of graphs is the one docs/speed.md states for two buckets.

In the child: train_e2v.py's step (bench/benchlib/step.py) makes the conditions of a few batches of
both buckets; two engines start from one copy of the initial weights, one eager, one compiled
(`e2v.train.engine.initialize_engine` applies speed.compile). The compiled engine's first pass over
those conditions pays the compile (its extra time over its later steps on the same conditions is the
compile time); the eager engine's pass over them, from fresh random streams as the compiled one had,
gives the losses to compare. Then rounds of both engines on the same conditions, the order reversed
every other round (a shared machine's load hits both alike): the step ratio is per round, then the
median. Legend: T latent frames.
"""

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
    """One child per preset, each with an empty inductor cache."""
    out = {"presets": {}}
    for preset in presets:
        roots = two_bucket_data(preset)
        cache = tempfile.mkdtemp(prefix="inductor_", dir=BENCH_DIR / "tmp")  # a cold compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            out["presets"][preset] = run_child("compile", args, preset=preset, data_root=roots[0], data_root_2=roots[1])
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            shutil.rmtree(cache, ignore_errors=True)
    return out


def child_compile(a) -> dict:
    """The eager and the compiled engine of one preset in this process (the module docstring)."""
    import copy

    import torch

    from bench.benchlib.step import StepRunner, init_single_rank, make_engine
    from bench.benchlib.steps import setup
    from e2v.models.speed import compiled_graphs

    init_single_rank()
    sets = bucket_sets(a.preset, (Path(a.data_root), Path(a.data_root_2))) + list(a.set)
    cfgs = {mode: make_config(a.preset, Path(a.data_root), None, sets + extra) for mode, extra in MODES.items()}
    parts, runner, engine, scheduler, batches, initial = setup(a.preset, cfgs["eager"], False, None, keep_initial=True)
    conds = []  # a few batches of each bucket, as the loader gives them
    while len(conds) < a.cache_batches or len({c.latents_BCTHW.shape[2] for c in conds}) < 2:
        conds.append(runner.train_step(engine, batches, Phases(False))[0])
    engines = {mode: make_engine(parts, cfg, False, transformer=copy.deepcopy(initial))[0] for mode, cfg in cfgs.items()}

    def run(mode: str, runner) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for c in conds:
            t0 = time.perf_counter()
            losses.append(runner.step(engines[mode], c, Phases(False)))
            times.append(time.perf_counter() - t0)
        return times, losses

    start = compiled_graphs()
    first, losses_c = run("compiled", StepRunner(cfgs["compiled"], parts, "cpu", False, None))
    graphs = compiled_graphs() - start
    eager_first, losses_e = run("eager", StepRunner(cfgs["eager"], parts, "cpu", False, None))
    rounds = []
    for r in range(a.overhead_rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        rounds.append({mode: run(mode, runner)[0] for mode in order})
    steady = [statistics.median(rd["compiled"][i] for rd in rounds) for i in range(len(conds))]
    ratio = [sum(rd["compiled"]) / sum(rd["eager"]) for rd in rounds]
    return {"preset": a.preset, "batch": cfgs["eager"].train.micro_batch_size,
            "latent_frames": [c.latents_BCTHW.shape[2] for c in conds], "torch_threads": torch.get_num_threads(),
            "first_pass_s": first, "eager_first_pass_s": eager_first, "rounds": rounds,
            "step_ratio": round(statistics.median(ratio), 3), "step_ratio_range": [round(min(ratio), 3), round(max(ratio), 3)],
            "eager_step_ms": round(1e3 * statistics.median(t for rd in rounds for t in rd["eager"]), 1),
            "compile_s": round(sum(f - s for f, s in zip(first, steady)), 1), "graphs": graphs,
            "losses_eager": losses_e, "losses_compiled": losses_c,
            "max_loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(losses_c, losses_e))}


def best_ratio(rounds: list[dict]) -> float:
    """compiled / eager over each condition's fastest step of all rounds: on a machine other jobs
    load, the least disturbed estimate (the median ratio is the one the round order protects)."""
    best = {mode: sum(min(rd[mode][i] for rd in rounds) for i in range(len(rounds[0][mode]))) for mode in MODES}
    return round(best["compiled"] / best["eager"], 3)


def render_compile(res: dict) -> list[str]:
    lines = ["## 10. The compiled block against eager (`--sections compile`, CPU)", "",
             "`speed.compile: true` (inductor, `compile_shapes: auto`, every WanTransformerBlock compiled in place) "
             "against eager: two engines from the same initial weights in one process (bench/benchlib/compile.py), an "
             "empty inductor cache, conditions of two frame buckets, gradient checkpointing on, fp32, the tiny config's "
             "LoRA (e2v_tiny_lora.yaml). Step ratio: compiled / eager over the same conditions, per round (the order "
             "reversed every other round), median (min-max); below 1 is faster. Best: each condition's fastest step "
             "over the rounds, compiled / eager (the least disturbed estimate on a loaded machine). Compile time: the "
             "compiled engine's first pass over the conditions less its later passes. Losses: the first pass of each, "
             "the same conditions and random streams.", "",
             "| preset | latent frames | step ratio | best | compile s | graphs | max loss rel. diff | eager step ms | "
             "rounds | threads | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset, r in res["presets"].items():
        lo, hi = r["step_ratio_range"]
        lines.append(f"| {preset} | {', '.join(map(str, r['latent_frames']))} | {r['step_ratio']} ({lo}-{hi}) | "
                     f"{best_ratio(r['rounds'])} | {r['compile_s']} | {r['graphs']} | {r['max_loss_rel_diff']:.1e} | {r['eager_step_ms']} | "
                     f"{len(r['rounds'])} | {r['torch_threads']} | {r.get('load1_before', '?')} -> {r.get('load1_after', '?')} |")
    return lines + [""]
