"""Per-rank activation memory under context parallelism, measured on CPU: one clip through one
transformer at Ulysses degree 1 (no context parallelism), Ulysses 2 and ring 2, fp32, gloo.

    python bench/bench_context_parallel.py           # -> bench/results/context_parallel.json + a table

Per rank and configuration, with and without gradient checkpointing:
  saved_mb     what autograd keeps for backward at the end of the forward (storage-deduplicated,
               parameters left out): the activation memory, exact and load-independent; the same
               measure tests/unit/test_estimate_memory.py fits the formula to
  estimate_mb  e2v.models.plan.activation_bytes for the same shapes (the forward's part: with
               checkpointing the recomputed block lives only during backward)
  exchange_mb  e2v.models.plan.exchange_bytes: the exchange's transient buffers (not in saved_mb)
  peak_rss_mb  the process's RSS peak during forward + backward above its RSS before (sampled
               every 2 ms; the allocator's caching included, so noisier)
Each configuration runs in fresh processes (torch.multiprocessing spawn, one per rank).

The model is the bench's "small" transformer (2 heads x 128, FFN 1024, 4 layers; bench/benchlib/common.py)
with the tiny preset's 32-wide text and image inputs, and the clip is 33 x 256 x 256 (9 x 16 x 16 =
2,304 video tokens), so the activations dominate what a rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/ is the maintainers' harness, not part of the installed package: `python bench/<script>.py`
# finds its sibling modules (bench.*) from the checkout's root.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from e2v.runtime.ports import free_port  # noqa: E402

MODEL = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=36, out_channels=16,
             text_dim=32, freq_dim=256, ffn_dim=1024, num_layers=4, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, image_dim=32, added_kv_proj_dim=256)
CLIP = dict(frames=33, size=256, references=1)  # latents 9 x 32 x 32 -> 2,304 tokens; 512 + 17 context tokens
CONFIGS = [(1, 1), (2, 1), (1, 2)]  # (ulysses, ring)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def measure(rank: int, world: int, port: int, ulysses: int, ring: int, checkpointing: bool, out: str) -> None:
    """One rank of one configuration: its saved bytes and its RSS peak over one forward + backward."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    from diffusers import WanTransformer3DModel

    from e2v.config.load import load_config
    from e2v.models import context_parallel
    from e2v.runtime.distributed import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**MODEL).requires_grad_(True)
    if checkpointing:
        model.enable_gradient_checkpointing()
    if ulysses * ring > 1:
        cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"parallel.ulysses_degree={ulysses}",
                                                            f"parallel.ring_degree={ring}"], check_paths=False)
        context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, world))
    g = torch.Generator().manual_seed(0)
    t = (CLIP["frames"] - 1) // 4 + 1
    inputs = dict(hidden_states=torch.randn(1, 36, t, CLIP["size"] // 8, CLIP["size"] // 8, generator=g),
                  timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                  encoder_hidden_states_image=torch.randn(1, 17 * CLIP["references"], 32, generator=g),
                  return_dict=False)
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    peak, done = [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    torch.distributed.barrier()
    before = _rss_mb()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        pred = model(**inputs)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(v for k, v in storages.items() if k not in params)
    pred.square().mean().backward()
    done.set()
    sampler.join()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"saved_mb": saved / 2**20, "peak_rss_mb": max(peak[0], _rss_mb()) - before}))
    torch.distributed.destroy_process_group()


def estimate_mb(ulysses: int, ring: int, checkpointing: bool) -> tuple[float, float]:
    """(saved for backward, exchange buffers) in MB by e2v.models.plan's formulas."""
    from e2v.models.plan import ModelShape, activation_bytes, activation_terms, exchange_bytes

    shape = ModelShape(MODEL["num_attention_heads"] * MODEL["attention_head_dim"], MODEL["ffn_dim"], MODEL["num_layers"])
    t = (CLIP["frames"] - 1) // 4 + 1
    s, ctx = t * (CLIP["size"] // 16) ** 2, 512 + 17 * CLIP["references"]
    cp = ulysses * ring
    gpu, _ = activation_bytes(s, ctx, shape, 1, 4, checkpointing, cp=cp)
    if checkpointing:  # the recomputed block exists only in backward: not in the forward's saved bytes
        gpu -= 4 * activation_terms(s, ctx, shape, cp)[0]
    return gpu / 2**20, exchange_bytes(s, shape, 1, 4, ulysses, ring) / 2**20


def main(argv=None) -> dict:
    import torch.multiprocessing as mp

    from bench.bench import machine
    from bench.benchlib.common import load1

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "context_parallel.json"))
    args = p.parse_args(argv)
    t0, load_before = time.time(), load1()
    rows = []
    for ulysses, ring in CONFIGS:
        for ckpt in (False, True):
            world = ulysses * ring
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(measure, args=(world, free_port(), ulysses, ring, ckpt, tmp), nprocs=world,
                                   start_method="spawn")
                ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
            est, exchange = estimate_mb(ulysses, ring, ckpt)
            rows.append({"ulysses": ulysses, "ring": ring, "gradient_checkpointing": ckpt,
                         "estimate_mb": round(est, 2), "exchange_mb": round(exchange, 2),
                         "ranks": [{k: round(v, 2) for k, v in r.items()} for r in ranks]})
    t = (CLIP["frames"] - 1) // 4 + 1
    result = {"machine": machine(), "model": {k: v for k, v in MODEL.items() if k != "patch_size"}, "clip": CLIP,
              "video_tokens": t * (CLIP["size"] // 16) ** 2, "dtype": "fp32", "rows": rows,
              "load": [load_before, load1()], "section_wall_s": round(time.time() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{result['video_tokens']} video tokens, {MODEL['num_layers']} layers x {MODEL['num_attention_heads']} heads "
          f"x {MODEL['attention_head_dim']}, fp32; MB per rank (saved for backward, its estimate, the exchange's "
          "buffers by estimate, RSS peak over forward + backward)")
    print(f"  {'ulysses':>7} {'ring':>4} {'ckpt':>5} {'saved':>16} {'estimate':>9} {'exchange':>9} {'RSS peak':>17}")
    for r in rows:
        saved = " / ".join(f"{x['saved_mb']:.1f}" for x in r["ranks"])
        rss = " / ".join(f"{x['peak_rss_mb']:.1f}" for x in r["ranks"])
        print(f"  {r['ulysses']:>7} {r['ring']:>4} {str(r['gradient_checkpointing'])[0]:>5} {saved:>16} "
              f"{r['estimate_mb']:>9.1f} {r['exchange_mb']:>9.1f} {rss:>17}")
    print(f"-> {args.out}")
    return result


if __name__ == "__main__":
    main()
