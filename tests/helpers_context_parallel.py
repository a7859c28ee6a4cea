"""The spawned side of tests/unit/test_context_parallel.py: 2 processes over gloo, each measuring
context parallelism (e2v/models/context_parallel.py) against the same computation done whole in the
same process (the oracle: the stock diffusers model / attention on the unsplit sequence; for task:
causal, the block-causal model on the unsplit sequence, whose rule is held to CausVid's by
tests/unit/test_causal_rule.py). Each rank
writes its numbers to <out>/rank<r>.json; the test asserts on them.

Legend: B batch, S video tokens, D width."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5  # fp32: the split sums the same products in another order (the launch tests' tolerance too)


def _cfg(ulysses: int, ring: int):
    from e2v.config.load import load_config

    return load_config(ROOT / "configs/e2v_tiny_lora.yaml",
                       [f"parallel.ulysses_degree={ulysses}", f"parallel.ring_degree={ring}"], check_paths=False)


def _tiny():
    from e2v.models.tiny import build_tiny_parts

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    return model.requires_grad_(True)


def _inputs(seed: int = 0) -> dict:
    """Tiny-preset inputs: 2 samples of 17 frames at 64 x 64 (80 video tokens), text and 1 reference."""
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 36, 5, 8, 8, generator=g), timestep=torch.tensor([300.0, 700.0]),
                encoder_hidden_states=torch.randn(2, 512, 32, generator=g),
                encoder_hidden_states_image=torch.randn(2, 17, 32, generator=g), return_dict=False)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _split_step(model, inputs: dict, mpu) -> tuple[torch.Tensor, dict]:
    """A context-parallel model's gathered prediction and its parameter gradients of
    mean(prediction^2), summed over the group (what DeepSpeed's reduction adds up)."""
    out = model(**inputs)[0]
    out.square().mean().backward()
    grads = _grads(model)
    for v in grads.values():
        torch.distributed.all_reduce(v, group=mpu.get_sequence_parallel_group())
    return out.detach(), grads


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def attention_alone(ulysses: int, ring: int, rank: int) -> dict:
    """The self-attention wrapper on its own: block 0's attn1 of a context-parallel model, fed this
    rank's token shard (and rope shard), against the stock processor on the whole sequence.
    Returns the largest differences of the output shard, of the input's gradient shard and of the
    attention's parameter gradients summed over the group."""
    from e2v.models import context_parallel

    cfg = _cfg(ulysses, ring)
    whole, split = _tiny(), _tiny()
    g = torch.Generator().manual_seed(1)
    x_BSD = torch.randn(2, 80, 24, generator=g)
    weight_BSD = torch.randn(2, 80, 24, generator=g)
    rope = whole.rope(torch.zeros(1, 36, 5, 8, 8))  # the rope tables of 5 x 4 x 4 tokens: [1, S, 1, 12] each

    x = x_BSD.clone().requires_grad_(True)
    out = whole.blocks[0].attn1(x, None, None, rope)
    (out * weight_BSD).sum().backward()
    ref_out, ref_dx, ref_grads = out.detach(), x.grad, _grads(whole.blocks[0].attn1)

    mpu = context_parallel.enable(split, cfg, context_parallel.layout(cfg, rank, 2))
    shard = slice(rank * 40, (rank + 1) * 40)
    x = x_BSD[:, shard].clone().requires_grad_(True)
    out = split.blocks[0].attn1(x, None, None, tuple(t[:, shard] for t in rope))
    (out * weight_BSD[:, shard]).sum().backward()
    grads = _grads(split.blocks[0].attn1)
    for v in grads.values():
        torch.distributed.all_reduce(v, group=mpu.get_sequence_parallel_group())
    return {"out": (out.detach() - ref_out[:, shard]).abs().max().item(),
            "input_grad": (x.grad - ref_dx[:, shard]).abs().max().item(),
            "param_grads": _max_diff(grads, ref_grads), "param_grad_scale": max(v.abs().max().item() for v in ref_grads.values())}


def whole_model(ulysses: int, ring: int, rank: int, checkpointing: bool) -> dict:
    """The tiny transformer, context-parallel, against itself whole: the gathered prediction and the
    parameter gradients of mean(prediction^2) summed over the group."""
    from e2v.models import context_parallel

    cfg = _cfg(ulysses, ring)
    model = _tiny()
    if checkpointing:
        model.enable_gradient_checkpointing()
    ref = model(**_inputs())[0]
    ref.square().mean().backward()
    ref, ref_grads = ref.detach(), _grads(model)
    model.zero_grad()

    mpu = context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, 2))
    out, grads = _split_step(model, _inputs(), mpu)
    return {"out": (out - ref).abs().max().item(), "grads": _max_diff(grads, ref_grads),
            "grad_scale": max(v.abs().max().item() for v in ref_grads.values()),
            "sequence_parallel_size": mpu.get_sequence_parallel_world_size(),
            "sequence_data_parallel_size": mpu.get_sequence_data_parallel_world_size()}


FRAME_T = torch.tensor([[900.0, 700.0, 500.0, 300.0, 100.0], [1000.0, 0.0, 250.0, 750.0, 500.0]])  # [B, T]


def causal_model(rank: int, frames_per_block: int, first_alone: bool, checkpointing: bool, cp_first: bool) -> dict:
    """The tiny transformer made block-causal (e2v/models/causal.py, the exact per-block path) with a
    timestep per latent frame (diffusers' per-token form, which its plan splits with the tokens),
    Ulysses 2, against the same causal model unsplit in this process: the gathered prediction and
    the parameter gradients of mean(prediction^2) summed over the group. `cp_first`: made
    context-parallel before causal (either order must keep both). Also: the stock bidirectional
    model's distance from the reference (the rule is there to be kept), a cached forward on the
    split model refused, and the causal sampler on the split model (context_parallel.whole_sequence)
    against the same rollout unsplit, before the split forward, which must be whole again after it."""
    from e2v.conditioning.encode import Conditions
    from e2v.eval.sampling import CausalRollout, denoise
    from e2v.models import context_parallel
    from e2v.models.causal import KVCache, cached, enable_causal, frame_timesteps

    cfg = _cfg(2, 1)
    inputs = {**_inputs(), "timestep": frame_timesteps(FRAME_T, 16)}  # 5 latent frames of 4 x 4 tokens
    bidirectional = _tiny()(**inputs)[0].detach()
    model = _tiny()
    if checkpointing:
        model.enable_gradient_checkpointing()

    def causal():
        enable_causal(model, frames_per_block, first_alone, "blocks")

    g = torch.Generator().manual_seed(5)
    noise = torch.randn(1, 16, 5, 8, 8, generator=g)
    c = Conditions(latents_BCTHW=torch.zeros_like(noise), text_BLD=torch.randn(1, 512, 32, generator=g),
                   cond_BCTHW=torch.randn(1, 20, 5, 8, 8, generator=g), clip_BLD=torch.randn(1, 17, 32, generator=g))
    rollout = CausalRollout(frames_per_block, first_alone, "blocks", (1000.0, 757.0, 522.0), 8.0)

    def sample():
        return denoise(model, c, None, noise, num_steps=0, guidance_scale=1.0, shift=0.0, rollout=rollout,
                       generator=torch.Generator().manual_seed(3))

    causal()
    ref = model(**inputs)[0]
    ref.square().mean().backward()
    ref, ref_grads = ref.detach(), _grads(model)
    model.zero_grad()
    ref_sample = sample()

    if cp_first:  # a fresh model: context-parallel, then causal
        model = _tiny()
        if checkpointing:
            model.enable_gradient_checkpointing()
        mpu = context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, 2))
        causal()
    else:
        mpu = context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, 2))
    try:
        with torch.no_grad(), cached(model, KVCache()):
            model(**inputs)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    split_sample = sample()
    out, grads = _split_step(model, inputs, mpu)
    return {"out": (out - ref).abs().max().item(), "grads": _max_diff(grads, ref_grads),
            "grad_scale": max(v.abs().max().item() for v in ref_grads.values()),
            "bidirectional_gap": (bidirectional - ref).abs().max().item(),
            "sample": (split_sample - ref_sample).abs().max().item(), "cached_refused": refused}


SAVED_SHAPE = dict(heads=4, head_dim=32, ffn=256, layers=2, frames=5, size=32)  # 5 x 16 x 16 = 1280 tokens


def saved_bytes(ulysses: int, rank: int, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward on this rank (storage-deduplicated, parameters left out),
    the measure tests/unit/test_estimate_memory.py holds the formula to, for a model bigger than the
    tiny one (its activations dominate)."""
    from diffusers import WanTransformer3DModel

    from e2v.models import context_parallel

    s = SAVED_SHAPE
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=s["heads"], attention_head_dim=s["head_dim"], in_channels=36,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=s["ffn"], num_layers=s["layers"], cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, image_dim=32,
        added_kv_proj_dim=s["heads"] * s["head_dim"]).requires_grad_(True)
    if checkpointing:
        model.enable_gradient_checkpointing()
    if ulysses > 1:
        cfg = _cfg(ulysses, 1)
        context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, 2))
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    inputs = dict(hidden_states=torch.randn(1, 36, s["frames"], s["size"], s["size"]), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 512, 32), encoder_hidden_states_image=torch.randn(1, 51, 32),
                  return_dict=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in storages.items() if k not in params)


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from e2v.runtime.distributed import init_distributed

    torch.set_num_threads(1)  # two ranks on a 2-core machine: a thread per core each would spin against the other
    init_distributed()
    result = {
        "attention_ulysses": attention_alone(2, 1, rank),
        "attention_ring": attention_alone(1, 2, rank),
        "model_ulysses": whole_model(2, 1, rank, checkpointing=False),
        "model_ring_checkpointing": whole_model(1, 2, rank, checkpointing=True),
        "causal_ulysses": causal_model(rank, 1, False, checkpointing=False, cp_first=False),
        "causal_ulysses_checkpointing": causal_model(rank, 2, True, checkpointing=True, cp_first=True),
        "saved_bytes": {f"ulysses2_checkpointing_{ck}": saved_bytes(2, rank, ck) for ck in (False, True)},
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def sequence_layout(ulysses: int, ring: int, rank: int) -> dict:
    """The sequence layout under context parallelism: the tiny T2V transformer (16 channels, no
    image attention) called through the training step's `predict` on 5 noisy video frames and 4
    reference slots (2 kept references, 2 zero slots), split over 2 ranks, against itself whole:
    the video frames' prediction (the slots' dropped) and the parameter gradients of its mean square
    summed over the group."""
    from e2v.conditioning.encode import Conditions
    from e2v.models import context_parallel
    from e2v.models.tiny import build_tiny_parts
    from e2v.train.step import predict

    cfg = _cfg(ulysses, ring)
    model = build_tiny_parts(seed=0, base="t2v", with_encoders=False).transformer.requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    slots = torch.cat([torch.randn(2, 16, 2, 8, 8, generator=g), torch.zeros(2, 16, 2, 8, 8)], dim=2)
    c = Conditions(latents_BCTHW=torch.randn(2, 16, 5, 8, 8, generator=g),
                   text_BLD=torch.randn(2, 512, 32, generator=g), ref_latents_BCNhw=slots, ref_layout="after")
    noisy, timestep = torch.randn(2, 16, 5, 8, 8, generator=g), torch.tensor([300.0, 700.0])

    def run():
        video = predict(model, noisy, timestep, c, c.text_BLD, torch.float32)
        video.square().mean().backward()
        grads = _grads(model)
        model.zero_grad()
        return video.detach(), grads

    ref, ref_grads = run()
    mpu = context_parallel.enable(model, cfg, context_parallel.layout(cfg, rank, 2))
    out, grads = run()
    for v in grads.values():
        torch.distributed.all_reduce(v, group=mpu.get_sequence_parallel_group())
    return {"shape": list(out.shape), "out": (out - ref).abs().max().item(), "grads": _max_diff(grads, ref_grads),
            "grad_scale": max(v.abs().max().item() for v in ref_grads.values())}


def sequence_worker(rank: int, world: int, port: int, out: str) -> None:
    """The sequence-layout cases, Ulysses 2 and ring 2, in a process group of their own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from e2v.runtime.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    result = {"ulysses": sequence_layout(2, 1, rank), "ring": sequence_layout(1, 2, rank)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def spawn(worker, out: Path) -> list[dict]:
    """Run `worker(rank, 2, port, out)` in 2 forked processes over gloo; each rank's results."""
    import torch.multiprocessing as mp

    from e2v.runtime.ports import free_port

    mp.start_processes(worker, args=(2, free_port(), str(out)), nprocs=2, start_method="fork")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
