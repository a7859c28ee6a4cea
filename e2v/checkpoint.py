"""DeepSpeed checkpoints that survive a kill, resume that continues the same run, a guard against
non-finite losses, and exports that load in plain diffusers (and ComfyUI) with no DeepSpeed.

Atomicity: every rank saves into `checkpoints/step_NNNNNN.partial/`; after a barrier the ranks hash
the folder's files between them and rank 0 writes `COMPLETE` (the size and SHA-256 of every file),
renames the folder to `step_NNNNNN` and then replaces `checkpoints/latest` (write-then-rename).
`--resume latest` takes the checkpoint `latest` names when its files all match its `COMPLETE`
manifest, else the newest intact one by step, so a kill during a save, a file truncated afterwards
(a half-finished copy, a full disk) or changed in place (a disk error, an edit), or an unreadable
`latest`, falls back to the previous checkpoint. `latest` wins over a higher step because a run
resumed from an older checkpoint path leaves the abandoned branch's higher steps behind. The
checkpoint folder must be on a filesystem every rank sees (DeepSpeed's own assumption for multi-node
saves).

Exact resume: DeepSpeed's client_state is written by rank 0 only, so each rank's RNG states go
into their own `rng_rank_NNNN.safetensors`; the data order is the sampler offset (`samples_seen`).
Nothing is unpickled beyond data: see e2v/integrity.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from e2v.integrity import (HASH, file_digest, load_rng, save_rng, usual_permissions,
                           weights_only_checkpoint_engine, weights_only_zero_to_fp32)

LORA_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "pytorch_lora_weights_comfyui.safetensors"  # LoRA + trained modules as `.diff`: ComfyUI's LoRA loader
EXTRA_FILE = "e2v_modules.safetensors"  # fully trained modules beside the LoRA (load_lora_weights rejects them)
COMFY_EXTRA_FILE = "e2v_modules_comfyui.safetensors"  # the same modules under original Wan names
MODEL_FILE = "e2v_model.json"  # what inference needs to rebuild the model shape
FULL_DIR = "transformer"  # full fine-tune: the transformer via save_pretrained (bf16; fp32 where diffusers keeps it)
MANIFEST = "COMPLETE"
EXPORT_META = "e2v_export.json"  # in each checkpoint: what tools/export_lora.py needs, offline
BASE_FILE = "e2v_base_modules.safetensors"  # run folder (and each checkpoint): trained-in-full modules before training
PARTIAL = ".partial"


def _tag(step: int) -> str:
    return f"step_{step:06d}"


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dist_barrier() -> None:
    if _dist():
        torch.distributed.barrier()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist() else 0


def init_distributed() -> None:
    """`deepspeed.init_distributed` with NCCL on CUDA, gloo elsewhere.

    On the CPU accelerator DeepSpeed JIT-compiles a shared-memory op (`deepspeed_shm_comm`) at
    every first init. Only `inference_all_reduce` uses it, never training; the compile costs ~30 s
    on a fresh 2-core machine, and torch's build lock (`~/.cache/torch_extensions/*/lock`) is never
    cleared when a build is killed, after which every later run waits on it forever, printing
    nothing. So CPU runs opt out of the op (set E2V_DS_SHM_COMM=1 to keep it)."""
    import deepspeed
    import deepspeed.ops

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("E2V_DS_SHM_COMM", "0") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # read before the backend builds it
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (a collective: all ranks must call it)."""
    if not _dist():
        return bool(flag)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"  # NCCL: CUDA only
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def install_stop_handlers() -> dict:
    """SIGTERM/SIGINT ask the loop to save and exit after the current step. Repeated signals
    change nothing: the deepspeed launcher forwards the signal it gets to every rank (which
    usually got it already from the scheduler or the terminal) and kills the ranks 30 s later,
    so a save that takes longer is cut short and the atomic protocol falls back to the previous
    checkpoint."""
    stop = {"signal": None}

    def handler(sig, _frame):
        stop["signal"] = sig

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop


# --- RNG ---------------------------------------------------------------------------------------


def rng_state(rng: random.Random, generator: torch.Generator) -> dict:
    return {
        "python": rng.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "generator": generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict, rng: random.Random, generator: torch.Generator) -> None:
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    generator.set_state(state["generator"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's RNG file; a checkpoint saved before the states were stored as data has `.pt`."""
    new = path / f"rng_rank_{rank:04d}.safetensors"
    old = new.with_suffix(".pt")
    return old if old.exists() and not new.exists() else new


# --- save / find / load ------------------------------------------------------------------------


def save_checkpoint(engine, ckpt_root: Path, step: int, client_state: dict, keep_last: int = 3,
                    rank: int = 0) -> Path:
    """Collective: every rank calls it. `client_state["rng"]` (this rank's RNG) is stored per rank."""
    ckpt_root = Path(ckpt_root)
    tag = _tag(step)
    partial, final = ckpt_root / f"{tag}{PARTIAL}", ckpt_root / tag
    client_state = dict(client_state)
    rng = client_state.pop("rng", None)
    if rank == 0:
        remove_stale_saves(ckpt_root)
    _dist_barrier()
    engine.save_checkpoint(str(ckpt_root), tag=partial.name, client_state=client_state, save_latest=False)
    if rng is not None:
        save_rng(rng, partial / f"rng_rank_{rank:04d}.safetensors")
    if rank == 0:
        (partial / EXPORT_META).write_text(json.dumps(export_meta(engine.module), indent=2, default=sorted))
        _link_or_copy(ckpt_root.parent / BASE_FILE, partial / BASE_FILE)  # a checkpoint exports alone
    _dist_barrier()
    files = _hash_files(partial)  # every rank hashes its share of the files; a collective
    if rank == 0:
        world = torch.distributed.get_world_size() if _dist() else 1
        _write_atomic(partial / MANIFEST, json.dumps({"step": step, "world_size": world, "hash": HASH,
                                                      "files": files}, indent=1))
        if final.exists():  # the same step saved again (a resumed run re-saving): swap, then drop the old one
            old = ckpt_root / f"{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _write_atomic(ckpt_root / "latest", tag)  # DeepSpeed's zero_to_fp32 reads this file
        prune_checkpoints(ckpt_root, keep_last)
    _dist_barrier()
    return final


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (no space, no time) where the filesystem allows, else a copy; nothing if `src`
    does not exist."""
    if not src.is_file():
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def remove_stale_saves(ckpt_root: Path) -> list[Path]:
    """Delete the `step_N.partial/` folders of saves that were cut short (~100 GB each at 14B;
    find_resume never uses them). Only one save runs at a time, so at the start of a save every
    such folder is stale; completed `step_N/` folders are never touched. Rank 0 only. Returns the
    deleted folders."""
    stale = sorted(p for p in Path(ckpt_root).glob(f"step_*{PARTIAL}") if p.is_dir())
    for p in stale:
        print(f"[e2v checkpoint] removing {p}: left by a save that did not finish")
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> list[Path]:
    """Keep the `keep_last` newest intact checkpoints by step (0: keep all) and, always, the one
    `latest` names (after a resume from an older path it is not among the highest steps).
    Returns the deleted folders."""
    if keep_last <= 0:
        return []
    pointed = _latest_pointer(ckpt_root)
    doomed = [p for p in complete_checkpoints(ckpt_root)[:-keep_last] if p != pointed]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _share(items: list) -> list:
    """This rank's share of a list every rank holds in the same order."""
    if not _dist():
        return items
    return items[torch.distributed.get_rank()::torch.distributed.get_world_size()]


def _gather(part: dict) -> dict:
    """The union of every rank's dict (a collective when distributed)."""
    if not _dist():
        return part
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _hash_files(folder: Path) -> dict:
    """{relative name: {"bytes", HASH}} of every file in the folder, the hashing split over the
    ranks (the files were just written: mostly read back from the page cache). A collective."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    mine = {n: {"bytes": (folder / n).stat().st_size, HASH: file_digest(folder / n)} for n in _share(names)}
    return dict(sorted(_gather(mine).items()))


def checkpoint_problem(path: Path, checksums: bool = True) -> str | None:
    """Why the checkpoint folder cannot be resumed from, or None if every file is as saved: present,
    of the recorded size and, with `checksums`, of the recorded SHA-256 (which reads every byte,
    split over the ranks: then a collective that every rank calls for the same folder). Manifests
    written before checksums were recorded hold sizes only."""
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
           for n in _share([n for n in files if HASH in files[n]]) if file_digest(Path(path) / n) != files[n][HASH]}
    bad = _gather(bad)
    return bad[min(bad)] if bad else None


def _step(path: Path) -> int | None:
    """The step of a `step_N` checkpoint folder name, None for anything else (`.partial`)."""
    m = re.fullmatch(r"step_(\d+)", Path(path).name)
    return int(m.group(1)) if m else None


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders that finished on every rank and are intact, oldest first by step (not by
    name: `step_1000000` sorts before `step_999999`)."""
    if not Path(ckpt_root).exists():
        return []
    found = [p for p in Path(ckpt_root).glob("step_*")
             if p.is_dir() and _step(p) is not None and checkpoint_problem(p, checksums=False) is None]
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
        if pointed is None and (root / "latest").exists() and _rank() == 0:
            print(f"[e2v checkpoint] ignoring {root / 'latest'}: {why}")
        if pointed is not None:
            problem = checkpoint_problem(pointed) if pointed.is_dir() else "the folder is missing"
            if problem is None:
                return pointed
            if _rank() == 0:
                print(f"[e2v checkpoint] skipping {pointed} (named by {root / 'latest'}): {problem}")
        found = [p for p in complete_checkpoints(root) if p != pointed]  # sizes match; newest first below
        newest = _step(found[-1]) if found else -1
        for p in sorted(root.glob("step_*")):  # say why anything newer than the pick is not used
            m = re.match(r"step_(\d+)", p.name)
            if p not in found and p != pointed and m and int(m.group(1)) > newest and _rank() == 0:
                print(f"[e2v checkpoint] skipping {p}: "
                      f"{checkpoint_problem(p, checksums=False) or 'not a checkpoint folder'}")
        for p in reversed(found):
            problem = checkpoint_problem(p)
            if problem is None:
                return p
            if _rank() == 0:
                print(f"[e2v checkpoint] skipping {p}: {problem}")
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
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine)  # DeepSpeed's own unpickles anything
    _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise RuntimeError(f"could not load checkpoint {path}")
    rank = _rank()
    rng_file = _rng_file(path, rank)
    if rng_file.exists():
        client_state["rng"] = load_rng(rng_file)
    else:
        saved = json.loads((path / MANIFEST).read_text()).get("world_size")
        raise FileNotFoundError(f"{rng_file} is missing: the checkpoint was saved by {saved} process(es); "
                                "resume with the same number of processes")
    return client_state


# --- non-finite guard --------------------------------------------------------------------------


class NonFiniteGuard:
    """A non-finite loss (checked before backward, so nothing is updated) or gradient norm
    (DeepSpeed's ZeRO optimizers already skip such a step) stops the run naming the step, the
    rank(s) and the sample ids, or, with train.skip_nonfinite, is skipped and counted. All ranks
    decide together, so no rank is left waiting in a collective. Too many skips in a row mean the
    weights themselves are broken: that stops the run even in skip mode."""

    MAX_CONSECUTIVE = 20

    def __init__(self, skip: bool, rank: int):
        self.skip, self.rank = skip, rank
        self.skipped, self.consecutive = 0, 0

    def bad(self, value: float, what: str, step: int, sample_ids: list) -> bool:
        """True (on every rank) if this micro-batch / step is to be skipped; raises to stop."""
        bad_here = not np.isfinite(value)
        if not any_rank(bad_here):
            self.consecutive = 0
            return False
        reports = [(self.rank, value, list(sample_ids))]
        if _dist():
            reports = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(reports, (self.rank, value, list(sample_ids)))
        where = "; ".join(f"rank {r}: {what} {v}, samples {ids}" for r, v, ids in reports if not np.isfinite(v))
        self.skipped, self.consecutive = self.skipped + 1, self.consecutive + 1
        if self.skip and self.consecutive <= self.MAX_CONSECUTIVE:
            if self.rank == 0:
                print(f"\n[e2v] step {step}: non-finite {what} skipped ({where}); {self.skipped} skipped so far")
            return True
        why = (f"{self.consecutive} non-finite in a row with train.skip_nonfinite" if self.skip
               else "set train.skip_nonfinite: true to skip such steps")
        raise FloatingPointError(f"non-finite {what} at step {step} ({where}). Nothing was saved from this step; "
                                 f"resume from the last checkpoint with --resume latest, e.g. with a lower "
                                 f"train.lr ({why})")

    def grad_norm(self, value, step: int, sample_ids: list) -> float:
        """The step's global gradient norm as a float (nan when DeepSpeed does not compute it),
        checked like a loss: DeepSpeed skipped the update of a non-finite step, we stop or count it."""
        if value is None:
            return float("nan")
        self.bad(float(value), "gradient norm", step, sample_ids)
        return float(value)


# --- exports -----------------------------------------------------------------------------------


def _gathered(params: list[torch.nn.Parameter]):
    """Under ZeRO-3 parameters are empty outside GatheredParameters; elsewhere a no-op."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _master(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The fp32 master copy DeepSpeed's optimizer holds (a collective under ZeRO), or None when
    the parameter is not managed by a ZeRO optimizer. Under bf16 the module weight is a rounded copy."""
    if not (hasattr(param, "_hp_mapping") or hasattr(param, "_z3_optimizer")):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def _adapter_name(transformer) -> str:
    return next(iter(transformer.peft_config))


def trained_state(transformer: torch.nn.Module, full_names: list[str], keep: bool = True) -> tuple[dict, dict]:
    """(LoRA state dict in diffusers naming, fully-trained module weights), gathered, fp32 CPU,
    from the optimizer's fp32 master copies when DeepSpeed holds them. Collective under ZeRO:
    every rank gathers, only a rank with `keep` (rank 0) holds the copies (6.4 B trained
    parameters of configs/e2v.yaml are 24 GiB of fp32 per rank that keeps them)."""
    named = dict(transformer.named_parameters())
    lora_names = [n for n, p in named.items() if "lora_" in n and p.requires_grad]
    lora, extra = {}, {}
    if getattr(transformer, "peft_config", None):
        adapter = f".{_adapter_name(transformer)}"
        for n in lora_names:
            lora[n.replace(adapter, "")] = _full_fp32(named[n], keep)
        from peft.utils import get_peft_model_state_dict

        with _gathered([named[n] for n in lora_names]):  # ZeRO-3: peft warns about empty shards otherwise
            expected = set(get_peft_model_state_dict(transformer))
        if keep and expected != set(lora):
            raise RuntimeError(f"LoRA export keys differ from peft's: {sorted(expected ^ set(lora))[:5]}")
    for n in full_names:
        extra[n.replace(".base_layer", "")] = _full_fp32(named[n], keep)
    if not keep:
        return {}, {}
    return lora, extra


def _full_fp32(param: torch.nn.Parameter, keep: bool = True) -> torch.Tensor | None:
    """The whole parameter in fp32 on the CPU (a collective under ZeRO); None where not `keep`."""
    master = _master(param)
    if master is not None:
        return master.detach().float().cpu().clone() if keep else None
    with _gathered([param]):
        return param.detach().float().cpu().clone() if keep else None


def export_meta(transformer: torch.nn.Module) -> dict:
    """Everything an offline export needs besides the weights: the transformer config, the LoRA
    adapter config, and which parameters train in full (all of them for a full fine-tune)."""
    peft = getattr(transformer, "peft_config", None)
    trainable = [n for n, p in transformer.named_parameters() if p.requires_grad]
    config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
    return {
        "transformer_config": config,
        "lora": peft[_adapter_name(transformer)].to_dict() if peft else None,
        "full_names": [n for n in trainable if "lora_" not in n],
        "training_type": "lora" if peft else "full",
    }


def save_base_modules(transformer: torch.nn.Module, full_names: list[str], run_dir: Path, rank: int = 0,
                      exclude: list[str] = ()) -> Path | None:
    """Before training: the modules a LoRA run trains in full, as the base model has them (fp32),
    into `<run_dir>/BASE_FILE`; the ComfyUI export writes each trained module as its difference
    from these. `exclude`: name patterns of modules the base lacks (those an expansion of a T2V base
    added or widened), which cannot be differences. Only the trained-in-full tensors are copied,
    one at a time (gathered under ZeRO-3: a collective); rank 0 holds them until written."""
    from safetensors.torch import save_file

    if not getattr(transformer, "peft_config", None):  # a full fine-tune exports the whole model
        return None
    named = dict(transformer.named_parameters())
    names = [n for n in full_names if not any(re.search(p, n) for p in exclude)]
    base = {}
    for n in names:
        value = _full_fp32(named[n])  # every rank takes part in the gather; rank 0 keeps the copy
        if rank == 0:
            base[n.replace(".base_layer", "")] = value
    if not base:
        return None
    path = Path(run_dir) / BASE_FILE
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in base.items()}, str(tmp))
    os.replace(tmp, path)
    usual_permissions(path)
    return path


def _read_base(*candidates: Path) -> dict:
    from safetensors.torch import load_file

    for path in candidates:
        if Path(path).is_file():
            return load_file(str(path))
    return {}


def export_lora(transformer: torch.nn.Module, out_dir: Path, full_names: list[str], rank: int = 0) -> Path:
    """LoRA run: the diffusers-format LoRA with adapter metadata (without it the loader sets
    alpha = r), a ComfyUI file (the LoRA plus the fully-trained modules as differences from the
    base weights the run saved beside `out_dir`), the fully-trained modules and the model shape.
    Full fine-tune: the transformer in bf16 (fp32 where diffusers keeps fp32) via save_pretrained
    in `<out_dir>/transformer`.
    Collective under ZeRO: every rank calls it, rank 0 writes."""
    meta = export_meta(transformer)
    if meta["training_type"] == "full":
        return export_full(transformer, Path(out_dir) / FULL_DIR, rank=rank)
    lora, extra = trained_state(transformer, full_names, keep=rank == 0)
    if rank == 0:
        write_lora_exports(Path(out_dir), lora, extra, meta, base=_read_base(Path(out_dir).parent / BASE_FILE))
    return Path(out_dir)


def _export_dtype(name: str) -> torch.dtype:
    """bf16, except the modules diffusers keeps in fp32: rounding them to bf16 would change the
    model diffusers loads."""
    from e2v.precision import kept_in_fp32

    return torch.float32 if kept_in_fp32(name) else torch.bfloat16


def export_full(transformer: torch.nn.Module, out_dir: Path, rank: int = 0) -> Path:
    """The whole transformer in bf16 (fp32 where diffusers keeps fp32), diffusers layout.
    Parameters are gathered one at a time, so no rank holds more than one full parameter beyond
    rank 0's copy of the model."""
    state = {}
    for name, p in transformer.named_parameters():
        value = _full_fp32(p, keep=rank == 0)
        if rank == 0:
            state[name] = value.to(_export_dtype(name))
    if rank == 0:
        for name, b in transformer.named_buffers():
            state[name] = b.detach().cpu()
        save_full(state, dict(transformer.config), out_dir)
    return out_dir


def save_full(state: dict, config: dict, out_dir: Path) -> None:
    from diffusers import WanTransformer3DModel

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    expected = set(model.state_dict())  # the rope tables are non-persistent buffers, rebuilt at load
    missing = sorted(expected - set(state))
    if missing:
        raise KeyError(f"full export: no weights for {missing[:5]}")
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True, assign=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    usual_permissions(*Path(out_dir).iterdir())


def write_lora_exports(out_dir: Path, lora: dict, extra: dict, meta: dict, base: dict | None = None) -> None:
    """`base`: the trained modules' weights before training (BASE_FILE); each module found there
    goes into the ComfyUI file as a difference, the others only into the modules files."""
    from diffusers.loaders import WanLoraLoaderMixin
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if lora:
        WanLoraLoaderMixin.save_lora_weights(str(out_dir), transformer_lora_layers=lora,
                                             transformer_lora_adapter_metadata=meta["lora"])
        try:  # the diffusers LoRA above is the primary export; an unmappable target costs only this copy
            check_comfy_mappable(sorted({k.rsplit(".lora_", 1)[0] for k in lora}))
            diffs, kept = comfy_diffs(extra, base or {})
            if kept:
                print(f"[e2v export] {len(kept)} trained tensors the base model lacks (e.g. {kept[0]}) cannot be "
                      f"differences in {COMFY_FILE}: they are in {COMFY_EXTRA_FILE} (full weights) only")
            save_file({k: v.contiguous() for k, v in {**comfy_lora(lora, meta["lora"]["lora_alpha"]), **diffs}.items()},
                      str(out_dir / COMFY_FILE))
        except ValueError as e:
            print(f"[e2v export] no {COMFY_FILE}: {e}")
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, str(out_dir / EXTRA_FILE))
        save_file({f"diffusion_model.{wan_original_key(k)}": v.contiguous() for k, v in extra.items()},
                  str(out_dir / COMFY_EXTRA_FILE))
    c = meta["transformer_config"]
    shape = {"in_channels": c["in_channels"], "image_dim": c.get("image_dim"),
             "added_kv_proj_dim": c.get("added_kv_proj_dim"), "extra_modules": sorted(extra)}
    (out_dir / MODEL_FILE).write_text(json.dumps(shape, indent=2))
    usual_permissions(*(out_dir / f for f in (LORA_FILE, COMFY_FILE, EXTRA_FILE, COMFY_EXTRA_FILE, MODEL_FILE)))


def comfy_diffs(extra: dict, base: dict) -> tuple[dict, list[str]]:
    """ComfyUI's full-weight differences for the trained modules the base model has (same name and
    shape in `base`): `diffusion_model.<Wan module>.diff` for a weight, `.diff_b` for its bias,
    `diffusion_model.<Wan parameter>.diff` for a parameter that is not a module's weight or bias
    (the modulation tables). ComfyUI's LoRA loader accepts `<key>.diff` for every model key it
    knows (`<module>` for a `.weight`, the full name for anything else) and adds it to the weight;
    `<module>.diff_b` to the bias. Returns (differences, names of trained tensors that have none)."""
    diffs, kept = {}, []
    for name, value in sorted(extra.items()):
        if name not in base or base[name].shape != value.shape:
            kept.append(name)
            continue
        key = wan_original_key(name)
        leaf = {".weight": ".diff", ".bias": ".diff_b"}
        stem, suffix = next(((key[: -len(s)], d) for s, d in leaf.items() if key.endswith(s)), (key, ".diff"))
        diffs[f"diffusion_model.{stem}{suffix}"] = value.float() - base[name].float()
    return diffs, kept


# Diffusers names -> original Wan2.1 names (what ComfyUI and the Wan repo use): the inverse of
# diffusers' `convert_wan_transformer_to_diffusers` (loaders/single_file_utils.py, weights) and
# `_convert_non_diffusers_wan_lora_to_diffusers` (loaders/lora_conversion_utils.py, LoRAs).
# Applied in order, first match wins; keys are module names, or parameter names for the
# modulation tables (parameters of the block / the model itself).
WAN_ORIGINAL_NAMES = {
    r"^blocks\.(\d+)\.attn1\.to_q$": r"blocks.\1.self_attn.q",
    r"^blocks\.(\d+)\.attn1\.to_k$": r"blocks.\1.self_attn.k",
    r"^blocks\.(\d+)\.attn1\.to_v$": r"blocks.\1.self_attn.v",
    r"^blocks\.(\d+)\.attn1\.to_out\.0$": r"blocks.\1.self_attn.o",
    r"^blocks\.(\d+)\.attn1\.norm_(q|k)$": r"blocks.\1.self_attn.norm_\2",
    r"^blocks\.(\d+)\.attn2\.to_q$": r"blocks.\1.cross_attn.q",
    r"^blocks\.(\d+)\.attn2\.to_k$": r"blocks.\1.cross_attn.k",
    r"^blocks\.(\d+)\.attn2\.to_v$": r"blocks.\1.cross_attn.v",
    r"^blocks\.(\d+)\.attn2\.to_out\.0$": r"blocks.\1.cross_attn.o",
    r"^blocks\.(\d+)\.attn2\.norm_(q|k)$": r"blocks.\1.cross_attn.norm_\2",
    r"^blocks\.(\d+)\.attn2\.add_k_proj$": r"blocks.\1.cross_attn.k_img",
    r"^blocks\.(\d+)\.attn2\.add_v_proj$": r"blocks.\1.cross_attn.v_img",
    r"^blocks\.(\d+)\.attn2\.norm_added_k$": r"blocks.\1.cross_attn.norm_k_img",
    # Wan's block applies norm3 before cross-attention; diffusers calls that norm2 (its conversion
    # swaps the two names). The other two block norms have no weights.
    r"^blocks\.(\d+)\.norm2$": r"blocks.\1.norm3",
    r"^blocks\.(\d+)\.ffn\.net\.0\.proj$": r"blocks.\1.ffn.0",
    r"^blocks\.(\d+)\.ffn\.net\.2$": r"blocks.\1.ffn.2",
    r"^blocks\.(\d+)\.scale_shift_table$": r"blocks.\1.modulation",
    r"^scale_shift_table$": "head.modulation",
    r"^patch_embedding$": "patch_embedding",
    r"^condition_embedder\.time_proj$": "time_projection.1",
    r"^condition_embedder\.text_embedder\.linear_1$": "text_embedding.0",
    r"^condition_embedder\.text_embedder\.linear_2$": "text_embedding.2",
    r"^condition_embedder\.time_embedder\.linear_1$": "time_embedding.0",
    r"^condition_embedder\.time_embedder\.linear_2$": "time_embedding.2",
    r"^condition_embedder\.image_embedder\.norm1$": "img_emb.proj.0",
    r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj$": "img_emb.proj.1",
    r"^condition_embedder\.image_embedder\.ff\.net\.2$": "img_emb.proj.3",
    r"^condition_embedder\.image_embedder\.norm2$": "img_emb.proj.4",
    r"^proj_out$": "head.head",
}


def wan_original_name(module: str) -> str:
    for pattern, repl in WAN_ORIGINAL_NAMES.items():
        if re.match(pattern, module):
            return re.sub(pattern, repl, module)
    raise KeyError(f"no original Wan name for '{module}' (add it to WAN_ORIGINAL_NAMES in e2v/checkpoint.py)")


def wan_original_key(param: str) -> str:
    """A diffusers parameter name in original Wan naming: `blocks.0.norm2.weight` -> `blocks.0.norm3.weight`."""
    module, _, leaf = param.rpartition(".")
    return f"{wan_original_name(module)}.{leaf}" if leaf in ("weight", "bias") else wan_original_name(param)


def comfy_lora(lora: dict, alpha: float) -> dict:
    """ComfyUI / original-Wan LoRA keys: `diffusion_model.<wan name>.lora_A.weight`, `.lora_B.weight`
    and the scalar `.alpha` (both loaders scale by alpha / rank). Outside the blocks diffusers'
    converter rejects `.alpha` keys, so there alpha / rank is folded into lora_A and no `.alpha`
    is written: ComfyUI and diffusers then both use scale 1, the same product."""
    out = {}
    for key, value in lora.items():
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key)
        if m is None:
            raise KeyError(f"unexpected LoRA key {key}")
        name = f"diffusion_model.{wan_original_name(m.group(1))}"
        if m.group(1).startswith("blocks."):
            out[f"{name}.{m.group(2)}.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
        else:
            rank = lora[f"{m.group(1)}.lora_A.weight"].shape[0]
            out[f"{name}.{m.group(2)}.weight"] = value * (alpha / rank) if m.group(2) == "lora_A" else value
    return out


def lora_module_names(transformer: torch.nn.Module) -> list[str]:
    """Names of the modules peft wrapped with a LoRA (`blocks.0.attn1.to_q`, ...)."""
    return [n for n, m in transformer.named_modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]


def check_comfy_mappable(lora_target_names: list[str]) -> None:
    """Fail at setup, not at the export after training, when the ComfyUI copy of this LoRA could
    not be written or would not load in diffusers. The oracle is diffusers' own ComfyUI/Wan LoRA
    converter, run on a rank-1 dummy LoRA of the same modules: it must give back exactly them.
    It knows the attention and FFN layers of every block (all of them, k_img and v_img together)
    and time_projection, text/time embeddings, img_emb and head outside them."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_wan_lora_to_diffusers,
    )

    names = sorted(lora_target_names)
    if not names:  # a full fine-tune: no LoRA to convert
        return
    dummy = {f"{n}.lora_{ab}.weight": torch.ones(1, 1) for n in names for ab in "AB"}
    fix = ("remove them from lora.target_modules (or train them in full with train.trainable), or set "
           "the targets to attention / FFN layers of every block")
    try:
        comfy = comfy_lora(dummy, alpha=1.0)
    except KeyError as e:
        raise ValueError(f"lora.target_modules: the ComfyUI export has no original Wan name for a LoRA module "
                         f"({e}); {fix}") from None
    try:
        back = {k.removeprefix("transformer.") for k in _convert_non_diffusers_wan_lora_to_diffusers(comfy)}
        odd, why = sorted({k.rsplit(".lora_", 1)[0] for k in set(dummy) ^ back}), "keys lost or renamed"
    except (ValueError, KeyError) as e:  # the converter lists the keys it could not place
        odd = [n for n in names if f"{wan_original_name(n)}." in str(e)] or names
        why = f"{type(e).__name__}: {str(e)[:200]}"
    if odd:
        raise ValueError(f"lora.target_modules: the ComfyUI copy of a LoRA on {odd[:6]} would not load in "
                         f"diffusers' Wan LoRA converter ({why}); {fix}")


def load_extra_modules(transformer: torch.nn.Module, lora_dir: Path) -> list[str]:
    """Load the fully-trained modules exported beside a LoRA (after `load_lora_weights`, which
    rejects non-LoRA keys). Names are plain module names; under a peft wrapper the weight lives
    at `<name>.base_layer`. Returns the loaded names."""
    from safetensors.torch import load_file

    path = Path(lora_dir) / EXTRA_FILE
    if not path.exists():
        return []
    extra = load_file(str(path))
    params = dict(transformer.named_parameters())
    loaded = []
    with torch.no_grad():
        for name, value in extra.items():
            target = params.get(name)
            if target is None:
                target = params.get(name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias"))
            if target is None or target.shape != value.shape:
                raise KeyError(f"{path}: {name} {tuple(value.shape)} does not fit this transformer "
                               f"(rebuild it with the shape in {MODEL_FILE})")
            target.copy_(value.to(target.dtype))
            loaded.append(name)
    return loaded


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


def export_checkpoint(path: Path, out_dir: Path) -> Path:
    """The same files export_lora writes at the end of a run, from a checkpoint folder."""
    state, meta = state_from_checkpoint(path)
    if meta["training_type"] == "full":
        out = Path(out_dir) / FULL_DIR
        save_full({k: v.to(_export_dtype(k)) for k, v in state.items()}, meta["transformer_config"], out)
        return out
    lora = {re.sub(r"\.lora_(A|B)\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in state.items() if "lora_" in k}
    extra = {n.replace(".base_layer", ""): state[n] for n in meta["full_names"]}
    base = _read_base(Path(path) / BASE_FILE, Path(path).parent.parent / BASE_FILE)
    write_lora_exports(Path(out_dir), lora, extra, meta, base=base)
    return Path(out_dir)
