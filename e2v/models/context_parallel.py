"""Context parallelism: one sample's video tokens split over `parallel.ulysses_degree` x
`parallel.ring_degree` ranks, so the activations and the attention of a long or large clip are
shared between GPUs (docs/context_parallel.md has the arithmetic and what composes with what).

Layout. The launched processes form data-parallel groups of P = U x R consecutive ranks
(e2v.runtime.distributed.context_parallel_mesh: rank = dp * P + r * U + u). The P ranks of a group act as
one data-parallel rank: they load the same micro-batch and draw the same elements, dropouts,
sigmas and noise, because the loader, the bucket sampler and the seeds take `Layout.dp_rank` and
`Layout.dp_size`, not the global rank and world.

In the transformer (`enable`):
- diffusers' context-parallel hooks, with the model's own `_cp_plan`, split the sequence after the
  patch embedding and the rope tables (rank k of a group keeps tokens [k S/P, (k+1) S/P)) and
  all-gather the output of `proj_out`: every rank returns the whole prediction and computes the
  same loss;
- self-attention (`attn1`) runs DeepSpeed's Ulysses exchange (`deepspeed.sequence.layer.
  DistributedAttention`): an all-to-all over the U ranks of a Ulysses group trades the token shard
  for a head shard (H/U heads over S/R tokens), attention runs, the inverse all-to-all returns the
  token shard;
- with R > 1 that attention is diffusers' ring attention (`TemplatedRingAttention`) over the R ranks
  of a ring group: the other shards' keys and values, merged by their log-sum-exp;
- cross-attention needs nothing: a query's attention over the text and image tokens does not depend
  on the other queries, so each token shard attends the whole, unsplit context, exactly;
- a block-causal transformer (`task: causal`, e2v/models/causal.py) keeps its rule: after the
  Ulysses exchange attention sees every token of the sequence, so the processor applies the
  model's own block rule there (causal.block_causal_attention) instead of full attention; ring
  attention takes no mask and is refused for it. The causal sampler's cached forwards run on the
  unsplit model (`whole_sequence`).

Gradients. The split's backward gives rank k the gradient through its own tokens and the gather's
backward hands it its slice of dL/dprediction, so the P ranks' parameter gradients sum to the
sample's gradient. DeepSpeed, given these groups (`SequenceParallelGroups`, its mpu interface),
all-reduces over every rank and divides by world / P = DP: the mean over the data-parallel groups
of each group's sum, the update of the data-parallel run of the same global batch. ZeRO partitions
parameters, gradients and optimizer state over every rank.

Legend: B batch, S video tokens (S/P per rank), H heads, D head width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from e2v.config.schema import ConfigError
from e2v.models.causal import RING_REFUSAL, BlockCausalAttention, block_causal_attention
from e2v.models.wan_rope import apply_rope


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: its global rank and world, and its data-parallel and
    context-parallel coordinates."""

    rank: int = 0
    world: int = 1
    ulysses: int = 1
    ring: int = 1

    @property
    def cp_size(self) -> int:
        return self.ulysses * self.ring

    @property
    def dp_size(self) -> int:
        return self.world // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def enabled(self) -> bool:
        return self.cp_size > 1


def layout(cfg, rank: int, world: int) -> Layout:
    """This rank's Layout under cfg.parallel; the launch must be a whole number of groups."""
    p = cfg.parallel
    degree = p.ulysses_degree * p.ring_degree
    if world % degree:
        raise ConfigError(
            f"parallel: ulysses_degree {p.ulysses_degree} x ring_degree {p.ring_degree} = {degree} ranks per "
            f"context-parallel group, but {world} processes were launched, not a multiple of {degree}: launch "
            f"{degree * max(1, world // degree)} (deepspeed --num_gpus N) or lower the degrees")
    return Layout(rank, world, p.ulysses_degree, p.ring_degree)


def check_heads(cfg, heads: int) -> None:
    """Ulysses gives each rank heads / ulysses_degree whole heads. On the meta device before
    loading (e2v.models.plan.preflight) and on the loaded model (a hub id's shape is known only then)."""
    u = cfg.parallel.ulysses_degree
    if heads % u:
        fits = [k for k in range(1, heads + 1) if heads % k == 0]
        raise ConfigError(f"parallel.ulysses_degree={u} must divide the transformer's {heads} attention heads "
                          f"(each rank attends heads / ulysses_degree of them): use one of {fits}, or split the "
                          "rest of the degree with parallel.ring_degree")


def zero_settings(cfg, ds_config: dict) -> dict:
    """The ZeRO settings context parallelism needs. ZeRO-1/2, and ZeRO-3's all-reduce path, divide
    the reduced gradients by world / P; ZeRO-3's reduce-scatter path (`reduce_scatter: true`, the
    default) divides by the world alone, which would halve the update at P = 2 (deepspeed 0.19.8,
    stage3.py: __avg_scatter_grads vs __avg_scatter_contiguous_grads). So under ZeRO-3 the
    gradients take the all-reduce path: reduce_scatter off, contiguous_gradients on; each rank then
    receives the whole reduced bucket, about twice a reduce-scatter's traffic."""
    p, zero = cfg.parallel, ds_config.get("zero_optimization", {})
    if p.ulysses_degree * p.ring_degree == 1 or zero.get("stage") != 3:
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "reduce_scatter": False, "contiguous_gradients": True}}


class SequenceParallelGroups:
    """DeepSpeed's sequence-parallel mpu interface (the one `deepspeed.runtime.sequence_parallel.
    parallel_state_sp` implements), over the groups of our mesh: deepspeed.initialize(mpu=...)
    reduces gradients and partitions ZeRO state over `sequence_data_parallel` (every rank) and
    divides the reduced gradients by its size over `sequence_parallel` (P)."""

    initialize_sequence_parallel = None  # DeepSpeed recognises a sequence-parallel mpu by this name

    def __init__(self, cp_group, all_group):
        self.cp_group, self.all_group = cp_group, all_group

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.cp_group)

    def get_sequence_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.cp_group)

    def get_sequence_data_parallel_group(self):
        return self.all_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.all_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.all_group)

    # parallel_state_sp aliases model parallelism to the sequence-parallel group; so do we
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def enable(transformer, cfg, lay: Layout) -> SequenceParallelGroups:
    """Make `transformer` context-parallel on this rank (a collective: every rank calls it) and
    return the groups for deepspeed.initialize(mpu=...)."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    from e2v.runtime.device import accelerator_device
    from e2v.runtime.distributed import context_parallel_mesh

    check_heads(cfg, transformer.config.num_attention_heads)
    mesh, all_group = context_parallel_mesh(lay.dp_size, lay.ring, lay.ulysses)
    # Built by hand, not by diffusers' enable_parallelism: that also swaps in diffusers' own
    # attention exchange and finds its device by dividing by the accelerator count, which is 0 on
    # a CPU-only machine.
    cp = ContextParallelConfig(ring_degree=lay.ring, ulysses_degree=lay.ulysses)
    cp.setup(lay.rank, lay.world, accelerator_device(), mesh)
    ring = ParallelConfig(context_parallel_config=cp) if lay.ring > 1 else None
    ulysses = cp._ulysses_mesh.get_group() if lay.ulysses > 1 else None
    state = getattr(transformer, "causal_state", None)  # made causal first (enable_causal): keep its rule
    for i, block in enumerate(transformer.blocks):
        processor = ContextParallelSelfAttention(ulysses, ring)
        if state is not None:
            processor.make_causal(BlockCausalAttention(state, i))
        block.attn1.set_processor(processor)
    apply_context_parallel(transformer, cp, transformer._cp_plan)
    transformer.e2v_context_parallel = cp  # what whole_sequence takes off and puts back
    return SequenceParallelGroups(cp._flattened_mesh.get_group(), all_group)


@contextlib.contextmanager
def whole_sequence(model):
    """Inside, every context-parallel transformer in `model` (itself, a DeepSpeed engine) runs
    unsplit: diffusers' split and gather hooks are taken off and each self-attention gets the
    processor of the whole sequence (the layer's block-causal one, or local attention), with the
    backend it had; put back on exit. Every rank of a group then computes the same whole forward.
    For the causal sampler: its cached forwards are one block each, small, and a block's tokens
    need not divide by the degree. Nothing changes for a model without context parallelism."""
    from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

    walk = getattr(model, "modules", None)  # a callable without modules (a test's stand-in) has none
    found = [m for m in walk() if vars(m).get("e2v_context_parallel") is not None] if walk else []
    split = {}
    for t in found:
        remove_context_parallel(t, t._cp_plan)
        for block in t.blocks:
            split[block.attn1] = block.attn1.processor
            block.attn1.set_processor(block.attn1.processor.unsplit())
    try:
        yield model
    finally:
        for attn, processor in split.items():
            attn.set_processor(processor)
        for t in found:
            apply_context_parallel(t, t.e2v_context_parallel, t._cp_plan)


class ContextParallelSelfAttention:
    """The self-attention processor under context parallelism: diffusers' WanAttnProcessor
    self-attention path (projections, RMS norm across heads, rope; transformer_wan.py), with the
    attention over the whole sequence done by DeepSpeed's Ulysses exchange around the local
    attention, which is diffusers' dispatch (SDPA or the chosen backend) or, with ring_degree > 1,
    diffusers' ring attention. On a block-causal transformer (`make_causal`) the local attention
    is the layer's block rule instead (Ulysses only)."""

    _attention_backend = None  # set by the model's set_attention_backend, as on diffusers' processors
    _parallel_config = None

    def __init__(self, ulysses_group, ring_config):
        from deepspeed.sequence.layer import DistributedAttention

        self.ring_config = ring_config
        self.causal = None  # the layer's BlockCausalAttention (make_causal): its rule, its cache path unsplit
        # [B, S/P, H, D] -> all-to-all (scatter heads, gather tokens) -> [B, S/R, H/U, D] -> attend -> back
        self.exchange = (None if ulysses_group is None else
                         DistributedAttention(self.attend, ulysses_group, scatter_idx=2, gather_idx=1))

    def make_causal(self, causal: BlockCausalAttention) -> None:
        """Attend by the block-causal rule of `causal` (the layer's processor of e2v/models/causal.py)
        after the exchange. Ring attention has no mask to take it: refused."""
        if self.ring_config is not None:
            raise ConfigError(RING_REFUSAL.format(self.ring_config.context_parallel_config.ring_degree))
        self.causal = causal

    def unsplit(self):
        """The processor of this layer for the whole sequence on one rank (whole_sequence), with this
        one's attention backend: the block-causal one, or this one without exchange."""
        whole = self.causal if self.causal is not None else ContextParallelSelfAttention(None, None)
        whole._attention_backend = self._attention_backend
        return whole

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        assert encoder_hidden_states is None and attention_mask is None, "self-attention only (attn1)"
        if self.causal is not None and self.causal.state.cache is not None:
            raise RuntimeError("a KV-cached causal forward on a context-parallel transformer: its block is split "
                               "over the ranks; sample inside e2v.models.context_parallel.whole_sequence (unsplit)")
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        q_BSHD, k_BSHD, v_BSHD = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        q_BSHD, k_BSHD = apply_rope(q_BSHD, *rotary_emb), apply_rope(k_BSHD, *rotary_emb)
        if self.exchange is None:
            out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD)
        else:
            out_BSHD = self.exchange(q_BSHD, k_BSHD, v_BSHD, 0)  # 0: the batch dimension
        hidden_states = out_BSHD.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))

    def attend(self, q_BSHD, k_BSHD, v_BSHD, *args, **kwargs):
        """Attention over this rank's head shard: whole sequence (Ulysses), or its ring of shards."""
        from diffusers.models.attention_dispatch import TemplatedRingAttention, dispatch_attention_fn

        if self.causal is not None:  # the whole sequence is here (Ulysses): the block rule, as without the split
            return block_causal_attention(self.causal.state, q_BSHD, k_BSHD, v_BSHD, self._attention_backend)
        if self.ring_config is None:
            return dispatch_attention_fn(q_BSHD, k_BSHD, v_BSHD, backend=self._attention_backend)
        forward_op, backward_op = _ring_ops(q_BSHD)
        return TemplatedRingAttention.apply(q_BSHD, k_BSHD, v_BSHD, None, 0.0, False, None, False, False,
                                            forward_op, backward_op, self.ring_config)


# --- the local attention of a ring step ----------------------------------------------------------
# diffusers' ring attention merges the partial attentions by their log-sum-exp, which plain SDPA
# does not return. On CUDA its native flash-attention ops give it (bf16 / fp16); on the CPU the
# same pair is torch's CPU flash attention (any float dtype), written here in diffusers' op shape.


def _ring_ops(q_BSHD):
    if q_BSHD.is_cuda:
        from diffusers.models.attention_dispatch import (
            _native_flash_attention_backward_op,
            _native_flash_attention_forward_op,
        )

        return _native_flash_attention_forward_op, _native_flash_attention_backward_op
    return _cpu_flash_forward_op, _cpu_flash_backward_op


def _cpu_flash_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(x.transpose(1, 2) for x in (query, key, value)), dropout_p, is_causal, scale=scale)
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.scale = scale
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)  # [B,S,H,D], [B,S,H]
    return (out, lse) if return_lse else out


def _cpu_flash_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(x.transpose(1, 2).contiguous() for x in (grad_out, query, key, value, out, lse)), 0.0, False,
        scale=ctx.scale)
    return tuple(g.transpose(1, 2) for g in grads)
