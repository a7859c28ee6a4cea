"""Train Wan (2.1, 2.2-I2V-A14B) to make video from elements (SkyReels-A2 style), or plain T2V / video regression.

    deepspeed train_e2v.py --config configs/e2v.yaml [--set train.lr=5e-5 ...] [--resume latest]

config -> models -> data -> deepspeed.initialize -> loop. Everything that is not the algorithm
lives in e2v/. Legend: B batch, C channels, T latent frames, h/w latent size, L tokens, D width.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

# The config stage: these import no torch, DeepSpeed or diffusers, so --help, a config error and
# the dry run's first line answer in about a second instead of after those imports' 15-25 s
# (bench/RESULTS.md, section 9). The stages after it: import_stages(), once the config is good.
from e2v.config.bases import vae_config
from e2v.config.load import load_config, save_config, to_dict
from e2v.config.schema import ConfigError
from e2v.config.seed_formats import map_seed_flags
from e2v.config.shapes import check_base
from e2v.models.weights import missing_weights, require_weights
from e2v.runtime.log import get_logger


def import_stages() -> None:
    """The pipeline's stages after the config, in order, as this module's names (what top-level
    imports would give the functions below). Imported once the command line and the config are
    checked; a second call changes nothing (a test's monkeypatched name stays)."""
    global torch, BadSampleError, index_samples, make_loader, check_later_phases, Validator, hold_out_problem
    global split_held_out, Visualizer, agree_on_local_facts, check_heads, layout, expansion_modules, is_expanded
    global load_parts, count_params, describe_plan, knows_shape_offline, preflight, trained_fp32_kept, speed
    global describe_trained, distributed, hostmem, lock_run_folder, set_rank_threads, ckpt, export, loop, outputs
    global resuming, check_comfy_mappable, lora_module_names, adam_choice, optimizer_preflight
    global resolve_deepspeed_config, initialize_engine, prepare_for_training, seed_process, step_rngs
    global training_dtype, NonFiniteGuard, fit_verdict, Log, unusable, FlopCounter, device_peak_tflops
    global CacheError, CacheStore, reads_cache, WeightEMA
    if "Log" in globals():
        return
    import torch

    from e2v.data.dataset import BadSampleError, index_samples, make_loader
    from e2v.data.preflight import unusable
    from e2v.data.store import CacheError, CacheStore
    from e2v.eval.preflight_deps import check_later_phases
    from e2v.eval.validation import Validator, hold_out_problem, reads_cache, split_held_out
    from e2v.eval.viz import Visualizer
    from e2v.models import speed
    from e2v.models.agree import agree_on_local_facts
    from e2v.models.context_parallel import check_heads, layout
    from e2v.models.expand import expansion_modules, is_expanded
    from e2v.models.load import load_parts
    from e2v.models.plan import count_params, describe_plan, knows_shape_offline, preflight
    from e2v.models.precision import trained_fp32_kept
    from e2v.models.trainable import describe_trained
    from e2v.runtime import distributed, hostmem
    from e2v.runtime.runlock import lock_run_folder
    from e2v.runtime.threads import set_rank_threads
    from e2v.train import checkpoint as ckpt, export, loop, outputs, resume as resuming
    from e2v.train.comfy import check_comfy_mappable, lora_module_names
    from e2v.train.ds_config import adam_choice, optimizer_preflight, resolve_deepspeed_config
    from e2v.train.ema import WeightEMA
    from e2v.train.engine import initialize_engine, prepare_for_training, seed_process, step_rngs, training_dtype
    from e2v.train.flops import FlopCounter, device_peak_tflops
    from e2v.train.guard import NonFiniteGuard
    from e2v.train.memory import fit_verdict
    from e2v.train.runlog import Log


if __name__ != "__main__":  # imported (the tests, the harness): every name at once, as a library's
    import_stages()

# rank 0's messages, tagged [e2v], [e2v config], ... (e2v/runtime/log.py)
logger, config_logger, data_logger, dry_run_logger = (
    get_logger(name) for name in ("e2v", "e2v.config", "e2v.data", "e2v.dry run"))

def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config, or a seed JSON dataset config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=5e-5")
    p.add_argument("--resume", default=None, help="'latest' (the run's newest intact checkpoint; none: stop), "
                   "'auto' (the same, or a fresh start when there is none) or a checkpoint folder")
    p.add_argument("--dry_run", action="store_true", help="validate, check every sample, build on meta, print plan, exit")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="with --dry_run: plan for N ranks (default: the config's own count, one context-parallel "
                        "group: parallel.ulysses_degree x ring_degree); a real start takes the launcher's")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args, old_flags = p.parse_known_args(argv)
    try:  # old finetrainers-style flags (docs/formats.md) -> --dataset_configs / --set
        config, sets, notes = map_seed_flags(old_flags)
    except ConfigError as e:
        p.error(str(e))
    for note in notes:
        config_logger.info(note)
    args.config, args.set = args.config or config, sets + args.set  # explicit --set wins
    if args.config is None:
        p.error("--config is required: a YAML config (configs/e2v.yaml) or a seed JSON dataset config")
    if args.gpus is not None and (not args.dry_run or args.gpus < 1):
        p.error("--gpus N (N >= 1) is for --dry_run: a real start takes the launcher's rank count "
                "(deepspeed --num_gpus N, torchrun --nproc_per_node N, srun -n N)")
    return args


def dry_run(cfg, args, ranks: int = 1) -> None:
    """Validated config (load_config) -> indexed data -> the transformer on the meta device with its
    LoRA and trained modules (no weights read, nothing downloaded) -> the plan for `ranks` processes,
    and whether it fits their GPUs and this machine's RAM (e2v.train.memory.fit_verdict). No DeepSpeed
    launch: an 8-GPU config is planned from one process. A data folder that does not exist yet, or
    weights not downloaded when the base's shape is known without them, are reported, not fatal:
    the plan is still worth reading."""
    error, notes = missing_weights(cfg)  # training's check (require_weights); the plan needs only the shape
    if error and not knows_shape_offline(cfg):
        raise SystemExit(f"weights: {error}")
    if error:
        dry_run_logger.warning(f"WARNING: weights: {error} (training stops here; the plan below needs only the "
                               "base's shape)")
    for note in notes:
        dry_run_logger.info(f"note: {note}")
    lay = layout(cfg, 0, ranks)  # the ranks must hold whole context-parallel groups
    missing = [d.data_root for d in cfg.data.datasets if not Path(d.data_root).exists()]
    for root in missing:
        dry_run_logger.warning(f"WARNING: data_root {root} does not exist: not indexed (training would stop here; "
              f"set it with --set data.datasets.0.data_root=...)")
    cfg.data.datasets = [d for d in cfg.data.datasets if d.data_root not in missing]
    excluded = []  # the same check as training's start; here listed, never fatal
    try:
        samples = index_samples(cfg, excluded=excluded, stop_on_bad=False) if cfg.data.datasets else []
    except BadSampleError as e:  # none usable: the plan is still worth reading
        dry_run_logger.info(str(e))
        samples = []
    held_out = hold_out_problem(cfg, len({(s.dataset, s.id) for s in samples})) if samples else None
    if held_out:  # training would stop here (split_held_out): so does the dry run
        raise SystemExit(f"config error: {'; '.join(held_out)}")
    transformer, full_names = preflight(cfg)
    comfy_check(transformer)
    ds_config = resolve_deepspeed_config(cfg, world_size=lay.dp_size, cuda=torch.cuda.is_available())
    usable = len({(s.dataset, s.id) for s in samples})
    dry_run_logger.info(f"config OK; {usable} usable samples in "
          f"{', '.join(d.data_root for d in cfg.data.datasets) or 'no existing data folder'}"
          + (f"; {len(unusable(excluded))} unusable (listed above): training stops at start with "
             f"data.on_bad_sample: {cfg.data.on_bad_sample}" if excluded and cfg.data.on_bad_sample == "error"
             else f"; {len(unusable(excluded))} unusable, left out (listed above)" if excluded else ""))
    precompute = f"python tools/precompute.py --config {args.config}" + "".join(f" --set {s}" for s in args.set)
    dry_run_logger.info("\n".join([describe_plan(transformer, cfg, ds_config, full_names),
                                    *fit_verdict(cfg, samples, precompute, gpus=ranks)]))


def comfy_check(transformer) -> None:
    """Say at start, not after training, when the LoRA's ComfyUI copy will not be written (a target
    diffusers' Wan LoRA converter cannot place); the diffusers LoRA is exported either way."""
    try:
        check_comfy_mappable(lora_module_names(transformer))
    except ValueError as e:
        logger.info(f"note: {e}. The export will skip {export.COMFY_FILE}.")


def run_dir_for(cfg, config_path: str, resume: str | None) -> Path:
    """<output_dir>/<run_id>; without run_id, a new timestamped id (or, for --resume latest / auto,
    the run of this config that saved a checkpoint last, named; latest with none stops)."""
    root = Path(cfg.output_dir)
    stem = Path(config_path).stem
    if cfg.run_id:
        return root / cfg.run_id
    if resume in resuming.MODES:
        run, why = resuming.run_to_resume(root, stem)
        if run is not None:
            logger.info(f"--resume {resume}: {why}")
            return run
        logger.info(f"{resuming.nothing_to_resume(resume, None, f'{why}; no run_id set')} in a new run folder")
    return root / f"{stem}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def checked_config(args):
    """The validated config, or None after a dry run; the model-dependent checks run on the meta
    device first, before minutes of loading. Everything up to the weights check answers before the
    stages are imported (import_stages)."""
    try:
        cfg = load_config(args.config, args.set, check_paths=not args.dry_run)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    if cfg.task == "causal":  # what the block-causal model cannot serve: its own rule, torch's import first
        from e2v.models.causal import causal_refusal

        refusal = causal_refusal(cfg)
        if refusal:
            raise SystemExit(f"config error: {refusal}")
    if args.dry_run:
        p = cfg.parallel
        ranks = args.gpus or p.ulysses_degree * p.ring_degree  # the config's own count: one context-parallel group
        why = ("--gpus" if args.gpus else "--gpus N plans for N" if ranks == 1 else
               f"one context-parallel group, parallel.ulysses_degree {p.ulysses_degree} x ring_degree "
               f"{p.ring_degree}; --gpus N plans for N")
        dry_run_logger.info(f"{args.config}: read and checked; planning for {ranks} rank{'s' * (ranks > 1)} ({why}): "
                            "checking the data, then the model on the meta device")
        import_stages()
        try:
            return dry_run(cfg, args, ranks)
        except ValueError as e:
            raise SystemExit(f"dry run: {e}")
    require_weights(cfg)  # one line before any loader retries (docs/weights.md)
    import_stages()
    try:
        head_dim = None
        if knows_shape_offline(cfg):
            transformer = preflight(cfg)[0]
            comfy_check(transformer)
            head_dim = transformer.config.attention_head_dim
        speed.preflight(cfg, head_dim)  # the attention kernel and the compiler can run here: every rank
    except ValueError as e:
        raise SystemExit(f"config error: {e}")
    return cfg


def start_run(cfg, args):
    """The process group, this rank's place in it (data- and context-parallel: e2v.models.context_parallel),
    its device, and the run folder (locked against a second run, the resolved config written).
    Returns (rank, world, layout, device, run folder, lock)."""
    malloc = hostmem.return_freed_memory()  # before the first weight is read
    distributed.resolve_launch()  # SLURM's tasks (srun) mapped first: LOCAL_RANK is this task's from here
    args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(args.local_rank)
        if cfg.train.mixed_precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise SystemExit("config error: train.mixed_precision: bf16, but this GPU has no bf16 (pre-Ampere); "
                             "set train.mixed_precision: 'no' (fp32; DeepSpeed's fp16 is not supported here)")
    distributed.init_distributed()
    threads = set_rank_threads() if cuda else None  # ranks share the node's cores (the offloaded Adam runs there)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        lay = layout(cfg, rank, world)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
    try:
        run_dir = run_dir_for(cfg, args.config, args.resume) if rank == 0 else None
        error = None
    except resuming.ResumeError as e:
        run_dir, error = None, str(e)
    run_dir, error = distributed.broadcast((run_dir and str(run_dir), error), rank)
    if error:
        raise SystemExit(f"resume error: {error}")
    run_dir = Path(run_dir)
    lock = lock_run_folder(run_dir, rank)  # held until exit: a second run in this folder stops
    args.resume_from = resuming.pick_checkpoint(args.resume, to_dict(cfg), run_dir, rank)  # before config.yaml
    if rank == 0:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        logger.info(malloc + (f"\n{threads}" if threads else ""))
        if lay.enabled:
            logger.info(f"context parallel: {world} processes = {lay.dp_size} data-parallel group(s) x "
                  f"{lay.ulysses} Ulysses x {lay.ring} ring ranks sharing each sample's tokens")
    seed_process(cfg, lay.dp_rank)  # a context-parallel group draws as its data-parallel rank
    return rank, world, lay, device, run_dir, lock


def build_model(cfg, run_dir: Path, rank: int, data_parallel: int, device):
    """The parts (the transformer partitioned at load under ZeRO-3; no encoders with the cache),
    set up for training. Returns (parts, names trained in full, resolved DeepSpeed config)."""
    ds_config = resolve_deepspeed_config(cfg, data_parallel, device.type == "cuda")
    optimizer_preflight(cfg, ds_config, device.type == "cuda")  # a compiled optimizer fails here, not after the load
    agree_on_local_facts(cfg, ds_config)  # every rank loads the same way, or every rank stops here
    parts = load_parts(cfg, with_encoders=not cfg.cache.enabled, device=device, ds_config=ds_config)
    full_names = prepare_for_training(parts, cfg)
    try:  # a hub id's shape is known only now (preflight could not see it)
        check_base(cfg, parts.transformer.config, vae_config(cfg) if parts.vae is None else parts.vae.config)
        check_heads(cfg, parts.transformer.config.num_attention_heads)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    export.save_base_modules(parts.transformer, full_names, run_dir, rank,  # the ComfyUI export's differences
                             exclude=expansion_modules(cfg) if is_expanded(cfg) else [])
    return parts, full_names, ds_config


def announce(cfg, run_dir: Path, ds_config: dict, parts, full_names: list[str], samples: list, cuda: bool) -> None:
    """Rank 0's start-up lines: the optimizer, the run folder, the model and what trains."""
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    logger.info(f"optimizer: {adam_choice(cfg, ds_config, cuda)[1]}")
    encoders = [n for n in ("vae", "text_encoder", "image_encoder") if getattr(parts, n) is not None]
    logger.info(f"run folder {run_dir}\n{len(samples)} samples; transformer "
          f"{count_params(parts.transformer) / 1e6:.2f}M params, "
          f"{count_params(parts.transformer, trainable_only=True) / 1e6:.3f}M trainable "
          f"({describe_trained(cfg, full_names)})\nfrozen encoders loaded: "
          f"{', '.join(encoders) or 'none'}")
    bf16_trained = trained_fp32_kept(parts.transformer) if cfg.train.mixed_precision == "bf16" else []
    if bf16_trained:
        logger.info(f"note: {len(bf16_trained)} trained tensors belong to modules diffusers keeps in fp32 "
              f"(e.g. {bf16_trained[0]}); DeepSpeed's bf16 mode trains them in bf16 (fp32 master copies)")


def resume(args, run_dir: Path, engine, rng, gen, rank: int, ema=None) -> tuple[int, int, Path | None]:
    """(global step, samples seen, checkpoint) of `--resume` (pick_checkpoint chose it), the EMA
    (train.ema_weight) read back with it; (0, 0, None) for a fresh run."""
    resume_from = args.resume_from
    if resume_from is None:
        return 0, 0, None
    state = ckpt.load_checkpoint(engine, resume_from)
    ckpt.set_rng_state(state["rng"], rng, gen)
    if ema is not None and not ema.load(resume_from / ckpt.EMA_FILE) and state["global_step"] >= ema.start_step:
        logger.info(f"note: {resume_from} holds no EMA weights: the average starts again at step "
                    f"{state['global_step'] + 1} (train.ema_weight)")
    logger.info(f"run {run_dir}: resumed from {resume_from} at step {state['global_step']}")
    return state["global_step"], state["samples_seen"], resume_from


def main(argv: list[str] | None = None):
    """The training run of `argv` (default: the command line), in this process."""
    args = parse_args(argv)
    cfg = checked_config(args)
    if cfg is None:  # a dry run
        return
    from tqdm import tqdm

    rank, world, lay, device, run_dir, _lock = start_run(cfg, args)
    check_later_phases(cfg, run_dir, rank)  # the mp4 writer, the tokenizer, writable folders: every rank, now
    rng, gen = step_rngs(cfg, lay.dp_rank)  # element choices and dropouts; sigmas, noise, posterior samples
    excluded = []  # samples left out at the start (on_bad_sample: skip); the same list on every rank
    try:  # before any weight is read: rank 0 checks every sample, every rank gets the verdict
        samples, val_samples = split_held_out(index_samples(cfg, verbose=rank == 0, excluded=excluded), cfg)
        if cfg.cache.enabled:  # a missing or stale entry: named now, not after minutes of loading weights
            CacheStore(cfg).verify_all(samples + (val_samples if reads_cache(cfg) else []))
    except BadSampleError as e:
        raise SystemExit(f"data error: {e}")
    except CacheError as e:
        raise SystemExit(f"cache error: {e}")
    except ConfigError as e:  # a hold-out that leaves nothing to train: before any weight loads
        raise SystemExit(f"config error: {e}")
    if val_samples:
        data_logger.info(f"{len({(s.dataset, s.id) for s in samples})} training samples + {len(val_samples)} "
                         f"held out for validation (validation.num_samples; never trained on)")
    parts, full_names, ds_config = build_model(cfg, run_dir, rank, lay.dp_size, device)
    if rank == 0:
        announce(cfg, run_dir, ds_config, parts, full_names, samples, device.type == "cuda")
    engine, scheduler = initialize_engine(parts, cfg, ds_config, lay)
    dtype = training_dtype(cfg)
    ema = WeightEMA.of(cfg, engine.module)  # train.ema_weight: the averaged weights validation samples with
    global_step, samples_seen, resumed = resume(args, run_dir, engine, rng, gen, rank, ema)

    # Handlers first: DataLoader workers fork at iter() and inherit them, so a process-group
    # SIGTERM (SLURM, Ctrl-C) only sets their unused flag instead of killing them mid-batch.
    stop, restore_signals = loop.stop_handlers()  # SIGTERM/SIGINT: save after this step, then exit
    data_iter = iter(make_loader(cfg, samples, rank=lay.dp_rank, world=lay.dp_size, start_sample=samples_seen))
    log = Log(run_dir, rank, first_step=global_step + 1 if resumed else 0, cfg=cfg)  # TensorBoard and/or W&B
    vis = Visualizer(cfg, run_dir, parts.vae, rank=rank, tb=log.boards, device=device)
    validator = Validator(cfg, val_samples, parts, run_dir, rank=rank, device=device, dtype=dtype, tb=log.boards,
                          ema=ema)
    if resumed is None:  # step 0: the untrained baseline (a resumed step was validated before its save)
        log.scalars(global_step, validator.maybe_run(engine, global_step))
    guard = NonFiniteGuard(cfg.train.skip_nonfinite, rank)

    def save(step, seen=None, rng_state=None):
        return ckpt.save_checkpoint(
            engine, run_dir / "checkpoints", step,
            {"global_step": step, "samples_seen": samples_seen if seen is None else seen,
             "rng": rng_state or ckpt.rng_state(rng, gen)},
            keep_last=cfg.train.keep_last, rank=rank, ema=ema)

    bar = tqdm(total=cfg.train.max_steps, initial=global_step, disable=rank != 0, desc="train", dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 30)  # logs and CI get a line every 30 s
    last_save, saved_step = time.time(), global_step
    peak, peak_source = device_peak_tflops(cfg.train.peak_tflops)  # the MFU's denominator (e2v/train/flops.py)
    logger.info(f"speed: MFU against {peak:g} TFLOPS, {peak_source}" if peak else f"speed: no MFU ({peak_source})")
    steplog = loop.StepLog(cfg, log, bar, guard, world, lay.dp_size, excluded=len(excluded),
                           flops=FlopCounter(parts.transformer, cfg), peak_tflops=peak)
    try:
        while global_step < cfg.train.max_steps:
            if world == 1:  # what an error-time save records (only a one-process run saves on error)
                step_start = (samples_seen, ckpt.rng_state(rng, gen))
            t_step = time.perf_counter()
            stepped = loop.train_step(engine, data_iter, parts, cfg, step=global_step + 1, device=device, dtype=dtype,
                                      rng=rng, gen=gen, guard=guard, vis=vis)
            global_step, samples_seen = global_step + 1, samples_seen + stepped.samples
            if ema is not None:
                ema.update(global_step)
            steplog.record(global_step, stepped, engine, scheduler, time.perf_counter() - t_step)
            log.scalars(global_step, validator.maybe_run(engine, global_step))
            every_min = cfg.train.checkpoint_every_minutes
            stopping = loop.stop_requested(stop)
            if ((cfg.train.checkpoint_every and global_step % cfg.train.checkpoint_every == 0) or stopping
                    or (every_min and distributed.any_rank(time.time() - last_save > 60 * every_min))):
                save(global_step)
                last_save, saved_step = time.time(), global_step
            if stopping:  # not exported: a preemption's grace is short, and the run is meant to go on
                logger.info(f"\nstop signal: checkpoint saved at step {global_step}; resume with --resume latest, "
                            f"or export these weights (lora/ is written at the last step only): python "
                            f"tools/export_lora.py {run_dir}/checkpoints/latest --out {run_dir}/lora")
                break
    except FloatingPointError:  # non-finite loss / gradient norm: the weights are suspect, save nothing
        restore_signals()
        raise
    except Exception as e:
        restore_signals()
        # One process: nothing else waits on a collective, so the weights of the last finished step
        # are saved before the error propagates (several ranks rely on the periodic checkpoints).
        if world == 1 and global_step > saved_step:
            logger.error(f"\nerror in step {global_step + 1}: saving step {global_step} first "
                         f"(resume with --resume latest)")
            save(global_step, *step_start)
        if isinstance(e, BadSampleError):  # named in its message: no traceback
            raise SystemExit(f"data error in step {global_step + 1}: {e}") from None
        raise
    finally:
        bar.close()
        vis.close()  # pending visualization writes land (or raise) even when the run fails
        log.close()

    if global_step >= cfg.train.max_steps:
        if saved_step < global_step:
            save(global_step)
        out = export.export_lora(parts.transformer, run_dir / "lora", full_names, rank=rank,
                                 comfyui_checkpoint=cfg.train.export_comfyui_checkpoint)
        if cfg.task == "causal":  # beside it, the file CausVid's own inference loads
            from e2v.models.load import base_state

            unrounded = (lambda: base_state(cfg)) if cfg.model.base_dtype == "fp8" else None  # fp8: the plain base
            export.export_causvid(parts.transformer, run_dir / "lora", full_names, rank=rank, base=unrounded)
        if ema is not None and ema.shadow and rank == 0:  # the average: the same files, from its weights
            ckpt.export_state(ema.shadow, export.export_meta(parts.transformer), run_dir / "lora_ema", run_dir)
        skipped_total = distributed.distinct_over_ranks(steplog.skipped_ids)  # every rank's skips, not rank 0's
        compiled = speed.compile_summary(parts.transformer)
        if rank == 0:  # the export's outputs are rank 0's
            what = "Model" if cfg.model.training_type == "full" else "LoRA"
            logger.info(f"done: {global_step} steps. Outputs in {run_dir}:\n"
                        + "\n".join(f"  {line}" for line in outputs.output_lines(run_dir, out, what, cfg))
                        + (f"\n{compiled}" if compiled else "")
                        + (f"\nskipped {skipped_total} bad sample(s) while loading" if skipped_total else "")
                        + (f"\nleft out {len(unusable(excluded))} bad sample(s) at the start "
                           "(listed there)" if excluded else ""))
    restore_signals()  # after the export: a signal during it still only sets the flag


if __name__ == "__main__":
    main()
