"""Per-GPU (or, with --cpu, host) memory of a training config for every shipped ds_config, with and
without gradient checkpointing / activation offload, which plan fits, and the command that runs it.
The memory model and its formulas: e2v/train/memory.py; docs/memory.md for the shipped configs.

    python tools/estimate_memory.py --config configs/e2v.yaml --gpus 1 --gpu-mem-gb 24
    python tools/estimate_memory.py --config configs/e2v.yaml --gpus 8 --gpu-mem-gb 80 --set data.num_frames=49
    python tools/estimate_memory.py --config configs/e2v_t2v_1.3b.yaml --cpu --procs 2   # CPU-only run
"""

from __future__ import annotations

import argparse
import json

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.config.bases import KNOWN_MODELS
from e2v.config.load import load_config
from e2v.config.schema import Config, ConfigError

# The memory model builds the transformer on the meta device (torch, diffusers: seconds to import),
# so it is imported in each function that uses it, after the config is read and checked.


def print_cpu(cfg: Config, procs: int) -> dict:
    from e2v.train.memory import estimate_cpu

    r = estimate_cpu(cfg, procs)
    terms = ", ".join(f"{k} {v:.2f}" for k, v in r["per_rank_gb"].items())
    print(f"CPU-only run, {procs} rank(s), {r['ds_config']}, checkpointing {cfg.train.gradient_checkpointing} "
          f"(GiB per rank): {terms}\n  training {r['train_per_rank_gb']:.2f} per rank; load "
          f"{r['load_per_rank_gb']:.2f} per rank ({'whole transformer on every rank' if r['whole_model_at_load'] else 'partitioned at load'})"
          f"\n  peak host memory of the run: {r['node_total_gb']:.2f} GiB (launcher included)")
    return r


def peak(row: dict) -> float:
    """GB per GPU of a plan: the larger of the training step and the validation phase."""
    return max(row["gpu_total_gb"], row["validation_gb"])


def print_advice(args, config: str, host: tuple, counts=None) -> None:
    from e2v.train.memory import advise, plan_options

    host_gb, source = host
    a = advise(config, args.set, args.gpus, args.gpu_mem_gb, args.nodes, host_gb, counts)
    ram = f"{host_gb:.0f} GB host RAM ({source})" if host_gb is not None else f"host RAM {source}"
    for extra, row in a["host_short"][:1]:
        print(f"note: {' '.join(plan_options(row) + extra)} fits the GPU ({peak(row):.1f} GB) but needs "
              f"~{row['cpu_per_node_gb']:.0f} GB host RAM per node; {ram}")
    if a["row"] is None:
        print(f"no plan fits {args.gpus} x {args.gpu_mem_gb:g} GB GPUs and {ram}, even with the cache, activation "
              "offload and 17 frames at half resolution: use more GPUs (--gpus) or GPUs with more memory")
        return
    extra, row = a["sets"], a["row"]
    launcher = f"deepspeed --num_gpus {args.gpus}" if args.gpus > 1 else "deepspeed"
    sets = " ".join(f"--set {x}" for x in args.set + plan_options(row) + extra)
    print(f"plan that fits ({peak(row):.1f} GB per GPU, ~{row['cpu_per_node_gb']:.0f} GB host RAM per node; "
          f"{ram}):")
    if "cache.enabled=true" in extra:
        print(f"  python tools/precompute.py --config {config}" + "".join(f" --set {x}" for x in args.set if x))
    print(f"  {launcher} train_e2v.py --config {config} {sets}")
    if "train.trainable=[]" in extra:
        print("  (LoRA alone: the modules the config trains in full stay frozen; their optimizer state is what "
              "did not fit the host RAM)")


def load_line(cfg: Config, r: dict, gpus: int) -> str:
    """Host RAM per node at start-up, with and without ZeRO-3's partitioned load (e2v.train.memory.
    partitioned_load_bytes: where the partitions live decides what it saves)."""
    dtype = "bf16" if cfg.train.mixed_precision == "bf16" else "fp32"
    whole = f"each rank materialises the {dtype} transformer: ~{r['load_cpu_per_node_gb']:.1f} GB CPU RAM per node"
    part = r["load_partitioned_gb"]
    if not part:
        return f"loading: {whole} (an fp8 base loads whole: ZeRO-2 only)"
    same = (" (parameter offload keeps the partitions in host RAM, and one GPU's share is the whole model: "
            "the same figure)" if gpus == 1 and round(part["zero3_offload.json"]) == round(r["load_cpu_per_node_gb"])
            else "")
    return (f"loading: without ZeRO-3's partitioned load (model.zero3_init, a local folder) {whole}; with it, "
            f"zero3 ~{part['zero3.json']:.1f} GB (the partitions on the GPUs, one gathered parameter per rank), "
            f"zero3_offload ~{part['zero3_offload.json']:.1f} GB (the node's share of the model in host RAM){same}")


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
    try:
        cfg = load_config(args.config, args.set + model, check_paths=False)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    from e2v.train.memory import count_model, estimate, estimate_cpu, host_memory_gb, plan_options

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
    fp8 = f", {r['fp8'] / 1e9:.2f}B of them fp8" if r["fp8"] else ""
    print(f"{args.config}: {(r['trainable'] + r['frozen'] + r['fp8']) / 1e9:.2f}B params ({r['trainable'] / 1e6:.1f}M "
          f"trainable{fp8}), "
          f"{h}x{w}x{cfg.data.num_frames}, micro batch {cfg.train.micro_batch_size}, {r['video_tokens']} video + "
          f"{r['context_tokens']} context tokens, {cfg.train.mixed_precision}; {args.nodes} node(s) x {args.gpus} GPU(s) "
          f"{cp_note}"
          f"of {args.gpu_mem_gb:g} GB. Estimates (GB per GPU; CPU per node):")
    print(f"  {'ds_config':20s} {'ckpt':5s} {'offl':5s} {'params':>7s} {'grads':>6s} {'optim':>6s} {'activ':>7s} "
          f"{'bufs':>5s} {'encod':>6s} {'total':>7s} {'valid':>6s} {'CPU':>6s} {'PCIe':>5s}  fits")
    for x in r["rows"]:
        print(f"  {x['ds_config']:20s} {str(x['gradient_checkpointing'])[0]:5s} {str(x['activation_offload'])[0]:5s} "
              f"{x['params_gb']:7.2f} {x['grads_gb']:6.2f} {x['optimizer_gb']:6.2f} {x['activations_gb']:7.2f} "
              f"{x['buffers_gb']:5.2f} {x['encoders_gb']:6.2f} {x['gpu_total_gb']:7.2f} {x['validation_gb']:6.2f} "
              f"{x['cpu_per_node_gb']:6.1f} {x['pcie_per_step_gb']:5.0f}  "
              f"{'yes' if x['fits'] else 'no'}")
    print("  encod: the frozen VAE, UMT5 and CLIP, resident when encoding online; 0 with cache.enabled "
          "(tools/precompute.py, then --set cache.enabled=true). valid: the validation phase's peak (0: off). "
          "PCIe: host-device copies per step. fits: training and validation")
    c, b = r["configured"], r["best"]
    print(f"configured ({c['ds_config']}, checkpointing {cfg.train.gradient_checkpointing}): "
          f"{peak(c):.1f} GB per GPU -> {'fits' if c['fits'] else 'does NOT fit'}")
    print("first that fits the GPU: " + (" ".join(plan_options(b)) + f" (~{b['cpu_per_node_gb']:.0f} GB host RAM per "
                                         "node)" if b else "none with these shapes and encoders"))
    print_advice(args, args.config, host_memory_gb(args.cpu_mem_gb), counts)
    ck = r["checkpoint_gb"]
    print(f"checkpoint per save ({cfg.deepspeed.config}): {ck['after']:.1f} GB (trained weights + optimizer state); "
          f"the frozen {ck['frozen']:.1f} GB are not saved (with them: {ck['before']:.1f} GB)")
    print(load_line(cfg, r, args.gpus))


if __name__ == "__main__":
    main()
