"""The gpu-check section causal_step: the causal task's training step (docs/causal.md) against the
bidirectional one on Wan2.1-T2V-1.3B's real shape (random weights, 480 x 832 x 81: latents
16 x 21 x 60 x 104, 32,760 tokens, 7 blocks of configs/causal_regression.yaml's 3 frames), the whole
transformer trained in bf16 with gradient checkpointing, as that config trains it. Each mode runs
the training loop's own micro-step (e2v.train.loop.micro_step) on the same model: bidirectional
(one timestep a sample, full attention), then the block-causal model (enable_causal) with its
attention by compiled FlexAttention and by one SDPA call per block. Per mode: the median step time
over the timed steps after a warm-up (flex compiles there), its forward and backward (the loop's
phase hook), and the peak
allocation (torch.cuda.max_memory_allocated; the weights and their gradients, the same in every
mode, included). The two causal paths draw the same timesteps and noise from the same seed, so
their losses must agree: a compiled mask that drifts from the rule shows there. In process, no
DeepSpeed and no optimizer step: what the causal task changes is the transformer's forward and
backward; ZeRO and AdamW cost the same in both.

On the CPU (--allow-cpu) it runs the same code at tiny sizes, without flex (FlexAttention has no
CPU backward), and says that the timings and peaks at the real shape were not measured: the
section is then INCOMPLETE, never PASSED.

Legend: B batch, C channels, T latent frames, h/w latent size, L text tokens, D text width.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from bench.gpulib.common import GIB, ROOT, Ctx

CONFIG = "configs/causal_regression.yaml"  # the seed's CausVid regression: 1.3B, 480 x 832 x 81, blocks of 3
REAL_SHAPE = (81, 480, 832)  # frames, height, width
TINY_SHAPE = (21, 32, 32)  # --allow-cpu: 6 latent frames, two blocks of 3
TIMED_STEPS = {True: 3, False: 1}  # after one warm-up step, on CUDA / on the CPU
LOSS_RTOL = 2e-2  # flex against blocks: the same exact rule, bf16 sums in another order
MODES = {  # name -> attention path of the causal model (None: the bidirectional model)
    "bidirectional": None,
    "causal_flex": "flex",
    "causal_blocks": "blocks",
}


def _model(cfg, real: bool, device):
    """The transformer built on `device` (its default init: the rope tables must be computed, which a
    meta build's to_empty would leave as garbage), in the run's dtype with diffusers' fp32 modules
    kept, every parameter trained (CausVid trains the whole generator)."""
    import torch
    from diffusers import WanTransformer3DModel

    from e2v.models.plan import KNOWN_WAN_CONFIGS
    from e2v.models.precision import to_inference_dtype
    from e2v.models.tiny import tiny_transformer_config

    conf = KNOWN_WAN_CONFIGS[cfg.model.pretrained] if real else tiny_transformer_config("t2v")
    dtype = torch.bfloat16 if real else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel.from_config(conf)
    to_inference_dtype(model, device, dtype).train().requires_grad_(True)
    model.enable_gradient_checkpointing()
    return model, conf, dtype


def _conditions(conf: dict, shape: tuple[int, int, int], device, dtype):
    import torch

    from e2v.conditioning.encode import Conditions

    frames, height, width = shape
    g = torch.Generator(device="cpu").manual_seed(1)
    latents_BCTHW = torch.randn(1, conf["in_channels"], (frames - 1) // 4 + 1, height // 8, width // 8, generator=g)
    text_BLD = torch.randn(1, 512, conf["text_dim"], generator=g)
    return Conditions(latents_BCTHW=latents_BCTHW.to(device), text_BLD=text_BLD.to(device, dtype))


class _NoOptimizer:
    """What e2v.train.loop.micro_step calls as its engine: the model's call, backward, and a step
    that only drops the gradients (no optimizer: the same cost in both modes, and the weights stay
    as built, so every step sees the same model)."""

    def __init__(self, model):
        self.model = model

    def modules(self):  # as a DeepSpeed engine's: the model's (e2v.models.causal.reference_block walks them)
        return self.model.modules()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        for p in self.model.parameters():
            p.grad = None


PHASES = ("forward_and_loss", "backward")  # the loop's phases this section reports apart


def _time_mode(model, cfg, c, dtype, device, steps: int) -> dict:
    """One warm-up step, then `steps` timed ones, each the training loop's micro-step
    (e2v.train.loop.micro_step: the flow draw, forward and loss, backward), its forward and backward
    timed through the loop's phase hook (synchronized on CUDA). Every step draws from the same seed,
    so a mode's losses repeat and the causal paths see the same draw."""
    import contextlib

    import torch

    from e2v.train import loop

    cuda = device.type == "cuda"
    engine, times = _NoOptimizer(model), []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(name: str):
        sync()
        t0 = time.perf_counter()
        yield
        sync()
        if name in PHASES:
            times[-1][name] = times[-1].get(name, 0.0) + time.perf_counter() - t0

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(1 + steps):
        times.append({})
        record = loop.StepRecord()
        t0 = time.perf_counter()
        loop.micro_step(engine, c, cfg, record, step=1, dtype=dtype, gen=torch.Generator().manual_seed(0), phase=phase)
        sync()
        times[-1]["step"] = time.perf_counter() - t0
        losses.append(record.losses[-1])
    timed = times[1:]
    out = {"step_s": round(statistics.median(t["step"] for t in timed), 3), "first_step_s": round(times[0]["step"], 3),
           **{f"{k}_s": round(statistics.median(t[k] for t in timed), 3) for k in PHASES},
           "losses": [round(x, 5) for x in losses]}
    out["passed"] = all(math.isfinite(x) for x in losses)
    if cuda:
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    return out


def section_causal_step(ctx: Ctx) -> dict:
    import torch

    from e2v.config.load import load_config
    from e2v.models.causal import enable_causal

    causal_cfg = load_config(str(ROOT / CONFIG), check_paths=False)
    device = torch.device("cuda" if ctx.cuda else "cpu")
    shape = REAL_SHAPE if ctx.cuda else TINY_SHAPE
    t0 = time.monotonic()
    model, conf, dtype = _model(causal_cfg, ctx.cuda, device)
    c = _conditions(conf, shape, device, dtype)
    out = {"shape": list(shape), "latent_shape": list(c.latents_BCTHW.shape),
           "frames_per_block": causal_cfg.causal.frames_per_block, "build_s": round(time.monotonic() - t0, 1),
           "timed_steps": TIMED_STEPS[ctx.cuda], "modes": {}}
    for name, attention in MODES.items():
        if attention == "flex" and not ctx.cuda:
            continue  # no backward on the CPU: said in skipped_checks below
        cfg = causal_cfg if attention else dataclasses.replace(causal_cfg, task="bidirectional")
        if attention:
            c_ = causal_cfg.causal
            enable_causal(model, c_.frames_per_block, c_.independent_first_frame, attention)
        try:
            out["modes"][name] = _time_mode(model, cfg, c, dtype, device, TIMED_STEPS[ctx.cuda])
        except torch.OutOfMemoryError as e:
            out["modes"][name] = {"passed": False, "oom": str(e)[:300]}
    modes = out["modes"]
    bi = modes["bidirectional"].get("step_s")
    for name in modes:
        s = modes[name].get("step_s")
        modes[name]["over_bidirectional"] = round(s / bi, 3) if s and bi else None
    out["passed"] = all(m["passed"] for m in modes.values())
    if "causal_flex" in modes and modes["causal_flex"]["passed"] and modes["causal_blocks"]["passed"]:
        flex, blocks = modes["causal_flex"]["losses"][0], modes["causal_blocks"]["losses"][0]
        out["flex_blocks_rel_diff"] = abs(flex - blocks) / max(abs(blocks), 1e-12)
        out["passed"] &= out["flex_blocks_rel_diff"] <= LOSS_RTOL
    if not ctx.cuda:
        out["skipped_checks"] = ["the causal step's time and peak memory at 480 x 832 x 81 and the compiled flex "
                                 "path (no CUDA: the code path ran at tiny sizes, blocks only)"]
    return out


def render_causal_step(r: dict) -> list[str]:
    """The section's lines in bench/RESULTS_GPU.md."""
    from bench.gpulib.report import _f as f, _ok  # the report's formats (it imports this module)

    if "modes" not in r:
        return []
    rows = ["| mode | result | step s | forward s | backward s | x bidirectional | first step s | max allocated GiB "
            "| losses |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        rows.append(f"| {name} | {_ok(m)} | {f(m.get('step_s'), '{:.3f}')} | {f(m.get('forward_and_loss_s'), '{:.3f}')} | "
                    f"{f(m.get('backward_s'), '{:.3f}')} | "
                    f"{f(m.get('over_bidirectional'), '{:.2f}')} | {f(m.get('first_step_s'), '{:.1f}')} | "
                    f"{f(m.get('max_memory_allocated_gib'), '{:.2f}')} | "
                    f"{m.get('losses', m.get('oom', '-'))} |")
    agree = (f"; flex and blocks losses differ by {r['flex_blocks_rel_diff']:.2e} (relative; at most {LOSS_RTOL:g})"
             if "flex_blocks_rel_diff" in r else "")
    frames, height, width = r["shape"]
    return rows + ["", f"{frames} x {height} x {width} (latents {r['latent_shape']}), blocks of "
                       f"{r['frames_per_block']} frames; the loop's micro-step (draw, forward, x0 loss, backward) of the "
                       f"whole transformer with gradient checkpointing, no optimizer step; median of {r['timed_steps']} "
                       f"step(s) after a warm-up (flex compiles there); model built in {r['build_s']} s{agree}."]
