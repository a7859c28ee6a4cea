"""The causal task's model (`task: causal`, docs/causal.md): CausVid's block-causal Wan, made from
diffusers' WanTransformer3DModel without a new parameter.

The T latent frames form blocks (`causal.frames_per_block`; with `independent_first_frame` frame 0
is a block of its own, Self-Forcing's rule). In self-attention a token of block b sees every token
of blocks 0..b, its own block in full, and nothing later; cross-attention to the text and image
tokens is unchanged. `enable_causal` swaps the processor of every block's `attn1` and adds a hook on
the rope module; the state dict, peft's LoRA targets (to_q / to_k / to_v / to_out.0), gradient
checkpointing and DeepSpeed ZeRO (a processor is no parameter) are untouched.

Two exact ways to apply the mask, never a dense L x L mask:
- blocks: one attention call per block, its queries against the keys and values of blocks 0..b
  (the FLOPs of the masked attention, about half the bidirectional's at 7 blocks; n_blocks SDPA
  calls a layer, each on diffusers' attention dispatch, so a chosen backend applies);
- flex: FlexAttention with a BlockMask built from the block layout in 128-token tiles (full tiles,
  partial tiles with the `kv < end of q's block` rule; building it costs O(tiles^2), not O(L^2)).
  It is fused only under torch.compile: on CUDA the compiled kernel runs (a compile per shape, Triton
  from the torch wheel, nothing built by hand; past torch's recompile limit, 8 shapes by default,
  dynamo falls back to the eager path: many buckets want `blocks`); on the CPU FlexAttention's eager path materializes
  the L x L scores, a compiled one costs ~5 s per shape and a C++ compiler, and neither has a
  backward (torch raises), so `auto` takes blocks there and flex on the CPU is for inference.

Per-frame timesteps: diffusers' model takes a per-token timestep [B, L] (Wan2.2 TI2V's path);
`frame_timesteps` repeats each frame's over its tokens. That computes the time embedding per token:
[B, L, 6 D] (0.6 GB in bf16 at 480x832x81 for the 1.3B) instead of per frame, the price of no new
model class.

References as block 0 (`conditioning.target_layout: clean_prefix`, docs/causal.md, "Elements to
video"): the reference latent frames go in front of the video at timestep 0 (e2v/conditioning/ti2v.py)
and form a block of their own, block 0, which every video block sees and which sees none of them;
the video's blocks follow as above. How many frames of a forward are references is not in its
input (a clean context frame also has t = 0): `reference_block` records it in the state before each
forward (e2v/train/step.predict, the one transformer call), as the rope hook records the grid.

Sampling (`KVCache`, `cached`): a forward whose input is one block attends to the cached keys and
values of the blocks before it, at their absolute frame positions (the rope hook shifts the block's
positions by the cached frame count, CausVid's `current_start`); `cached(..., write=True)` appends
the block's own keys and values (the t=0 pass over the finished block).

Context parallelism (docs/context_parallel.md): Ulysses (`parallel.ulysses_degree`) serves the mask
exactly. Its all-to-all gives each rank the whole sequence for H/U heads before attention runs, so
e2v/models/context_parallel.py's processor applies the same rule there (`block_causal_attention`, on
the grid the rope hook records from the rope's unsplit input); the per-token timestep is split with
the tokens by diffusers' plan. Ring attention (`parallel.ring_degree > 1`) takes no mask in
diffusers, so it is refused (`causal_refusal`). The sampler's cached forwards run on the unsplit
model (context_parallel.whole_sequence): one block at a time is small, and need not divide by the
degree.

Legend: B batch, T latent frames, n tokens per latent frame (h/2 * w/2), L tokens (T n), H heads,
D head width, K cached tokens.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from e2v.models.wan_rope import apply_rope

ATTENTION_PATHS = ("auto", "flex", "blocks")
FLEX_TILE = 128  # FlexAttention's default tile (BLOCK_SIZE) in tokens, both sides


# --- the block layout ----------------------------------------------------------------------------


def block_ids(num_frames: int, frames_per_block: int, independent_first_frame: bool,
              reference_frames: int = 0) -> torch.Tensor:
    """The block index of each latent frame, LongTensor[T]: frames 0..k-1 are block 0, and so on;
    with `independent_first_frame` frame 0 is block 0 alone and blocks of k follow. With
    `reference_frames` N > 0 the first N frames are the references' block 0 and the video's blocks
    follow, numbered from 1. Raises when the video's frames do not split into whole blocks."""
    if frames_per_block < 1:
        raise ValueError(f"causal.frames_per_block is {frames_per_block}: it must be at least 1")
    if reference_frames:  # a forward of the references alone (the rollout's first cache write) has no video
        video_T = (block_ids(num_frames - reference_frames, frames_per_block, independent_first_frame) + 1
                   if num_frames > reference_frames else torch.zeros(0, dtype=torch.long))
        return torch.cat([torch.zeros(reference_frames, dtype=torch.long), video_T])
    first = 1 if independent_first_frame else 0
    rest = num_frames - first
    if num_frames < 1 or rest % frames_per_block:
        shape = f"{num_frames} latent frames" + (" (frame 0 alone, then the rest)" if first else "")
        need = "1 + a multiple" if first else "a multiple"
        raise ValueError(
            f"causal.frames_per_block = {frames_per_block}: {shape} do not split into whole blocks; the latent "
            f"frame count ((data.num_frames - 1) / 4 + 1 for each frame bucket) must be {need} of "
            f"causal.frames_per_block: change data.num_frames (or data.frame_buckets) or causal.frames_per_block"
            + ("" if first else ", or set causal.independent_first_frame"))
    ids_T = torch.arange(rest) // frames_per_block + first
    return torch.cat([torch.zeros(first, dtype=torch.long), ids_T])


def block_spans(num_frames: int, frames_per_block: int, independent_first_frame: bool,
                reference_frames: int = 0) -> list[tuple[int, int]]:
    """[start, end) latent frames of each block, in order (block_ids' rule)."""
    counts = torch.bincount(block_ids(num_frames, frames_per_block, independent_first_frame, reference_frames)).tolist()
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [(e - c, e) for c, e in zip(counts, ends)]


def frame_timesteps(t_BT: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """Per-frame timesteps [B, T] -> diffusers' per-token form [B, T n] (each frame's over its tokens,
    in the patch embedding's frame-major token order)."""
    return t_BT.repeat_interleave(tokens_per_frame, dim=1)


RING_REFUSAL = ("task: causal with parallel.ring_degree: {}: diffusers' ring attention takes no mask, so it cannot "
                "apply the block-causal rule; set parallel.ring_degree: 1 and split with parallel.ulysses_degree "
                "instead (its exchange gives attention the whole sequence, which the rule needs)")


def causal_refusal(cfg) -> str | None:
    """Why this config's causal model cannot run, naming the key and the fix; None when it can.
    Called at start (train_e2v.py) for task: causal; whether the frames split into whole blocks is
    the config's own check (e2v/config/checks.py, by e2v.config.shapes.whole_blocks)."""
    if cfg.parallel.ring_degree > 1:
        return RING_REFUSAL.format(cfg.parallel.ring_degree)
    if cfg.conditioning.target_layout == "sequence":
        return ("task: causal with conditioning.target_layout: sequence: its reference slots follow the video with "
                "the sample's one timestep, so no causal block can hold them; use clean_prefix (the references as "
                "a clean block 0 that every video block sees: docs/causal.md), overlay or prepend, or task: "
                "bidirectional")
    if cfg.model.expert is not None:
        return ("task: causal on a two-expert base (model.expert is set): the KV cache of one expert does not "
                "serve the other; use a one-transformer base (Wan2.1) or task: bidirectional")
    return None


# --- the processors' shared state ----------------------------------------------------------------


@dataclass
class KVCache:
    """The self-attention keys and values of the finished blocks, per transformer block
    ([B, K, H, D] each, rope applied at their absolute positions), and how many latent frames they
    hold (the next block's frame offset). One per guidance pass: the conditional and unconditional
    passes see different texts, so their keys differ from the second layer on. It grows by
    concatenation: at 480x832x81 on the 1.3B a full cache is ~6 GB in bf16 per pass (CausVid
    preallocates the same), and each forward copies one layer's cache at a time."""

    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    frames: int = 0
    reference_frames: int = 0  # of `frames`, the references' block 0 (the first block written, at t = 0)


@dataclass
class CausalState:
    """What the processors of one transformer share: the block rule, the latent grid of the current
    forward (the rope hook records it: buckets vary, so every forward brings its own), the KV cache
    in use, and the masks built per shape. Under gradient checkpointing the recompute reads the
    grid of the forward it belongs to: nothing runs a forward between a step's forward and its
    backward."""

    frames_per_block: int
    independent_first_frame: bool
    attention: str = "auto"
    grid: tuple[int, int, int] | None = None  # (T, h/2, w/2) after the patch embedding
    reference_frames: int = 0  # of the grid's T, the references' block 0 in front (reference_block)
    cache: KVCache | None = None
    write: bool = False
    masks: dict = field(default_factory=dict)

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) tokens of each block of the current forward."""
        t, h, w = self.grid
        return [(a * h * w, b * h * w)
                for a, b in block_spans(t, self.frames_per_block, self.independent_first_frame, self.reference_frames)]

    def path(self, device: torch.device) -> str:
        """flex or blocks for this device (`auto`: flex where it is compiled, CUDA; the module docstring)."""
        if self.attention == "auto":
            return "flex" if device.type == "cuda" else "blocks"
        return self.attention


def _state(module) -> CausalState:
    state = getattr(module, "causal_state", None)
    if state is None:
        raise RuntimeError("this transformer is not causal: call e2v.models.causal.enable_causal on it first")
    return state


def causal_transformer(model):
    """The causal WanTransformer3DModel inside `model` (itself, a DeepSpeed engine, a peft wrapper)."""
    # its own attribute, not one forwarded: a DeepSpeed engine's __getattr__ answers with its module's
    found = [m for m in model.modules() if vars(m).get("causal_state") is not None and hasattr(m, "rope")]
    if len(found) != 1:
        raise RuntimeError(f"expected one causal transformer in {type(model).__name__}, found {len(found)}: "
                           "call e2v.models.causal.enable_causal on it (two-expert bases are refused)")
    return found[0]


# --- enabling ------------------------------------------------------------------------------------


def enable_causal(transformer, frames_per_block: int, independent_first_frame: bool, attention: str = "auto"):
    """Make a diffusers WanTransformer3DModel block-causal in self-attention, in place: every
    block's attn1 gets a BlockCausalAttention processor and the rope module a hook that records
    the latent grid of each forward (and shifts positions under a KV cache); on a transformer made
    context-parallel already (context_parallel.enable, either order works) its processors keep
    the Ulysses exchange and take the rule for the attention after it. No parameter, buffer or
    module is added or renamed. Returns the transformer."""
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"causal.attention: {attention!r} is not one of {ATTENTION_PATHS}")
    if frames_per_block < 1:
        raise ValueError(f"causal.frames_per_block is {frames_per_block}: it must be at least 1")
    state = CausalState(frames_per_block, independent_first_frame, attention)
    _FOUND.clear()
    transformer.causal_state = state
    transformer.rope.causal_state = state
    if not getattr(transformer.rope, "causal_hooked", False):  # once: a second hook would shift twice
        transformer.rope.register_forward_hook(_rope_hook)
        transformer.rope.causal_hooked = True
    for i, block in enumerate(transformer.blocks):
        # made context-parallel first: its processor takes the rule (e2v.models.context_parallel; asked by
        # name, as that module imports this one)
        if hasattr(block.attn1.processor, "make_causal"):
            block.attn1.processor.make_causal(BlockCausalAttention(state, i))
        else:
            block.attn1.set_processor(BlockCausalAttention(state, i))
    return transformer


def ensure_causal(model, frames_per_block: int, independent_first_frame: bool, attention: str = "auto"):
    """`enable_causal` on every WanTransformer3DModel inside `model` that is not causal yet (a
    sampler's fresh transformer, a full fine-tune's export); one already causal keeps its settings.
    Returns `model`."""
    for module in model.modules():
        if hasattr(module, "rope") and hasattr(module, "blocks") and getattr(module, "causal_state", None) is None:
            enable_causal(module, frames_per_block, independent_first_frame, attention)
    return model


def _rope_hook(rope, args, output):
    """After diffusers' rope: record the grid of this forward; under a KV cache, the block's
    tables at its absolute frames (cache.frames onwards) instead of from frame 0. The shifted
    tables come from the same rope on a stand-in input of offset + T frames (a stride-0 view: no
    memory), of which the block's are the last T n tokens."""
    state = rope.causal_state
    x = args[0]
    p_t, p_h, p_w = rope.patch_size
    state.grid = (x.shape[2] // p_t, x.shape[3] // p_h, x.shape[4] // p_w)
    offset = state.cache.frames if state.cache is not None else 0
    if not offset:
        return output
    t, h, w = state.grid
    stand_in = x.new_empty(()).expand(x.shape[0], x.shape[1], (offset + t) * p_t, x.shape[3], x.shape[4])
    if offset + t > rope.max_seq_len:
        raise ValueError(f"frames {offset}..{offset + t} exceed the model's rope table ({rope.max_seq_len} frames)")
    return tuple(f[:, offset * h * w:] for f in rope.forward(stand_in))


# model -> the causal states inside it, found by one walk per model (~4 ms over the 1.3B's 858
# modules on a CPU: too much for every forward); enable_causal empties it, so a model made causal
# after a first look is looked at again
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_block(model, frames: int) -> None:
    """Record that the next forwards' first `frames` latent frames are the references' block 0
    (0: none), on the causal transformer inside `model`; nothing for a model that is not causal.
    Set before every forward and left in place, as the grid: a checkpointed layer's recompute in
    backward reads the forward's. A callable with no module walk (a test's stand-in) has none."""
    walk = getattr(model, "modules", None)
    if walk is None:
        return
    states = _FOUND.get(model)
    if states is None:
        states = _FOUND[model] = [vars(m)["causal_state"] for m in walk()
                                  if vars(m).get("causal_state") is not None and hasattr(m, "rope")]
    for state in states:
        state.reference_frames = frames


@contextlib.contextmanager
def cached(model, cache: KVCache, write: bool = False):
    """Forwards inside see `cache`: their input is one block, at frame offset `cache.frames`; its
    queries attend to the cached keys and values and to its own. With `write`, each layer appends
    the block's keys and values (run the finished block at t=0 so), and on exit the frames count.
    The first block written to an empty cache may be the references' (reference_block): the cache
    keeps their count, so the blocks after it are numbered as in the full forward."""
    state = _state(causal_transformer(model))
    state.cache, state.write = cache, write
    try:
        yield cache
        if write:
            if not cache.frames:
                cache.reference_frames = state.reference_frames
            cache.frames += state.grid[0]
    finally:
        state.cache, state.write = None, False


# --- attention -----------------------------------------------------------------------------------


class BlockCausalAttention:
    """attn1's processor: diffusers' WanAttnProcessor self-attention (projections, RMS norm across
    heads, rope; transformer_wan.py) with the block-causal attention of the module docstring, or,
    under `cached`, the block's queries against the cached keys and values and its own."""

    _attention_backend = None  # set by the model's set_attention_backend, as on diffusers' processors
    _parallel_config = None

    def __init__(self, state: CausalState, layer: int):
        self.state, self.layer = state, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if encoder_hidden_states is not None or attention_mask is not None:
            raise RuntimeError("BlockCausalAttention is attn1's processor (self-attention, no mask)")
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        q_BLHD, k_BLHD, v_BLHD = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        q_BLHD, k_BLHD = apply_rope(q_BLHD, *rotary_emb), apply_rope(k_BLHD, *rotary_emb)
        cache = self.state.cache
        if cache is None:
            out_BLHD = self.attend(q_BLHD, k_BLHD, v_BLHD)
        else:
            out_BLHD = self.attend_cached(cache, q_BLHD, k_BLHD, v_BLHD)
        hidden_states = out_BLHD.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))

    def attend(self, q_BLHD, k_BLHD, v_BLHD):
        """Block-causal attention over the whole sequence of this forward."""
        return block_causal_attention(self.state, q_BLHD, k_BLHD, v_BLHD, self._attention_backend)

    def attend_cached(self, cache: KVCache, q_BLHD, k_BLHD, v_BLHD):
        """The block's queries against [cached keys, its own]: what its rows of the masked full
        attention see, since the cache holds exactly blocks 0..b-1."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        t = self.state.grid[0]
        refs = cache.reference_frames if cache.frames else self.state.reference_frames  # the sequence's block 0
        ids_T = block_ids(cache.frames + t, self.state.frames_per_block, self.state.independent_first_frame, refs)
        if ids_T[cache.frames:].unique().numel() != 1 or (cache.frames and ids_T[cache.frames - 1] == ids_T[-1]):
            raise ValueError(f"a cached forward takes one whole block: frames {cache.frames}..{cache.frames + t} "
                             f"are not one block under causal.frames_per_block = {self.state.frames_per_block}")
        if cache.frames:
            k_BKHD = torch.cat([cache.k[self.layer], k_BLHD], 1)
            v_BKHD = torch.cat([cache.v[self.layer], v_BLHD], 1)
        else:
            k_BKHD, v_BKHD = k_BLHD, v_BLHD
        if self.state.write:
            cache.k[self.layer], cache.v[self.layer] = k_BKHD, v_BKHD
        return dispatch_attention_fn(q_BLHD, k_BKHD, v_BKHD, backend=self._attention_backend)

    def block_mask(self, device):
        return block_mask(self.state, device)


def block_causal_attention(state: CausalState, q_BLHD, k_BLHD, v_BLHD, backend=None) -> torch.Tensor:
    """The block-causal rule over the whole sequence of this forward (any number of heads: under
    Ulysses a rank's H/U), by the state's path: flex with the grid's BlockMask, or one call per
    block on diffusers' dispatch with `backend`. What BlockCausalAttention and, after the Ulysses
    exchange, context parallelism's processor apply."""
    t, h, w = state.grid
    if q_BLHD.shape[1] != t * h * w:
        raise RuntimeError(f"self-attention over {q_BLHD.shape[1]} tokens, but the latent grid {t}x{h}x{w} has "
                           f"{t * h * w}: a split sequence is refused for task: causal (the block rule needs every "
                           "token: under parallel.ulysses_degree the exchange gives attention the whole sequence)")
    if state.path(q_BLHD.device) == "flex":
        return flex_block_attention(q_BLHD, k_BLHD, v_BLHD, block_mask(state, q_BLHD.device))
    return blocks_attention(q_BLHD, k_BLHD, v_BLHD, state.spans(), backend)


def block_mask(state: CausalState, device):
    """The BlockMask of the current grid, built once per (grid, reference frames, device): one
    grid splits differently with another count of reference frames in front."""
    key = (state.grid, state.reference_frames, str(device))
    if key not in state.masks:
        state.masks[key] = build_block_mask(state.spans(), device)
    return state.masks[key]


def blocks_attention(q_BLHD, k_BLHD, v_BLHD, spans: list[tuple[int, int]], backend=None) -> torch.Tensor:
    """Exact block-causal attention, one call per block: block [a, b) of the queries against keys
    and values [0, b)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return torch.cat([dispatch_attention_fn(q_BLHD[:, a:b], k_BLHD[:, :b], v_BLHD[:, :b], backend=backend)
                      for a, b in spans], 1)


def token_ends(spans: list[tuple[int, int]], device) -> torch.Tensor:
    """For each token, the end of its block: the first key it may not see, LongTensor[L]."""
    return torch.cat([torch.full((b - a,), b, dtype=torch.long, device=device) for a, b in spans])


def build_block_mask(spans: list[tuple[int, int]], device):
    """FlexAttention's BlockMask of the block-causal rule, from tiles: a (query tile, key tile) pair
    is full when every key precedes the end of the tile's first query's block, empty when no key
    precedes the end of its last query's block, partial (the mask_mod decides per token) otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    ends_L = token_ends(spans, device)
    length = ends_L.numel()
    tiles = -(-length // FLEX_TILE)
    start_Q = torch.arange(tiles, device=device) * FLEX_TILE
    last_Q = (start_Q + FLEX_TILE).clamp(max=length) - 1
    lo_Q, hi_Q = ends_L[start_Q], ends_L[last_Q]  # the block ends of a tile's first and last query
    k_first, k_last = start_Q, last_Q  # key tiles have the same edges
    full_QK = k_last[None, :] < lo_Q[:, None]
    some_QK = k_first[None, :] < hi_Q[:, None]
    partial_QK = some_QK & ~full_QK

    def indices(sel_QK):  # BlockMask's layout: per query tile, the count and the (sorted) key tiles first
        num_Q = sel_QK.sum(1, dtype=torch.int32)
        order_QK = torch.argsort((~sel_QK).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return num_Q[None, None], order_QK[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < ends_L[q_idx]

    kv_num, kv_idx = indices(partial_QK)
    full_num, full_idx = indices(full_QK)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod,
                                    seq_lengths=(length, length))


_compiled_flex = None


def flex_block_attention(q_BLHD, k_BLHD, v_BLHD, block_mask) -> torch.Tensor:
    """FlexAttention under the block mask: compiled on CUDA (once per shape), eager elsewhere
    (exact, but it materializes the scores: the module docstring)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (x.transpose(1, 2) for x in (q_BLHD, k_BLHD, v_BLHD))
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        out = _compiled_flex(q, k, v, block_mask=block_mask)
    else:
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise RuntimeError("causal.attention: flex has no backward on the CPU (torch's FlexAttention): "
                           "train with causal.attention: blocks or auto there")
        with warnings.catch_warnings():  # its "unfused implementation" warning: the docstring's cost, known
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask)
    return out.transpose(1, 2)
