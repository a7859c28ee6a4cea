"""The block-causal Wan (e2v/models/causal.py) against CausVid's rule, written here: a token of latent
frame f sees a key of frame g iff block(g) <= block(f), where block(f) = f // k, or, with
independent_first_frame (Self-Forcing), 0 for frame 0 and (f - 1) // k + 1 after it. Both attention
paths give exactly that mask (read off the attention itself); on a tiny diffusers
WanTransformer3DModel a later block's input never moves an earlier block's output; the two paths
agree; the state dict, peft's LoRA, gradient checkpointing and the per-frame timestep keep working."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from e2v.config.schema import Config
from e2v.models.causal import (
    block_ids,
    block_spans,
    blocks_attention,
    build_block_mask,
    causal_refusal,
    enable_causal,
    flex_block_attention,
    frame_timesteps,
)
from e2v.models.tiny import seeded, tiny_transformer_config

LAYOUTS = [(1, False, 5), (3, False, 6), (3, True, 7), (2, True, 5)]  # (frames per block, first alone, frames)


def block_of(frame: int, k: int, first_alone: bool) -> int:
    if first_alone:
        return 0 if frame == 0 else (frame - 1) // k + 1
    return frame // k


def dense_rule(frames: int, n: int, k: int, first_alone: bool) -> torch.Tensor:
    """[L, L] bool: query token i may see key token j (tokens frame-major, n per frame)."""
    b = torch.tensor([block_of(i // n, k, first_alone) for i in range(frames * n)])
    return b[None, :] <= b[:, None]


@pytest.mark.parametrize("k, first_alone, frames", LAYOUTS)
def test_block_ids_follow_the_rule(k, first_alone, frames):
    assert block_ids(frames, k, first_alone).tolist() == [block_of(f, k, first_alone) for f in range(frames)]


def test_frames_that_do_not_split_name_the_keys():
    with pytest.raises(ValueError, match=r"causal.frames_per_block = 4: 6 latent frames.*data.num_frames"):
        block_ids(6, 4, False)
    with pytest.raises(ValueError, match=r"1 \+ a multiple of causal.frames_per_block"):
        block_ids(6, 3, True)


def seen_mask(attend, frames: int, n: int) -> torch.Tensor:
    """The mask an attention function applies, read off its output: with zero queries every visible
    key gets the same weight, and one-hot values put that weight in the key's column."""
    length = frames * n
    q = torch.zeros(1, length, 1, length)
    k = torch.randn(1, length, 1, length)
    v = torch.eye(length).view(1, length, 1, length)
    with torch.no_grad():
        return attend(q, k, v)[0, :, 0] > 0


@pytest.mark.parametrize("k, first_alone, frames", LAYOUTS)
@pytest.mark.parametrize("path", ["blocks", "flex"])
def test_both_paths_apply_exactly_the_block_causal_mask(path, k, first_alone, frames):
    n = 40 if k == 1 else 24  # > 128 tokens in all: the flex mask spans full, partial and empty tiles
    spans = [(a * n, b * n) for a, b in block_spans(frames, k, first_alone)]
    if path == "blocks":
        def attend(q, k_, v):
            return blocks_attention(q, k_, v, spans)
    else:
        mask = build_block_mask(spans, "cpu")

        def attend(q, k_, v):
            return flex_block_attention(q, k_, v, mask)
    assert torch.equal(seen_mask(attend, frames, n), dense_rule(frames, n, k, first_alone))


def tiny(seed: int = 0, causal=(3, False, "blocks")) -> WanTransformer3DModel:
    with seeded(seed):
        model = WanTransformer3DModel(**tiny_transformer_config("t2v")).eval()
    return enable_causal(model, *causal) if causal else model


def inputs(frames: int = 6, h: int = 4, w: int = 6, seed: int = 1):
    with seeded(seed):
        x = torch.randn(1, 16, frames, h, w)
        text = torch.randn(1, 8, 32)
        t_BT = torch.randint(0, 1000, (1, frames)).float()
    return x, text, t_BT


def run(model, x, text, t_BT):
    n = (x.shape[3] // 2) * (x.shape[4] // 2)
    return model(x, timestep=frame_timesteps(t_BT, n), encoder_hidden_states=text, return_dict=False)[0]


@pytest.mark.parametrize("causal", [(3, False, "blocks"), (1, False, "flex"), (2, True, "blocks")])
def test_a_later_block_never_moves_an_earlier_one(causal):
    k, first_alone, _ = causal
    frames = 5 if first_alone else 6
    x, text, t_BT = inputs(frames)
    last = block_spans(frames, k, first_alone)[-1][0]  # the first frame of the last block
    x2, t2 = x.clone(), t_BT.clone()
    x2[:, :, last:] = torch.randn_like(x2[:, :, last:])
    t2[:, last:] = 999.0 - t2[:, last:]
    with torch.no_grad():
        outs = {name: (run(m, x, text, t_BT), run(m, x2, text, t2))
                for name, m in (("causal", tiny(causal=causal)), ("bidirectional", tiny(causal=None)))}
    a, b = outs["causal"]
    assert torch.equal(a[:, :, :last], b[:, :, :last])
    assert not torch.equal(a[:, :, last:], b[:, :, last:])
    a, b = outs["bidirectional"]  # the control: without the mask the earlier frames do move
    assert not torch.equal(a[:, :, :last], b[:, :, :last])


@pytest.mark.parametrize("dtype, tol", [
    # fp32: the two paths sum the same products in another order (per-block softmax vs flex's tiles)
    (torch.float32, 1e-5),
    # bf16: each path rounds its own partial sums and outputs to 8 bits of mantissa (~4e-3 relative)
    (torch.bfloat16, 3e-2),
])
def test_flex_and_per_block_paths_agree(dtype, tol):
    x, text, t_BT = inputs(7, 4, 8)
    model = tiny(causal=(3, True, "blocks")).to(dtype)
    with torch.no_grad():
        blocks = run(model, x.to(dtype), text.to(dtype), t_BT)
        model.causal_state.attention = "flex"
        flex = run(model, x.to(dtype), text.to(dtype), t_BT)
    torch.testing.assert_close(flex.float(), blocks.float(), atol=tol, rtol=tol)


def test_no_new_parameters_and_lora_checkpointing_train():
    """Same state-dict names and values; peft's LoRA on attn1's projections attaches and trains
    through the causal processors; gradient checkpointing gives the same gradients."""
    from peft import LoraConfig

    plain, causal = tiny(causal=None), tiny()
    assert list(causal.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(causal.state_dict().values(), plain.state_dict().values()))
    assert not any("causal" in n for n, _ in causal.named_buffers())

    x, text, t_BT = inputs()
    grads = []
    for checkpointing in (False, True):
        model = tiny()
        with seeded(5):  # the same LoRA weights both times
            model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        run(model, x, text, t_BT).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0] and all("lora" in n for n in grads[0])
    assert grads[0]["blocks.0.attn1.to_q.lora_B.default.weight"].abs().sum() > 0
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=0, rtol=0)


def test_per_frame_timesteps_of_one_value_are_diffusers_scalar_timestep():
    """frame_timesteps' per-token form on diffusers' TI2V path equals its [B] timestep path when
    every frame has the sample's timestep (token order: frame-major, n per frame)."""
    model = tiny(causal=None)
    x, text, _ = inputs()
    with torch.no_grad():
        per_frame = run(model, x, text, torch.full((1, 6), 321.0))
        scalar = model(x, timestep=torch.tensor([321.0]), encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(per_frame, scalar, atol=1e-5, rtol=1e-5)
    assert frame_timesteps(torch.tensor([[1, 2]]), 3).tolist() == [[1, 1, 1, 2, 2, 2]]


def test_what_the_causal_model_refuses_is_named():
    cfg = Config()
    cfg.task = "causal"
    assert causal_refusal(cfg) is None
    cfg.parallel.ulysses_degree = 2  # Ulysses serves the block rule (attention sees the whole sequence)
    assert causal_refusal(cfg) is None
    cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = 1, 2  # ring attention takes no mask
    assert causal_refusal(cfg).startswith("task: causal with parallel.ring_degree: 2") and (
        "parallel.ulysses_degree instead" in causal_refusal(cfg))
    cfg.parallel.ring_degree = 1
    cfg.conditioning.target_layout = "clean_prefix"  # the references as block 0: served
    assert causal_refusal(cfg) is None
    cfg.conditioning.target_layout = "sequence"
    assert "conditioning.target_layout: sequence" in causal_refusal(cfg) and "use clean_prefix" in causal_refusal(cfg)
