"""The fp8 base (e2v/models/fp8.py) and 8-bit AdamW (deepspeed.optimizer: adamw_8bit).

Bound of the fp8 layer (derived, not fitted): e4m3 keeps 3 mantissa bits, so rounding a weight
whose scaled value |w / s| lies in e4m3's normal range (>= 2^-6) moves it by at most half an ulp,
2^-4 |w|; below it, by at most half the subnormal step, 2^-10 s. Hence, per output element,
|y_fp8 - y| <= sum_i |x_i| max(2^-4 |w_ji|, 2^-10 s_j), plus fp32 accumulation rounding. The
measured errors (docs/memory.md) are ~2.7% relative, of the weights and of the outputs alike."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ROOT

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.models.fp8 import FP8, FP8_MAX, Fp8Linear, fp8_targets, quantize_base, swap_blocks

GB = 2**30


def _bound(x_BI, w_OI, scale_O1):
    """The derived elementwise bound of |x (W_fp8 - W)^T| (module docstring)."""
    dw_OI = torch.maximum(w_OI.abs() * 2**-4, scale_O1 * 2**-10)
    return x_BI.abs() @ dw_OI.T


def _per_tensor(w_OI):
    s = torch.exp2(torch.ceil(torch.log2(w_OI.abs().max() / FP8_MAX)))
    return (w_OI / s).to(FP8).float() * s


@pytest.mark.parametrize("out_f,in_f", [(8, 16), (1024, 5120)])  # tiny; 1024 rows of a Wan-14B projection
def test_fp8_layer_within_the_derived_bound_and_per_channel_keeps_small_rows(out_f, in_f):
    torch.manual_seed(0)
    # rows spread over two decades, as the rows of trained projections differ in range
    w = (torch.randn(out_f, in_f) * 0.02 * torch.exp(torch.empty(out_f, 1).uniform_(-math.log(100), math.log(100))))
    w = w.bfloat16().float()  # the bf16 base the checkpoint holds
    linear = torch.nn.Linear(in_f, out_f, bias=True)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight_fp8.dtype == torch.uint8 and layer.weight_fp8.numel() == out_f * in_f
    scale = layer.weight_scale
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two: exact in bf16
    assert torch.equal(layer.dequantized(torch.bfloat16).float(), layer.dequantized(torch.float32))
    x = torch.randn(16, in_f)
    with torch.no_grad():
        err = (layer(x) - linear(x)).abs()
    slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    assert (err <= _bound(x, w, scale) + slack).all()
    rel = (layer(x) - linear(x)).norm() / (linear(x) - linear.bias).norm()
    assert 0.01 < rel < 0.04  # measured 2.66% at both real widths (docs/memory.md)
    if out_f > 8:  # per output channel against one scale per tensor: the worst row
        q = layer.dequantized(torch.float32)
        worst = lambda a: ((a - w).norm(dim=1) / w.norm(dim=1)).max()  # noqa: E731
        assert worst(q) < 0.03 < 0.06 < worst(_per_tensor(w))  # measured 2.8% against 8.9%


def _tiny_transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, image_dim=24, added_kv_proj_dim=32, rope_max_seq_len=32)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 36, 3, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
                encoder_hidden_states_image=torch.randn(1, 5, 24, generator=g), return_dict=False)


def _with_lora(model):
    from peft import LoraConfig

    model.requires_grad_(False)
    torch.manual_seed(3)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "ffn.net.2"]))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
    return model


def test_lora_gradients_through_fp8_equal_a_model_holding_the_dequantised_weights():
    """The oracle: the same transformer with ordinary nn.Linear layers whose weights ARE the
    dequantised fp8 weights; the LoRA's gradients agree to fp32 rounding, and so do the outputs."""
    fp8, ref = _tiny_transformer(), _tiny_transformer()
    names = fp8_targets(fp8, [])
    assert len(names) == 2 * 12 and all(n.startswith("blocks.") for n in names)  # 12 Linears a block
    assert quantize_base(fp8, []) == sum(ref.get_submodule(n).weight.numel() for n in names)
    with torch.no_grad():
        for n in names:
            ref.get_submodule(n).weight.copy_(fp8.get_submodule(n).dequantized(torch.float32))
    fp8, ref = _with_lora(fp8), _with_lora(ref)
    out_fp8, out_ref = fp8(**_inputs())[0], ref(**_inputs())[0]
    torch.testing.assert_close(out_fp8, out_ref, rtol=1e-6, atol=1e-6)
    out_fp8.square().mean().backward()
    out_ref.square().mean().backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 10 * 2  # blocks x LoRA'd layers (8 attention, add_k_proj, ffn.net.2) x A, B
    for n, p in fp8.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-8)
    # nothing of the fp8 base is in the state a checkpoint or an export reads
    assert not [k for k in fp8.state_dict() if "fp8" in k or "weight_scale" in k]


def test_backward_keeps_the_fp8_weight_not_a_bf16_copy():
    """Autograd saves the 1-byte weight (and the input), never the dequantised one."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32))
    x = torch.randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert sorted(str(t.dtype) for t in saved) == ["torch.float32", "torch.uint8"]  # the scale; the bits
    assert x.grad is not None and layer.bias.grad is None


def test_blocks_on_the_host_give_the_same_outputs_and_gradients():
    """swap_blocks on the CPU (device = host): the hooks bring each block's fp8 weights for each call
    of the block, the forward and, under gradient checkpointing, its recompute in the backward, and
    put the host copy back after it; the results equal the unswapped model's."""
    plain, swapped = _tiny_transformer(), _tiny_transformer()
    for m in (plain, swapped):
        quantize_base(m, [])
        m.enable_gradient_checkpointing()
    plain, swapped = _with_lora(plain), _with_lora(swapped)
    held = swap_blocks(swapped, 1, torch.device("cpu"))
    assert held == sum(m.weight_fp8.numel() for m in swapped.blocks[1].modules() if isinstance(m, Fp8Linear))
    calls = []
    hooks = swapped.blocks[1]._forward_pre_hooks
    for k, hook in list(hooks.items()):
        hooks[k] = lambda mod, args, hook=hook: calls.append(torch.is_grad_enabled()) or hook(mod, args)
    assert not swapped.blocks[0]._forward_pre_hooks  # only the last block is on the host
    a, b = plain(**_inputs())[0], swapped(**_inputs())[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    a.sum().backward()
    b.sum().backward()
    assert len(calls) == 2  # the forward, then the recompute in the backward
    for (n, p), (_, q) in zip(plain.named_parameters(), swapped.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_the_config_keys_refuse_what_cannot_work():
    tiny = ROOT / "configs/e2v_tiny_lora.yaml"
    with pytest.raises(ConfigError, match="model.training_type: lora"):
        load_config(tiny, ["model.base_dtype=fp8", "model.training_type=full"], check_paths=False)
    with pytest.raises(ConfigError, match="zero2.json"):
        load_config(tiny, ["model.base_dtype=fp8", "deepspeed.config=ds_configs/zero3.json"], check_paths=False)
    with pytest.raises(ConfigError, match="model.base_dtype: fp8"):
        load_config(tiny, ["model.fp8_blocks_on_host=2"], check_paths=False)
    with pytest.raises(ConfigError, match="export_comfyui_checkpoint"):
        load_config(tiny, ["model.base_dtype=fp8", "train.export_comfyui_checkpoint=true"], check_paths=False)
    from e2v.models.plan import preflight

    with pytest.raises(ValueError, match="use at most 2"):
        preflight(load_config(tiny, ["model.base_dtype=fp8", "model.fp8_blocks_on_host=3"], check_paths=False))


def test_14b_parameter_bytes_by_count_match_the_estimate():
    """configs/e2v_i2v_14b_fp8_24gb.yaml on the meta device: the fp8 weights are exactly the Linear
    weights of the 40 blocks (counted here from diffusers' own model), and the estimate's weight
    bytes are 1 per fp8 weight + 4 per scale + 2 per remaining (bf16) parameter."""
    from diffusers import WanTransformer3DModel

    from e2v.models.plan import KNOWN_WAN_CONFIGS
    from e2v.train.memory import count_model, estimate, model_states

    cfg = load_config(ROOT / "configs/e2v_i2v_14b_fp8_24gb.yaml", check_paths=False)
    with torch.device("meta"):
        base = WanTransformer3DModel.from_config(KNOWN_WAN_CONFIGS["Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"])
    block_linears = [m for n, m in base.named_modules() if n.startswith("blocks.") and type(m) is torch.nn.Linear]
    c = count_model(cfg)
    assert c.fp8 == sum(m.weight.numel() for m in block_linears) == 16_148_070_400
    assert c.fp8_rows == sum(m.out_features for m in block_linears)
    assert c.trainable + c.frozen + c.fp8 == sum(p.numel() for p in base.parameters()) + c.trainable - (
        sum(p.numel() for n, p in base.named_parameters() if n.startswith(("patch_embedding.", "condition_embedder.image_embedder."))))
    params = model_states(c, "zero2.json", 1, 1)["params"]
    assert params == 2 * (c.trainable + c.frozen) + c.fp8 + 4 * c.fp8_rows
    assert (params - 2 * (c.trainable + c.frozen)) / c.fp8 == pytest.approx(1.0, abs=1e-3)  # ~1 byte a weight
    r = estimate(cfg, 1, 24, counts=c)
    host_gb = 40 / 40 * c.fp8 / GB
    assert r["configured"]["params_gb"] == pytest.approx((params - c.fp8 + 2 * c.fp8 / 40) / GB)
    assert r["configured"]["cpu_per_node_gb"] > host_gb  # the fp8 blocks live in host RAM


def test_the_fp8_config_fits_24_gb_and_64_gb_of_host_ram_with_validation():
    """tools/estimate_memory.py's own verdict on the shipped fp8 config: training and the validation
    phase fit one 24 GB card, host RAM fits 64 GB at load and in training, and the advice keeps the
    config as it is (nothing to add)."""
    from e2v.train.memory import advise, estimate

    path = ROOT / "configs/e2v_i2v_14b_fp8_24gb.yaml"
    cfg = load_config(path, check_paths=False)
    assert (cfg.model.base_dtype, cfg.deepspeed.optimizer, cfg.cache.enabled) == ("fp8", "adamw_8bit", True)
    assert (cfg.data.num_frames, cfg.data.resolution, cfg.validation.every_n_steps) == (81, [480, 832], 500)
    r = estimate(cfg, 1, 24)
    row = r["configured"]
    assert row["fits"] and row["gpu_total_gb"] == pytest.approx(19.0, abs=0.1)
    assert row["validation_gb"] == pytest.approx(20.9, abs=0.1)  # the figures in the config's header
    assert row["cpu_per_node_gb"] < 64 and r["load_cpu_per_node_gb"] < 64
    a = advise(str(path), [], 1, 24, 1, 64)
    assert a["sets"] == [] and a["row"]["ds_config"] == "zero2.json"


def test_the_advice_proposes_fp8_before_parameter_offload():
    """configs/e2v_24gb.yaml on a 64 GB host: ZeRO-3 parameter offload fits the GPU but needs ~65 GB of
    host RAM; the advice's plan is the fp8 base with 8-bit AdamW under ZeRO-2, fp8 blocks on the host."""
    from e2v.train.memory import advise, estimate

    configured = estimate(load_config(ROOT / "configs/e2v_24gb.yaml", check_paths=False), 1, 24)["configured"]
    assert configured["ds_config"] == "zero3_offload.json" and configured["fits"] and configured["cpu_per_node_gb"] > 64
    a = advise(str(ROOT / "configs/e2v_24gb.yaml"), [], 1, 24, 1, 64)
    assert not a["host_short"]  # the fp8 plan came first: ZeRO-3 offload was not reached
    assert a["sets"][:2] == ["model.base_dtype=fp8", "deepspeed.optimizer=adamw_8bit"]
    assert a["sets"][2].startswith("model.fp8_blocks_on_host=")
    assert a["row"]["ds_config"] == "zero2.json" and max(a["row"]["gpu_total_gb"], a["row"]["validation_gb"]) <= 24


def test_adamw_8bit_is_the_client_optimizer_with_nothing_built(monkeypatch):
    import e2v.runtime.adam as adam
    from e2v.train.ds_config import adam_choice, optimizer_preflight, resolve_deepspeed_config

    monkeypatch.setattr(adam, "_builder", lambda *a: pytest.fail("DeepSpeed's Adam op builder was touched"))
    for ds in ("zero2.json", "zero2_offload.json"):
        cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["deepspeed.optimizer=adamw_8bit",
                                                                f"deepspeed.config=ds_configs/{ds}"], check_paths=False)
        resolved = resolve_deepspeed_config(cfg, 1, cuda=False)
        assert "optimizer" not in resolved and resolved["zero_allow_untested_optimizer"] is True
        assert resolved["zero_force_ds_cpu_optimizer"] is False
        assert "AdamW8bit" in adam_choice(cfg, resolved, cuda=True)[1]
        optimizer_preflight(cfg, resolved, cuda=True)
    p = torch.nn.Parameter(torch.randn(8192))
    opt = adam.adamw_8bit([p], 1e-3, (0.9, 0.999), 1e-8, 0.0)
    p.grad = torch.randn(8192)
    opt.step()
    state = opt.state_dict()["state"][0]["__bnb_optimizer_quant_state__"]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8  # 8-bit moments
    assert adam.optimizer_bytes("adamw_8bit") == pytest.approx(6.03125) and adam.optimizer_bytes("torch_adamw") == 12


def test_the_r2v_fp8_config_fits_24_gb_and_64_gb_of_host_ram_with_validation():
    """The same verdict for SkyReels-V3-R2V-14B's LoRA in its sequence layout (4 reference slots:
    39,000 tokens at 81 x 480 x 832): the figures in configs/r2v_skyreels_v3_14b_fp8_24gb.yaml's header."""
    from e2v.train.memory import estimate

    cfg = load_config(ROOT / "configs/r2v_skyreels_v3_14b_fp8_24gb.yaml", check_paths=False)
    assert (cfg.model.base_dtype, cfg.deepspeed.optimizer, cfg.cache.enabled) == ("fp8", "adamw_8bit", True)
    assert (cfg.conditioning.target_layout, cfg.conditioning.sequence.slots) == ("sequence", 4)
    r = estimate(cfg, 1, 24)
    row = r["configured"]
    assert row["fits"] and row["gpu_total_gb"] == pytest.approx(19.9, abs=0.1)
    assert row["validation_gb"] == pytest.approx(21.9, abs=0.1)
    assert row["cpu_per_node_gb"] < 64 and r["load_cpu_per_node_gb"] < 64
