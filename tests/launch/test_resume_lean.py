"""Lean checkpoints: a LoRA (or partly trained) model's checkpoint leaves the frozen base weights
out, under ZeRO-1, -2 and -3, and a resume from it continues bit for bit; a checkpoint written in
the older format (frozen weights included) still resumes, to the same values. One process, no
launcher: the tiny transformer with the tiny LoRA recipe's LoRA and modules trained in full."""

import random

import pytest
import torch
from helpers_resume import _engine, _step

from e2v.models.plan import checkpoint_bytes
from e2v.runtime.integrity import weights_only_load
from e2v.train import checkpoint as ckpt


def _weights(engine) -> dict:
    """Every parameter, whole (gathered under ZeRO-3), and the fp32 masters of the trained ones."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    named = dict(engine.module.named_parameters())
    masters = {f"master.{n}": safe_get_full_fp32_param(p).clone() for n, p in named.items() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(named.values())) if hasattr(next(iter(named.values())), "ds_id") \
            else torch.no_grad():
        return {**{n: p.detach().clone() for n, p in named.items()}, **masters}


def _save(engine, root, step: int, lean: bool = True):
    if not lean:  # the format saved before: DeepSpeed's default, frozen weights included
        real = engine.save_checkpoint
        engine.save_checkpoint = lambda *a, **k: real(*a, **{**k, "exclude_frozen_parameters": False})
    try:
        return ckpt.save_checkpoint(engine, root, step, {"step": step, "rng": ckpt.rng_state(random.Random(0),
                                                                                         torch.Generator())})
    finally:
        engine.__dict__.pop("save_checkpoint", None)


def len_values(engine, names: set) -> int:
    return sum(getattr(p, "ds_numel", None) or p.numel() for n, p in engine.module.named_parameters() if n in names)


def _module_state(path):
    """(module tensor names, bytes of the checkpoint's DeepSpeed files) of a checkpoint folder."""
    files = [f for f in path.rglob("*.pt")]
    names = set()
    for f in files:
        state = weights_only_load(f)
        names |= set(state.get("module") or {})
        names |= set(state.get("frozen_param_fragments") or {})  # ZeRO-2/3 keep frozen tensors here too
    return names, sum(f.stat().st_size for f in files)


def test_lean_checkpoint_holds_no_frozen_tensor_and_both_formats_resume_exactly(tmp_path, one_rank_group):
    # The stages in one test: DeepSpeed keeps the process group it first saw, so the one-rank
    # group (made and torn down per test) must outlive all three.
    for stage in (1, 2, 3):
        _lean_and_old_resume(stage, tmp_path / f"zero{stage}")


def _lean_and_old_resume(stage: int, tmp_path):
    engine = _engine(stage)
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert frozen and trained
    _step(engine)
    lean = _save(engine, tmp_path / "lean", 1)
    old = _save(engine, tmp_path / "old", 1, lean=False)
    loss_2 = _step(engine)
    want = _weights(engine)

    lean_names, lean_bytes = _module_state(lean)
    old_names, old_bytes = _module_state(old)
    assert not lean_names & frozen, f"frozen tensors in the lean checkpoint: {sorted(lean_names & frozen)[:3]}"
    assert trained <= lean_names or stage == 3, "ZeRO-1/2 keep the trained module weights"
    assert frozen <= old_names, "the old format holds the frozen weights (the test's old checkpoint is one)"
    frozen_bytes = len_values(engine, frozen) * 4
    assert old_bytes - lean_bytes >= frozen_bytes, (old_bytes, lean_bytes, frozen_bytes)
    estimate = checkpoint_bytes(len_values(engine, trained), len_values(engine, frozen), 4, stage)
    assert estimate["frozen"] == frozen_bytes
    assert estimate["after"] <= lean_bytes <= 1.3 * estimate["after"], "the plan's estimate, plus pickle framing"
    print(f"ZeRO-{stage}: DeepSpeed files {old_bytes} -> {lean_bytes} bytes; frozen fp32 weights {frozen_bytes} bytes")

    for folder in (lean, old):
        resumed = _engine(stage)
        state = ckpt.load_checkpoint(resumed, folder)
        assert state["step"] == 1
        assert _step(resumed) == loss_2, folder
        got = _weights(resumed)
        assert got.keys() == want.keys()
        differ = [n for n in want if not torch.equal(got[n], want[n])]
        assert not differ, f"{folder.parent.name}: resumed weights differ after a step: {differ[:3]}"

    if stage == 2:  # a checkpoint that lacks a trained tensor is refused, naming it
        model_file = lean / "mp_rank_00_model_states.pt"
        state = weights_only_load(model_file)
        dropped = next(n for n in state["module"] if "lora_A" in n)
        del state["module"][dropped]
        torch.save(state, model_file)
        with pytest.raises(RuntimeError, match=rf"{lean} does not fit this model: missing trained tensors \['{dropped}'\]"):
            ckpt.load_checkpoint(_engine(stage), lean)
