"""The gpu-check section fp8_14b: configs/e2v_i2v_14b_fp8_24gb.yaml's transformer at the I2V-14B
widths (random weights, FP8_LAYERS blocks: the per-block terms are the same in every block, the
activations do not depend on the depth), quantised to fp8 on the host, every block's fp8 weights
on the host, one checkpointed training step with the block inputs offloaded and AdamW8bit, then one
no-grad forward (validation's transformer part), under the 24 GiB cap. The peaks
(torch.cuda.max_memory_allocated) against e2v.train.memory's terms for the same model: model states,
activations and the dequantised layer (the DeepSpeed buckets and the CUDA-context allowance are not
part of an in-process run). In process, no DeepSpeed: what it checks is the fp8 path's memory."""

from __future__ import annotations

import time

from bench.gpulib.common import GIB, LIMIT_GIB, ROOT, Ctx

FP8_LAYERS = 4
CONFIG = "configs/e2v_i2v_14b_fp8_24gb.yaml"
ESTIMATE_RTOL = 0.15  # passed: each peak within 15% of its estimate


def _model(cfg, real: bool):
    import torch
    from diffusers import WanTransformer3DModel

    from e2v.models.fp8 import quantize_base
    from e2v.models.plan import KNOWN_WAN_CONFIGS
    from e2v.models.trainable import full_patterns, setup_training

    conf = dict(KNOWN_WAN_CONFIGS[cfg.model.pretrained], num_layers=FP8_LAYERS if real else 2)
    if not real:  # --allow-cpu: the code path at tiny widths
        conf.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, image_dim=32,
                    added_kv_proj_dim=32, freq_dim=32)
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(conf)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    # to_empty leaves the rope tables (non-persistent buffers, computed at construction) uninitialised
    # memory: made again, fp32 as diffusers makes them, or the forward reads garbage (NaN losses)
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    model.rope = WanRotaryPosEmbed(conf["attention_head_dim"], tuple(model.config.patch_size),
                                   model.config.rope_max_seq_len)
    quantize_base(model, full_patterns(cfg, False))
    setup_training(model, cfg, expanded=False)
    model.enable_gradient_checkpointing()
    return model, conf


def _estimate(model, cfg, s: int, ctx_tokens: int) -> dict:
    """e2v.train.memory's terms for this model as built (bytes, bf16): ZeRO-2 model states with every
    block's fp8 weights on the host, the dequantised layer, and the activations: checkpointed with
    the block inputs offloaded (training), or a no-grad forward's (validation)."""
    import dataclasses

    from e2v.models.plan import activation_bytes, activation_terms
    from e2v.train.memory import counts_of, dequant_bytes, fp8_on_host, model_states

    c, e = counts_of(model), 2
    every_block = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_blocks_on_host=c.layers))
    host_fp8, in_flight = fp8_on_host(every_block, c)
    st = model_states(c, "zero2.json", 1, 1, weight_bytes=e, optimizer=cfg.deepspeed.optimizer)
    states = st["params"] - host_fp8 + in_flight + st["grads"] + st["optimizer"] + dequant_bytes(c, e)
    block, outside = activation_terms(s, ctx_tokens, c)
    return {"train": states + activation_bytes(s, ctx_tokens, c, 1, e, True, True)[0],
            "validation": states + e * (block + outside)}


def section_fp8_14b(ctx: Ctx) -> dict:
    import torch

    from e2v.config.load import load_config
    from e2v.models.fp8 import swap_blocks
    from e2v.runtime.adam import adamw_8bit
    from e2v.train.step import activation_context

    cfg = load_config(str(ROOT / CONFIG), check_paths=False)
    device = torch.device("cuda" if ctx.cuda else "cpu")
    t0 = time.monotonic()
    model, conf = _model(cfg, ctx.cuda)
    model.to(device)
    on_host = swap_blocks(model, conf["num_layers"], device)
    build_s = round(time.monotonic() - t0, 1)
    frames, (h, w) = ctx.sizes.frames, ctx.sizes.resolution
    t, hh, ww = (frames - 1) // 4 + 1, h // 8, w // 8
    g = torch.Generator(device=device).manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 36, t, hh, ww, generator=g, device=device, dtype=torch.bfloat16),
                  timestep=torch.tensor([700.0], device=device),
                  encoder_hidden_states=torch.randn(1, 512, conf["text_dim"], generator=g, device=device, dtype=torch.bfloat16),
                  encoder_hidden_states_image=torch.randn(1, 257, conf["image_dim"], generator=g, device=device,
                                                          dtype=torch.bfloat16), return_dict=False)
    est = _estimate(model, cfg, t * (hh // 2) * (ww // 2), 512 + 257)
    opt = adamw_8bit([p for p in model.parameters() if p.requires_grad], cfg.train.lr, cfg.train.betas, cfg.train.eps, 0.0)
    out = {"layers": conf["num_layers"], "fp8_on_host_gib": round(on_host / GIB, 2), "build_s": build_s,
           "estimate_train_gib": round(est["train"] / GIB, 2), "estimate_validation_gib": round(est["validation"] / GIB, 2)}
    if ctx.cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, LIMIT_GIB * GIB / total))
        torch.cuda.reset_peak_memory_stats()
    try:
        with activation_context(True):
            loss = model(**inputs)[0].float().square().mean()
        loss.backward()
        opt.step()
        out["loss"] = loss.item()
        if ctx.cuda:
            out["peak_train_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            model(**inputs)
        if ctx.cuda:
            out["peak_validation_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    except torch.OutOfMemoryError as e:
        return {**out, "passed": False, "oom": str(e)[:300]}
    finally:
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    if not ctx.cuda:
        return {**out, "peaks": "not measured without CUDA", "passed": out["loss"] == out["loss"]}
    ratios = {k: out[f"peak_{k}_gib"] / out[f"estimate_{k}_gib"] for k in ("train", "validation")}
    out["measured_to_estimate"] = {k: round(v, 3) for k, v in ratios.items()}
    out["passed"] = all(abs(v - 1) <= ESTIMATE_RTOL for v in ratios.values())
    return out
