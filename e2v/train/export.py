"""Exports that load in plain diffusers (and ComfyUI) with no DeepSpeed: the LoRA with its adapter
metadata, a ComfyUI copy with the trained modules as differences, the modules trained in full
beside it, the model shape; or (a full fine-tune) the whole transformer, in diffusers' layout and
as one file under Wan's original names for ComfyUI's diffusion-model loader (a LoRA run writes that
file too, the LoRA fused in, with train.export_comfyui_checkpoint). Wan2.2's experts: the
same files in one folder per expert. Under ZeRO every rank
takes part in the gathers and rank 0 alone keeps and writes the copies.

Length (about 500 lines): every export format's writer, so the formats share one fuse / name /
dtype rule; the ComfyUI names are in e2v/train/comfy.py, CausVid's in e2v/models/causvid_ckpt.py.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from e2v.models.experts import each_expert, plain_name, split_names, split_state
from e2v.runtime.files import replacing
from e2v.runtime.integrity import usual_permissions
from e2v.runtime.log import get_logger
from e2v.runtime.stream_safetensors import StreamedSafetensors, nbytes
from e2v.train.comfy import (
    check_comfy_mappable,
    comfy_diffs,
    comfy_lora,
    comfy_lora_unapplied,
    wan_original_key,
    wan_original_state,
)

log = get_logger("e2v.export")

LORA_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "pytorch_lora_weights_comfyui.safetensors"  # LoRA + trained modules as `.diff`: ComfyUI's LoRA loader
EXTRA_FILE = "e2v_modules.safetensors"  # fully trained modules beside the LoRA (load_lora_weights rejects them)
COMFY_EXTRA_FILE = "e2v_modules_comfyui.safetensors"  # the same modules under original Wan names
MODEL_FILE = "e2v_model.json"  # what inference needs to rebuild the model shape
FULL_DIR = "transformer"  # full fine-tune: the transformer via save_pretrained (bf16; fp32 where diffusers keeps it)
BASE_FILE = "e2v_base_modules.safetensors"  # run folder (and each checkpoint): trained-in-full modules before training
# The whole transformer (LoRA fused) under Wan's original key names, export dtypes: ComfyUI's
# diffusion-model loader ("Load Diffusion Model") reads it and applies every tensor.
COMFY_CHECKPOINT_FILE = "e2v_transformer_comfyui.safetensors"
# task: causal: the whole transformer (LoRA fused) as CausVid's generator checkpoint, which CausVid's
# and Self-Forcing's inference load (e2v/models/causvid_ckpt.py)
CAUSVID_FILE = "e2v_causvid.pt"


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
    parameters of configs/e2v.yaml are 24 GiB of fp32 per rank that keeps them). The LoRA's
    names are peft's (`get_peft_model_state_dict` on the gathered masters: the adapter name
    dropped), so nothing is gathered twice."""
    named = dict(transformer.named_parameters())
    lora, extra = {}, {}
    if getattr(transformer, "peft_config", None):
        masters = {n: _full_fp32(p, keep) for n, p in named.items() if "lora_" in n and p.requires_grad}
        if keep:
            from peft.utils import get_peft_model_state_dict

            lora = get_peft_model_state_dict(transformer, state_dict=masters, adapter_name=_adapter_name(transformer),
                                             save_embedding_layers=False)
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
    adapter config, which parameters train in full (all of them for a full fine-tune), and the
    Wan2.2 experts the model holds (each exported to its own folder; [] for one transformer)."""
    experts = each_expert(transformer)
    first = experts[0][1]  # two experts share the shape, the adapter config and the training type
    peft = getattr(first, "peft_config", None)
    trainable = [n for n, p in transformer.named_parameters() if p.requires_grad]
    config = {k: v for k, v in dict(first.config).items() if not k.startswith("_")}
    return {
        "transformer_config": config,
        "lora": peft[_adapter_name(first)].to_dict() if peft else None,
        "full_names": [n for n in trainable if "lora_" not in n],
        "training_type": "lora" if peft else "full",
        "experts": [name for name, _ in experts if name],
        # a block-causal model (models.causal.enable_causal) also exports CausVid's file (export_causvid)
        "task": "causal" if getattr(first, "causal_state", None) is not None else "bidirectional",
    }


def save_base_modules(transformer: torch.nn.Module, full_names: list[str], run_dir: Path, rank: int = 0,
                      exclude: list[str] = ()) -> Path | None:
    """Before training: the modules a LoRA run trains in full, as the base model has them (fp32),
    into `<run_dir>/BASE_FILE`; the ComfyUI export writes each trained module as its difference
    from these. `exclude`: name patterns of modules the base lacks (those an expansion of a T2V base
    added or widened), which cannot be differences. Streamed (runtime.stream_safetensors): one
    tensor at a time is gathered (under ZeRO-3: a collective every rank joins) and written by rank
    0, which never holds more than that one."""
    if not getattr(each_expert(transformer)[0][1], "peft_config", None):  # a full fine-tune exports the whole model
        return None
    named = dict(transformer.named_parameters())
    names = [n for n in full_names if not any(re.search(p, plain_name(n)) for p in exclude)]
    if not names:
        return None
    keys = {n: n.replace(".base_layer", "") for n in names}
    path = Path(run_dir) / BASE_FILE
    with contextlib.ExitStack() as stack:
        out = None
        if rank == 0:
            tmp = stack.enter_context(replacing(path))
            out = stack.enter_context(StreamedSafetensors(tmp, {keys[n]: (torch.float32, full_shape(named[n]))
                                                                for n in names}))
        for n in names:
            value = _full_fp32(named[n], keep=rank == 0)  # every rank takes part in the gather
            if out is not None:
                out.write(keys[n], value)
            del value
    if rank == 0:
        usual_permissions(path)
    return path


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The whole parameter's shape, also for a ZeRO-3 partition (empty outside a gather)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def read_base(*candidates: Path) -> dict:
    from safetensors.torch import load_file

    for path in candidates:
        if Path(path).is_file():
            return load_file(str(path))
    return {}


def export_lora(transformer: torch.nn.Module, out_dir: Path, full_names: list[str], rank: int = 0,
                comfyui_checkpoint: bool = False) -> Path:
    """LoRA run: the diffusers-format LoRA with adapter metadata (without it the loader sets
    alpha = r), a ComfyUI file (the LoRA plus the fully-trained modules as differences from the
    base weights the run saved beside `out_dir`), the fully-trained modules and the model shape.
    Full fine-tune: the transformer in bf16 (fp32 where diffusers keeps fp32) via save_pretrained
    in `<out_dir>/transformer`. Wan2.2's experts: the same files for each expert the model holds,
    in `<out_dir>/high_noise/` and `<out_dir>/low_noise/`, under the plain transformer names (the
    low-noise LoRA loads with `load_lora_weights(..., load_into_transformer_2=True)`).
    `comfyui_checkpoint` (a LoRA run): also the fused transformer as COMFY_CHECKPOINT_FILE (a full
    fine-tune always writes it).
    Collective under ZeRO: every rank calls it, rank 0 writes. Returns the folder written."""
    base = read_base(Path(out_dir).parent / BASE_FILE) if rank == 0 else {}
    out = Path(out_dir)
    for expert, module in each_expert(transformer):
        folder = out / expert if expert else out
        meta = export_meta(module)
        if meta["training_type"] == "full":
            written = export_full(module, folder / FULL_DIR, rank=rank)
            out = out if expert else written
            continue
        lora, _ = trained_state(module, [], keep=rank == 0)  # the LoRA: small, held
        layout, values = trained_modules(module, split_names(full_names, expert), keep=rank == 0)
        if comfyui_checkpoint:  # the fused model is held whole anyway: the modules too
            extra = dict(values) if rank == 0 else {n: v for n, v in values}
            if rank == 0:
                write_lora_exports(folder, lora, extra, meta, base=split_state(base, expert))
            fused = fused_state(module, lora, extra, meta, keep=rank == 0)
            if rank == 0:
                save_comfy_checkpoint(fused, folder / COMFY_CHECKPOINT_FILE)
        elif rank == 0:  # streamed: one trained module's tensor held at a time
            write_lora_exports(folder, lora, (layout, values), meta, base=split_state(base, expert))
        else:
            for _ in values:  # this rank's part of each gather
                pass
    return out


def export_causvid(transformer: torch.nn.Module, out_dir: Path, full_names: list[str], rank: int = 0,
                   base=None) -> Path | None:
    """task: causal: the trained transformer, whole (a LoRA run's LoRA and trained modules fused in),
    in export dtypes, as `<out_dir>/e2v_causvid.pt` in CausVid's generator layout (write_causvid).
    `base`: a callable giving the unrounded base state (e2v.models.load.base_state), for a LoRA
    trained on the fp8 base, whose live weights are fp8 buffers: the LoRA fuses into the base it
    applies to, as the offline export does. Rank 0 holds the whole model while writing (~2.8 GB of
    bf16 for the 1.3B). Collective under ZeRO: every rank calls it, rank 0 writes. Returns the file
    on rank 0, None elsewhere."""
    keep, meta = rank == 0, export_meta(transformer)
    _one_transformer(meta)  # on every rank, before any collective
    if meta["training_type"] == "full":
        state = {n: _full_fp32(p, keep) for n, p in transformer.named_parameters()}  # every rank gathers
    else:
        lora, _ = trained_state(transformer, [], keep=keep)
        _, values = trained_modules(transformer, full_names, keep=keep)
        extra = dict(values)
        if base is None:
            state = fused_state(transformer, lora, extra, meta, keep=keep)
        else:  # no collective: the fp8 base is whole on every rank (ZeRO-3 is refused with it)
            state = fuse_lora_state(base(), lora, extra, meta) if keep else {}
    return write_causvid(state, out_dir, meta) if keep else None


def write_causvid(state: dict, out_dir: Path, meta: dict) -> Path:
    """The one rule of CausVid's file for the end-of-run export (export_causvid) and the offline one
    (checkpoint.export_checkpoint): the whole transformer `state` (diffusers names; a LoRA already
    fused) in export dtypes as `<out_dir>/e2v_causvid.pt`, `{"generator": {"model.<original Wan
    name>": ...}}` (e2v/models/causvid_ckpt.py), with the run's file permissions."""
    from e2v.models.causvid_ckpt import save_causvid_checkpoint

    _one_transformer(meta)
    path = save_causvid_checkpoint({n: v.to(export_dtype(n)) for n, v in state.items()}, Path(out_dir) / CAUSVID_FILE)
    usual_permissions(path)
    return path


def _one_transformer(meta: dict) -> None:
    if meta["experts"]:
        raise ValueError("task: causal exports one transformer: a two-expert base is refused (models.causal.causal_refusal)")


def trained_modules(transformer: torch.nn.Module, full_names: list[str], keep: bool = True):
    """The modules trained in full as (layout: name -> (fp32, shape), a generator of (name, fp32
    CPU value) in that order): each value is gathered when the generator reaches it (a collective
    under ZeRO: every rank runs the generator to its end), None where not `keep`."""
    named = dict(transformer.named_parameters())
    layout = {n.replace(".base_layer", ""): (torch.float32, full_shape(named[n])) for n in full_names}

    def values():
        for n in full_names:
            yield n.replace(".base_layer", ""), _full_fp32(named[n], keep)

    return layout, values()


def fused_state(transformer: torch.nn.Module, lora: dict, extra: dict, meta: dict, keep: bool = True) -> dict:
    """The transformer a LoRA run trained, as one plain state dict (diffusers names, export dtypes):
    the frozen base weights gathered from the live module (a collective under ZeRO-3), the modules
    trained in full (`extra`), and the LoRA (`lora`, diffusers naming) fused by diffusers / peft
    (`load_lora_adapter`, `fuse_lora`) in fp32. Rank 0 (`keep`) holds the whole model in fp32
    while fusing: 4 bytes a parameter, ~57 GiB for a 14B transformer. {} where not `keep`."""
    named = [(n, p) for n, p in transformer.named_parameters() if not p.requires_grad]
    frozen = {n.replace(".base_layer", ""): _full_fp32(p, keep) for n, p in named}
    return fuse_lora_state(frozen, lora, extra, meta) if keep else {}


def fuse_lora_state(frozen: dict, lora: dict, extra: dict, meta: dict) -> dict:
    """fused_state's fusing, from plain tensors (the offline export passes the base the run's
    config.yaml loads as `frozen`): `frozen` and `extra` (diffusers names; `extra` wins where both
    have a name) make the whole transformer, the LoRA is fused into it in fp32. Export dtypes."""
    from diffusers import WanTransformer3DModel

    config = {k: v for k, v in meta["transformer_config"].items() if not k.startswith("_")}
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    model.load_state_dict({k: v.float() for k, v in {**frozen, **extra}.items()}, strict=True, assign=True)
    model.load_lora_adapter(lora, prefix=None, adapter_name="e2v", metadata=meta["lora"])
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    return {k: v.to(export_dtype(k)) for k, v in model.state_dict().items()}


def save_comfy_checkpoint(state: dict, path: Path) -> Path:
    """The whole transformer (diffusers names) as one safetensors file under Wan's original key
    names, no prefix: the layout of the Wan repository's checkpoints and of ComfyUI's
    models/diffusion_models files. Every key maps (wan_original_key raises on one that does not)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in wan_original_state(state).items()}, str(tmp), metadata={"format": "pt"})
    usual_permissions(path)
    return path


def export_dtype(name: str) -> torch.dtype:
    """bf16, except the modules diffusers keeps in fp32: rounding them to bf16 would change the
    model diffusers loads."""
    from e2v.models.precision import kept_in_fp32

    return torch.float32 if kept_in_fp32(name) else torch.bfloat16


def export_full(transformer: torch.nn.Module, out_dir: Path, rank: int = 0, max_shard_bytes: int = 10**10) -> Path:
    """The whole transformer in bf16 (fp32 where diffusers keeps fp32), diffusers layout (config,
    safetensors shards of at most `max_shard_bytes` as save_pretrained's default "10GB" cuts them,
    and their index), and beside it the ComfyUI file under Wan's names. Streamed
    (runtime.stream_safetensors): each parameter is gathered (a collective under ZeRO-3), cast and
    written to its shard and the ComfyUI file by rank 0, which holds one parameter at a time
    instead of the whole model (28 GiB of bf16 for 14B)."""
    from diffusers import WanTransformer3DModel

    out_dir = Path(out_dir)
    named = list(transformer.named_parameters())
    layout = {n: (export_dtype(n), full_shape(p)) for n, p in named}
    with contextlib.ExitStack() as stack:
        shard_of, comfy = {}, None
        if rank == 0:
            config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
            with torch.device("meta"):
                model = WanTransformer3DModel.from_config(config)
            missing = sorted(set(model.state_dict()) - set(layout))  # rope tables: non-persistent, rebuilt at load
            if missing:
                raise KeyError(f"full export: no weights for {missing[:5]}")
            out_dir.mkdir(parents=True, exist_ok=True)
            model.save_config(str(out_dir))
            shards = _shards({n: layout[n] for n in model.state_dict()}, max_shard_bytes)
            for file, names in shards.items():
                tmp = stack.enter_context(replacing(out_dir / file))
                writer = stack.enter_context(StreamedSafetensors(tmp, {n: layout[n] for n in names}, {"format": "pt"}))
                shard_of.update({n: writer for n in names})
            if len(shards) > 1:
                total = sum(nbytes(*layout[n]) for n in shard_of)
                index = {"metadata": {"total_size": total},
                         "weight_map": {n: f for f, names in shards.items() for n in names}}
                (out_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            tmp = stack.enter_context(replacing(out_dir.parent / COMFY_CHECKPOINT_FILE))
            comfy = stack.enter_context(StreamedSafetensors(
                tmp, {wan_original_key(n): layout[n] for n in shard_of}, {"format": "pt"}))
        for name, p in named:
            value = _full_fp32(p, keep=rank == 0)  # every rank takes part in the gather
            if name in shard_of:
                value = value.to(export_dtype(name))
                shard_of[name].write(name, value)
                comfy.write(wan_original_key(name), value)
            del value
    if rank == 0:
        usual_permissions(*out_dir.iterdir(), out_dir.parent / COMFY_CHECKPOINT_FILE)
    return out_dir


def _shards(layout: dict, max_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file under `max_bytes` (one tensor larger than that
    gets a file of its own), named as diffusers' save_pretrained names its shards."""
    groups, size = [[]], 0
    for name, (dtype, shape) in layout.items():
        b = nbytes(dtype, shape)
        if groups[-1] and size + b > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += b
    if len(groups) == 1:
        return {"diffusion_pytorch_model.safetensors": groups[0]}
    n = len(groups)
    return {f"diffusion_pytorch_model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


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
    save_comfy_checkpoint(model.state_dict(), Path(out_dir).parent / COMFY_CHECKPOINT_FILE)


def write_lora_exports(out_dir: Path, lora: dict, extra, meta: dict, base: dict | None = None) -> None:
    """`extra`: the modules trained in full, name -> tensor, or streamed as (layout: name ->
    (dtype, shape), an iterable of (name, tensor) in that order; trained_modules): each tensor is
    written to the modules files and its difference to the ComfyUI file as it comes
    (runtime.stream_safetensors), so none needs to be held beyond its turn. `base`: the trained
    modules' weights before training (BASE_FILE); each module found there goes into the ComfyUI
    file as a difference, the others only into the modules files."""
    from diffusers.loaders import WanLoraLoaderMixin

    if isinstance(extra, dict):
        layout, values = {k: (v.dtype, tuple(v.shape)) for k, v in extra.items()}, extra.items()
    else:
        layout, values = extra
    base = base or {}
    out_dir.mkdir(parents=True, exist_ok=True)
    diff_keys = {}  # trained name -> (ComfyUI difference key, shape): comfy_diffs's rule, on meta tensors
    comfy, comfy_ok = {}, False
    if lora:
        WanLoraLoaderMixin.save_lora_weights(str(out_dir), transformer_lora_layers=lora,
                                             transformer_lora_adapter_metadata=meta["lora"])
        try:  # the diffusers LoRA above is the primary export; an unmappable target costs only this copy
            check_comfy_mappable(sorted({k.rsplit(".lora_", 1)[0] for k in lora}))
            kept = []
            for name in sorted(layout):
                dtype, shape = layout[name]
                value, before = torch.empty(shape, dtype=dtype, device="meta"), base.get(name)
                diffs, k = comfy_diffs({name: value}, {} if before is None else {name: before.to("meta")})
                kept += k
                diff_keys.update({name: (key, tuple(d.shape)) for key, d in diffs.items()})
            if kept:
                log.info(f"{len(kept)} trained tensors the base model lacks (e.g. {kept[0]}) cannot be "
                         f"differences in {COMFY_FILE}: they are in {COMFY_EXTRA_FILE} (full weights) only")
            comfy, comfy_ok = comfy_lora(lora, meta["lora"]["lora_alpha"]), True
        except ValueError as e:
            log.info(f"no {COMFY_FILE}: {e}")
    with contextlib.ExitStack() as stack:
        def writer(file: str, entries: dict):
            return stack.enter_context(StreamedSafetensors(stack.enter_context(replacing(out_dir / file)), entries))

        comfy_out = None
        if comfy_ok:
            comfy_out = writer(COMFY_FILE, {**{k: (v.dtype, tuple(v.shape)) for k, v in comfy.items()},
                                            **{diff_keys[n][0]: (torch.float32, diff_keys[n][1])
                                               for n in layout if n in diff_keys}})  # the order they come in
            for k, v in comfy.items():
                comfy_out.write(k, v)
        modules_out = modules_comfy_out = None
        if layout:
            modules_out = writer(EXTRA_FILE, layout)
            modules_comfy_out = writer(COMFY_EXTRA_FILE, {f"diffusion_model.{wan_original_key(k)}": v
                                                          for k, v in layout.items()})
        for name, value in values:
            modules_out.write(name, value)
            modules_comfy_out.write(f"diffusion_model.{wan_original_key(name)}", value)
            if comfy_out is not None and name in diff_keys:
                (key, d), = comfy_diffs({name: value}, {name: base[name]})[0].items()
                comfy_out.write(key, d)
            del value
    c = meta["transformer_config"]
    shape = {"in_channels": c["in_channels"], "image_dim": c.get("image_dim"),
             "added_kv_proj_dim": c.get("added_kv_proj_dim"), "extra_modules": sorted(layout)}
    unapplied = comfy_lora_unapplied(sorted(layout))
    if unapplied:
        shape["comfyui_lora_not_applied"] = unapplied
        shape["comfyui_note"] = comfy_unapplied_note(unapplied)
        log.warning(f"warning: {shape['comfyui_note']}")
    (out_dir / MODEL_FILE).write_text(json.dumps(shape, indent=2))
    usual_permissions(*(out_dir / f for f in (LORA_FILE, COMFY_FILE, EXTRA_FILE, COMFY_EXTRA_FILE, MODEL_FILE)))


def comfy_unapplied_note(unapplied: list[str]) -> str:
    """What a ComfyUI user of this LoRA must know about the trained tensors its LoRA load drops."""
    return (f"a stock ComfyUI LoRA load does not apply {len(unapplied)} trained tensor(s): "
            f"{', '.join(unapplied)} (Wan's modulation tables, blocks.N.modulation / head.modulation; ComfyUI "
            "patches only parameters of leaf modules), so in ComfyUI this LoRA gives a different model than in "
            f"diffusers. For ComfyUI load {COMFY_CHECKPOINT_FILE} (the transformer with the LoRA fused, written with "
            "train.export_comfyui_checkpoint: true) with the diffusion-model loader instead of the LoRA, or train "
            "without scale_shift_table in train.trainable (docs/comfyui.md)")


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
