"""A training run on the fp8 base with 8-bit AdamW through the real entry point (deepspeed
train_e2v.py, the tiny preset): a resume continues with the uninterrupted run's losses, the
checkpoint carries no fp8 base, and the exported LoRA loads onto the ordinary (unquantised) base
in diffusers, where it changes the output as it does on the fp8 base it was trained against."""

from __future__ import annotations

import torch
from helpers import ROOT, load_checkpoint_module, read_scalars
from helpers_launch import launch_train

FP8_RUN = ("model.base_dtype=fp8", "deepspeed.optimizer=adamw_8bit", "train.max_steps=4", "train.checkpoint_every=2",
           "train.micro_batch_size=1", "validation.every_n_steps=0")


def _probe():
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g),
                encoder_hidden_states_image=torch.randn(1, 257, 32, generator=g), return_dict=False)


def test_fp8_run_resumes_exactly_saves_no_base_and_exports_to_the_plain_base(demo_data, tmp_path):
    from e2v.config.load import load_config
    from e2v.models.fp8 import Fp8Linear, quantize_base
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import full_patterns, setup_training
    from e2v.train.export import load_extra_modules

    config = str(ROOT / "configs/e2v_tiny_lora.yaml")
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}", *FP8_RUN)
    launch_train(config, *sets, "run_id=whole").wait()
    whole = tmp_path / "whole"
    launch_train(config, *sets, "run_id=resumed", extra=("--resume", str(whole / "checkpoints/step_000002"))).wait()
    a, b = read_scalars(whole), read_scalars(tmp_path / "resumed")
    assert sorted(b) == [3, 4]
    for step in (3, 4):  # step 4 follows the first update from the restored 8-bit state
        assert b[step]["train/loss"] == a[step]["train/loss"], step  # bit-exact

    # the checkpoint: only what trains (LoRA, the modules in full), no fp8 bits, no scales
    saved = whole / "checkpoints/step_000004"
    state = torch.load(saved / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not [k for k in state if "fp8" in k or "weight_scale" in k or k.endswith("base_layer.weight")]
    assert "bitsandbytes" in (saved / "e2v_optimizer.json").read_text()

    # the trained model, rebuilt: the fp8 base + the checkpoint's LoRA
    cfg = load_config(whole / "config.yaml", check_paths=False)
    fp8 = build_tiny_parts(seed=0, with_encoders=False).transformer
    quantize_base(fp8, full_patterns(cfg, False))
    setup_training(fp8, cfg, expanded=False)
    load_checkpoint_module(fp8, state)
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    plain_fp8 = build_tiny_parts(seed=0, with_encoders=False).transformer
    quantize_base(plain_fp8, full_patterns(cfg, False))

    # the export onto the ordinary base, as a diffusers user loads it
    base = build_tiny_parts(seed=0, with_encoders=False).transformer
    with torch.no_grad():
        before = base(**_probe())[0]
        base.load_lora_adapter(str(whole / "lora"), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
        load_extra_modules(base, whole / "lora")
        after = base(**_probe())[0]
        on_fp8, fp8_before = fp8(**_probe())[0], plain_fp8(**_probe())[0]
    delta_plain, delta_fp8 = after - before, on_fp8 - fp8_before
    assert delta_plain.abs().max() > 1e-3  # the LoRA does something on the plain base
    # ... the same thing it does on the fp8 base, up to the base's rounding (~3% of the weights)
    assert (delta_plain - delta_fp8).norm() / delta_fp8.norm() < 0.1
    assert (after - on_fp8).norm() / (after - after.mean()).norm() < 0.1

    # and onto a bf16 base
    bf16 = build_tiny_parts(seed=0, with_encoders=False).transformer.to(torch.bfloat16)
    bf16.load_lora_adapter(str(whole / "lora"), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
    load_extra_modules(bf16, whole / "lora")
    with torch.no_grad():
        out = bf16(**{k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                      for k, v in _probe().items()})[0]
    assert (out.float() - after).norm() / after.norm() < 0.05
