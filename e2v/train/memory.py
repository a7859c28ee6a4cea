"""The memory model: per-GPU memory of a training config (parameters, gradients, optimizer state,
activations) for each shipped ds_config (ZeRO stage, offload), with and without gradient checkpointing, and which
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
WanTransformer3DModel on CPU (fp32, torch SDPA; tests/unit/test_estimate_memory.py measures tiny and
small models against the formula, within 20%, and tests/unit/test_context_parallel.py a rank of a
Ulysses-2 group). On GPUs, flash attention saves the same O(S) tensors. With P > 1, plus the
exchange's transient buffers (e2v.models.plan.exchange_bytes): 2 S D / P for Ulysses' all-to-all, 2 S D / U
for ring attention's gathered keys and values, S x 64 for the gathered prediction; they are added
to the "bufs" column. Plus DeepSpeed's communication buffers, read from the ds_config: the gradient reduce
bucket and the all-gather (ZeRO-2) or prefetch (ZeRO-3) bucket, e bytes per element each
(5e8 elements in the shipped configs: 2 GB in bf16), and a fixed 2 GB per GPU for the CUDA
context, kernels' workspaces and fragmentation. Plus the frozen encoders an online run keeps on
every GPU (e2v.models.plan.encoder_bytes: UMT5-XXL in bf16 10.6 GiB, CLIP ViT-H 2.4 GiB and the VAE 0.5
GiB in fp32), none with cache.enabled.

The fp8 base (model.base_dtype: fp8, e2v/models/fp8.py), ZeRO-2 only: F fp8 weights take 1 byte
each plus 4 per output channel (their scales) instead of 2; model.fp8_blocks_on_host = b of the K
blocks keep theirs in host RAM: b F / K bytes move from the GPU to the host, and the GPU holds two
blocks' in flight (2 F / K). One fp8 layer (the largest, F_1) is dequantised in the forward and
again in the backward: 2 e F_1 more in "bufs". The optimizer's 12 bytes per trained parameter (fp32
master 4 + AdamW's moments 8) are 4 + 2 + 8/256 with 8-bit AdamW (deepspeed.optimizer: adamw_8bit):
e2v.runtime.adam.optimizer_bytes.

The validation phase (`validation_bytes`): the resident training state (everything above but the
activations and the encoders) plus the transformer's inference activations e (A + O) at batch 1, the
VAE's weights, its tiled decode (VAE_DECODE_TILED_GB, an allowance) and, without the cache, the
largest single encoder (validation brings them one at a time). A row fits when both phases fit.
PCIe per step (`pcie_bytes`): the fp8 blocks on the host (twice with checkpointing), offloaded
activations out and back, ZeRO-3 offload's parameters gathered (twice with checkpointing),
optimizer offload's gradients down and weights up.

`estimate_cpu` (the tool's `--cpu`): a run with no GPU (DeepSpeed's CPU accelerator), where everything is host memory, summed
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

Length (about 500 lines): one model, read top to bottom: what the transformer holds (count_model),
what its states take per ZeRO stage, what activations and validation add, the host's share, and the
plans that fit; each term is used by the next, and the GPU check compares its peaks with the same
functions, so splitting it would scatter one formula's parts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from e2v.config.load import load_config
from e2v.config.schema import REPO_ROOT, Config, resolve_repo_path
from e2v.models.context_parallel import check_heads, layout
from e2v.models.expand import is_expanded
from e2v.models.fp8 import Fp8Linear, quantize_base
from e2v.models.plan import (
    activation_bytes,
    activation_terms,
    build_meta_transformer,
    checkpoint_bytes,
    encoder_bytes,
    encoder_numels,
    exchange_bytes,
    per_token_time,
    tokens,
)
from e2v.models.trainable import full_patterns, setup_training
from e2v.runtime.adam import TORCH_ADAMW, optimizer_bytes

GB = 2**30
OVERHEAD_GB = 2.0
SHIPPED = ["zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json"]
# The VAE's tiled decode of one validation video (diffusers' 256 x 256 pixel tiles, 4 frames a
# chunk, fp32): the decoder's widest feature maps of one tile plus the decoded clip. An allowance,
# not a fitted term: the gpu-check section fp8_14b records the real peak.
VAE_DECODE_TILED_GB = 1.5
RUNTIME_GB = 1.0  # per CPU rank: python, torch, diffusers, transformers, deepspeed, allocator slack
LAUNCHER_GB = 0.15  # the deepspeed runner and launch.py processes


@dataclass(frozen=True)
class ModelCounts:
    trainable: int
    frozen: int  # frozen parameters in the training dtype
    largest_layer: int
    width: int
    ffn: int
    layers: int
    fp8: int = 0  # frozen weights stored in fp8 (model.base_dtype: fp8), not among `frozen`
    fp8_rows: int = 0  # their output channels: one fp32 scale each
    fp8_largest: int = 0  # the largest fp8 layer: the weight one forward or backward dequantises


def count_model(cfg: Config) -> ModelCounts:
    """Exact counts of the transformer as training builds it (expansion, the fp8 base, LoRA,
    train.trainable), on the meta device: no memory, nothing downloaded. A 14B build with its LoRA
    takes seconds (peft's injection), so the counts are kept per model-shaping config: everything
    but the data folders, the run's name and outputs, validation and visualization."""
    key = _model_key(cfg)
    if key not in _COUNTS:
        _COUNTS[key] = _count_model(cfg)
    return _COUNTS[key]


_COUNTS: dict[str, ModelCounts] = {}  # count_model's, per _model_key


def _model_key(cfg: Config) -> str:
    d = dataclasses.asdict(cfg)
    for key in ("output_dir", "run_id", "validation", "visualization"):
        d.pop(key, None)
    d["data"].pop("datasets", None)
    return json.dumps(d, sort_keys=True, default=str)


def _count_model(cfg: Config) -> ModelCounts:
    model = build_meta_transformer(cfg)
    check_heads(cfg, model.config.num_attention_heads)
    expanded = is_expanded(cfg)
    if cfg.model.base_dtype == "fp8":
        quantize_base(model, full_patterns(cfg, expanded))
    setup_training(model, cfg, expanded=expanded)
    return counts_of(model)


def counts_of(model) -> ModelCounts:
    """The counts of a transformer as built for training (its LoRA and trained modules set up, an
    fp8 base quantised), on any device: what count_model reads from its meta-device build, and what
    a measured run (bench/gpulib/fp8_section.py) compares its peaks with."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    fp8 = [m.weight_fp8 for m in model.modules() if isinstance(m, Fp8Linear)]
    c = model.config
    return ModelCounts(trainable, total - trainable, largest, c.num_attention_heads * c.attention_head_dim,
                       c.ffn_dim, c.num_layers, fp8=sum(w.numel() for w in fp8), fp8_rows=sum(w.shape[0] for w in fp8),
                       fp8_largest=max((w.numel() for w in fp8), default=0))


def model_states(c: ModelCounts, ds_name: str, gpus_per_node: int, nodes: int, weight_bytes: int = 2,
                 optimizer: str = TORCH_ADAMW) -> dict:
    """Bytes per GPU (params, grads, optimizer) and per node in CPU RAM, after DeepSpeed's estimators;
    an fp8 base adds 1 byte per fp8 weight and 4 per scale to the (ZeRO-2) params."""
    g = gpus_per_node * nodes
    pt, pf, big = c.trainable, c.frozen, c.largest_layer
    w, o = weight_bytes, optimizer_bytes(optimizer)
    fp8 = c.fp8 + 4 * c.fp8_rows
    table = {
        "zero2.json": dict(params=w * (pt + pf) + fp8, grads=6 * pt / g, optimizer=o * pt / g,
                           cpu=pt * 4 * gpus_per_node * 1.5),
        "zero2_offload.json": dict(params=w * (pt + pf) + fp8, grads=0, optimizer=0,
                                   cpu=pt * max(4 * g, 4 + o) * 1.5),
        "zero3.json": dict(params=4 * big + w * (pt + pf) / g, grads=4 * pt / g, optimizer=o * pt / g,
                           cpu=(pt + pf) * 4 * gpus_per_node * 1.5),
        "zero3_offload.json": dict(params=4 * big, grads=0, optimizer=0,
                                   cpu=(pt * max(4 * gpus_per_node, (6 + o) / nodes) + w * pf / nodes) * 1.5),
    }
    return table[ds_name]


def buffer_bytes(ds_name: str, elem_bytes: int) -> float:
    """DeepSpeed's per-GPU communication buckets for a shipped ds_config (from its zero_optimization)."""
    z = json.loads((REPO_ROOT / "ds_configs" / ds_name).read_text())["zero_optimization"]
    gather = z.get("stage3_prefetch_bucket_size" if z["stage"] == 3 else "allgather_bucket_size", 5e8)
    return elem_bytes * (z.get("reduce_bucket_size", 5e8) + gather)


def fp8_on_host(cfg: Config, c: ModelCounts) -> tuple[float, float]:
    """(fp8 bytes kept in host RAM by model.fp8_blocks_on_host, the GPU bytes of the blocks in flight:
    the one that runs and the next one's copy). Blocks are equal in size."""
    n = cfg.model.fp8_blocks_on_host
    if not n or not c.fp8:
        return 0.0, 0.0
    per_block = c.fp8 / c.layers
    return n * per_block, 2 * per_block


def dequant_bytes(c: ModelCounts, elem_bytes: int) -> int:
    """One fp8 layer's weight dequantised to the training dtype in the forward and again in the
    backward (e2v/models/fp8.py): the largest layer's, twice."""
    return 2 * elem_bytes * c.fp8_largest


def validation_bytes(cfg: Config, s: int, ctx: int, c: ModelCounts, e: int, cp: int) -> dict:
    """What the validation phase adds on the GPU to the resident training state (weights, gradients,
    optimizer, buffers): the transformer's inference activations (no grad: one block's working set
    plus what lives outside the blocks, batch 1; the guidance's two passes run one after the other),
    the VAE and its tiled decode, and, without the cache, the largest encoder (validation brings the
    encoders one at a time, each only for its part). Zero parts when validation is off."""
    v = cfg.validation
    if not v.every_n_steps:
        return {}
    block, outside = activation_terms(s, ctx, c, cp=cp, per_token_time=per_token_time(cfg))
    out = {"inference_activations": e * (block + outside)}
    if v.num_videos or v.sets:
        enc = encoder_bytes(cfg)
        out["vae"] = enc.get("vae") or vae_weight_bytes(cfg)
        out["vae_decode"] = VAE_DECODE_TILED_GB * GB
        if len(enc) > 1:
            out["largest_encoder"] = max(b for k, b in enc.items() if k != "vae")
    return out


def vae_weight_bytes(cfg: Config) -> int:
    """The VAE's weights in model.vae_dtype, built on the meta device (a cached run has none resident)."""
    if cfg.model.preset is not None:
        return 0  # the tiny VAE: a few kilobytes
    return (2 if cfg.model.vae_dtype == "bf16" else 4) * encoder_numels(cfg)["vae"]


def estimate(cfg: Config, gpus: int, gpu_mem_gb: float, nodes: int = 1, counts: ModelCounts | None = None) -> dict:
    """`counts`: count_model(cfg) when the caller has it (it builds the model on the meta device).
    With an fp8 base only the ZeRO-2 rows exist (model.base_dtype: fp8 needs ZeRO-2). A row fits
    when both the training step and the validation phase do."""
    counts = counts or count_model(cfg)
    s, ctx = tokens(cfg)
    e = 2 if cfg.train.mixed_precision == "bf16" else 4
    lay = layout(cfg, 0, gpus * nodes)  # the GPUs must hold whole context-parallel groups
    u, r = lay.ulysses, lay.ring
    batch = cfg.train.micro_batch_size
    encoders = sum(encoder_bytes(cfg).values())  # resident on every GPU unless the cache replaces them
    val = validation_bytes(cfg, s, ctx, counts, e, u * r)
    host_fp8, in_flight = fp8_on_host(cfg, counts)
    dequant = dequant_bytes(counts, e)
    ema = 4 * counts.trainable if cfg.train.ema_weight > 0 else 0  # train.ema_weight: fp32 on every rank's host
    rows = []
    for ds_name in SHIPPED[:2] if counts.fp8 else SHIPPED:
        st = model_states(counts, ds_name, gpus, nodes, weight_bytes=e, optimizer=cfg.deepspeed.optimizer)
        params = st["params"] - host_fp8 + in_flight
        for ckpt, off in ((False, False), (True, False), (True, True)):
            act_gpu, act_cpu = activation_bytes(s, ctx, counts, batch, e, ckpt, off, cp=u * r,
                                                per_token_time=per_token_time(cfg))
            buffers = buffer_bytes(ds_name, e) + exchange_bytes(s, counts, batch, e, u, r) + dequant
            resident = params + st["grads"] + st["optimizer"] + buffers + OVERHEAD_GB * GB
            gpu = resident + act_gpu + encoders
            validation = resident + sum(val.values()) if val else 0.0
            rows.append(dict(ds_config=ds_name, gradient_checkpointing=ckpt, activation_offload=off,
                             params_gb=params / GB, grads_gb=st["grads"] / GB, optimizer_gb=st["optimizer"] / GB,
                             activations_gb=act_gpu / GB, buffers_gb=buffers / GB, encoders_gb=encoders / GB,
                             gpu_total_gb=gpu / GB, validation_gb=validation / GB,
                             cpu_per_node_gb=(st["cpu"] + (act_cpu + host_fp8 + ema) * gpus) / GB,
                             pcie_per_step_gb=pcie_bytes(host_fp8, ckpt, act_cpu, counts, ds_name, e) / GB,
                             fits=max(gpu, validation) <= gpu_mem_gb * GB))
    configured = next(r for r in rows if r["ds_config"] == Path(cfg.deepspeed.config).name
                      and r["gradient_checkpointing"] == cfg.train.gradient_checkpointing
                      and r["activation_offload"] == (cfg.train.activation_offload and cfg.train.gradient_checkpointing))
    # Cheapest that fits: least offloading first (faster), checkpointing only when needed.
    best = next((r for r in rows if r["fits"]), None)
    stage = json.loads(resolve_repo_path(cfg.deepspeed.config).read_text())["zero_optimization"]["stage"]
    ckpt_bytes = checkpoint_bytes(counts.trainable, counts.frozen, e, stage, optimizer_bytes(cfg.deepspeed.optimizer))
    return dict(trainable=counts.trainable, frozen=counts.frozen, fp8=counts.fp8, largest_layer=counts.largest_layer,
                checkpoint_gb={k: v / GB for k, v in ckpt_bytes.items()}, validation_parts_gb={k: v / GB for k, v in val.items()},
                video_tokens=s, context_tokens=ctx, context_parallel=u * r, rows=rows, configured=configured, best=best,
                # read in the train dtype; an fp8 base is quantised layer by layer from that copy
                load_cpu_per_node_gb=e * (counts.trainable + counts.frozen + counts.fp8) * gpus / GB,
                load_partitioned_gb={name: partitioned_load_bytes(counts, e, name, gpus, nodes) / GB
                                     for name in ("zero3.json", "zero3_offload.json")} if not counts.fp8 else {})


def partitioned_load_bytes(c: ModelCounts, e: int, ds_name: str, gpus_per_node: int, nodes: int) -> float:
    """Host RAM per node while ZeRO-3's partitioned load runs (e2v/models/zero3_load.py): zero.Init
    puts each rank's partition where the ds_config keeps parameters, so it is host RAM only under
    parameter offload (zero3_offload: the node's share of the model, e P / N), GPU memory otherwise;
    plus, on every rank, the one parameter gathered while rank 0 copies its file value in (at most
    the largest layer). On one GPU with parameter offload the node's share is the whole model: the
    partitioned load then needs as much host RAM as the whole one."""
    gathered = gpus_per_node * e * c.largest_layer
    offloaded = json.loads((REPO_ROOT / "ds_configs" / ds_name).read_text())["zero_optimization"].get(
        "offload_param", {}).get("device") == "cpu"
    return gathered + (e * (c.trainable + c.frozen) / nodes if offloaded else 0)


def pcie_bytes(host_fp8: float, checkpointing: bool, act_cpu: float, c: ModelCounts, ds_name: str, e: int) -> float:
    """Host-device copies per step (an estimate of the traffic, not of its time): fp8 blocks kept on
    the host, once per forward and again for the recompute; offloaded activations out and back;
    ZeRO-3 offload's parameters gathered in the forward and the recompute (e bytes each, frozen
    ones included); optimizer offload's gradients down and updated weights up (e bytes each)."""
    b = host_fp8 * (2 if checkpointing else 1) + 2 * act_cpu
    if ds_name == "zero3_offload.json":
        b += e * (c.trainable + c.frozen) * (2 if checkpointing else 1)
    if ds_name in ("zero2_offload.json", "zero3_offload.json"):
        b += 2 * e * c.trainable
    return b


def estimate_cpu(cfg: Config, procs: int) -> dict:
    """Host memory (GiB) of a CPU-only run of `cfg` with `procs` ranks on this machine: the
    configured ds_config and checkpointing, every term per rank and the node total (module
    docstring)."""
    from e2v.models.zero3_load import zero3_load_blocker

    c = count_model(cfg)
    s, ctx = tokens(cfg)
    e = 2 if cfg.train.mixed_precision == "bf16" else 4
    g, pt, pf = procs, c.trainable, c.frozen
    z = json.loads(resolve_repo_path(cfg.deepspeed.config).read_text())["zero_optimization"]
    zero3 = z["stage"] == 3
    weights = (e * (pt + pf) / g if zero3 else e * (pt + pf)) + c.fp8 + 4 * c.fp8_rows  # fp8: ZeRO-2 only
    # ZeRO-3 keeps gathered parameters resident while they will be used again (the shipped
    # stage3_max_reuse_distance spans the model), up to stage3_max_live_parameters: the bound.
    gathered = e * min(z.get("stage3_max_live_parameters", 1e9), pt + pf) if zero3 else 0
    grads = (e * pt / g if zero3 else e * pt) + 4 * pt / g
    optimizer = optimizer_bytes(cfg.deepspeed.optimizer) * pt / g
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
    load = (e * (pt + pf + c.fp8) if whole_load else weights) + enc + runtime
    per_rank = dict(weights=weights, gathered=gathered, grads=grads, optimizer=optimizer, buffers=buffers, activations=act,
                    encoders=enc, runtime=runtime)
    return dict(procs=g, ds_config=Path(cfg.deepspeed.config).name, per_rank_gb={k: v / GB for k, v in per_rank.items()},
                train_per_rank_gb=train / GB, load_per_rank_gb=load / GB, whole_model_at_load=whole_load,
                node_total_gb=(g * max(train, load) + LAUNCHER_GB * GB) / GB)


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


# The plan for weights that do not fit in the training dtype, before any parameter offload: the
# frozen base in fp8 and 8-bit AdamW moments (ZeRO-2; docs/memory.md).
FP8_PLAN = ["model.base_dtype=fp8", "deepspeed.optimizer=adamw_8bit"]


def advise(config: str, sets: list[str], gpus: int, gpu_mem_gb: float, nodes: int, host_gb: float | None,
           counts: ModelCounts | None = None) -> dict:
    """The first plan that fits both the GPUs and the host RAM: the configured shapes, then with the
    cache (no encoders on the GPU), then smaller frames / resolution with the cache. Within each:
    the training dtype without parameter offload (least offloading first: estimate's row order),
    then (LoRA) the fp8 base with 8-bit AdamW, with the fewest fp8 blocks kept on the host that
    fit, then ZeRO-3's parameter offload. Returns {sets, row, host_short: [plans that fit the GPU
    but not the RAM]}."""
    cfg = load_config(config, sets, check_paths=False)
    variants = [[]] + ([] if cfg.cache.enabled else [["cache.enabled=true"]])
    variants += [variants[-1] + shape for shape in smaller_shapes(cfg)]
    if cfg.train.trainable:  # last: LoRA alone trains less than the config asks, but needs ~10x less host RAM
        variants += [variants[len(variants) > 1] + ["train.trainable=[]"]]
    # counts depend on what trains and on the fp8 base, not on the shapes: built once each
    host_short, counts = [], {(False, cfg.model.base_dtype == "fp8"): counts}
    fp8_open = cfg.model.training_type == "lora" and cfg.model.base_dtype != "fp8"

    def rows_of(extra: list[str], also: tuple = ()) -> tuple[ModelCounts, list[dict]]:
        c = load_config(config, sets + extra + list(also), check_paths=False)
        key = ("train.trainable=[]" in extra, c.model.base_dtype == "fp8")
        counts[key] = counts.get(key) or count_model(c)
        return counts[key], estimate(c, gpus, gpu_mem_gb, nodes, counts=counts[key])["rows"]

    def first(extra: list[str], rows: list[dict]) -> dict | None:
        for row in rows:
            if not row["fits"]:
                continue
            if host_gb is not None and row["cpu_per_node_gb"] > host_gb:
                host_short.append((extra, row))
                continue
            return dict(sets=extra, row=row, host_short=host_short)
        return None

    def with_fp8(extra: list[str]) -> dict | None:
        plan = extra + FP8_PLAN
        zero2 = ("deepspeed.config=ds_configs/zero2.json",)  # a valid config to count; the row names its own
        c, rows = rows_of(plan, zero2)
        found = first(plan, rows)
        if found or not c.fp8:
            return found
        per_block = c.fp8 / c.layers / GB
        for row in rows:  # the fewest blocks on the host that bring this row under the GPU size
            over = max(row["gpu_total_gb"], row["validation_gb"]) - gpu_mem_gb
            n = math.ceil((over + 2 * per_block) / per_block)  # + the two blocks in flight
            if not row["gradient_checkpointing"] or n > c.layers:
                continue
            swapped = plan + [f"model.fp8_blocks_on_host={n}"]
            same = [r for r in rows_of(swapped, (f"deepspeed.config=ds_configs/{row['ds_config']}",))[1]
                    if (r["ds_config"], r["gradient_checkpointing"], r["activation_offload"])
                    == (row["ds_config"], row["gradient_checkpointing"], row["activation_offload"])]
            found = first(swapped, same)
            if found:
                return found
        return None

    for extra in variants:
        _, rows = rows_of(extra)
        param_offload = [r for r in rows if r["ds_config"] == "zero3_offload.json"]
        found = (first(extra, [r for r in rows if r not in param_offload]) or (with_fp8(extra) if fp8_open else None)
                 or first(extra, param_offload))
        if found:
            return found
    return dict(sets=None, row=None, host_short=host_short)


def fit_verdict(cfg: Config, samples: list, precompute: str = "python tools/precompute.py --config <config>",
                gpu_mem_gb: float | None = None, host_gb: float | None = None, gpus: int = 1) -> list[str]:
    """The dry run's answer for `gpus` GPUs on one node: the configured plan's training and validation
    peaks per GPU against the GPU (this machine's first CUDA device, else `gpu_mem_gb`, else 24 GB),
    the node's host RAM against this machine's (psutil) at load and in training, and, when the config
    reads the cache, whether the cache holds the samples (an empty one is filled with
    tools/precompute.py first)."""
    from e2v.data.store import CacheStore

    if torch.cuda.is_available():
        gpu_mem_gb, where = torch.cuda.get_device_properties(0).total_memory / GB, "this machine's GPU"
    elif gpu_mem_gb is None:
        gpu_mem_gb, where = 24.0, "no GPU here: judged for a 24 GB card"
    else:
        where = "given"
    host_gb, host_source = host_memory_gb(host_gb)
    r = estimate(cfg, gpus, gpu_mem_gb)
    row, e = r["configured"], 2 if cfg.train.mixed_precision == "bf16" else 4
    val = f", validation {row['validation_gb']:.1f} GiB" if row["validation_gb"] else ", validation off"
    verdict = "fits" if row["fits"] else "does NOT fit: tools/estimate_memory.py --config ... proposes a plan that does"
    host = max(row["cpu_per_node_gb"], r["load_cpu_per_node_gb"]) + RUNTIME_GB
    host_verdict = ("" if host_gb is None else
                    f" -> {'fits' if host <= host_gb else 'does NOT fit'} {host_gb:.0f} GiB ({host_source})")
    on = f"one {gpu_mem_gb:.0f} GiB GPU" if gpus == 1 else f"each of {gpus} {gpu_mem_gb:.0f} GiB GPUs on one node"
    lines = [f"memory on {on} ({where}; estimate): training {row['gpu_total_gb']:.1f} GiB"
             f"{val} -> {verdict}",
             f"host RAM (estimate): {r['load_cpu_per_node_gb']:.1f} GiB while the {'bf16' if e == 2 else 'fp32'} "
             f"transformer loads, {row['cpu_per_node_gb']:.1f} GiB in training, + {RUNTIME_GB:.0f} GiB of runtime"
             f"{host_verdict}; PCIe copies ~{row['pcie_per_step_gb']:.0f} GB per step"]
    if cfg.cache.enabled and samples:
        store = CacheStore(cfg)
        missing = sum(not store.path(s).exists() for s in samples)
        if missing == len(samples):
            lines.append(f"the cache is empty (cache.enabled: true): fill it first with {precompute} "
                         "(training stops at start without it)")
        elif missing:
            lines.append(f"the cache lacks {missing} of {len(samples)} samples: {precompute} adds them "
                         "(valid entries are kept)")
    return lines
