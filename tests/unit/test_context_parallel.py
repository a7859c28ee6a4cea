"""Context parallelism (e2v/models/context_parallel.py, docs/context_parallel.md) against oracles without it.

In process (2 processes spawned over gloo, tests/helpers_context_parallel.py): the self-attention
wrapper alone and the whole tiny transformer, Ulysses 2 and ring 2 (with gradient checkpointing),
against the same computation on the whole sequence; the block-causal transformer (task: causal)
under Ulysses 2 against itself unsplit; the activation formula against the bytes a rank of a
Ulysses-2 group saves for backward.

The training runs with context parallelism against runs without it: tests/launch/test_context_parallel_runs.py."""

from __future__ import annotations

import pytest
from helpers import ROOT
from helpers_context_parallel import TOL


def _cfg(*sets, path="configs/e2v_tiny_lora.yaml"):
    from e2v.config.load import load_config

    return load_config(ROOT / path, list(sets), check_paths=False)


def test_context_parallel_config_errors_name_the_key_and_the_fix():
    from e2v.config.schema import ConfigError
    from e2v.models.context_parallel import layout
    from e2v.models.plan import preflight

    with pytest.raises(ConfigError, match=r"parallel: ulysses_degree 3 x ring_degree 1 = 3 .* 17 frames at 64 x 64 "
                                          r"make 80 tokens .* \(2, 4, 5, 8, 10, 16\)"):
        _cfg("parallel.ulysses_degree=3")
    with pytest.raises(ConfigError, match=r"= 4 ranks .* 17 frames at 48 x 48 make 45 tokens"):  # every bucket counts
        _cfg("parallel.ring_degree=4", "data.resolution_buckets=[[64,64],[48,48]]")
    with pytest.raises(ConfigError, match=r"parallel.ulysses_degree=0 must be >= 1"):
        _cfg("parallel.ulysses_degree=0")
    # the tiny preset has 2 heads: Ulysses 4 fits the tokens (80) but not the heads, found before loading
    with pytest.raises(ConfigError, match=r"parallel.ulysses_degree=4 must divide the transformer's 2 attention "
                                          r"heads .* use one of \[1, 2\].*parallel.ring_degree"):
        preflight(_cfg("parallel.ulysses_degree=4"))
    with pytest.raises(ConfigError, match=r"2 ranks per context-parallel group, but 3 processes .* launch 2"):
        layout(_cfg("parallel.ulysses_degree=2"), 0, 3)
    # I2V-14B (40 heads) at 720 x 1280 x 81 (75,600 tokens): the README's degrees 2, 4 and 8 fit both
    for degree in (2, 4, 8):
        _cfg(f"parallel.ulysses_degree={degree}", "data.resolution=[720,1280]", path="configs/e2v.yaml")
    from e2v.models.context_parallel import check_heads
    check_heads(_cfg("parallel.ulysses_degree=8", path="configs/e2v.yaml"), 40)


def test_context_parallel_layout_groups_consecutive_ranks():
    """4 processes at Ulysses 2: ranks 0, 1 are data-parallel rank 0 and 2, 3 rank 1, as the mesh
    (dp, ring, ulysses) lays them out; the loader, sampler and seeds take the data-parallel rank."""
    from e2v.models.context_parallel import layout

    cfg = _cfg("parallel.ulysses_degree=2")
    lays = [layout(cfg, r, 4) for r in range(4)]
    assert [(x.dp_rank, x.cp_rank, x.dp_size, x.cp_size) for x in lays] == [
        (0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]
    plain = layout(_cfg(), 3, 4)
    assert (plain.dp_rank, plain.dp_size, plain.enabled) == (3, 4, False)


def test_context_parallel_zero3_takes_deepspeeds_all_reduce_path():
    """ZeRO-3's reduce-scatter averages over every rank (ignoring the sequence-parallel size), so a
    context-parallel ZeRO-3 run turns it off (the dp2_u2 run below shows the result); ZeRO-2 and
    runs without context parallelism keep their ds_config."""
    from e2v.train.ds_config import resolve_deepspeed_config

    z3 = resolve_deepspeed_config(_cfg("parallel.ulysses_degree=2", "deepspeed.config=ds_configs/zero3.json"), 1, False)
    assert z3["zero_optimization"]["reduce_scatter"] is False and z3["zero_optimization"]["contiguous_gradients"]
    assert z3["train_batch_size"] == 4  # micro batch 4 x 1 data-parallel rank
    for sets in (("deepspeed.config=ds_configs/zero3.json",), ("parallel.ulysses_degree=2",)):
        assert "reduce_scatter" not in resolve_deepspeed_config(_cfg(*sets), 1, False)["zero_optimization"]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    from helpers_context_parallel import spawn, worker

    return spawn(worker, tmp_path_factory.mktemp("cp_spawn"))


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_context_parallel_attention_wrapper_equals_whole_sequence_attention(spawned, kind):
    """Self-attention of a token shard through DeepSpeed's Ulysses exchange (or diffusers' ring
    attention) = the stock processor on the whole sequence, forward and backward."""
    for rank in spawned:
        r = rank[f"attention_{kind}"]
        assert r["out"] < TOL and r["input_grad"] < TOL, r
        assert r["param_grads"] < TOL and r["param_grad_scale"] > 1e-2, r  # gradients that are there


@pytest.mark.parametrize("kind", ["ulysses", "ring_checkpointing"])
def test_context_parallel_transformer_equals_whole_sequence_transformer(spawned, kind):
    """The tiny transformer split over 2 ranks: every rank returns the whole prediction, and the
    ranks' parameter gradients sum to the unsplit model's (DeepSpeed's reduction relies on it)."""
    for rank in spawned:
        r = rank[f"model_{kind}"]
        assert r["out"] < TOL and r["grads"] < TOL and r["grad_scale"] > 1e-2, r
        assert (r["sequence_parallel_size"], r["sequence_data_parallel_size"]) == (2, 2)


@pytest.mark.parametrize("kind", ["ulysses", "ulysses_checkpointing"])
def test_context_parallel_causal_transformer_equals_whole_sequence_causal_transformer(spawned, kind):
    """task: causal under Ulysses 2, with a timestep per latent frame: the block rule applied after the
    exchange gives the unsplit causal model's prediction and summed gradients (frames_per_block 1;
    with checkpointing, frame 0 alone then blocks of 2, made context-parallel before causal). The
    stock bidirectional model is far from it (the rule is kept, not dropped); a cached forward on the
    split model is refused; the causal sampler on it runs unsplit and equals the rollout without
    context parallelism."""
    for rank in spawned:
        r = rank[f"causal_{kind}"]
        assert r["out"] < TOL and r["grads"] < TOL and r["grad_scale"] > 1e-2, r
        assert r["bidirectional_gap"] > 1e-2, r
        assert r["sample"] < TOL, r
        assert "sample inside e2v.models.context_parallel.whole_sequence" in r["cached_refused"], r


def test_ring_attention_refuses_the_causal_rule():
    """A ring processor cannot take the block rule (diffusers' ring attention has no mask): the
    causal_refusal line, naming parallel.ring_degree and the fix."""
    from types import SimpleNamespace

    from e2v.config.schema import ConfigError
    from e2v.models.context_parallel import ContextParallelSelfAttention

    ring = ContextParallelSelfAttention(None, SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=2)))
    with pytest.raises(ConfigError, match=r"^task: causal with parallel.ring_degree: 2: .*set parallel.ring_degree: 1 "
                                          r"and split with parallel.ulysses_degree instead"):
        ring.make_causal(None)


def test_context_parallel_activation_formula_matches_saved_bytes_per_rank(spawned):
    """Per rank of a Ulysses-2 group, the bytes autograd keeps for backward against
    e2v.models.plan.activation_bytes at cp=2 (within 20%, as tests/unit/test_estimate_memory.py holds the
    unsplit formula), and clearly below the unsplit formula."""
    from helpers_context_parallel import SAVED_SHAPE as s

    from e2v.models.plan import ModelShape, activation_bytes, activation_terms

    shape = ModelShape(s["heads"] * s["head_dim"], s["ffn"], s["layers"])
    tokens, ctx = s["frames"] * s["size"] ** 2 // 4, 512 + 51
    for ck in (False, True):
        measured = [rank["saved_bytes"][f"ulysses2_checkpointing_{ck}"] for rank in spawned]
        # with checkpointing the recomputed block (A) lives only during backward: not in the forward's bytes
        gpu, _ = activation_bytes(tokens, ctx, shape, 1, 4, ck, cp=2)
        whole, _ = activation_bytes(tokens, ctx, shape, 1, 4, ck, cp=1)
        if ck:
            gpu -= 4 * activation_terms(tokens, ctx, shape, 2)[0]
            whole -= 4 * activation_terms(tokens, ctx, shape, 1)[0]
        for m in measured:
            assert gpu == pytest.approx(m, rel=0.2), (ck, m, gpu)
            assert m < 0.8 * whole, (ck, m, whole)


def test_context_parallel_estimate_and_dry_run_divide_the_activations():
    """tools/estimate_memory.py and the dry run's plan use the context-parallel degree: the
    activations per GPU are the formula's at cp = U x R (which the test above holds to measured
    bytes), below the unsplit figure, and the exchange's buffers are added to the buffers."""
    from e2v.models.plan import activation_bytes, describe_plan, exchange_bytes, preflight, tokens
    from e2v.train import memory as em
    from e2v.train.ds_config import resolve_deepspeed_config

    plain, split = _cfg(), _cfg("parallel.ulysses_degree=2")
    a, b = em.estimate(plain, 2, 80), em.estimate(split, 2, 80)
    c = em.count_model(split)
    s, ctx = tokens(split)
    assert (s, b["context_parallel"], a["context_parallel"]) == (80, 2, 1)
    for ra, rb in zip(a["rows"], b["rows"]):
        gib = 2**30
        ck, off = rb["gradient_checkpointing"], rb["activation_offload"]
        assert rb["activations_gb"] * gib == pytest.approx(activation_bytes(s, ctx, c, 4, 4, ck, off, cp=2)[0])
        assert rb["activations_gb"] < ra["activations_gb"]
        assert (rb["buffers_gb"] - ra["buffers_gb"]) * gib == pytest.approx(exchange_bytes(s, c, 4, 4, 2, 1))
    with pytest.raises(ValueError, match="2 ranks per context-parallel group, but 3 processes"):
        em.estimate(split, 3, 80)
    transformer, full = preflight(split)
    plan = describe_plan(transformer, split, resolve_deepspeed_config(split, 1, False), full)
    assert "activations per GPU (estimate)" in plan and "exchange buffers" in plan
    assert "for 80 video tokens, 40 per GPU over 2 context-parallel" in plan


def test_ring_attention_in_fp32_is_refused_at_config_time_on_cuda(monkeypatch):
    """On CUDA the ring's attention is the flash op, bf16 / fp16 only: fp32 stops at load_config,
    naming the key and both fixes. The CPU's flash op takes fp32 (the ring tests here run it)."""
    from e2v.config.schema import ConfigError

    assert _cfg("parallel.ring_degree=2", "train.mixed_precision=no").parallel.ring_degree == 2  # CPU: allowed
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"parallel.ring_degree: 2 with train.mixed_precision: 'no' .*bf16 or fp16 "
                                          r"only; set train.mixed_precision: bf16, or .*parallel.ulysses_degree"):
        _cfg("parallel.ring_degree=2", "train.mixed_precision=no")
    assert _cfg("parallel.ring_degree=2", "train.mixed_precision=bf16").train.mixed_precision == "bf16"
    assert _cfg("parallel.ulysses_degree=2", "train.mixed_precision=no").parallel.ulysses_degree == 2
