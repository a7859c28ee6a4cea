"""DeepSpeed checkpoints that survive a kill, and resume that continues the same run; the offline
export of a checkpoint folder (tools/export_lora.py) through e2v/train/export.py's writers.

Atomicity: every rank saves into `checkpoints/step_NNNNNN.partial/`, counting and hashing the bytes
of each file it writes (e2v/runtime/integrity.py: record_write); the ranks' records are gathered and
rank 0 writes `COMPLETE` from them (the size, SHA-256 and writing rank of every file: never a stat()
or a listing of files other nodes just wrote, which NFS can show short or absent), renames the
folder to `step_NNNNNN` and then replaces `checkpoints/latest` (write-then-rename).
`--resume latest` takes the checkpoint `latest` names when its files all match its `COMPLETE`
manifest, else the newest intact one by step, so a kill during a save, a file truncated afterwards
(a half-finished copy, a full disk) or changed in place (a disk error, an edit), or an unreadable
`latest`, falls back to the previous checkpoint. `latest` wins over a higher step because a run
resumed from an older checkpoint path leaves the abandoned branch's higher steps behind. The
checkpoint folder must be on a filesystem every rank sees (DeepSpeed's own assumption for multi-node
saves).

Exact resume: DeepSpeed's client_state is written by rank 0 only, so each rank's RNG states go
into their own `rng_rank_NNNN.safetensors`; the data order is the sampler offset (`samples_seen`).
Nothing is unpickled beyond data: see e2v/runtime/integrity.py.

Length (about 500 lines): saving and resuming are one concern (what a save writes is what resume
reads); the export writers it calls live in e2v/train/export.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from e2v.models.experts import split_names, split_state
from e2v.runtime.distributed import barrier, gather_all, is_distributed, merge_over_ranks, share_of_work, this_rank
from e2v.runtime.files import write_text_atomic
from e2v.runtime.integrity import (
    HASH,
    file_digest,
    load_rng,
    record_file,
    record_write,
    save_rng,
    weights_only_checkpoint_engine,
    weights_only_zero_to_fp32,
)
from e2v.runtime.log import get_logger
from e2v.train.ema import EMA_FILE, read_ema
from e2v.train.export import (
    BASE_FILE,
    FULL_DIR,
    export_dtype,
    export_meta,
    fuse_lora_state,
    read_base,
    save_full,
    write_causvid,
    write_lora_exports,
)

log = get_logger("e2v.checkpoint")

MANIFEST = "COMPLETE"
OPTIMIZER_FILE = "e2v_optimizer.json"  # the class that stepped the weights; a resume must use the same
EXPORT_META = "e2v_export.json"  # in each checkpoint: what tools/export_lora.py needs, offline
PARTIAL = ".partial"
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed's global rank 0 copies these into a ZeRO save


def _tag(step: int) -> str:
    return f"step_{step:06d}"


# --- RNG ---------------------------------------------------------------------------------------


def rng_state(rng: random.Random, generator: torch.Generator) -> dict:
    return {
        "python": rng.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "generator": generator.get_state(),
        # this rank's own device only: a resume may see other devices (CUDA_VISIBLE_DEVICES, fewer GPUs)
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict, rng: random.Random, generator: torch.Generator) -> None:
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    generator.set_state(state["generator"])
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):  # an older checkpoint: every visible device's state; take this rank's
        own = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda = cuda[own] if own < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)  # the current device: the rank's own (torch.cuda.set_device at start)


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's RNG file; a checkpoint saved before the states were stored as data has `.pt`."""
    new = path / f"rng_rank_{rank:04d}.safetensors"
    old = new.with_suffix(".pt")
    return old if old.exists() and not new.exists() else new


# --- the optimizer's class --------------------------------------------------------------------


def optimizer_class(engine) -> str:
    """The qualified class of the optimizer that steps the weights (under ZeRO, the one DeepSpeed wraps)."""
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def _config_value(qualified: str) -> str:
    """The deepspeed.optimizer value that builds this class."""
    if qualified.startswith("bitsandbytes."):
        return "adamw_8bit"
    return "deepspeed_adam" if qualified.startswith("deepspeed.") else "torch_adamw"


def check_optimizer_class(engine, path: Path) -> None:
    """Stop a resume whose optimizer differs from the one that saved the checkpoint: the states of
    torch's AdamW and DeepSpeed's FusedAdam / CPU Adam are not each other's (names, layout, step
    counts), and a mix would load a wrong state or fail deep in DeepSpeed. A checkpoint saved
    before the class was recorded is not checked."""
    record = Path(path) / OPTIMIZER_FILE
    if not record.is_file():
        return
    saved, now = json.loads(record.read_text())["class"], optimizer_class(engine)
    if saved != now:
        raise SystemExit(f"--resume {path}: the checkpoint was saved with the optimizer {saved} "
                         f"(deepspeed.optimizer: {_config_value(saved)}), this run builds {now} "
                         f"(deepspeed.optimizer: {_config_value(now)}); their states do not convert. Resume with "
                         f"--set deepspeed.optimizer={_config_value(saved)}, or start a new run")


# --- save / find / load ------------------------------------------------------------------------


def save_checkpoint(engine, ckpt_root: Path, step: int, client_state: dict, keep_last: int = 3,
                    rank: int = 0, ema=None) -> Path:
    """Collective: every rank calls it. `client_state["rng"]` (this rank's RNG) is stored per rank;
    `ema` (e2v/train/ema.py, the same on every rank) is written by rank 0 as EMA_FILE."""
    ckpt_root = Path(ckpt_root)
    tag = _tag(step)
    partial, final = ckpt_root / f"{tag}{PARTIAL}", ckpt_root / tag
    client_state = dict(client_state)
    rng = client_state.pop("rng", None)
    if rank == 0:
        remove_stale_saves(ckpt_root)
    barrier()
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine)  # records what DeepSpeed writes
    engine.checkpoint_engine.written.clear()
    # Lean: the frozen base weights stay out (a resume loads them from the model folder anyway);
    # a full fine-tune has none, so it saves everything. load_checkpoint reads either format.
    engine.save_checkpoint(str(ckpt_root), tag=partial.name, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=True)
    mine = dict(engine.checkpoint_engine.written)  # path -> this rank's record of what it wrote
    if rng is not None:
        path = partial / f"rng_rank_{rank:04d}.safetensors"
        mine[str(path)] = save_rng(rng, path)
    if rank == 0:
        for name, data in ((OPTIMIZER_FILE, {"class": optimizer_class(engine)}),
                           (EXPORT_META, export_meta(engine.module))):
            text = json.dumps(data, indent=2, default=sorted).encode()
            mine[str(partial / name)] = record_write(partial / name, lambda f: f.write(text))
        payload = ema.payload() if ema is not None else None
        if payload is not None:
            mine[str(partial / EMA_FILE)] = record_write(partial / EMA_FILE, lambda f: f.write(payload))
        if _link_or_copy(ckpt_root.parent / BASE_FILE, partial / BASE_FILE):  # a checkpoint exports alone
            mine[str(partial / BASE_FILE)] = _base_record(partial / BASE_FILE)
        for name in RECOVERY_SCRIPTS:  # DeepSpeed's rank 0 copies them in without its engine
            if (partial / name).is_file():
                mine[str(partial / name)] = record_file(partial / name)
    files = gather_records(partial, mine)  # a collective: after it, every rank's files are written
    if rank == 0:
        world = torch.distributed.get_world_size() if is_distributed() else 1
        write_text_atomic(partial / MANIFEST, json.dumps({"step": step, "world_size": world, "hash": HASH,
                                                      "files": files}, indent=1), durable=True)
        if final.exists():  # the same step saved again (a resumed run re-saving): swap, then drop the old one
            old = ckpt_root / f"{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        write_text_atomic(ckpt_root / "latest", tag, durable=True)  # DeepSpeed's zero_to_fp32 reads this file
        prune_checkpoints(ckpt_root, keep_last)
    barrier()
    return final


_BASE_RECORDS: dict = {}  # (device, inode, size, mtime_ns) -> record_file's record, for _base_record


def _base_record(path: Path) -> dict:
    """record_file of a checkpoint's BASE_FILE, hashed once per process for the run's one file:
    every save hard-links the same inode (rank 0 wrote it at the start of this run), so only a
    copy (a new inode) or a rewritten file is read and hashed again."""
    st = Path(path).stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _BASE_RECORDS:
        _BASE_RECORDS[key] = record_file(path)
    return _BASE_RECORDS[key]


def _link_or_copy(src: Path, dst: Path) -> bool:
    """A hard link (no space, no time) where the filesystem allows, else a copy; nothing (False)
    if `src` does not exist."""
    if not src.is_file():
        return False
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return True


def remove_stale_saves(ckpt_root: Path) -> list[Path]:
    """Delete the `step_N.partial/` folders of saves that were cut short (~100 GB each at 14B;
    find_resume never uses them). Only one save runs at a time, so at the start of a save every
    such folder is stale; completed `step_N/` folders are never touched. Rank 0 only. Returns the
    deleted folders."""
    stale = sorted(p for p in Path(ckpt_root).glob(f"step_*{PARTIAL}") if p.is_dir())
    for p in stale:
        log.info(f"removing {p}: left by a save that did not finish")
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> list[Path]:
    """Keep the `keep_last` newest completed checkpoints by step (0: keep all) and, always, the one
    `latest` names (after a resume from an older path it is not among the highest steps).
    Completed: a readable manifest, which the save wrote from its writers' records; the files
    are not stat()ed (just after a save, another node's files can look short on NFS). Returns the
    deleted folders."""
    if keep_last <= 0:
        return []
    pointed = _latest_pointer(ckpt_root)
    doomed = [p for p in complete_checkpoints(ckpt_root, sizes=False)[:-keep_last] if p != pointed]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def gather_records(folder: Path, mine: dict) -> dict:
    """The manifest's files: {name relative to `folder`: {"bytes", HASH, "rank"}} from every rank's
    record of the files it wrote (`mine`: path -> record), gathered (a collective). Two ranks
    recording one file with different bytes is an error naming both."""
    files: dict = {}
    for r, part in enumerate(gather_all({str(Path(p).relative_to(folder)): rec for p, rec in mine.items()})):
        for name, rec in part.items():
            seen = files.get(name)
            if seen is not None and {k: seen[k] for k in rec} != rec:
                raise RuntimeError(f"checkpoint {folder}: ranks {seen['rank']} and {r} both wrote {name}, with "
                                   "different bytes; the checkpoint is not saved")
            files.setdefault(name, {**rec, "rank": r})
    return dict(sorted(files.items()))


def _manifest_files(path: Path) -> dict | str:
    """The manifest's {name: {"bytes", ...}} of a checkpoint folder, or why there is none."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        return f"no {MANIFEST} manifest (the save was interrupted)"
    try:
        files = json.loads(manifest.read_text())["files"]
        files = {n: v if isinstance(v, dict) else {"bytes": v} for n, v in files.items()}
        for v in files.values():
            int(v["bytes"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST} manifest ({type(e).__name__}: {e})"
    return files


def checkpoint_problem(path: Path, checksums: bool = True) -> str | None:
    """Why the checkpoint folder cannot be resumed from, or None if every file is as saved: present,
    of the recorded size and, with `checksums`, of the recorded SHA-256 (which reads every byte,
    split over the ranks: then a collective that every rank calls for the same folder). Manifests
    written before checksums were recorded hold sizes only."""
    files = _manifest_files(path)
    if isinstance(files, str):
        return files
    for name, rec in files.items():
        f = Path(path) / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != rec["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, {rec['bytes']} were saved (truncated)"
    if not checksums:
        return None
    bad = {n: f"{Path(path) / n} does not match the {HASH} recorded when it was saved (changed since: "
              "a disk or copy error, or an edit)"
           for n in share_of_work([n for n in files if HASH in files[n]]) if file_digest(Path(path) / n) != files[n][HASH]}
    bad = merge_over_ranks(bad)
    return bad[min(bad)] if bad else None


def _step(path: Path) -> int | None:
    """The step of a `step_N` checkpoint folder name, None for anything else (`.partial`)."""
    m = re.fullmatch(r"step_(\d+)", Path(path).name)
    return int(m.group(1)) if m else None


def complete_checkpoints(ckpt_root: Path, sizes: bool = True) -> list[Path]:
    """Checkpoint folders that finished on every rank and (with `sizes`) whose files have their
    recorded sizes, oldest first by step (not by name: `step_1000000` sorts before `step_999999`)."""
    if not Path(ckpt_root).exists():
        return []

    def intact(p: Path) -> bool:
        return checkpoint_problem(p, checksums=False) is None if sizes else isinstance(_manifest_files(p), dict)

    found = [p for p in Path(ckpt_root).glob("step_*") if p.is_dir() and _step(p) is not None and intact(p)]
    return sorted(found, key=_step)


def read_latest(ckpt_root: Path) -> tuple[Path | None, str | None]:
    """(the checkpoint folder `checkpoints/latest` names, None) or (None, why it names none): the
    file is missing, or holds anything but a `step_N` name in UTF-8 (a damaged disk block, an edit)."""
    pointer = Path(ckpt_root) / "latest"
    if not pointer.is_file():
        return None, f"{pointer} does not exist"
    raw = pointer.read_bytes()
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{pointer} is not text ({len(raw)} bytes, starting {raw[:16]!r})"
    if _step(name) is None:
        return None, f"{pointer} holds {name[:60]!r}, not a step_N folder name"
    return Path(ckpt_root) / name, None


def _latest_pointer(ckpt_root: Path) -> Path | None:
    return read_latest(ckpt_root)[0]


def find_resume(resume: str, run_dir: Path | None) -> Path | None:
    """`latest` -> the checkpoint `checkpoints/latest` names if it is intact, else the newest
    intact one by step (None if there is none); a path -> that checkpoint folder (must be intact).
    Checksums are verified for the pick only (a collective: every rank calls find_resume); a pick
    whose files changed since the save gives way to the next newest."""
    if resume == "latest":
        root = Path(run_dir) / "checkpoints" if run_dir else None
        if root is None or not root.exists():
            return None
        pointed, why = read_latest(root)
        if pointed is None and (root / "latest").exists():
            log.info(f"ignoring {root / 'latest'}: {why}")
        if pointed is not None:
            problem = checkpoint_problem(pointed) if pointed.is_dir() else "the folder is missing"
            if problem is None:
                return pointed
            log.info(f"skipping {pointed} (named by {root / 'latest'}): {problem}")
        found = [p for p in complete_checkpoints(root) if p != pointed]  # sizes match; newest first below
        newest = _step(found[-1]) if found else -1
        for p in sorted(root.glob("step_*")):  # say why anything newer than the pick is not used
            m = re.match(r"step_(\d+)", p.name)
            if p not in found and p != pointed and m and int(m.group(1)) > newest:
                log.info(f"skipping {p}: {checkpoint_problem(p, checksums=False) or 'not a checkpoint folder'}")
        for p in reversed(found):
            problem = checkpoint_problem(p)
            if problem is None:
                return p
            log.info(f"skipping {p}: {problem}")
        return None
    path = Path(resume)
    problem = checkpoint_problem(path)
    if problem:
        raise FileNotFoundError(f"--resume {resume}: cannot resume from this folder: {problem}. "
                                "Use --resume latest to take the newest intact checkpoint.")
    return path


def load_checkpoint(engine, path: Path) -> dict:
    """Model, optimizer, LR schedule and client state (step, samples seen), plus this rank's RNG."""
    path = Path(path)
    check_optimizer_class(engine, path)  # before any state is read into the engine
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine)  # DeepSpeed's own unpickles anything
    _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True, load_module_strict=False,
                                             custom_load_fn=_load_module_state(path))
    if client_state is None:
        raise RuntimeError(f"could not load checkpoint {path}")
    rank = this_rank()
    rng_file = _rng_file(path, rank)
    if rng_file.exists():
        client_state["rng"] = load_rng(rng_file)
    else:
        saved = json.loads((path / MANIFEST).read_text()).get("world_size")
        raise FileNotFoundError(f"{rng_file} is missing: the checkpoint was saved by {saved} process(es); "
                                "resume with the same number of processes")
    return client_state


def _load_module_state(path: Path):
    """DeepSpeed's module load for a checkpoint with or without the frozen weights: a lean one
    (saved with `exclude_frozen_parameters`) lacks exactly the frozen parameters, which keep the
    values the model folder gave them; an older one holds them too, and they load as saved (the
    same values). Anything else missing, or a tensor the model does not have, is an error naming
    the checkpoint."""
    def load(src: dict, dst: torch.nn.Module) -> None:
        frozen = {n for n, p in dst.named_parameters() if not p.requires_grad}
        result = dst.load_state_dict(src, strict=False)
        missing = sorted(set(result.missing_keys) - frozen)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint {path} does not fit this model: missing trained tensors {missing[:5]}, "
                               f"unexpected {sorted(result.unexpected_keys)[:5]}; resume with the config it was "
                               "saved with (model, lora, train.trainable)")
    return load


# --- offline export from a checkpoint folder (tools/export_lora.py) ----------------------------


def state_from_checkpoint(path: Path) -> tuple[dict, dict]:
    """(fp32 state dict of the trained parameters in module naming, export metadata), read from
    a DeepSpeed checkpoint folder on CPU, any ZeRO stage, with no process group."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem:
        raise FileNotFoundError(f"{path}: {problem}")
    meta = json.loads((path / EXPORT_META).read_text())
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with weights_only_zero_to_fp32():
        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name,
                                                         exclude_frozen_parameters=meta["training_type"] == "lora")
    return {k: v.float() for k, v in state.items()}, meta


def export_checkpoint(path: Path, out_dir: Path, ema: bool = False) -> Path:
    """The same files export_lora (and, task: causal, export_causvid) write at the end of a run,
    from a checkpoint folder; `ema`: from the checkpoint's EMA weights (e2v/train/ema.py) instead
    of its trained ones (what the run exports as lora_ema/)."""
    state, meta = state_from_checkpoint(path)
    if ema:
        state = {**state, **ema_state(path)}
    return export_state(state, meta, out_dir, Path(path).parent.parent, Path(path) / BASE_FILE)


def export_state(state: dict, meta: dict, out_dir: Path, run_dir: Path, *base_files: Path) -> Path:
    """The export files of the trained parameters `state` (fp32, module names) of a model described by
    `meta` (export.export_meta): a checkpoint's (export_checkpoint) or, at the end of a run, its EMA
    (train_e2v.py writes lora_ema/ with it, on rank 0 alone: no collective). The run folder `run_dir`
    gives the base modules' copies (and base_files before them) and, for a causal LoRA's CausVid file,
    the base its config.yaml loads."""
    all_base = read_base(*base_files, Path(run_dir) / BASE_FILE)
    out = Path(out_dir)
    for expert in meta.get("experts") or [""]:  # Wan2.2's experts: one folder each, plain names
        folder, st = out / expert if expert else out, split_state(state, expert)
        if meta["training_type"] == "full":
            save_full({k: v.to(export_dtype(k)) for k, v in st.items()}, meta["transformer_config"], folder / FULL_DIR)
            out = out if expert else folder / FULL_DIR
            continue
        lora = {re.sub(r"\.lora_(A|B)\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in st.items() if "lora_" in k}
        extra = {n.replace(".base_layer", ""): st[n] for n in split_names(meta["full_names"], expert)}
        write_lora_exports(folder, lora, extra, meta, base=split_state(all_base, expert))
    if meta.get("task") == "causal":  # beside them, CausVid's file (one transformer: the loop ran once)
        whole = state if meta["training_type"] == "full" else fuse_lora_state(run_base(run_dir), lora, extra, meta)
        write_causvid(whole, Path(out_dir), meta)
    return out


def ema_state(path: Path) -> dict:
    """A checkpoint's EMA weights (fp32, module names), an error naming the file when it has none."""
    state = read_ema(Path(path) / EMA_FILE)
    if state is None:
        raise FileNotFoundError(f"{Path(path) / EMA_FILE} is missing: the checkpoint holds no EMA weights (its run had "
                                "train.ema_weight 0, or saved before train.ema_start_step); export without --ema")
    return state


def run_base(run_dir: Path) -> dict:
    """The frozen base a LoRA run trained on, which its checkpoints do not hold (a lean save): the
    base the run folder's config.yaml loads (e2v.models.load.base_state), as a state dict."""
    from e2v.config.load import load_config
    from e2v.models.load import base_state
    from e2v.models.weights import require_weights

    config = Path(run_dir) / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} is missing: a LoRA checkpoint of task: causal exports e2v_causvid.pt "
                                "(the LoRA fused into its base) from its run's config.yaml beside checkpoints/; "
                                "export from the run folder's checkpoints/step_N")
    cfg = load_config(config, check_paths=False)
    require_weights(cfg)  # a base that is not here: weights.py's one line, before any loader runs
    return base_state(cfg)
