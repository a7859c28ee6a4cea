"""train.activation_offload (e2v/train/step.py ActivationOffload) on CPU, where everything but the
pinned, non-blocking copies runs: which saved tensors are offloaded (the forward's activations,
never a parameter, trained or frozen, nor a view of one), and that backward with them gives the
gradients of the run without (the oracle)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers_conditioning import make_batch, make_cfg


def step_grads(transformer, cfg, c, hooks=None):
    from e2v.train.step import draw_flow, forward_loss

    transformer.zero_grad(set_to_none=True)
    sigma, noise, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(0))
    if hooks is None:
        loss = forward_loss(transformer, c, sigma, noise, noisy, cfg, torch.float32)[0]
    else:
        with hooks:
            loss = forward_loss(transformer, c, sigma, noise, noisy, cfg, torch.float32)[0]
    loss.backward()
    return {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_activations_are_offloaded_and_parameters_stay(tiny_parts, monkeypatch, checkpointing):
    import e2v.train.step as step
    from e2v.conditioning.layout import batch_conditions

    cfg = make_cfg()
    transformer = copy.deepcopy(tiny_parts.transformer)
    for name, p in transformer.named_parameters():  # a few trained, the rest frozen, as a LoRA run has it
        p.requires_grad_("proj_out" in name or "blocks.0.attn1" in name)
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    with torch.no_grad():
        c = batch_conditions(make_batch([2, 3]), tiny_parts, cfg, rng=random.Random(0),
                         generator=torch.Generator().manual_seed(0))
    want = step_grads(transformer, cfg, c)

    seen = []
    real = step.offloads
    monkeypatch.setattr(step, "offloads", lambda t: seen.append((t, real(t))) or seen[-1][1])
    hooks = step.ActivationOffload(pin_memory=False)
    got = step_grads(transformer, cfg, c, hooks)

    params = list(transformer.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    weights = [t for t, _ in seen if any(t is p for p in params) or t.untyped_storage().data_ptr() in storages]
    assert weights, "the forward saved no weight: the check below would test nothing"
    assert not [tuple(t.shape) for t, moved in seen if moved and t.untyped_storage().data_ptr() in storages]
    assert hooks.offloaded and len(hooks.offloaded) == sum(moved for _, moved in seen)
    assert all(t.grad_fn is not None for t, moved in seen if moved)  # activations only
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_offload_is_on_only_with_cuda(monkeypatch):
    import contextlib

    import e2v.train.step as step

    assert isinstance(step.activation_context(True), contextlib.nullcontext)  # CPU: nothing to offload
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(step.activation_context(True), step.ActivationOffload)
    assert isinstance(step.activation_context(False), contextlib.nullcontext)
