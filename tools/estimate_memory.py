"""Per-GPU memory of a training config: parameters, gradients, optimizer state and activations, for
each shipped ds_config (ZeRO stage, offload), with and without gradient checkpointing, and which
one fits the GPUs. Estimates, not measurements: see the formulas below.

    python tools/estimate_memory.py --config configs/e2v.yaml --gpus 1 --gpu-mem-gb 24
    python tools/estimate_memory.py --config configs/e2v.yaml --gpus 8 --gpu-mem-gb 80 --set data.num_frames=49
    python tools/estimate_memory.py --config configs/e2v_t2v_1.3b.yaml --cpu --procs 2   # CPU-only run

Model states follow DeepSpeed's own estimators (estimate_zero2/3_model_states_mem_needs; a test
checks they agree for a full fine-tune), extended to frozen weights, which hold only their 16-bit
copy (no gradient, no optimizer state). P_t trainable, P_f frozen parameters, G GPUs in total,
n per node, N nodes, L the largest layer (params of one module), bytes per 16-bit weight 2:
  zero2          params 2(P_t+P_f)            grads 6 P_t/G   optimizer 12 P_t/G
  zero2_offload  params 2(P_t+P_f)            grads, optimizer on CPU: P_t max(4G, 16) 1.5 per node
  zero3          params 4L + 2(P_t+P_f)/G     grads 4 P_t/G   optimizer 12 P_t/G
  zero3_offload  params 4L (the working layer) rest on CPU: (P_t max(4n, 18/N) + 2 P_f / N) 1.5 per node
(6 = 16-bit + fp32 gradient, 12 = fp32 master + Adam's two moments; 1.5 is DeepSpeed's buffer factor.)

Activations per GPU, B micro batch, S video tokens = T (H/16)(W/16), C context tokens
(512 text + 257 per CLIP element), D width, F FFN width, layers K, e bytes per element (2 in bf16),
P = parallel.ulysses_degree x ring_degree ranks sharing each sample's tokens (1 without context
parallelism; docs/context_parallel.md); the formula lives in e2v/models/plan.py, which the dry run shares:
  one block      A = (24.2 S D + 2 S F) / P + 4 C D      (+ 5.5 S D / P with per-token timesteps)
  outside blocks O = 2.3 S D / P + 3.4 C D + 267 S      (+ 11 S D / P with per-token timesteps)
(Per-token timesteps: the clean_prefix layout of Wan2.2 TI2V, whose S also counts the reference
frames in front of the clip.)
  no checkpointing              e B (K A + O)
  gradient checkpointing        e B (S D (K/P + 1 - 1/P) + O + A)   (block inputs kept, one block recomputed)
  + activation_offload          e B (O + A) on the GPU, the block inputs in pinned CPU RAM
The coefficients are fitted to the bytes autograd saves for backward in diffusers'
WanTransformer3DModel on CPU (fp32, torch SDPA; tests/test_estimate_memory.py measures tiny and
small models against the formula, within 20%, and tests/test_context_parallel.py a rank of a
Ulysses-2 group). On GPUs, flash attention saves the same O(S) tensors. With P > 1, plus the
exchange's transient buffers (e2v.models.plan.exchange_bytes): 2 S D / P for Ulysses' all-to-all, 2 S D / U
for ring attention's gathered keys and values, S x 64 for the gathered prediction; they are added
to the "bufs" column. Plus DeepSpeed's communication buffers, read from the ds_config: the gradient reduce
bucket and the all-gather (ZeRO-2) or prefetch (ZeRO-3) bucket, e bytes per element each
(5e8 elements in the shipped configs: 2 GB in bf16), and a fixed 2 GB per GPU for the CUDA
context, kernels' workspaces and fragmentation. Plus the frozen encoders an online run keeps on
every GPU (e2v.models.plan.encoder_bytes: UMT5-XXL in bf16 10.6 GiB, CLIP ViT-H 2.4 GiB and the VAE 0.5
GiB in fp32), none with cache.enabled.

`--cpu`: a run with no GPU (DeepSpeed's CPU accelerator), where everything is host memory, summed
over the --procs ranks on the node. Per rank, in training: the weights (ZeRO-3: a 1/G share plus
the gathered parameters it keeps live, up to stage3_max_live_parameters), gradients e P_t (ZeRO-2's 16-bit gradients) + 4 P_t/G (the fp32 partition),
optimizer 12 P_t/G (torch's AdamW, the CPU default: fp32 master + two moments), the activations as
above, the communication buckets as far as they fill (min(bucket, P_t) elements: an empty() bucket
never touched is not resident), the encoders, and RUNTIME_GB of interpreter, libraries and
allocator slack; plus LAUNCHER_GB for the launcher processes. At load the whole transformer is
read on every rank that does not partition at load (e P per rank, before any optimizer state), so
the peak is the larger of the load and the training figure. Checked against the peak PSS of the
process tree by bench/smoke_real.py (real shapes, 1 and 2 ranks). The figures assume that a freed
tensor's memory goes back to the OS, which e2v's processes arrange at start (e2v/runtime/hostmem.py); under
glibc's default malloc a process keeps the high-water mark of what it once held (the 1.3B ZeRO-3
smoke peaked at 1.39x this estimate that way).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path



from e2v.config.schema import Config
from e2v.config.load import load_config  # noqa: E402
from e2v.models.context_parallel import check_heads, layout  # noqa: E402
from e2v.models.expand import is_expanded  # noqa: E402
from e2v.models.plan import (activation_bytes, activation_terms, build_meta_transformer, checkpoint_bytes, encoder_bytes,  # noqa: E402,F401
    exchange_bytes, per_token_time, tokens)
from e2v.models.trainable import setup_training  # noqa: E402

GB = 2**30
OVERHEAD_GB = 2.0
SHIPPED = ["zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json"]
# Short names for the released Wan transformers (their configs: e2v.models.plan.KNOWN_WAN_CONFIGS).
RUNTIME_GB = 1.0  # per CPU rank: python, torch, diffusers, transformers, deepspeed, allocator slack
LAUNCHER_GB = 0.15  # the deepspeed runner and launch.py processes
KNOWN_MODELS = {"t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                "i2v-14b": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}


@dataclass
class ModelCounts:
    trainable: int
    frozen: int
    largest_layer: int
    width: int
    ffn: int
    layers: int


def count_model(cfg: Config) -> ModelCounts:
    """Exact counts of the transformer as training builds it (expansion, LoRA, train.trainable),
    on the meta device: no memory, nothing downloaded."""
    model = build_meta_transformer(cfg)
    check_heads(cfg, model.config.num_attention_heads)
    setup_training(model, cfg, expanded=is_expanded(cfg))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    c = model.config
    return ModelCounts(trainable, total - trainable, largest, c.num_attention_heads * c.attention_head_dim,
                       c.ffn_dim, c.num_layers)


def model_states(c: ModelCounts, ds_name: str, gpus_per_node: int, nodes: int, weight_bytes: int = 2) -> dict:
    """Bytes per GPU (params, grads, optimizer) and per node in CPU RAM, after DeepSpeed's estimators."""
    g = gpus_per_node * nodes
    pt, pf, big = c.trainable, c.frozen, c.largest_layer
    w = weight_bytes
    table = {
        "zero2.json": dict(params=w * (pt + pf), grads=6 * pt / g, optimizer=12 * pt / g,
                           cpu=pt * 4 * gpus_per_node * 1.5),
        "zero2_offload.json": dict(params=w * (pt + pf), grads=0, optimizer=0, cpu=pt * max(4 * g, 16) * 1.5),
        "zero3.json": dict(params=4 * big + w * (pt + pf) / g, grads=4 * pt / g, optimizer=12 * pt / g,
                           cpu=(pt + pf) * 4 * gpus_per_node * 1.5),
        "zero3_offload.json": dict(params=4 * big, grads=0, optimizer=0,
                                   cpu=(pt * max(4 * gpus_per_node, 18 / nodes) + w * pf / nodes) * 1.5),
    }
    return table[ds_name]


def buffer_bytes(ds_name: str, elem_bytes: int) -> float:
    """DeepSpeed's per-GPU communication buckets for a shipped ds_config (from its zero_optimization)."""
    z = json.loads((Path(__file__).resolve().parent.parent / "ds_configs" / ds_name).read_text())["zero_optimization"]
    gather = z.get("stage3_prefetch_bucket_size" if z["stage"] == 3 else "allgather_bucket_size", 5e8)
    return elem_bytes * (z.get("reduce_bucket_size", 5e8) + gather)


def estimate(cfg: Config, gpus: int, gpu_mem_gb: float, nodes: int = 1, counts: ModelCounts | None = None) -> dict:
    """`counts`: count_model(cfg) when the caller has it (it builds the model on the meta device)."""
    counts = counts or count_model(cfg)
    s, ctx = tokens(cfg)
    e = 2 if cfg.train.mixed_precision == "bf16" else 4
    lay = layout(cfg, 0, gpus * nodes)  # the GPUs must hold whole context-parallel groups
    u, r = lay.ulysses, lay.ring
    batch = cfg.train.micro_batch_size
    encoders = sum(encoder_bytes(cfg).values())  # resident on every GPU unless the cache replaces them
    rows = []
    for ds_name in SHIPPED:
        st = model_states(counts, ds_name, gpus, nodes, weight_bytes=e)
        for ckpt, off in ((False, False), (True, False), (True, True)):
            act_gpu, act_cpu = activation_bytes(s, ctx, counts, batch, e, ckpt, off, cp=u * r,
                                                per_token_time=per_token_time(cfg))
            buffers = buffer_bytes(ds_name, e) + exchange_bytes(s, counts, batch, e, u, r)
            gpu = st["params"] + st["grads"] + st["optimizer"] + act_gpu + buffers + encoders + OVERHEAD_GB * GB
            rows.append(dict(ds_config=ds_name, gradient_checkpointing=ckpt, activation_offload=off,
                             params_gb=st["params"] / GB, grads_gb=st["grads"] / GB, optimizer_gb=st["optimizer"] / GB,
                             activations_gb=act_gpu / GB, buffers_gb=buffers / GB, encoders_gb=encoders / GB,
                             gpu_total_gb=gpu / GB,
                             cpu_per_node_gb=(st["cpu"] + act_cpu * gpus) / GB, fits=gpu <= gpu_mem_gb * GB))
    configured = next(r for r in rows if r["ds_config"] == Path(cfg.deepspeed.config).name
                      and r["gradient_checkpointing"] == cfg.train.gradient_checkpointing
                      and r["activation_offload"] == (cfg.train.activation_offload and cfg.train.gradient_checkpointing))
    # Cheapest that fits: least offloading first (faster), checkpointing only when needed.
    best = next((r for r in rows if r["fits"]), None)
    stage = json.loads((Path(__file__).resolve().parent.parent / cfg.deepspeed.config).read_text())["zero_optimization"]["stage"]
    ckpt_bytes = checkpoint_bytes(counts.trainable, counts.frozen, e, stage)
    return dict(trainable=counts.trainable, frozen=counts.frozen, largest_layer=counts.largest_layer,
                checkpoint_gb={k: v / GB for k, v in ckpt_bytes.items()},
                video_tokens=s, context_tokens=ctx, context_parallel=u * r, rows=rows, configured=configured, best=best,
                load_cpu_per_node_gb=e * (counts.trainable + counts.frozen) * gpus / GB)  # read in the train dtype


def estimate_cpu(cfg: Config, procs: int) -> dict:
    """Host memory (GiB) of a CPU-only run of `cfg` with `procs` ranks on this machine: the
    configured ds_config and checkpointing, every term per rank and the node total (module
    docstring, `--cpu`)."""
    from e2v.models.zero3_load import zero3_load_blocker

    c = count_model(cfg)
    s, ctx = tokens(cfg)
    e = 2 if cfg.train.mixed_precision == "bf16" else 4
    g, pt, pf = procs, c.trainable, c.frozen
    z = json.loads((Path(__file__).resolve().parent.parent / cfg.deepspeed.config).read_text())["zero_optimization"]
    zero3 = z["stage"] == 3
    weights = e * (pt + pf) / g if zero3 else e * (pt + pf)
    # ZeRO-3 keeps gathered parameters resident while they will be used again (the shipped
    # stage3_max_reuse_distance spans the model), up to stage3_max_live_parameters: the bound.
    gathered = e * min(z.get("stage3_max_live_parameters", 1e9), pt + pf) if zero3 else 0
    grads = (e * pt / g if zero3 else e * pt) + 4 * pt / g
    optimizer = 12 * pt / g
    gather = z.get("stage3_prefetch_bucket_size" if zero3 else "allgather_bucket_size", 5e8)
    lay = layout(cfg, 0, g)
    u, r = lay.ulysses, lay.ring
    buffers = (e * (min(z.get("reduce_bucket_size", 5e8), pt) + (min(gather, pt) if g > 1 or zero3 else 0))
               + exchange_bytes(s, c, cfg.train.micro_batch_size, e, u, r))
    act, _ = activation_bytes(s, ctx, c, cfg.train.micro_batch_size, e, cfg.train.gradient_checkpointing, cp=u * r,
                              per_token_time=per_token_time(cfg))
    enc = sum(encoder_bytes(cfg).values())
    runtime = RUNTIME_GB * GB
    train = weights + gathered + grads + optimizer + buffers + act + enc + runtime
    whole_load = (not zero3 or cfg.model.preset is not None  # a tiny preset is built whole on every rank
                  or zero3_load_blocker(cfg, {"zero_optimization": z}) is not None)
    load = (e * (pt + pf) if whole_load else weights) + enc + runtime
    per_rank = dict(weights=weights, gathered=gathered, grads=grads, optimizer=optimizer, buffers=buffers, activations=act,
                    encoders=enc, runtime=runtime)
    return dict(procs=g, ds_config=Path(cfg.deepspeed.config).name, per_rank_gb={k: v / GB for k, v in per_rank.items()},
                train_per_rank_gb=train / GB, load_per_rank_gb=load / GB, whole_model_at_load=whole_load,
                node_total_gb=(g * max(train, load) + LAUNCHER_GB * GB) / GB)


def print_cpu(cfg: Config, procs: int) -> dict:
    r = estimate_cpu(cfg, procs)
    terms = ", ".join(f"{k} {v:.2f}" for k, v in r["per_rank_gb"].items())
    print(f"CPU-only run, {procs} rank(s), {r['ds_config']}, checkpointing {cfg.train.gradient_checkpointing} "
          f"(GiB per rank): {terms}\n  training {r['train_per_rank_gb']:.2f} per rank; load "
          f"{r['load_per_rank_gb']:.2f} per rank ({'whole transformer on every rank' if r['whole_model_at_load'] else 'partitioned at load'})"
          f"\n  peak host memory of the run: {r['node_total_gb']:.2f} GiB (launcher included)")
    return r


def host_memory_gb(given: float | None) -> tuple[float | None, str]:
    """(GB of RAM, where the figure came from): --cpu-mem-gb, else this machine's (psutil)."""
    if given is not None:
        return given, "--cpu-mem-gb"
    try:
        import psutil

        return psutil.virtual_memory().total / GB, "this machine"
    except Exception:  # psutil missing: the plan cannot be checked against RAM
        return None, "unknown (give --cpu-mem-gb)"


def smaller_shapes(cfg: Config) -> list[list[str]]:
    """Overrides that shrink the activations, mildest first: fewer frames (4k+1 counts down to 17),
    then a lower resolution (3/4, then 1/2 of each side, in multiples of 16)."""
    out = [[f"data.num_frames={f}"] for f in (49, 33, 17) if f < cfg.data.num_frames]
    h, w = cfg.data.resolution
    for k in (0.75, 0.5):
        hh, ww = max(16, round(h * k / 16) * 16), max(16, round(w * k / 16) * 16)
        out.append([f"data.resolution=[{hh},{ww}]"])
    return out


def plan_options(row: dict) -> list[str]:
    return [f"deepspeed.config=ds_configs/{row['ds_config']}",
            f"train.gradient_checkpointing={str(row['gradient_checkpointing']).lower()}",
            f"train.activation_offload={str(row['activation_offload']).lower()}"]


def advise(config: str, sets: list[str], gpus: int, gpu_mem_gb: float, nodes: int, host_gb: float | None,
           counts: ModelCounts | None = None) -> dict:
    """The first plan that fits both the GPUs and the host RAM: the configured shapes, then with the
    cache (no encoders on the GPU), then smaller frames / resolution with the cache; within each,
    the least offloading first (estimate's row order). Returns {sets, row, host_short: [plans
    that fit the GPU but not the RAM]}."""
    cfg = load_config(config, sets, check_paths=False)
    variants = [[]] + ([] if cfg.cache.enabled else [["cache.enabled=true"]])
    variants += [variants[-1] + shape for shape in smaller_shapes(cfg)]
    if cfg.train.trainable:  # last: LoRA alone trains less than the config asks, but needs ~10x less host RAM
        variants += [variants[len(variants) > 1] + ["train.trainable=[]"]]
    host_short, counts = [], {False: counts}  # counts depend on what trains, not on the shapes: built once each
    for extra in variants:
        c = load_config(config, sets + extra, check_paths=False)
        key = "train.trainable=[]" in extra
        counts[key] = counts.get(key) or count_model(c)
        r = estimate(c, gpus, gpu_mem_gb, nodes, counts=counts[key])
        for row in r["rows"]:
            if not row["fits"]:
                continue
            if host_gb is not None and row["cpu_per_node_gb"] > host_gb:
                host_short.append((extra, row))
                continue
            return dict(sets=extra, row=row, host_short=host_short)
    return dict(sets=None, row=None, host_short=host_short)


def print_advice(args, config: str, host: tuple, counts: ModelCounts | None = None) -> None:
    host_gb, source = host
    a = advise(config, args.set, args.gpus, args.gpu_mem_gb, args.nodes, host_gb, counts)
    ram = f"{host_gb:.0f} GB host RAM ({source})" if host_gb is not None else f"host RAM {source}"
    for extra, row in a["host_short"][:1]:
        print(f"note: {' '.join(plan_options(row) + extra)} fits the GPU ({row['gpu_total_gb']:.1f} GB) but needs "
              f"~{row['cpu_per_node_gb']:.0f} GB host RAM per node; {ram}")
    if a["row"] is None:
        print(f"no plan fits {args.gpus} x {args.gpu_mem_gb:g} GB GPUs and {ram}, even with the cache, activation "
              "offload and 17 frames at half resolution: use more GPUs (--gpus) or GPUs with more memory")
        return
    extra, row = a["sets"], a["row"]
    launcher = f"deepspeed --num_gpus {args.gpus}" if args.gpus > 1 else "deepspeed"
    sets = " ".join(f"--set {x}" for x in args.set + plan_options(row) + extra)
    print(f"plan that fits ({row['gpu_total_gb']:.1f} GB per GPU, ~{row['cpu_per_node_gb']:.0f} GB host RAM per node; "
          f"{ram}):")
    if "cache.enabled=true" in extra:
        print(f"  python tools/precompute.py --config {config}" + "".join(f" --set {x}" for x in args.set if x))
    print(f"  {launcher} train_e2v.py --config {config} {sets}")
    if "train.trainable=[]" in extra:
        print("  (LoRA alone: the modules the config trains in full stay frozen; their optimizer state is what "
              "did not fit the host RAM)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-mem-gb", type=float, default=24.0)
    p.add_argument("--model", choices=sorted(KNOWN_MODELS), help="estimate this Wan transformer instead")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--cpu", action="store_true", help="a CPU-only run: everything in host memory (--procs ranks)")
    p.add_argument("--procs", type=int, default=1, help="with --cpu: ranks on this machine")
    p.add_argument("--cpu-mem-gb", dest="cpu_mem_gb", type=float, default=None,
                   help="host RAM per node the plan must fit (default: this machine's)")
    args = p.parse_args()
    model = [f"model.pretrained={KNOWN_MODELS[args.model]}", "model.preset=null"] if args.model else []
    cfg = load_config(args.config, args.set + model, check_paths=False)
    if args.cpu:
        r = estimate_cpu(cfg, args.procs)
        print(json.dumps(r, indent=1)) if args.json else print_cpu(cfg, args.procs)
        return
    counts = count_model(cfg)
    r = estimate(cfg, args.gpus, args.gpu_mem_gb, args.nodes, counts=counts)
    if args.json:
        print(json.dumps(r, indent=1))
        return
    h, w = cfg.data.resolution
    cp_note = f"(context parallel: {r['context_parallel']} ranks share each sample's tokens) " if r["context_parallel"] > 1 else ""
    print(f"{args.config}: {(r['trainable'] + r['frozen']) / 1e9:.2f}B params ({r['trainable'] / 1e6:.1f}M trainable), "
          f"{h}x{w}x{cfg.data.num_frames}, micro batch {cfg.train.micro_batch_size}, {r['video_tokens']} video + "
          f"{r['context_tokens']} context tokens, {cfg.train.mixed_precision}; {args.nodes} node(s) x {args.gpus} GPU(s) "
          f"{cp_note}"
          f"of {args.gpu_mem_gb:g} GB. Estimates (GB per GPU; CPU per node):")
    print(f"  {'ds_config':20s} {'ckpt':5s} {'offl':5s} {'params':>7s} {'grads':>6s} {'optim':>6s} {'activ':>7s} "
          f"{'bufs':>5s} {'encod':>6s} {'total':>7s} {'CPU':>7s}  fits")
    for x in r["rows"]:
        print(f"  {x['ds_config']:20s} {str(x['gradient_checkpointing'])[0]:5s} {str(x['activation_offload'])[0]:5s} "
              f"{x['params_gb']:7.2f} {x['grads_gb']:6.2f} {x['optimizer_gb']:6.2f} {x['activations_gb']:7.2f} "
              f"{x['buffers_gb']:5.2f} {x['encoders_gb']:6.2f} {x['gpu_total_gb']:7.2f} {x['cpu_per_node_gb']:7.1f}  "
              f"{'yes' if x['fits'] else 'no'}")
    print("  encod: the frozen VAE, UMT5 and CLIP, resident when encoding online; 0 with cache.enabled "
          "(tools/precompute.py, then --set cache.enabled=true)")
    c, b = r["configured"], r["best"]
    print(f"configured ({c['ds_config']}, checkpointing {cfg.train.gradient_checkpointing}): "
          f"{c['gpu_total_gb']:.1f} GB per GPU -> {'fits' if c['fits'] else 'does NOT fit'}")
    print("first that fits the GPU: " + (" ".join(plan_options(b)) + f" (~{b['cpu_per_node_gb']:.0f} GB host RAM per "
                                         "node)" if b else "none with these shapes and encoders"))
    print_advice(args, args.config, host_memory_gb(args.cpu_mem_gb), counts)
    ck = r["checkpoint_gb"]
    print(f"checkpoint per save ({cfg.deepspeed.config}): {ck['after']:.1f} GB (trained weights + optimizer state); "
          f"the frozen {ck['frozen']:.1f} GB are not saved (with them: {ck['before']:.1f} GB)")
    dtype = "bf16" if cfg.train.mixed_precision == "bf16" else "fp32"
    print(f"loading: without ZeRO-3's partitioned load (model.zero3_init, a local folder) each rank materialises "
          f"the {dtype} transformer: ~{r['load_cpu_per_node_gb']:.0f} GB CPU RAM per node at start-up; with it, "
          f"~{r['load_cpu_per_node_gb'] / args.gpus / args.nodes:.0f} GB")


if __name__ == "__main__":
    main()
