"""bench/RESULTS.md, regenerated from every bench/results/*.json: machine, versions, date, load,
a summary computed from the tables, then one table per section."""

from __future__ import annotations

import json
from pathlib import Path

from bench.benchlib.common import BENCH_DIR, STEP_PHASES
from bench.benchlib.memory import render_memory
from bench.benchlib.prepare import render_prepare

PHASE_NAMES = {
    "data_wait": "data wait (main process: decode + preprocess, or cache file read)",
    "cache_assembly": "cached entries -> step tensors (layout.batch_conditions)", "vae_encode": "VAE encode (target + condition)",
    "text_encode": "text encode (tokenize + UMT5)", "clip_encode": "CLIP encode (processor + vision)",
    "conditioning_other": "conditioning glue", "noise_and_input": "sigma, noise, model input",
    "forward_and_loss": "forward + loss", "loss_check": "non-finite loss check (all ranks)", "backward": "backward", "optimizer": "optimizer step",
    "logging": "logging (step statistics, grad norm, TensorBoard, tqdm, stop-signal check)",
}
KIND_NAMES = {"full": "train_e2v.py step (ZeRO-2, logging)", "engine": "engine step (ZeRO-2, no logging)",
              "bare": "bare PyTorch loop", "zero2_no_overlap": "ZeRO-2, overlap_comm off", "zero1": "ZeRO-1",
              "zero0": "ZeRO-0 (no partitioning)"}


def fmt(s: dict | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


PRECISION = {"no": "fp32", "bf16": "bf16 (DeepSpeed, fp32 masters)"}


def _on_off(flag) -> str:
    return {True: "on", False: "off"}.get(flag, "?")


def _load(r: dict) -> str:
    return f"{r.get('load1_before', '?')} -> {r.get('load1_after', '?')}"


def render_steps(res: dict, title: str) -> list[str]:
    out = [f"## 1. Step breakdown{title}", "",
           "One training step (gradient accumulation 1) as train_e2v.py runs it, split into phases; ms per step, "
           "median (min-max) over the timed steps. *Online*: DataLoader (0 workers) + VAE / UMT5 / CLIP every step. "
           "*Cached*: `cache.enabled` with the entries tools/precompute.py wrote (e2v/data/store.py): the DataLoader "
           "reads one safetensors file per sample, batch_conditions builds the step's tensors, no encoder is "
           "loaded.", ""]
    for preset, r in res["presets"].items():
        on, ca = r["online"], r["cached"]
        out += [f"**{preset}**: batch {on['batch']}, {on['frames']} x {on['resolution'][0]} x {on['resolution'][1]} "
                f"pixels -> latents {' x '.join(map(str, on['latent_shape']))}; transformer "
                f"{on['transformer_params_M']} M params ({on['trainable_params_M']} M trainable: LoRA + the "
                f"modules e2v_tiny_lora.yaml trains in full); {on['phases_ms']['forward_and_loss']['n']} timed steps, "
                f"torch threads {on.get('torch_threads', '?')}; {PRECISION.get(on.get('mixed_precision'), '?')}, "
                f"gradient checkpointing {_on_off(on.get('gradient_checkpointing'))}; "
                f"load {_load(on)} (online), {_load(ca)} (cached).", "",
                "| phase | online ms | share | cached ms | share |", "|---|---|---|---|---|"]
        ton, tca = on["step_ms"]["median"], ca["step_ms"]["median"]
        for p in STEP_PHASES:
            a, b = on["phases_ms"].get(p), ca["phases_ms"].get(p)
            if a is None and b is None:
                continue
            share = lambda x, t: f"{100 * x['median'] / t:.0f}%" if x else "-"  # noqa: E731
            out.append(f"| {PHASE_NAMES[p]} | {fmt(a, 2)} | {share(a, ton)} | {fmt(b, 2)} | {share(b, tca)} |")
        pre = r.get("precompute", {})
        out += [f"| **step** | **{fmt(on['step_ms'])}** | | **{fmt(ca['step_ms'])}** | |", "",
                f"online / cached step: **{r['online_over_cached']}x**. Filling the cache "
                f"(tools/precompute.py, {pre.get('samples', '?')} samples, process start included): "
                f"{pre.get('wall_s', '?')} s.", ""] + speed_line(on, ca)
    return out


def speed_line(on: dict, ca: dict) -> list[str]:
    """The transformer's FLOPs per step (e2v/train/flops.py) over each mode's median step."""
    if "speed" not in on:
        return []
    s = on["speed"]
    mfu = lambda x: (f", MFU {100 * x['mfu']:.1f}% (HFU {100 * x['hfu']:.1f}%)" if "mfu" in x else "")  # noqa: E731
    return [f"Transformer FLOPs per step: {s['step_tflop']:.4g} TFLOP (forward + backward; {s['hardware_tflop']:.4g} "
            f"with the recomputed forward). Online: {s['tokens_per_s']:.4g} video tokens/s, "
            f"{s['tflops_per_gpu']:.3g} TFLOPS{mfu(s)}; cached: {ca['speed']['tokens_per_s']:.4g} tokens/s, "
            f"{ca['speed']['tflops_per_gpu']:.3g} TFLOPS{mfu(ca['speed'])}. Peak: "
            f"{_f_peak(s)}.", ""]


def _f_peak(s: dict) -> str:
    return f"{s['peak_tflops']:g} TFLOPS dense bf16, {s['peak_source']}" if s.get("peak_tflops") else s["peak_source"]


def render_overhead(res: dict, title: str) -> list[str]:
    out = [f"## 2. Overhead: the train_e2v.py step against a bare PyTorch loop{title}", "",
           "Cached tensors, the same model (copies of one initial state) and batches. Each round runs every "
           "kind for a few steps, the order reversed every other round; a kind's time is its per-round median, "
           "the ratio is per round, then median (min-max) over rounds. The bare loop is forward, loss, backward, "
           "clip_grad_norm_, torch AdamW, LambdaLR, zero_grad. Same work, checked: from the same initial weights "
           "the engine and the bare loop give the same losses step for step (max |diff| below).", ""]
    for preset, r in res["presets"].items():
        o = r["cached"].get("overhead")
        if not o:
            continue
        k = o["kinds"]
        eq = o["equivalence"]
        same = (f"losses engine vs bare over {eq['steps']} steps: max |diff| {eq['max_abs_diff']:.1e}" if eq
                else "same-work check skipped for a real model")
        out += [f"**{preset}** ({o['rounds']} rounds x {o['steps_per_round']} steps; {same})", "",
                "| step | ms | ratio over bare | forward + loss | backward | optimizer | logging |",
                "|---|---|---|---|---|---|---|"]
        for kind, v in k.items():
            ph = v["phases_ms"]
            cells = [fmt(ph.get(p), 2) for p in ("forward_and_loss", "backward", "optimizer", "logging")]
            out.append(f"| {KIND_NAMES.get(kind, kind)} | {fmt(v['step_ms'], 2)} | "
                       f"**{fmt(v['ratio_over_bare'], 3)}** | " + " | ".join(cells) + " |")
        verdict = "within" if o["within_goal"] else "OVER"
        prof = o["profile"]
        logs = ", ".join(f"{p.split('/')[1].replace('_', ' ')} {v['median']:.2f}"
                         for p, v in k["full"]["phases_ms"].items() if p.startswith("logging/"))
        calls = prof["python_calls_per_step"]
        files = ", ".join(f"{x['file']} {x['extra_ms']:+.2f}" for x in prof["top_files"][:4])
        funcs = ", ".join(f"{x['function'].split('/')[-1]} {x['extra_ms']:+.2f} ({x['calls_per_step']:g} calls)"
                          for x in prof["top_functions"][:4])
        out += ["", f"train_e2v.py step / bare: **{k['full']['ratio_over_bare']['median']:.3f}x**, {verdict} the "
                f"{o['goal']}x goal. Where the extra time goes (cProfile own time, full minus bare, ms per step; "
                f"cProfile inflates Python-heavy code, so this is a ranking): by file {files}; "
                f"by function {funcs}. Python function calls per step: {calls['full']} (train_e2v.py step) "
                f"against {calls['bare']} (bare). The logging phase, ms: {logs}.", ""]
    return out


def render_data(d: dict) -> list[str]:
    t = d["target"]
    out = ["## 3. Data pipeline at 81 x 480 x 832", "",
           f"{d['clips']} synthetic clips, {t[0]} frames at {d['source_hw'][0]}x{d['source_hw'][1]} (H.264, CRF 23), "
           f"centre-cropped and resized (torch antialiased bicubic, e2v.data.media) to {t[1]}x{t[2]}; elements: {d['elements']}. One sample is "
           f"one E2VDataset.load: a {d['video_tensor_mb']} MB float32 video tensor. ms per sample, one torch thread, "
           f"median (min-max) over {d['decoders']['decord']['item']['n']} loads. Decoded pixels of the two "
           f"decoders differ by {d['decoder_mean_abs_diff_levels']} levels (mean |diff|, of 255). "
           f"Load {_load(d)}.", "",
           "| decoder | decode | resize + to tensor | elements + rest | whole sample | samples/s (1 core) |",
           "|---|---|---|---|---|---|"]
    for name, v in d["decoders"].items():
        out.append(f"| {name} | {fmt(v['decode'])} | {fmt(v['resize_to_tensor'])} | {fmt(v['elements_and_rest'])} | "
                   f"{fmt(v['item'])} | {v['samples_per_s_one_core']} |")
    dec = d["decoders"]
    r = dec["opencv"]["decode"]["median"] / dec["decord"]["decode"]["median"]
    share = dec["decord"]["resize_to_tensor"]["median"] / dec["decord"]["item"]["median"]
    alt = d.get("resize_alternative")
    out += ["", f"OpenCV / decord decode time: **{r:.2f}x**. Resize + to-tensor is **{100 * share:.0f}%** of a "
            f"decord sample."]
    if alt:
        out += ["", f"Resize before and after: e2v.data.media.frames_to_video resizes the whole clip with torch's "
                f"antialiased filter on uint8 ({fmt(alt['current_ms'])} ms); PIL per frame, as it did before "
                f"(`pil_frames_to_video` here), takes {fmt(alt['pil_per_frame_ms'])} ms: **{alt['speedup']}x**; "
                f"pixels differ by {alt['mean_abs_diff_levels']} levels on average, "
                f"{alt['max_abs_diff_levels']} at most (of 255)."]
    out += ["", "DataLoader over the same samples (decord, batch 1, wall time from the first "
            "`iter` to the last sample, worker start-up included):", "",
            "| workers | samples | seconds | samples/s | per worker | vs 1 worker |", "|---|---|---|---|---|---|"]
    for w, v in d["dataloader_scaling"].items():
        out.append(f"| {w} | {v['samples']} | {v['seconds']} | {v['samples_per_s']} | {v['samples_per_s_per_worker']} "
                   f"| {v['speedup_vs_1_worker']}x |")
    return out + [""]


def _loads(node) -> list[float]:
    """Every load1_* value recorded anywhere in the results."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k.startswith("load1_") and isinstance(v, (int, float))] + \
            [x for v in node.values() for x in _loads(v)]
    return []


def render_summary(steps: dict | None, data: dict | None) -> list[str]:
    """The headline numbers, computed from the tables below (so they never disagree with them)."""
    out = ["## Summary", ""]
    for preset, r in (steps or {}).get("presets", {}).items():
        on = r["online"]
        top = max((p for p in STEP_PHASES if p in on["phases_ms"]), key=lambda p: on["phases_ms"][p]["median"])
        share = on["phases_ms"][top]["median"] / on["step_ms"]["median"]
        out.append(f"- {preset}, online: the largest phase is {PHASE_NAMES[top]} ({100 * share:.0f}% of the step); "
                   f"the cached step is {r['online_over_cached']}x faster.")
        o = r["cached"].get("overhead")
        if o:
            full = o["kinds"]["full"]["ratio_over_bare"]["median"]
            engine = o["kinds"]["engine"]["ratio_over_bare"]["median"]
            extra = o["kinds"]["full"]["step_ms"]["median"] - o["kinds"]["bare"]["step_ms"]["median"]
            out.append(f"- {preset}, overhead: train_e2v.py step / bare loop {full:.3f}x "
                       f"({'within' if o['within_goal'] else 'over'} {o['goal']}x; {extra:+.2f} ms per step), "
                       f"engine alone {engine:.3f}x; largest extra Python time in "
                       f"{o['profile']['top_files'][0]['file']}.")
    if data:
        dec = data["decoders"]["decord"]
        stage = max(("decode", "resize_to_tensor", "elements_and_rest"), key=lambda k: dec[k]["median"])
        sc = data["dataloader_scaling"]
        alt = data.get("resize_alternative")
        out.append(f"- data at 81 x 480 x 832: {dec['samples_per_s_one_core']} samples/s per core (decord); the "
                   f"largest stage is {stage.replace('_', ' ')} ({100 * dec[stage]['median'] / dec['item']['median']:.0f}%)"
                   + (f" (torch whole-clip resize, {alt['speedup']}x faster than PIL per frame)" if alt else "")
                   + f"; 2 workers give {sc['2']['speedup_vs_1_worker']}x the throughput of 1.")
    return out + [""] if len(out) > 2 else []


def render_measured(measured: dict) -> list[str]:
    """Section 7: figures measured once by hand (bench/results/measured.json), which comments in the
    code cite by their key instead of stating a number that goes stale."""
    lines = ["## 7. Measured by hand", "", measured["about"], "", "| key | what | figure | how |", "|---|---|---|---|"]
    lines += [f"| `{r['key']}` | {r['what']} | {r['figure']} | {r['how']} |" for r in measured["rows"]]
    return lines + [""]


def render_preflight(pre: dict) -> list[str]:
    """Section 8: the start-up data check's cost per clip (bench/results/preflight.json, written by
    bench/bench_preflight.py), which e2v/data/preflight.py's timeout sizing cites."""
    per_clip = pre["workers"] / pre["clips_per_s_first"]
    return ["## 8. The data check's cost (bench/bench_preflight.py)", "",
            f"The data check before step 1 (e2v/data/preflight.py) over {pre['clips']} clips ({pre['clip']}), "
            f"{pre['workers']} workers, {pre['machine']}, {pre['date']}, load {pre['load_avg']:.1f}: the first check "
            f"{pre['first_check_s']:.1f} s ({pre['clips_per_s_first']} clips/s, {per_clip:.2f} s a clip on one "
            f"worker); a restart, answered from its cache, {pre['restart_s']:.1f} s. {pre['usable']} of "
            f"{pre['clips']} usable.", ""]


def render_cli_start(res: dict) -> list[str]:
    """Section 9: how long each command takes to answer --help, a config error and the dry run's first
    line (bench/results/cli_start.json, written by bench/bench_cli_start.py), each tree measured."""
    runs = {label: {(r["command"], r["case"]): r for r in run["rows"]} for label, run in res.items()}
    labels = list(runs)
    lines = ["## 9. Command start-up (bench/bench_cli_start.py)", "",
             "Seconds from starting `python <command> ...` from the checkout to its answer (the process's exit; "
             "for the dry run its first line), median of the repeats (min in brackets). A config error is a YAML "
             "with two unknown keys in two sections.", ""]
    lines += [f"- {label}: commit {run['commit']}, {run['date']}, {run['repeats']} repeats, load "
              f"{run['load_avg'][0]:.1f} -> {run['load_avg'][1]:.1f} ({run['machine']}, Python {run['python']})"
              for label, run in res.items()]
    lines += ["", "| command | case | " + " | ".join(f"{lb} (s)" for lb in labels) + " | "
              + " | ".join(f"{lb} said" for lb in labels) + " |", "|---|---|" + "---|" * 2 * len(labels)]

    def said(row: dict | None) -> str:
        """The answer's first line (a traceback's last), and how many lines it took."""
        if row is None:
            return "-"
        text = row["last"] if row["said"].startswith("Traceback") or "last" not in row else row["said"]
        more = f" (+{row['lines'] - 1} lines)" if row.get("lines", 1) > 1 and not row["said"].startswith("usage") else ""
        return ("traceback: " if row["said"].startswith("Traceback") else "") + text[:80].replace("|", "/") + more

    for key in dict.fromkeys(k for r in runs.values() for k in r):
        cells = [f"{runs[lb][key]['median_s']:.2f} ({runs[lb][key]['min_s']:.2f})" if key in runs[lb] else "-"
                 for lb in labels]
        lines.append(f"| `{key[0]}` | {key[1]} | " + " | ".join(cells) + " | "
                     + " | ".join(said(runs[lb].get(key)) for lb in labels) + " |")
    return lines + [""]


def render(bench_dir: Path = BENCH_DIR) -> Path:
    # this benchmark's sections only (steps*, data): results/ also holds other tools' files
    # (smoke_real.json from bench/smoke_real.py, gpu.json from bench/gpu_check.py)
    results = {p.stem: json.loads(p.read_text()) for p in sorted((bench_dir / "results").glob("*.json"))
               if p.stem == "data" or p.stem.startswith("steps")}
    any_res = next(iter(results.values()), None)
    lines = ["# Benchmarks", "",
             "Written by `make bench` (`python bench/bench.py`); do not edit by hand, rerun it. Raw numbers: "
             "`bench/results/*.json`. Times are ms, median (min-max) over repeats; absolute times depend on the "
             "machine and on its load (the 1-minute load average before -> after each run is given), the ratios "
             "are what compare across machines.", ""]
    if any_res:
        m = any_res["machine"]
        v = ", ".join(f"{k} {x}" for k, x in m["versions"].items() if x)
        lines += [f"- Machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}), "
                  f"GPU: {m['gpu'] or 'none'}", f"- Versions: Python {m['python']}, {v}",
                  "- Date: " + ", ".join(f"{k} {r['machine']['date_utc']}"
                                         + (f" (took {r['section_wall_s']:.0f} s)" if "section_wall_s" in r else "")
                                         + (" (--quick: too few repeats to trust)" if r.get("quick") else "")
                                         for k, r in results.items()),
                  f"- Load: the 1-minute load average of this {m['cores']}-core machine was "
                  f"{min(_loads(results)):.2f} to {max(_loads(results)):.2f} while these ran (each table gives "
                  f"its own). A load above {m['cores']} means other processes competed for the cores: times are "
                  f"inflated, ratios measured interleaved less so.",
                  ""]
    steps = results.get("steps")
    lines += render_summary(steps, results.get("data"))
    if steps:
        lines += render_steps(steps, "") + render_overhead(steps, "")
    if "data" in results:
        lines += render_data(results["data"])
    lines += render_memory(steps, results.get("data"), "")
    model = results.get("steps_model")
    lines += ["## 5. Real model (`--model PATH`, GPU)", ""]
    if model:
        lines += render_steps(model, " (real model)") + render_overhead(model, " (real model)")
        lines += render_memory(model, None, " (real model)")
    else:
        lines += ["Not run here (no GPU on this machine). On a GPU machine with a Wan2.1 diffusers folder:", "",
                  "    python bench/bench.py --model /path/to/Wan2.1-I2V-14B-480P-Diffusers [--set data.num_frames=33] "
                  "[--overhead-rounds 0]", "",
                  "runs sections 1, 2 and 4 for that model (81 x 480 x 832, batch 1, bf16, gradient checkpointing on, "
                  "on the 720p bench clips) "
                  "into bench/results/steps_model.json, with torch.cuda.max_memory_allocated per configuration. "
                  "Section 2 keeps a second copy of the transformer for the bare loop: use --overhead-rounds 0 for "
                  "a model that does not fit twice.", ""]
    if (bench_dir / "results" / "prepare.json").exists():  # bench/bench_prepare.py's
        lines += render_prepare(json.loads((bench_dir / "results" / "prepare.json").read_text()))
    if (bench_dir / "results" / "measured.json").exists():  # kept by hand: the figures code comments cite
        lines += render_measured(json.loads((bench_dir / "results" / "measured.json").read_text()))
    if (bench_dir / "results" / "preflight.json").exists():  # bench/bench_preflight.py's
        lines += render_preflight(json.loads((bench_dir / "results" / "preflight.json").read_text()))
    if (bench_dir / "results" / "cli_start.json").exists():  # bench/bench_cli_start.py's
        lines += render_cli_start(json.loads((bench_dir / "results" / "cli_start.json").read_text()))
    if (bench_dir / "results" / "compile.json").exists():  # bench.py --sections compile
        from bench.benchlib.compile import render_compile

        lines += render_compile(json.loads((bench_dir / "results" / "compile.json").read_text()))
    if (bench_dir / "results" / "causal.json").exists():  # bench/bench_causal.py's
        from bench.bench_causal import render_causal

        lines += render_causal(json.loads((bench_dir / "results" / "causal.json").read_text()))
    path = bench_dir / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path
