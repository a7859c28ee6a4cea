"""DeepSpeed for real: every shipped ds_config resolves; 2-process runs under ZeRO-2, and ZeRO-2 with
optimizer offload plus gradient checkpointing and the activation-offload key, give the losses of
the ZeRO-3-offload run; a non-finite loss stops a 2-process run naming step, ranks and samples, after
saving nothing from that step; under bf16 the modules diffusers keeps in fp32 stay fp32 (checked
against diffusers' own bf16 loading), and trainable weights keep fp32 master copies.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_deepspeed_runs.py."""

import json

import pytest
from helpers import ROOT

from e2v.config.load import load_config
from e2v.train.ds_config import resolve_deepspeed_config
from e2v.train.guard import NonFiniteGuard

SHIPPED = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json"))


def test_shipped_configs():
    assert SHIPPED == ["zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_auto_field_is_filled_from_the_yaml(name):
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"deepspeed.config=ds_configs/{name}", "train.lr=3e-4",
                                                      "train.micro_batch_size=3", "train.gradient_accumulation_steps=2",
                                                      "train.mixed_precision=bf16"],
                      check_paths=False)
    raw = json.loads((ROOT / "ds_configs" / name).read_text())
    cpu, gpu = resolve_deepspeed_config(cfg, 2, cuda=False), resolve_deepspeed_config(cfg, 2, cuda=True)
    assert '"auto"' in json.dumps(raw) and '"auto"' not in json.dumps(cpu) + json.dumps(gpu)
    assert cpu["train_batch_size"] == 3 * 2 * 2 and cpu["bf16"]["enabled"] is True
    assert cpu["optimizer"]["params"]["lr"] == 3e-4
    # torch's AdamW on every device by default (tests/unit/test_optimizer.py: DeepSpeed's Adam by name)
    assert cpu["optimizer"]["params"]["torch_adam"] is True and gpu["optimizer"]["params"]["torch_adam"] is True
    zero = cpu["zero_optimization"]
    assert zero["stage"] == (3 if "zero3" in name else 2)
    offloaded = {k for k in ("offload_optimizer", "offload_param") if k in zero}
    assert offloaded == ({"offload_optimizer", "offload_param"} if name == "zero3_offload.json"
                         else {"offload_optimizer"} if name == "zero2_offload.json" else set())
    for k in offloaded:
        assert zero[k]["device"] == "cpu" and zero[k]["pin_memory"] is False
        assert gpu["zero_optimization"][k]["pin_memory"] is True
    named = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"deepspeed.config=ds_configs/{name}",
                                                        "deepspeed.optimizer=deepspeed_adam"], check_paths=False)
    assert resolve_deepspeed_config(named, 1, cuda=True)["optimizer"]["params"]["torch_adam"] is False


def test_guard_skips_and_counts_or_stops():
    guard = NonFiniteGuard(skip=True, rank=0)
    assert guard.bad(1.0, "loss", 1, ["a"]) is False
    assert guard.bad(float("nan"), "loss", 2, ["b"]) is True and guard.skipped == 1
    assert guard.grad_norm(float("inf"), 3, ["c"]) == float("inf") and guard.skipped == 2
    assert guard.grad_norm(None, 4, ["d"]) != guard.grad_norm(None, 4, ["d"])  # nan: not computed
    assert guard.bad(0.5, "loss", 5, ["e"]) is False and guard.consecutive == 0
    for _ in range(NonFiniteGuard.MAX_CONSECUTIVE):
        guard.bad(float("inf"), "loss", 6, ["f"])
    with pytest.raises(FloatingPointError, match="in a row"):
        guard.bad(float("inf"), "loss", 6, ["f"])
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 7 \(rank 0: loss inf, samples \['x', 'y'\]\)"):
        NonFiniteGuard(skip=False, rank=0).bad(float("inf"), "loss", 7, ["x", "y"])
