"""The GPU check's report: bench/RESULTS_GPU.md and bench/results/gpu.json, rewritten after every section."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpulib.causal_section import render_causal_step
from bench.gpulib.fp8_section import ESTIMATE_RTOL
from bench.gpulib.sections import CONFIGS_24GB, R2V_RUNS, SECTIONS, STEP_PHASES, WAN22_RUNS
from bench.gpulib.speed_section import render_speed


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ok(r: dict) -> str:
    if "skipped" in r:
        return "skipped"
    if not r.get("passed"):
        return "FAILED"
    return "INCOMPLETE" if r.get("skipped_checks") else "ok"


def render(result: dict) -> str:
    """bench/RESULTS_GPU.md from a result dict (the one gpu.json holds)."""
    lines = [f"# GPU check: {result['device']}", "",
             f"`python bench/gpu_check.py{result.get('argv', '')}` on {result['device']}, {result['date_utc']}: "
             f"{result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget. "
             f"Overall: {result.get('verdict', 'PASSED' if result.get('passed') else 'FAILED')}"
             f"{' (so far)' if not result.get('finished') else ''}.", ""]
    skipped = [f"{n} ({r['skipped']})" for n, r in result["sections"].items() if "skipped" in r]
    skipped += [f"{n}: {c}" for n, r in result["sections"].items() for c in r.get("skipped_checks", [])]
    if skipped:
        lines += ["Not run, so not shown to work: " + "; ".join(skipped) + ".", ""]
    if not result.get("cuda"):
        lines += ["**CPU at tiny sizes (--allow-cpu): checks the tool's code paths; no figure here is a GPU's.**", ""]
    lines += ["| section | result | wall s |", "|---|---|---|"]
    for s in SECTIONS:
        r = result["sections"].get(s.name)
        if r is not None:
            lines.append(f"| {s.name} | {_ok(r)}{': ' + r['skipped'] if 'skipped' in r else ''} | {_f(r.get('wall_s'), '{:.0f}')} |")
    lines.append("")
    for s in SECTIONS:
        r = result["sections"].get(s.name)
        if r is None or "skipped" in r:
            continue
        lines += [f"## {s.name}: {s.title}", ""]
        if "error" in r and not r.get("passed"):
            lines += ["```", str(r["error"])[-1500:], "```", ""]
        lines += RENDERERS.get(s.name, lambda r: [])(r)
        lines += [f"- skipped check: {c}" for c in r.get("skipped_checks", [])] + [""]
    return "\n".join(lines)


def _render_environment(r: dict) -> list[str]:
    v = r.get("versions", {})
    problems = r.get("import_problems") or {}
    missing = ([f"- **cannot import {k}**: {x}" for k, x in problems.items()]
               + ["- install the carried wheels: `make gpu-check WHEELS=folder` (docs/gpu.md)"] if problems else [])
    source = [f"- installed from {r['installed_from']} before the check"] if r.get("installed_from") else []
    return missing + source + [f"- device: {r.get('device')} ({_f(r.get('memory_gib'), '{:.1f}')} GiB, compute capability "
            f"{r.get('capability', '-')}), driver {r.get('driver', '-')}, CUDA {r.get('cuda')}",
            "- " + ", ".join(f"{k} {x}" for k, x in v.items()),
            f"- TORCH_CUDA_ARCH_LIST: {r.get('TORCH_CUDA_ARCH_LIST') or 'unset'}"
            + (f" ({r['arch_list_problem']})" if r.get("arch_list_problem") else ""),
            "- optimizer: " + "; ".join(f"{k}: {x}" for k, x in r.get("optimizer", {}).items())]


def _render_step(r: dict) -> list[str]:
    if "online" not in r:
        return []
    rows = ["| mode | step s | " + " | ".join(STEP_PHASES.values()) + " | max allocated GiB | estimate GiB |",
            "|---|---|" + "---|" * len(STEP_PHASES) + "---|---|"]
    for mode in ("online", "cached"):
        m = r[mode]
        rows.append(f"| {mode} | {m['step_s']:.2f} | " + " | ".join(_f(m["phases_s"].get(k)) for k in STEP_PHASES)
                    + f" | {_f(m['max_memory_allocated_gib'], '{:.1f}')} | {m['estimate_gib']:.1f} |")
    falls = "; ".join(f"{m} {r[m]['loss_falls']['losses']} ({'falls' if r[m]['loss_falls']['passed'] else 'DOES NOT FALL'})"
                      for m in ("online", "cached") if "loss_falls" in r[m])
    return rows + ["", f"Latents {r['online']['latent_shape']}; precompute {r['precompute_s']} s; online / cached "
                       f"{r['online_over_cached']}. Phases: medians over the timed steps (CUDA events on a GPU).",
                   "", f"Losses over every step (warmup, fixed timestep): {falls or '-'}"] + _step_speed(r)


def _step_speed(r: dict) -> list[str]:
    """The transformer's MFU in each mode (e2v/train/flops.py's count over the median step; the
    online step's time includes its encoders, which the count leaves out)."""
    modes = [m for m in ("online", "cached") if (r[m].get("speed") or {}).get("tokens_per_s")]
    if not modes:
        return []
    pct = lambda s: f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""  # noqa: E731
    return ["", "Speed (transformer FLOPs over the whole step): " + "; ".join(
        f"{m} {r[m]['speed']['tokens_per_s']:.0f} video tokens/s, {r[m]['speed']['tflops_per_gpu']:.1f} TFLOPS"
        f"{pct(r[m]['speed'])}" for m in modes) + "."]


def _render_vae(r: dict) -> list[str]:
    if "fp32" not in r:
        return []
    return [f"One {r['clip']} clip, latents {r['latent_shape']}: fp32 {r['fp32']['encode_s']:.2f} s, bf16 "
            f"{r['bf16']['encode_s']:.2f} s ({r['speedup']}x); relative latent error of bf16 "
            f"{r['relative_latent_error']:.2e}. Random weights: the error of the released VAE may differ."]


def _run_line(name: str, x: dict) -> str:
    return (f"| {name} | {_ok(x)} | {x.get('rc')} | {x.get('losses')} | {_f(x.get('step_time_after_first_s'))} | "
            f"{_f(x.get('max_memory_allocated_gib'))} |")


RUN_HEADER = ["| run | result | rc | losses | step s (after the first) | max allocated GiB |", "|---|---|---|---|---|---|"]


def _render_main(r: dict) -> list[str]:
    out = RUN_HEADER + [_run_line(k, r[k]) for k in ("first", "resumed") if k in r]
    s = r.get("sample", {})
    return out + ["", f"Partitioned at load: {'yes' if r.get('partitioned_load') else 'NO'}; resumed from step "
                      f"{r.get('resumed', {}).get('from_step')}; export: {', '.join(r.get('export_files', [])) or 'none'}; "
                      f"sample: {_ok(s) if s else '-'} (shape {s.get('shape')}, pixel std {s.get('pixel_std')}, "
                      f"mean frame-to-frame change {s.get('frame_to_frame_change')}, PSNR against the fp32 "
                      f"reference {s.get('psnr_db_vs_fp32')} dB)"]


def _render_24gb(r: dict) -> list[str]:
    out = ["| config | result | estimate GiB | max allocated GiB | max reserved GiB | exceeds by GiB | step s |",
           "|---|---|---|---|---|---|---|"]
    for name in CONFIGS_24GB:
        x = r.get(name)
        if x:
            run = x.get("run", {})
            est = x["estimate"]["gpu_total_gib"]
            est40 = f" (40 layers: {x['estimate_40_layers']['gpu_total_gib']:.1f})" if "estimate_40_layers" in x else ""
            out.append(f"| {name} | {_ok(x)} | {est:.1f}{est40} | {_f(run.get('max_memory_allocated_gib'))} | "
                       f"{_f(run.get('max_memory_reserved_gib'))} | {_exceeds(x)} | "
                       f"{_f(run.get('step_time_after_first_s'))} |")
    return out + ["", f"Each under torch.cuda.set_per_process_memory_fraction = {r.get('limit_gib')} GiB of the card."]


def _exceeds(x: dict) -> str:
    return f"{_f(x.get('exceeds_by_gib'))}{' (refused ' + _f(x.get('refused_gib')) + ')' if x.get('oom') else ''}"


def _render_validation(r: dict) -> list[str]:
    run, est = r.get("run", {}), r.get("estimate", {})
    out = RUN_HEADER + ([_run_line("validation_24gb", run)] if run else [])
    if "precompute" in r and r["precompute"].get("rc"):
        out += ["", f"The precompute failed (rc {r['precompute']['rc']}): nothing was trained."]
    size = (f"{r['frames']} frames at {' x '.join(map(str, r['resolution']))}"
            + ("" if r.get("real_size") else " (tiny sizes, not the training shape)")) if "frames" in r else "-"
    return out + ["", f"Validated at steps {r.get('validated_steps', '-')} (losses {run.get('val_loss', '-')}); "
                      f"video written: {'yes' if r.get('video_written') else 'NO'}; {size}. Estimate "
                      f"{_f(est.get('gpu_total_gib'), '{:.1f}')} GiB training, {_f(est.get('validation_gib'), '{:.1f}')} "
                      f"GiB the validation phase; max reserved {_f(run.get('max_memory_reserved_gib'))} GiB; exceeds by "
                      f"{_exceeds(r)} GiB; under torch.cuda.set_per_process_memory_fraction = {r.get('limit_gib')} GiB."]


def _render_fp8(r: dict) -> list[str]:
    ratios = r.get("measured_to_estimate", {})
    out = ["| phase | peak allocated GiB | estimate GiB | peak / estimate |", "|---|---|---|---|"]
    out += [f"| {k} | {_f(r.get(f'peak_{k}_gib'))} | {_f(r.get(f'estimate_{k}_gib'))} | {_f(ratios.get(k), '{:.3f}')} |"
            for k in ("train", "validation")]
    oom = [f"Out of memory under the cap: {r['oom']}"] if r.get("oom") else []
    peaks = f" Peaks: {r['peaks']}." if "peaks" in r else ""
    return out + ["", f"{r.get('layers')} blocks at the I2V-14B widths, their fp8 weights on the host "
                      f"({_f(r.get('fp8_on_host_gib'))} GiB), built in {_f(r.get('build_s'), '{:.1f}')} s; loss "
                      f"{_f(r.get('loss'), '{:.4f}')}. Passed when each peak is within {ESTIMATE_RTOL:.0%} of "
                      f"e2v.train.memory's estimate.{peaks}"] + oom


def _render_offload(r: dict) -> list[str]:
    out = RUN_HEADER + [_run_line(f"offload {k}", r[k]) for k in ("off", "on") if k in r]
    peak = (f"; offload saves {_f(r['peak_saved_gib'])} GiB of peak allocation" if "peak_saved_gib" in r else "")
    return out + ["", f"{r.get('frames')} frames; losses equal within tolerance: "
                      f"{'yes' if r.get('losses', {}).get('passed') else 'NO'}{peak}"]


def _render_wan22(r: dict, runs: dict = WAN22_RUNS) -> list[str]:
    out = ["| preset | result | losses | validation loss |", "|---|---|---|---|"]
    return out + [f"| {n} | {_ok(r[n])} | {r[n].get('losses')} | {r[n].get('val_loss')} |" for n in runs if n in r]


def _render_attention(r: dict) -> list[str]:
    if "backend" not in r:
        return []
    return [f"Backend torch dispatched to: **{r['backend']}** (" + (", ".join(f"`{k}`" for k in r.get("sdpa_ops", []))
            or "no SDPA op") + "); SDPA flags: " + ", ".join(f"{k} {v}" for k, v in r["sdp_flags"].items()),
            "", "Device kernels under it: " + (", ".join(f"`{k}`" for k in r["attention_kernels"]) or "none")]


def _render_offload_adam(r: dict) -> list[str]:
    if "optimizer" not in r:
        return []
    return [f"{r['optimizer']} (fused: {r['fused']}) on a {r['partition_device']} partition of {r['partition_numel']} "
            f"values (pinned: {r['pinned']}); losses {[round(x, 4) for x in r['losses']]}; largest difference from "
            f"torch's reference AdamW per step {r['max_abs_diff']} (tolerance {r['atol']})"]


RENDERERS = {"environment": _render_environment, "step_1.3b": _render_step, "vae_dtype": _render_vae,
             "main_path": _render_main, "gpu_24gb": _render_24gb, "validation_24gb": _render_validation,
             "fp8_14b": _render_fp8, "activation_offload": _render_offload,
             "wan22": _render_wan22, "r2v": lambda r: _render_wan22(r, R2V_RUNS), "attention": _render_attention,
             "offload_adam": _render_offload_adam, "speed": render_speed, "causal_step": render_causal_step}


def write_report(result: dict, out_dir: Path) -> tuple[Path, Path]:
    md, js = out_dir / "RESULTS_GPU.md", out_dir / "results" / "gpu.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(render(result) + "\n")
    return md, js
