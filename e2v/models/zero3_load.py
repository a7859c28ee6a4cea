"""ZeRO-3: the pretrained transformer partitioned at load (built inside zero.Init, streamed from its
safetensors shards by rank 0), so no rank ever holds the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from e2v.config.bases import resolve_pretrained
from e2v.config.schema import Config
from e2v.models.expand import expanded_config, init_new_modules, widened_patch_weight
from e2v.models.precision import kept_in_fp32
from e2v.runtime.device import accelerator_device
from e2v.runtime.log import get_logger

log = get_logger("e2v")


def zero3_load_blocker(cfg: Config, ds_config: dict | None, subfolder: str = "transformer") -> str | None:
    """Why the transformer in `subfolder` cannot be partitioned at load (load_transformer_zero3),
    or None if it can."""
    if ds_config is None or ds_config.get("zero_optimization", {}).get("stage") != 3:
        return "not ZeRO-3"
    if not cfg.model.zero3_init:
        return "model.zero3_init is false"
    folder = Path(resolve_pretrained(cfg.model.pretrained)) / subfolder
    if not folder.is_dir():
        return (f"{cfg.model.pretrained} is not a local folder; download it first "
                f"(hf download {cfg.model.pretrained} --local-dir DIR) and set model.pretrained: DIR")
    if not _safetensors_files(folder):
        return f"no diffusion_pytorch_model*.safetensors in {folder}"
    return None


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files diffusers' from_pretrained reads (no variant): one file, or the shards its
    index names."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "diffusion_pytorch_model.safetensors"
    return [single] if single.exists() else []


def load_transformer_zero3(folder: Path, ds_config: dict, dtype: torch.dtype,
                           expand_to: tuple[int, int | None] | None = None, seed: int = 0
                           ) -> tuple[WanTransformer3DModel, dict[str, torch.Tensor]]:
    """Build the transformer inside deepspeed.zero.Init, so each rank holds only its partition of
    every parameter from the start, then stream the safetensors files into it one tensor at a time:
    each parameter is gathered, rank 0 copies the file value in, and ZeRO re-partitions it on exit
    (GatheredParameters with modifier_rank=0). Peak CPU RAM per rank: its partitions plus one
    gathered parameter, instead of the whole model (~31 GiB per rank for I2V-14B in bf16).
    diffusers' from_pretrained has no zero.Init path (transformers' has). The cast is
    from_pretrained's (file value -> dtype, round to nearest). Returns the fp32 file values of the
    _keep_in_fp32_modules parameters for fp32_kept_params; every rank reads those itself (~0.1 GiB
    for 14B). Costs one all-gather per parameter (~1,100 for 14B).
    `expand_to` (in_channels, image_dim or None): build the base widened for elements (e2v/models/expand.py)
    and load it partitioned too: the file's patch embedding goes into the first input channels, and
    the modules the files lack take init_new_modules' values (made on rank 0 in a meta copy, the
    same values the whole load's expand_for_elements gives for the same `seed`)."""
    import deepspeed
    import torch.distributed as dist
    from diffusers.models.modeling_utils import no_init_weights
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    from safetensors import safe_open

    rank = dist.get_rank()
    files = _safetensors_files(folder)
    config = WanTransformer3DModel.load_config(str(folder))
    if expand_to is not None:
        config = expanded_config(config, *expand_to)
    # The weights come from the files: skip the random init (minutes for 14B), and leave the
    # training RNG where from_pretrained leaves it (it builds on the meta device, drawing nothing).
    # The partitions' dtype comes from the ds_config's bf16 flag, which the training dtype sets
    # (config.resolve_deepspeed_config): zero.Init's own `dtype` argument is misread in deepspeed
    # 0.19 on an accelerator without fp16 (`dtype or fp16 if fp16 else bf16` makes a CPU fp32 run
    # bf16), so it is not passed.
    ds_bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    if ds_bf16 != (dtype == torch.bfloat16):
        raise RuntimeError(f"zero3 load: the ds_config's bf16.enabled={ds_bf16} does not match the dtype {dtype}")
    with torch.random.fork_rng(devices=[]), no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = WanTransformer3DModel.from_config(config)
    # zero.Init's tensor-constructor override also reaches the rope tables computed in __init__
    # (they come out fp32 but not equal to a plain build): rebuild them outside it, on the device
    # the engine runs on: deepspeed.initialize does not move a module built under zero.Init, so a
    # CPU table would meet CUDA queries in the first forward. They are the model's only buffers;
    # anything else would need the same treatment.
    c = model.config
    model.rope = WanRotaryPosEmbed(c.attention_head_dim, c.patch_size, c.rope_max_seq_len).to(accelerator_device())
    others = [n for n, _ in model.named_buffers() if not n.startswith("rope.")]
    if others:
        raise RuntimeError(f"zero3 load: buffers built under zero.Init that are not rebuilt: {others[:5]}")

    params = dict(model.named_parameters())
    fp32_file_values, seen = {}, set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            unknown = sorted(keys - set(params))
            if unknown:
                raise RuntimeError(f"{path}: tensors the model does not have: {unknown[:5]}")
            for name in [n for n in params if n in keys]:  # the model's order: the same on every rank
                p = params[name]
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if rank == 0:
                        value = f.get_tensor(name)
                        if expand_to is not None and name == "patch_embedding.weight":
                            value = widened_patch_weight(value, p.shape[1])
                        if tuple(value.shape) != tuple(p.shape):
                            raise RuntimeError(f"{path}: {name} has shape {tuple(value.shape)}, "
                                               f"the model {tuple(p.shape)}")
                        with torch.no_grad():
                            p.data.copy_(value)
                        del value
                if kept_in_fp32(name):  # a copy: the file's tensor holds its whole mmap resident
                    fp32_file_values[name] = f.get_tensor(name).to(torch.float32, copy=True)
                seen.add(name)
    if expand_to is not None:
        new = set(params) - seen
        _stream_new_modules(model, config, new, rank, dtype, seed)
        seen |= new
    missing = sorted(set(params) - seen)
    if missing:
        raise RuntimeError(f"{folder}: no file value for {len(missing)} parameters, e.g. {missing[:5]}")
    log.info(f"transformer partitioned at load (zero.Init, {str(dtype).removeprefix('torch.')}), "
             f"streamed from {len(files)} shard file{'s' if len(files) != 1 else ''}"
             + (", expanded for elements" if expand_to is not None else ""))
    return model, fp32_file_values


def _stream_new_modules(model: WanTransformer3DModel, config: dict, new: set[str], rank: int,
                        dtype: torch.dtype, seed: int) -> None:
    """Fill the partitioned parameters `new` (those of the modules expansion adds: no file has
    them) with init_new_modules' values, computed on rank 0 in a meta-device copy of the model, one
    module at a time materialised."""
    import deepspeed

    reference = None
    if rank == 0:
        with torch.device("meta"):
            reference = WanTransformer3DModel.from_config(config)
        owners = {id(reference.get_submodule(n.rpartition(".")[0])) for n in new}
        init_new_modules(reference, lambda m: id(m) in owners, "cpu", dtype, seed)
    values = dict(reference.named_parameters()) if reference is not None else {}
    params = dict(model.named_parameters())
    for name in [n for n in params if n in new]:  # the model's order: the same on every rank
        with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    params[name].data.copy_(values[name])
