"""The causal task with what the rest of a run may bring (docs/causal.md): the seed's YAML at tiny
sizes, a LoRA, on clips of two lengths (21 frames: two blocks of 3; 12 frames: trained at 9, one
block, by the seed's time_division_factor), with gradient checkpointing. ZeRO-2 with its optimizer
offloaded to the CPU gives the losses of the same run without offload; a run on the fp8 base from
the cache (tools/precompute.py) trains both frame buckets with no encoder loaded, and its CausVid file
holds the LoRA fused into the plain base, not into the fp8-rounded weights it trained against."""

from __future__ import annotations

import contextlib
import csv
import io
import math

import pytest
from helpers import ROOT, read_scalars
from helpers_launch import launch_train, wait_all
from helpers_t2v import make_csv_videos

CONFIG = str(ROOT / "configs/causal_regression.yaml")
STEPS = 4
OFFLOAD_RTOL = 1e-4  # fp32: DeepSpeed's CPU Adam against torch's AdamW, the same update summed in another order


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("causal_mixed")
    rows = []
    for name, frames in (("long", 21), ("short", 12)):
        make_csv_videos(data / name, num_clips=2, num_frames=frames)
        with (data / name / "metadata.csv").open() as f:
            rows += [{"video": f"{name}/{r['video']}", "prompt": r["prompt"]} for r in csv.DictReader(f)]
    with (data / "metadata.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path_factory.mktemp("causal_mixed_runs")
    sets = ("model.preset=tiny", "model.pretrained=null", "model.training_type=lora", f"data.datasets.0.data_root={data}",
            f"data.datasets.0.media_root={data}", f"data.datasets.0.metadata_path={data / 'metadata.csv'}",
            "data.num_frames=21", "data.resolution=[32,32]", "train.mixed_precision='no'",
            "train.gradient_checkpointing=true", "train.lr=1e-3", f"train.max_steps={STEPS}",
            "train.checkpoint_every=100", "validation.every_n_steps=0", "visualization.enabled=false",
            f"output_dir={out}", f"cache.dir={out / 'cache'}")
    plain = launch_train(CONFIG, *sets, "run_id=plain")
    offload = launch_train(CONFIG, *sets, "run_id=offload", "deepspeed.config=ds_configs/zero2_offload.json")
    from tools.precompute import main as precompute

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            assert precompute(["--config", CONFIG, *[a for s in sets for a in ("--set", s)]]) == 0
    except BaseException:
        wait_all(plain, offload, check=False)
        raise
    plain, offload = wait_all(plain, offload)
    fp8 = launch_train(CONFIG, *sets, "run_id=fp8_cached", "model.base_dtype=fp8", "cache.enabled=true").wait()
    return out, {"plain": plain, "offload": offload, "fp8_cached": fp8}, printed.getvalue()


def test_both_frame_buckets_train_with_checkpointing(runs):
    out, procs, _ = runs
    log = procs["plain"].stdout
    assert "21x32x32" in log and "9x32x32" in log, log[-2000:]  # the printed bucket table: two blocks, one block
    scalars = read_scalars(out / "plain")
    assert sorted(scalars) == list(range(1, STEPS + 1)) and all(math.isfinite(s["train/loss"]) for s in scalars.values())


def test_optimizer_offload_gives_the_losses_without_it(runs):
    out = runs[0]
    plain, offload = read_scalars(out / "plain"), read_scalars(out / "offload")
    for step in range(1, STEPS + 1):
        assert offload[step]["train/loss"] == pytest.approx(plain[step]["train/loss"], rel=OFFLOAD_RTOL), step
    assert plain[STEPS]["train/loss"] != plain[1]["train/loss"]  # the weights moved: the comparison saw updates


def test_the_fp8_base_trains_from_the_cache_without_encoders(runs):
    out, procs, precomputed = runs
    assert "wrote 4 entries" in precomputed, precomputed
    log = procs["fp8_cached"].stdout + procs["fp8_cached"].stderr
    assert "frozen encoders loaded: none" in log and "21x32x32" in log and "9x32x32" in log, log[-2000:]
    scalars = read_scalars(out / "fp8_cached")
    assert sorted(scalars) == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["train/loss"]) for s in scalars.values())
    assert any(k.startswith("train/loss_at_time_") for s in scalars.values() for k in s)  # the causal rule's buckets


def test_the_fp8_runs_causvid_file_fuses_the_lora_into_the_plain_base(runs):
    """A weight no LoRA touches (a feed-forward projection, stored fp8 in training) is exported as the
    seeded tiny base holds it, not fp8-rounded; a LoRA target is the base plus the LoRA's delta, from
    the exported adapter file: B A x alpha / rank (rank 8 and alpha 8 unless the run set them)."""
    import json

    import torch
    from diffusers import WanTransformer3DModel
    from safetensors import safe_open

    from e2v.models.fp8 import Fp8Linear
    from e2v.models.tiny import seeded, tiny_transformer_config

    folder = runs[0] / "fp8_cached/lora"
    exported = torch.load(folder / "e2v_causvid.pt", weights_only=True)["generator"]
    with seeded(0):
        base = WanTransformer3DModel(**tiny_transformer_config("t2v"))
    ffn = base.blocks[0].ffn.net[2].weight.detach()
    kept = exported["model.blocks.0.ffn.2.weight"]
    assert torch.equal(kept, ffn.to(kept.dtype))
    rounded = Fp8Linear.from_linear(base.blocks[0].ffn.net[2]).dequantized(torch.float32)
    assert not torch.equal(kept.float(), rounded.to(kept.dtype).float())  # fp8 rounding moves it: the check can fail
    with safe_open(str(folder / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        a = f.get_tensor("transformer.blocks.0.attn1.to_q.lora_A.weight")
        b = f.get_tensor("transformer.blocks.0.attn1.to_q.lora_B.weight")
    scale = meta["transformer.lora_alpha"] / meta["transformer.r"]
    expected = base.blocks[0].attn1.to_q.weight.detach() + scale * b.float() @ a.float()
    q = exported["model.blocks.0.self_attn.q.weight"]
    # peft fuses in fp32, then the export dtype rounds: one rounding of that dtype apart at most
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[q.dtype]
    torch.testing.assert_close(q.float(), expected, rtol=ulp, atol=1e-6)
    # and the same tolerance tells it from the base alone: the LoRA is in it
    assert not torch.allclose(q.float(), base.blocks[0].attn1.to_q.weight.detach(), rtol=ulp, atol=1e-6)
