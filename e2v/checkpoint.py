"""DeepSpeed checkpoints that survive a kill, resume that continues the same run, and exports that
load in plain diffusers (and ComfyUI) with no DeepSpeed installed.

Atomicity: DeepSpeed writes a tag folder; only after every rank has finished (barrier) does rank 0
write `COMPLETE` into it and then replace `checkpoints/latest` (write-then-rename). `--resume latest`
takes the newest folder with `COMPLETE`, so a kill during a save falls back to the previous one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

LORA_FILE = "pytorch_lora_weights.safetensors"
EXTRA_FILE = "e2v_modules.safetensors"  # fully trained modules beside the LoRA (load_lora_weights rejects them)
MODEL_FILE = "e2v_model.json"  # what inference needs to rebuild the model shape


def _tag(step: int) -> str:
    return f"step_{step:06d}"


def _dist_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


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


def save_checkpoint(engine, ckpt_root: Path, step: int, client_state: dict, keep_last: int = 3,
                    rank: int = 0) -> Path:
    tag = _tag(step)
    engine.save_checkpoint(str(ckpt_root), tag=tag, client_state=client_state, save_latest=False)
    _dist_barrier()
    path = ckpt_root / tag
    if rank == 0:
        (path / "COMPLETE").write_text(json.dumps({"step": step}))
        tmp = ckpt_root / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ckpt_root / "latest")
        for old in complete_checkpoints(ckpt_root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _dist_barrier()
    return path


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders whose save finished on every rank, oldest first."""
    if not ckpt_root.exists():
        return []
    return sorted(p for p in ckpt_root.glob("step_*") if (p / "COMPLETE").exists())


def find_resume(resume: str, run_dir: Path | None) -> Path | None:
    """`latest` -> newest complete checkpoint of the run (None if there is none); a path -> that
    checkpoint folder (must be complete)."""
    if resume == "latest":
        found = complete_checkpoints(run_dir / "checkpoints") if run_dir else []
        incomplete = sorted(set((run_dir / "checkpoints").glob("step_*")) - set(found)) if run_dir else []
        for p in incomplete:
            if not found or p.name > found[-1].name:
                print(f"[e2v checkpoint] ignoring incomplete checkpoint {p} (a save was interrupted)")
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "COMPLETE").exists():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint folder (no COMPLETE marker)")
    return path


def load_checkpoint(engine, path: Path) -> dict:
    _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise RuntimeError(f"could not load checkpoint {path}")
    return client_state


# --- exports -----------------------------------------------------------------------------------


def _gathered(module: torch.nn.Module, params: list[torch.nn.Parameter]):
    """Under ZeRO-3 parameters are empty outside GatheredParameters; elsewhere a no-op."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    import contextlib

    return contextlib.nullcontext()


def trained_state(transformer: torch.nn.Module, full_names: list[str]) -> tuple[dict, dict]:
    """(LoRA state dict in diffusers naming, fully-trained module weights), gathered, fp32 CPU."""
    from peft.utils import get_peft_model_state_dict

    params = [p for _, p in transformer.named_parameters()]
    with _gathered(transformer, params):
        lora = {}
        if getattr(transformer, "peft_config", None):
            lora = {k: v.detach().float().cpu().clone() for k, v in get_peft_model_state_dict(transformer).items()}
        named = dict(transformer.named_parameters())
        extra = {n.replace(".base_layer", ""): named[n].detach().float().cpu().clone() for n in full_names}
    return lora, extra


def export_lora(transformer: torch.nn.Module, out_dir: Path, full_names: list[str], rank: int = 0) -> Path:
    """Diffusers-format LoRA with adapter metadata (without it the loader sets alpha = r), plus the
    fully-trained modules and the model shape beside it."""
    from diffusers.loaders import WanLoraLoaderMixin
    from safetensors.torch import save_file

    lora, extra = trained_state(transformer, full_names)
    if rank != 0:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if lora:
        meta = transformer.peft_config["default"].to_dict()
        WanLoraLoaderMixin.save_lora_weights(str(out_dir), transformer_lora_layers=lora,
                                             transformer_lora_adapter_metadata=meta)
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, str(out_dir / EXTRA_FILE))
    c = transformer.config
    shape = {"in_channels": c.in_channels, "image_dim": c.image_dim, "added_kv_proj_dim": c.added_kv_proj_dim,
             "extra_modules": sorted(extra)}
    (out_dir / MODEL_FILE).write_text(json.dumps(shape, indent=2))
    return out_dir


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
