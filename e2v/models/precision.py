"""diffusers keeps some Wan modules in fp32 (`_keep_in_fp32_modules`: the time embedder, the
modulation tables, the norms, the rope tables); DeepSpeed's bf16 mode casts every parameter. One
name rule decides which those are (kept_in_fp32), and their exact fp32 values are taken before
`deepspeed.initialize` and put back after it (e2v/train/engine.py), by the export (e2v/train/export.py)
and by inference (`to_inference_dtype`: tools/sample.py, and the base Wan2.2 expert validation
loads)."""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel


def kept_in_fp32(name: str) -> bool:
    """Whether diffusers keeps this Wan parameter or buffer in fp32 (`_keep_in_fp32_modules`: time
    embedder, modulation tables, norms, rope), matched as its loader does: a listed name equals
    one dotted component."""
    return any(k in name.split(".") for k in WanTransformer3DModel._keep_in_fp32_modules or [])


def model_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype the transformer computes in: its parameters' outside the modules kept in fp32."""
    return next((p.dtype for n, p in transformer.named_parameters() if not kept_in_fp32(n)), torch.float32)


def fp32_kept_params(transformer: torch.nn.Module, file_values: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """fp32 copies of the frozen parameters diffusers keeps in fp32 (`_keep_in_fp32_modules`; for
    Wan: rope, time_embedder, scale_shift_table, norm1/2/3), taken before deepspeed.initialize:
    DeepSpeed's bf16 mode casts every parameter (it keeps only buffers, such as the rope tables).
    Names match as in diffusers' loader: a listed name equals one dotted component. Trainable
    parameters are not listed: they live in the optimizer's bf16 buffers with fp32 master copies,
    so a TRAINED kept module (train.trainable: [scale_shift_table], a full fine-tune) computes in
    bf16 under DeepSpeed's bf16 mode; `trained_fp32_kept` names them for the start-up note.
    A parameter partitioned at load (ZeRO-3, load_transformer_zero3) takes its value from
    `file_values` (Parts.fp32_file_values): its partition is a slice in the training dtype."""
    kept = {}
    for name, p in transformer.named_parameters():
        if p.requires_grad or not kept_in_fp32(name):
            continue
        if hasattr(p, "ds_tensor"):
            if not file_values or name not in file_values:
                raise RuntimeError(f"fp32_kept_params: {name} is partitioned and has no fp32 file value")
            kept[name] = file_values[name]
        else:
            kept[name] = p.detach().float().clone()
    return kept


def trained_fp32_kept(transformer: torch.nn.Module) -> list[str]:
    """Trainable parameters of the modules diffusers keeps in fp32 (they run in bf16 under bf16)."""
    return [name for name, p in transformer.named_parameters()
            if p.requires_grad and kept_in_fp32(name)]


def restore_fp32_params(transformer: torch.nn.Module, saved: dict[str, torch.Tensor]) -> int:
    """Put the fp32 copies back after deepspeed.initialize (exact original values, not a re-cast
    of the bf16 ones). Under ZeRO-3 a parameter is a partition (`ds_tensor`) plus, when it is
    persistent (below stage3_param_persistence_threshold), a full copy; both become fp32, and
    ZeRO-3 gathers parameters grouped by dtype. Returns how many parameters were restored."""
    import torch.distributed as dist

    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            p = params[name]
            if not hasattr(p, "ds_tensor"):
                p.data = value.to(p.device)
                continue
            part = p.ds_tensor
            n = part.ds_numel
            start = dist.get_rank(group=p.ds_process_group) * n
            flat = value.flatten()[start:start + n]
            shard = torch.zeros(n, dtype=torch.float32, device=part.device)
            shard[: flat.numel()] = flat
            part.data = shard
            p.data = value.to(p.device) if p.data.numel() else torch.empty(0, dtype=torch.float32, device=p.device)
    return len(saved)


def to_inference_dtype(model, device: str, dtype: torch.dtype):
    """The transformer on `device` in `dtype`, except the modules diffusers keeps in fp32 (Wan's
    `_keep_in_fp32_modules`: time embedder, scale_shift_table, norms): a plain `.to(bf16)` would
    round them, while from_pretrained(torch_dtype=bf16) and training (restore_fp32_params) keep
    them fp32. The copies are exact: taken before the cast. Frozen first: fp32_kept_params lists
    frozen parameters only, and a full fine-tune's transformer comes back trainable. The rope
    tables are buffers, which fp32_kept_params leaves out (DeepSpeed does not cast buffers), so
    they are kept here by the same name rule."""
    model.eval().requires_grad_(False)
    kept = fp32_kept_params(model)
    buffers = {n: b.float().clone() for n, b in model.named_buffers() if b.is_floating_point() and kept_in_fp32(n)}
    model.to(device, dtype)
    restore_fp32_params(model, kept)
    for name, value in buffers.items():
        model.get_buffer(name).data = value.to(device)
    return model
