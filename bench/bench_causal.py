"""What the causal task costs against the bidirectional one, measured on the CPU (docs/causal.md,
"Memory and speed"): the attention alone, then a whole transformer's forward and backward.

    python bench/bench_causal.py            # -> bench/results/causal.json + a table

attention: one self-attention of the 1.3B's heads (12 x 128) over 21 latent frames in 7 blocks of 3
(CausVid's 81-frame layout) at 120 tokens a frame (2,520 tokens: a CPU-sized clip; at 480 x 832
it is 1,560 a frame), fp32, forward and backward, each way:
  full        SDPA without a mask: the bidirectional task's attention
  blocks      e2v.models.causal.blocks_attention, one SDPA call per block (the CPU's training path)
  dense_mask  SDPA with an L x L boolean mask of the same rule: what e2v never builds
  flex_eager  FlexAttention under e2v's BlockMask, forward only (no CPU backward; it materializes
              the scores without torch.compile, so it is the inference-only path here)
  per mode: the median time over the repeats, the bytes autograd keeps for backward (exact and
  load-independent), and the largest difference from the dense mask's output (the oracle).

step: one transformer layer of the 1.3B's width (12 heads x 128, FFN 8960; the tiny preset's 32-wide
text) at 81 x 128 x 128 (21 x 8 x 8 = 1,344 video tokens), batch 1, fp32, without gradient
checkpointing (with it, a layer keeps its inputs only, which this hook does not see): bidirectional (one timestep) against block-causal (blocks path, a timestep per
frame: diffusers' per-token time embedding, whose modulation tensors are then [B, L, D] instead of
[B, 1, D]), forward + backward of mean(prediction^2): the median time and the bytes kept for
backward, per video token (they grow linearly with the tokens: no attention state is L x L), and
those bytes scaled to the 1.3B at 480 x 832 x 81 (32,760 tokens, 30 layers; fp32 here, about half
in bf16).

The FLOP share of the block-causal attention is sum_b (block b's queries x keys 0..b) / L^2
= 28 / 49 = 0.571 for 7 equal blocks; the time share follows it where attention dominates.
One thread (torch.set_num_threads(1)), so another job on the machine moves the times less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, HEAD_DIM = 12, 128  # Wan2.1-T2V-1.3B
FRAMES, PER_BLOCK, TOKENS_PER_FRAME = 21, 3, 120
STEP_MODEL = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=8960, num_layers=1, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
REAL_TOKENS, REAL_LAYERS = 32760, 30  # Wan2.1-T2V-1.3B at 480 x 832 x 81
STEP_CLIP = (21, 16, 16)  # latent frames, h, w: 81 x 128 x 128
REPEATS = 3


def _saved_bytes(fn, leave_out=()) -> tuple[object, int]:
    """fn()'s result and the bytes of the storages autograd saved for backward while it ran, but
    those of the tensors in `leave_out` (the parameters)."""
    import torch

    storages, left = {}, {x.untyped_storage().data_ptr() for x in leave_out}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return out, sum(v for k, v in storages.items() if k not in left)


def _timed(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention() -> dict:
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from e2v.models.causal import block_spans, blocks_attention, build_block_mask, flex_block_attention, token_ends

    n = TOKENS_PER_FRAME
    spans = [(a * n, b * n) for a, b in block_spans(FRAMES, PER_BLOCK, False)]
    length = FRAMES * n
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, length, HEADS, HEAD_DIM, generator=g) for _ in range(3))  # [B, L, H, D]
    ends = token_ends(spans, "cpu")
    dense_LL = torch.arange(length)[None, :] < ends[:, None]
    mask = build_block_mask(spans, "cpu")

    def bhld(x):
        return x.transpose(1, 2)

    ways = {
        "full": lambda q, k, v: bhld(sdpa(bhld(q), bhld(k), bhld(v))),
        "blocks": lambda q, k, v: blocks_attention(q, k, v, spans),
        "dense_mask": lambda q, k, v: bhld(sdpa(bhld(q), bhld(k), bhld(v), attn_mask=dense_LL)),
    }
    with torch.no_grad():
        oracle = ways["dense_mask"](q, k, v)
    out = {"tokens": length, "heads": HEADS, "head_dim": HEAD_DIM, "blocks": len(spans),
           "flop_share": sum((b - a) * b for a, b in spans) / length**2, "dense_mask_bytes": dense_LL.numel(),
           "dense_mask_bytes_at_32760": 32760**2, "modes": {}}
    for name, fn in ways.items():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

        def step():
            o = fn(*leaves)
            o.square().mean().backward()

        result, saved = _saved_bytes(lambda: fn(*leaves))
        row = {"fwd_bwd_s": round(_timed(step), 4), "forward_s": round(_timed(lambda: fn(q, k, v)), 4),
               "saved_mb": round(saved / 2**20, 1)}
        if name == "blocks":  # dense_mask is the oracle itself
            row["max_diff_from_dense"] = float((result.detach() - oracle).abs().max())
        out["modes"][name] = row
    with torch.no_grad():
        flex = flex_block_attention(q, k, v, mask)
        out["modes"]["flex_eager"] = {"forward_s": round(_timed(lambda: flex_block_attention(q, k, v, mask)), 4),
                                      "max_diff_from_dense": float((flex - oracle).abs().max())}
    full = out["modes"]["full"]
    for row in out["modes"].values():
        row["forward_over_full"] = round(row["forward_s"] / full["forward_s"], 3)
        if "fwd_bwd_s" in row:
            row["fwd_bwd_over_full"] = round(row["fwd_bwd_s"] / full["fwd_bwd_s"], 3)
    return out


def step() -> dict:
    import torch
    from diffusers import WanTransformer3DModel

    from e2v.models.causal import enable_causal, frame_timesteps

    t, h, w = STEP_CLIP
    tokens = t * h * w // 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, t, h, w, generator=g)
    text = torch.randn(1, 512, 32, generator=g)
    out = {"latents": [t, h, w], "tokens": tokens, "modes": {}}
    for task in ("bidirectional", "causal_blocks"):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**STEP_MODEL).requires_grad_(True)
        if task == "bidirectional":
            timestep = torch.tensor([500.0])
        else:
            enable_causal(model, PER_BLOCK, False, "blocks")
            listed = torch.tensor([[1000.0, 757.0, 522.0, 0.0, 757.0, 522.0, 1000.0]])
            timestep = frame_timesteps(listed.repeat_interleave(PER_BLOCK, 1), h * w // 4)

        def forward():
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

        def train_step():
            forward().square().mean().backward()
            model.zero_grad(set_to_none=True)

        pred, activations = _saved_bytes(forward, list(model.parameters()))
        del pred
        out["modes"][task] = {
            "fwd_bwd_s": round(_timed(train_step, 2), 3), "saved_mb": round(activations / 2**20, 1),
            "saved_kb_per_token": round(activations / tokens / 2**10, 2),
            "saved_gb_at_real_shape": round(activations / tokens * REAL_TOKENS * REAL_LAYERS / 2**30, 1)}
    bi = out["modes"]["bidirectional"]
    for row in out["modes"].values():
        row["time_over_bidirectional"] = round(row["fwd_bwd_s"] / bi["fwd_bwd_s"], 3)
        row["saved_over_bidirectional"] = round(row["saved_mb"] / bi["saved_mb"], 3)
    return out


def render_causal(r: dict) -> list[str]:
    """Section 11 of bench/RESULTS.md from bench/results/causal.json."""
    a, s, m = r["attention"], r["step"], r["machine"]
    lines = ["## 11. The causal task's cost against the bidirectional (bench/bench_causal.py, CPU)", "",
             f"{m['date_utc']}, {m['cpu']}, {m['cores']} cores, one torch thread, torch {m['versions']['torch']}"
             + (f"; {m['note']}" if m.get("note") else "") + ".", "",
             f"Self-attention of the 1.3B's heads ({a['heads']} x {a['head_dim']}) over {a['tokens']} tokens in "
             f"{a['blocks']} blocks, fp32 (the block-causal FLOP share {a['flop_share']:.3f}); the dense mask is the "
             f"oracle (an L x L bool: {a['dense_mask_bytes'] / 2**20:.1f} MiB here, "
             f"{a['dense_mask_bytes_at_32760'] / 2**30:.2f} GiB at 32,760 tokens).", "",
             "| attention | forward s | forward + backward s | x full (fwd, fwd+bwd) | saved for backward MB "
             "| max abs diff from the dense mask |", "|---|---|---|---|---|---|"]
    for name, row in a["modes"].items():
        diff = f"{row['max_diff_from_dense']:.1e}" if "max_diff_from_dense" in row else "-"
        lines.append(f"| {name} | {row['forward_s']} | {row.get('fwd_bwd_s', '- (no CPU backward)')} | "
                     f"{row['forward_over_full']}, {row.get('fwd_bwd_over_full', '-')} | {row.get('saved_mb', '-')} "
                     f"| {diff} |")
    lines += ["", f"One transformer layer of the 1.3B's width at {s['tokens']} video tokens "
              f"({' x '.join(map(str, s['latents']))} latents), fp32, no gradient checkpointing:", "",
              "| task | forward + backward s | x bidirectional | saved for backward MB | KB a token | x bidirectional "
              "| at 32,760 tokens x 30 layers, GB (fp32) |", "|---|---|---|---|---|---|---|"]
    for name, row in s["modes"].items():
        lines.append(f"| {name} | {row['fwd_bwd_s']} | {row['time_over_bidirectional']} | {row['saved_mb']} | "
                     f"{row['saved_kb_per_token']} | {row['saved_over_bidirectional']} | {row['saved_gb_at_real_shape']} |")
    return lines + [""]


def main(argv=None) -> dict:
    import torch

    from bench.bench import machine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "causal.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"machine": machine(), "attention": attention(), "step": step()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    a = result["attention"]
    print(f"attention: {a['tokens']} tokens, {a['heads']} x {a['head_dim']}, {a['blocks']} blocks "
          f"(FLOP share {a['flop_share']:.3f})")
    print("mode         forward s  fwd+bwd s  saved MB  / full (fwd, fwd+bwd)  max |diff| from dense mask")
    for name, r in a["modes"].items():
        diff = (f"{r['max_diff_from_dense']:.2e}" if "max_diff_from_dense" in r
                else "(the oracle)" if name == "dense_mask" else "(no mask)")
        print(f"{name:<12} {r['forward_s']:9.4f}  {r.get('fwd_bwd_s', float('nan')):9.4f}  "
              f"{r.get('saved_mb', float('nan')):8.1f}  {r['forward_over_full']:5.3f} "
              f"{r.get('fwd_bwd_over_full', float('nan')):5.3f}   {diff}")
    s = result["step"]
    print(f"step: one layer of the 1.3B's width at {s['latents']} latents ({s['tokens']} tokens), fp32")
    for name, r in s["modes"].items():
        print(f"{name:<28} fwd+bwd {r['fwd_bwd_s']:.3f} s ({r['time_over_bidirectional']:.3f}x)  saved "
              f"{r['saved_mb']:.1f} MB ({r['saved_over_bidirectional']:.3f}x), {r['saved_kb_per_token']:.1f} KB a "
              f"token: {r['saved_gb_at_real_shape']:.1f} GB at 32,760 tokens x 30 layers")
    print(f"-> {args.out}")
    return result


if __name__ == "__main__":
    main()
