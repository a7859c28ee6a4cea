"""The memory model (e2v/train/memory.py) and its command line (tools/estimate_memory.py): model-state figures equal DeepSpeed's own estimators for a full
fine-tune; parameter counts equal the real training setup's; the activation formula matches the
bytes autograd actually saves for backward in tiny and small Wan transformers on CPU."""

import contextlib
import io
import re
import sys

import pytest
import torch
from helpers import ROOT
from helpers_memory import _saved_bytes

from e2v.models import plan
from e2v.train import memory as em
from tools import estimate_memory

GB = 2**30


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (8, 1), (8, 2)])
def test_model_states_equal_deepspeed_estimators_for_full_finetune(gpus, nodes):
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    c = em.ModelCounts(trainable=1_418_996_800, frozen=0, largest_layer=45_880_320, width=1536, ffn=8960, layers=30)
    ours = {n: em.model_states(c, n, gpus, nodes) for n in em.SHIPPED}
    gpu = {n: v["params"] + v["grads"] + v["optimizer"] for n, v in ours.items()}
    kw = dict(num_gpus_per_node=gpus, num_nodes=nodes)
    ds = {
        "zero2.json": estimate_zero2_model_states_mem_needs(c.trainable, cpu_offload=False, **kw),
        "zero2_offload.json": estimate_zero2_model_states_mem_needs(c.trainable, cpu_offload=True, **kw),
        # We load without zero.Init (every rank materialises the model): DeepSpeed's zero_init=False.
        "zero3.json": estimate_zero3_model_states_mem_needs(c.trainable, c.largest_layer, cpu_offload=False,
                                                            cpu_offload_params=False, zero_init=False, **kw)[:2],
        "zero3_offload.json": estimate_zero3_model_states_mem_needs(c.trainable, c.largest_layer, cpu_offload=True,
                                                                    cpu_offload_params=True, zero_init=False, **kw)[:2],
    }
    for name, (ds_cpu, ds_gpu) in ds.items():
        assert gpu[name] == pytest.approx(ds_gpu, abs=1), name
        assert ours[name]["cpu"] == pytest.approx(ds_cpu, abs=1), name
    # The printed *_all_cold tables (GB, 2 decimals) show the same numbers.
    for fn, rows in ((estimate_zero2_model_states_mem_needs_all_cold, {"offload_optimizer=cpu": "zero2_offload.json",
                                                                      "offload_optimizer=none": "zero2.json"}),
                     (estimate_zero3_model_states_mem_needs_all_cold,
                      {"offload_param=cpu,offload_optimizer=cpu,zero_init=0": "zero3_offload.json",
                       "offload_param=none,offload_optimizer=none,zero_init=0": "zero3.json"})):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            fn(c.trainable, c.largest_layer, **kw) if "zero3" in fn.__name__ else fn(c.trainable, **kw)
        for line in out.getvalue().splitlines():
            m = re.match(r"\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.*)", line)
            options = re.sub(r"OffloadDeviceEnum\.|\s", "", m.group(3)) if m else None
            if options in rows:
                name = rows[options]
                assert float(m.group(2)) == pytest.approx(round(gpu[name] / GB, 2), abs=0.006), (name, line)
                assert float(m.group(1)) == pytest.approx(round(ours[name]["cpu"] / GB, 2), abs=0.006), (name, line)
                rows = {k: v for k, v in rows.items() if v != name}
        assert not rows, f"lines not found in DeepSpeed's table: {rows}"


def test_frozen_weights_add_only_their_16bit_copy():
    full = em.ModelCounts(trainable=10_000, frozen=0, largest_layer=100, width=8, ffn=8, layers=1)
    lora = em.ModelCounts(trainable=10_000, frozen=1_000_000, largest_layer=100, width=8, ffn=8, layers=1)
    for name in em.SHIPPED:
        a, b = em.model_states(full, name, 4, 1), em.model_states(lora, name, 4, 1)
        assert b["grads"] == a["grads"] and b["optimizer"] == a["optimizer"]
        expected = {"zero2.json": 2e6, "zero2_offload.json": 2e6, "zero3.json": 2e6 / 4, "zero3_offload.json": 0}[name]
        assert b["params"] - a["params"] == pytest.approx(expected)


def test_counts_equal_the_training_setup():
    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    setup_training(model, cfg, expanded=False)
    c = em.count_model(cfg)
    assert c.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert c.trainable + c.frozen == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("heads,head_dim,ffn,layers,frames,size", [
    (2, 12, 32, 2, 5, 16),      # the tiny preset's transformer, 17 frames at 64 x 64 (80 tokens)
    (4, 32, 256, 2, 5, 32),     # a small one: 320 tokens
    (8, 32, 512, 3, 3, 32),
])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_saved_bytes(heads, head_dim, ffn, layers, frames, size, checkpointing):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32, image_dim=32, added_kv_proj_dim=heads * head_dim)
    model.requires_grad_(True)
    inputs = dict(hidden_states=torch.randn(1, 36, frames, size, size), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 512, 32), encoder_hidden_states_image=torch.randn(1, 51, 32),
                  return_dict=False)
    measured = _saved_bytes(model, inputs, checkpointing)
    s, ctx = frames * size * size // 4, 512 + 51
    c = em.ModelCounts(0, 0, 0, heads * head_dim, ffn, layers)
    block, outside = plan.activation_terms(s, ctx, c)
    # With checkpointing only the block inputs are saved in the forward; the recomputed block (A)
    # lives during backward, which the estimate adds on top.
    predicted = 4 * (layers * s * c.width + outside if checkpointing else layers * block + outside)
    assert predicted == pytest.approx(measured, rel=0.2)
    gpu, moved = plan.activation_bytes(s, ctx, c, 1, 4, checkpointing, offload=False)
    assert gpu == pytest.approx(predicted + (4 * block if checkpointing else 0)) and moved == 0


def test_plans_the_14b_e2v_lora_onto_a_24_gb_gpu(capsys, monkeypatch):
    """The README's 24 GB lines: online, the resident encoders (13.4 GB) leave no configuration that
    fits; from the cache the 14B E2V config fits one 24 GB card with ZeRO-3 offload, checkpointing
    and activation offload (the CLI's own output)."""
    def run(*sets):
        monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "--config", str(ROOT / "configs/e2v.yaml"),
                                          "--gpus", "1", "--gpu-mem-gb", "24", *sets])
        estimate_memory.main()
        return capsys.readouterr().out

    online = run("--cpu-mem-gb", "256")
    assert "16.50B params" in online and "first that fits the GPU: none" in online
    # the advice tries the cache itself and prints the plan as commands to paste
    plan = ("deepspeed train_e2v.py --config {} --set deepspeed.config=ds_configs/zero3_offload.json --set "
            "train.gradient_checkpointing=true --set train.activation_offload=true --set cache.enabled=true")
    assert plan.format(ROOT / "configs/e2v.yaml") in online and "python tools/precompute.py --config" in online
    assert "~202 GB host RAM per node; 256 GB host RAM (--cpu-mem-gb)" in online
    cached = run("--set", "cache.enabled=true", "--cpu-mem-gb", "256")
    assert ("first that fits the GPU: deepspeed.config=ds_configs/zero3_offload.json train.gradient_checkpointing=true "
            "train.activation_offload=true") in cached
    # a 64 GB host cannot hold the fp32 masters and moments of the 6.4 B trained parameters: said
    # (16.5 GB: the validation phase's peak, above training's 14.5), and the plan that fits both
    # trains the LoRA alone, on the fp8 base with 8-bit AdamW rather than ZeRO-3's parameter offload
    small = run("--cpu-mem-gb", "64")
    assert "fits the GPU (16.5 GB) but needs ~202 GB host RAM per node; 64 GB host RAM (--cpu-mem-gb)" in small
    assert "--set cache.enabled=true --set train.trainable=[] --set model.base_dtype=fp8" in small and "LoRA alone" in small
    assert "--set deepspeed.config=ds_configs/zero2.json" in small and "deepspeed.optimizer=adamw_8bit" in small


def test_resident_encoders_are_counted_from_their_real_configs():
    """UMT5-XXL's encoder (5.68 B parameters, bf16), CLIP ViT-H/14's vision tower (0.63 B, fp32) and
    the Wan VAE (0.13 B, fp32), built on the meta device; nothing with the cache, no CLIP for T2V."""
    from e2v.config.load import load_config
    from e2v.models.plan import encoder_bytes

    cfg = load_config(ROOT / "configs/e2v.yaml", check_paths=False)
    b = encoder_bytes(cfg)
    assert round(b["text_encoder"] / 2 / 1e9, 2) == 5.68 and round(b["image_encoder"] / 4 / 1e9, 2) == 0.63
    assert round(b["vae"] / 4 / 1e9, 2) == 0.13
    assert encoder_bytes(load_config(ROOT / "configs/e2v.yaml", ["cache.enabled=true"], check_paths=False)) == {}
    assert set(encoder_bytes(load_config(ROOT / "configs/t2v_lora.yaml", check_paths=False))) == {"vae", "text_encoder"}
    gb = em.estimate(cfg, 1, 80)["rows"][0]["encoders_gb"]
    assert gb == pytest.approx(sum(b.values()) / 2**30)


def test_communication_buckets_come_from_the_ds_config():
    """reduce bucket + all-gather (ZeRO-2) or prefetch (ZeRO-3) bucket, in elements of the training
    dtype: the shipped configs' 5e8 + 5e8 elements are 2e9 bytes in bf16, 4e9 in fp32."""
    import json

    for name in em.SHIPPED:
        z = json.loads((ROOT / "ds_configs" / name).read_text())["zero_optimization"]
        gather = z["stage3_prefetch_bucket_size"] if z["stage"] == 3 else z["allgather_bucket_size"]
        assert em.buffer_bytes(name, 2) == 2 * (z["reduce_bucket_size"] + gather) == 2e9
        assert em.buffer_bytes(name, 4) == 4e9


def test_cpu_mode_puts_every_term_in_host_memory():
    """--cpu (a run with no GPU): the node total is the ranks' larger phase (load or training) plus
    the launcher; ZeRO-3 splits weights and optimizer over the ranks, ZeRO-2 only the optimizer.
    bench/smoke_real.py checks the figures against measured peaks at real shapes."""
    from e2v.config.load import load_config

    def cpu(ds, procs):
        cfg = load_config(str(ROOT / "configs/e2v_tiny_lora.yaml"), [f"deepspeed.config=ds_configs/{ds}"], check_paths=False)
        return em.estimate_cpu(cfg, procs)

    z2, z2_two, z3_two = cpu("zero2_offload.json", 1), cpu("zero2_offload.json", 2), cpu("zero3.json", 2)
    for r in (z2, z2_two, z3_two):
        assert sum(r["per_rank_gb"].values()) == pytest.approx(r["train_per_rank_gb"])
        peak = max(r["train_per_rank_gb"], r["load_per_rank_gb"])
        assert r["node_total_gb"] == pytest.approx(r["procs"] * peak + em.LAUNCHER_GB)
    assert z2_two["per_rank_gb"]["optimizer"] == pytest.approx(z2["per_rank_gb"]["optimizer"] / 2)
    assert z2_two["per_rank_gb"]["weights"] == pytest.approx(z2["per_rank_gb"]["weights"])
    assert z3_two["per_rank_gb"]["weights"] == pytest.approx(z2["per_rank_gb"]["weights"] / 2)
    # what ZeRO-3 keeps gathered: the whole tiny model (under stage3_max_live_parameters); none on ZeRO-2
    assert z3_two["per_rank_gb"]["gathered"] == pytest.approx(z2["per_rank_gb"]["weights"])
    assert z2["per_rank_gb"]["gathered"] == 0
    assert z2["per_rank_gb"]["encoders"] > 0  # the tiny run encodes online


def test_dry_run_gives_the_fit_verdict_host_ram_and_the_precompute_step(demo_data, capsys, monkeypatch):
    """--dry_run on the 24 GB configs: the GPU verdict with the validation phase, host RAM at load
    and in training, and, when the config reads an empty cache, the precompute command to run."""
    import train_e2v

    def dry(config, *sets):
        argv = ["train_e2v.py", "--config", config, "--dry_run", "--set", f"data.datasets.0.data_root={demo_data}"]
        monkeypatch.setattr(sys, "argv", argv + [a for s in sets for a in ("--set", s)])
        train_e2v.main()
        return capsys.readouterr().out

    out = dry("configs/e2v_24gb.yaml")
    assert "training 14.5 GiB, validation 16.5 GiB -> fits" in out
    assert "host RAM (estimate): 31.0 GiB while the bf16 transformer loads, 65.1 GiB in training" in out
    out = dry("configs/e2v_i2v_14b_fp8_24gb.yaml", "data.num_frames=17")  # the demo's clips are 17 frames
    assert "fp8 base: 16.148 B frozen weights" in out and "validation 13.3 GiB -> fits" in out
    assert "host RAM (estimate): 31.0 GiB while the bf16 transformer loads" in out
    assert (f"the cache is empty (cache.enabled: true): fill it first with python tools/precompute.py --config "
            f"configs/e2v_i2v_14b_fp8_24gb.yaml --set data.datasets.0.data_root={demo_data} --set data.num_frames=17") in out


def test_the_24gb_configs_fit_with_validation_on():
    """Every shipped 24 GB config validates (every_n_steps > 0) and fits one 24 GB card in both phases
    by the estimate. The validation phase: the resident training state plus the transformer's
    inference activations, the VAE and its tiled decode and, encoding online, the largest encoder
    (UMT5-XXL), not all three at once."""
    from e2v.config.load import load_config
    from e2v.models.plan import encoder_bytes

    for name in ("e2v_24gb", "e2v_t2v_1.3b_24gb", "e2v_i2v_14b_fp8_24gb"):
        cfg = load_config(ROOT / f"configs/{name}.yaml", check_paths=False)
        r = em.estimate(cfg, 1, 24)
        row = r["configured"]
        assert cfg.validation.every_n_steps > 0 and row["validation_gb"] > 0, name
        assert row["fits"] and max(row["gpu_total_gb"], row["validation_gb"]) <= 24, name
        parts = r["validation_parts_gb"]
        assert set(parts) == {"inference_activations", "vae", "vae_decode"}, name  # cached: no encoder
        resident = row["params_gb"] + row["grads_gb"] + row["optimizer_gb"] + row["buffers_gb"] + em.OVERHEAD_GB
        assert row["validation_gb"] == pytest.approx(resident + sum(parts.values()))
    online = load_config(ROOT / "configs/e2v_t2v_1.3b_24gb.yaml", ["cache.enabled=false"], check_paths=False)
    enc = encoder_bytes(online)
    parts = em.estimate(online, 1, 24)["validation_parts_gb"]
    assert parts["largest_encoder"] * GB == enc["text_encoder"] == max(enc.values())
    assert parts["vae"] * GB == enc["vae"]
    off = em.estimate(load_config(ROOT / "configs/e2v_24gb.yaml", ["validation.every_n_steps=0"], check_paths=False), 1, 24)
    assert off["configured"]["validation_gb"] == 0 and off["validation_parts_gb"] == {}


def test_the_ema_adds_an_fp32_copy_of_the_trained_weights_per_rank_to_host_memory():
    """train.ema_weight (e2v/train/ema.py): every rank averages in fp32 on its host; CausVid's whole-1.3B
    fine-tune on 8 GPUs: 4 bytes x 1.4 B trained parameters x 8 ranks more host RAM, no GPU memory."""
    from e2v.config.load import load_config

    cfg = load_config(ROOT / "configs/causal_regression.yaml", check_paths=False)
    without = em.estimate(cfg, 8, 80)
    cfg.train.ema_weight = 0.99
    with_ema = em.estimate(cfg, 8, 80)
    assert 1.3e9 < without["trainable"] < 1.5e9
    for a, b in zip(without["rows"], with_ema["rows"]):
        assert b["cpu_per_node_gb"] - a["cpu_per_node_gb"] == pytest.approx(4 * without["trainable"] * 8 / GB)
        assert b["gpu_total_gb"] == a["gpu_total_gb"]
