"""The FLOP model (e2v/train/flops.py) against a count written out by hand from the layer shapes,
for the tiny transformer and for Wan2.1-T2V-1.3B (plain, and expanded for elements) at
480 x 832 x 81; against what torch's FlopCounterMode measures on a tiny forward and backward (full
fine-tune and a LoRA on a frozen base); the peak table and its override; the speed scalars."""

from __future__ import annotations

import pytest

from e2v.train.flops import (
    FULL,
    StepFlops,
    Tokens,
    Training,
    peak_tflops,
    perf_scalars,
    sample_flops,
    training_of,
)

# Wan2.1-T2V-1.3B as diffusers' conversion script writes it (docs: FACTS of the project's first
# round): 12 heads x 128, 30 layers, FFN 8960, 16 latent channels, text 4096, freq 256, patch 1x2x2.
WAN_1_3B = dict(num_attention_heads=12, attention_head_dim=128, num_layers=30, ffn_dim=8960, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, patch_size=[1, 2, 2], image_dim=None, added_kv_proj_dim=None)
# Expanded for elements (e2v.models.expand): 16 noisy + 4 mask + 16 condition channels, CLIP ViT-H (1280
# wide) image attention whose k / v read the width-1536 image embedding.
WAN_1_3B_E2V = dict(WAN_1_3B, in_channels=36, image_dim=1280, added_kv_proj_dim=1536)
TINY = dict(num_attention_heads=2, attention_head_dim=12, num_layers=2, ffn_dim=32, in_channels=36, out_channels=16,
            text_dim=32, freq_dim=32, patch_size=[1, 2, 2], image_dim=32, added_kv_proj_dim=24)
# 81 frames -> 21 latent frames; 480 x 832 -> 60 x 104 latents -> 30 x 52 patches
S_480P_81 = 21 * 30 * 52
CLIP_TOKENS = 257


def hand_count(D, F, K, c_in, c_out, text_dim, freq, image_dim, kv, S, Ct, Ci, *, lora_r=0, lora_targets=(),
               full=(), checkpointing=False):
    """FLOPs of one sample's training step, every matmul written out as (rows, in, out): the
    forward, then the backward as input-gradients (the blocks and the head; never the embedders'
    first layers) plus weight-gradients (the layers in `full`; "all" for a full fine-tune), LoRA's
    A (in x r) and B (r x out) on `lora_targets`; attention's QK^T and AV, whose backward takes
    two products for dQ and two more for dK and dV."""
    everything = full == "all"
    emb = [("patch", S, c_in * 4, D), ("time1", 1, freq, D), ("time2", 1, D, D), ("time_proj", 1, D, 6 * D),
           ("text1", Ct, text_dim, D), ("text2", Ct, D, D)]
    if Ci:
        emb += [("image1", Ci, image_dim, image_dim), ("image2", Ci, image_dim, D)]
    block = [("to_q", S, D, D), ("to_k", S, D, D), ("to_v", S, D, D), ("to_out.0", S, D, D),  # self-attention
             ("x_to_q", S, D, D), ("x_to_out.0", S, D, D),  # cross-attention on the video tokens
             ("x_to_k", Ct, D, D), ("x_to_v", Ct, D, D),  # cross-attention keys / values on the text
             ("ffn.net.0.proj", S, D, F), ("ffn.net.2", S, F, D)]
    if Ci:
        block += [("add_k_proj", Ci, kv, D), ("add_v_proj", Ci, kv, D)]
    head = [("proj_out", S, D, c_out * 4)]
    self_attention, text_attention, image_attention = 2 * S * S * D, 2 * S * Ct * D, 2 * S * Ci * D  # QK^T and AV

    def trains(name):
        return everything or name in full

    def lora(name):
        return lora_r if name.removeprefix("x_") in lora_targets else 0

    fwd = sum(m * k * n for _, m, k, n in emb)
    # embedders: a later layer's input-gradient when the first trains (a full fine-tune here); the image
    # embedder's first one too: a LayerNorm with learnable scale and shift comes before it
    bwd = sum(m * k * n for name, m, k, n in emb if trains(name))
    bwd += sum(m * k * n for name, m, k, n in emb
               if everything and name in ("time2", "time_proj", "text2", "image1", "image2"))
    block_fwd = block_bwd = 0
    for name, m, k, n in block:
        r = lora(name)
        context = name in ("x_to_k", "x_to_v", "add_k_proj", "add_v_proj")
        grad_in = not context or everything  # the context's k / v pass a gradient on only if the embedders train
        block_fwd += m * k * n + m * r * (k + n)
        block_bwd += (m * k * n if grad_in else 0) + (m * k * n if trains(name) else 0)
        block_bwd += m * r * n + m * r * n + m * k * r + (m * k * r if grad_in else 0)
    # backward: dQ always, dK and dV where the keys / values carry a gradient (their projections train)
    text_kv = everything or lora("x_to_k") or trains("x_to_k")
    image_kv = everything or trains("add_k_proj")
    block_fwd += self_attention + text_attention + image_attention
    block_bwd += 2 * self_attention + (2 if text_kv else 1) * text_attention + (2 if image_kv else 1) * image_attention
    for name, m, k, n in head:
        fwd += m * k * n
        bwd += m * k * n + (m * k * n if trains(name) else 0)
    fwd += K * block_fwd
    bwd += K * block_bwd
    return 2 * fwd, 2 * bwd, (2 * K * block_fwd if checkpointing else 0)


def _close(got: StepFlops, want: tuple, rel: float = 0.02):
    assert got.forward == pytest.approx(want[0], rel=rel)
    assert got.backward == pytest.approx(want[1], rel=rel)
    assert got.recompute == pytest.approx(want[2], rel=rel)


def _shape(c):
    d = c["num_attention_heads"] * c["attention_head_dim"]
    return (d, c["ffn_dim"], c["num_layers"], c["in_channels"], c["out_channels"], c["text_dim"], c["freq_dim"],
            c["image_dim"], c["added_kv_proj_dim"])


def test_known_configs_are_the_ones_counted_here():
    """The 1.3B dict written above is the plan's (e2v.models.plan.KNOWN_WAN_CONFIGS), so the figures
    below are those of the model training builds."""
    from e2v.models.plan import KNOWN_WAN_CONFIGS

    known = KNOWN_WAN_CONFIGS["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]
    assert {k: known.get(k) for k in WAN_1_3B} == WAN_1_3B


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_full_fine_tune_matches_the_hand_count(checkpointing):
    tok = Tokens(video=5 * 4 * 4, text=512, image=2 * 17)
    want = hand_count(*_shape(TINY), tok.video, 512, tok.image, full="all", checkpointing=checkpointing)
    _close(sample_flops(TINY, tok, FULL, checkpointing=checkpointing), want, rel=1e-9)


def test_1_3b_at_480p_81_frames_matches_the_hand_count():
    """Plain T2V-1.3B and the elements expansion (three CLIP references), full fine-tune with
    checkpointing; and the expanded model with the shipped recipe (configs/e2v_t2v_1.3b.yaml: LoRA
    rank 64 on the attention and FFN, the expansion modules in full)."""
    plain = hand_count(*_shape(WAN_1_3B), S_480P_81, 512, 0, full="all", checkpointing=True)
    _close(sample_flops(WAN_1_3B, Tokens(S_480P_81), FULL, checkpointing=True), plain)
    e2v = hand_count(*_shape(WAN_1_3B_E2V), S_480P_81, 512, 3 * CLIP_TOKENS, full="all", checkpointing=True)
    _close(sample_flops(WAN_1_3B_E2V, Tokens(S_480P_81, image=3 * CLIP_TOKENS), FULL, checkpointing=True), e2v)
    # The attention products dominate at this length: 2 S^2 D per layer, ~70% of the forward.
    assert 2 * 30 * 2 * S_480P_81**2 * 1536 / plain[0] == pytest.approx(0.70, abs=0.02)

    targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    k = WAN_1_3B_E2V["num_layers"]
    names = [f"blocks.{i}.{a}.{t}" for i in range(k) for a in ("attn1", "attn2") for t in targets[:4]]
    names += [f"blocks.{i}.ffn.net.{j}" for i in range(k) for j in ("0.proj", "2")]
    full = ["patch_embedding", "condition_embedder.image_embedder.ff.net.0.proj", "condition_embedder.image_embedder.ff.net.2"]
    full += [f"blocks.{i}.attn2.{p}" for i in range(k) for p in ("add_k_proj", "add_v_proj")]
    recipe = Training(frozenset(full), {n: 64 for n in names}, frozenset(full))
    got = sample_flops(WAN_1_3B_E2V, Tokens(S_480P_81, image=3 * CLIP_TOKENS), recipe, checkpointing=True)
    want = hand_count(*_shape(WAN_1_3B_E2V), S_480P_81, 512, 3 * CLIP_TOKENS, lora_r=64, lora_targets=targets,
                      full=("patch", "image1", "image2", "add_k_proj", "add_v_proj"), checkpointing=True)
    # the image embedder trains, so its second layer and add_k / add_v pass input-gradients on: add them
    d, ci = 1536, 3 * CLIP_TOKENS
    want = (want[0], want[1] + 2 * (ci * 1280 * d + k * 2 * ci * d * d), want[2])
    _close(got, want)


def test_the_shipped_1_3b_config_counts_what_it_trains():
    """configs/e2v_t2v_1.3b.yaml built on the meta device (e2v.train.flops.config_flops): the LoRA
    ranks and full-trained modules read from the built model give the recipe's count above, and a
    full fine-tune costs more backward than the LoRA run (frozen weights: input-gradients only)."""
    from e2v.config.load import load_config
    from e2v.models.plan import preflight
    from e2v.train.flops import config_flops

    cfg = load_config("configs/e2v_t2v_1.3b.yaml", ["train.gradient_checkpointing=true", "train.micro_batch_size=1",
                                                  "train.gradient_accumulation_steps=1"], check_paths=False)
    model = preflight(cfg)[0]
    t = training_of(model)
    assert t.rank("blocks.0.attn1.to_q") == 64 and t.rank("blocks.29.ffn.net.2") == 64
    assert t.rank("blocks.0.attn2.add_k_proj") == 0 and t.trains("blocks.0.attn2.add_k_proj")
    assert t.trains("patch_embedding") and not t.trains("blocks.0.attn1.to_q") and not t.trains("proj_out")
    lora = config_flops(cfg, model)
    assert lora.video_tokens == S_480P_81 and lora.forward == pytest.approx(
        sample_flops(dict(model.config), Tokens(S_480P_81, image=3 * CLIP_TOKENS), FULL).forward, rel=0.02)
    full = sample_flops(dict(model.config), Tokens(S_480P_81, image=3 * CLIP_TOKENS), FULL, checkpointing=True)
    assert full.backward > lora.backward > full.forward


def _measured(model, inputs) -> tuple[int, int]:
    """(forward, backward) FLOPs torch's FlopCounterMode counts, attention through the math kernel
    (its matmuls are what the counter sees on a CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel([SDPBackend.MATH]):
        with FlopCounterMode(display=False) as fwd:
            out = model(**inputs, return_dict=False)[0]
        with FlopCounterMode(display=False) as bwd:
            out.float().square().mean().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("lora, checkpointing", [(False, False), (True, False), (True, True)])
def test_tiny_step_matches_what_torch_counts(lora, checkpointing):
    """The tiny I2V transformer's forward and backward as torch's flop counter sees them: a full
    fine-tune, and a rank-4 LoRA on a frozen base with the patch embedding trained (e2v's tiny
    recipe: the frozen linears' input-gradients are computed, their weight-gradients are not);
    with gradient checkpointing the backward holds every block's forward once more."""
    import torch
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{k: v for k, v in TINY.items()}, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  rope_max_seq_len=32)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                                         "ffn.net.0.proj", "ffn.net.2"]))
        model.patch_embedding.requires_grad_(True)
    if checkpointing:
        model.enable_gradient_checkpointing()
    tok = Tokens(video=3 * 4 * 4, text=512, image=17)
    inputs = dict(hidden_states=torch.randn(1, 36, 3, 8, 8), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 512, 32), encoder_hidden_states_image=torch.randn(1, 17, 32))
    fwd, bwd = _measured(model, inputs)
    got = sample_flops(TINY, tok, training_of(model), checkpointing=checkpointing)
    assert (got.forward, got.backward + got.recompute) == (fwd, bwd)  # every product, counted as torch counts it
    assert bool(got.recompute) == checkpointing


def test_context_parallel_splits_the_video_tokens_work():
    """Per rank, P ways: every video-token linear and the attention; the embedders and the context's
    k / v are whole on every rank."""
    tok = Tokens(S_480P_81, image=3 * CLIP_TOKENS)
    one, four = (sample_flops(WAN_1_3B_E2V, tok, FULL, checkpointing=True, cp=p) for p in (1, 4))
    assert four.forward > one.forward / 4 and four.forward == pytest.approx(one.forward / 4, rel=0.01)
    assert four.recompute == pytest.approx(one.recompute / 4, rel=0.01)


def test_peak_table_and_override():
    assert peak_tflops(None, "NVIDIA H100 80GB HBM3")[0] == 989.0
    assert peak_tflops(None, "NVIDIA H100 PCIe")[0] == 756.0
    assert peak_tflops(None, "NVIDIA H200")[0] == 989.0
    assert peak_tflops(None, "NVIDIA B200")[0] == 2250.0
    assert peak_tflops(None, "NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert peak_tflops(None, "NVIDIA L40S")[0] == 362.05
    assert peak_tflops(None, "NVIDIA GeForce RTX 4090")[0] == 165.2
    assert peak_tflops(None, "NVIDIA RTX 6000 Ada Generation")[0] == 364.2
    assert peak_tflops(500.0, "NVIDIA H100 80GB HBM3") == (500.0, "train.peak_tflops")
    unknown, why = peak_tflops(None, "NVIDIA GB200")
    assert unknown is None and "train.peak_tflops" in why
    assert peak_tflops(None, None)[0] is None


def test_speed_scalars():
    """tokens/s counts every data-parallel group; TFLOPS per GPU are model FLOPs; MFU only with a peak."""
    f = StepFlops(forward=1e15, backward=2e15, recompute=1e15, video_tokens=32760)
    s = perf_scalars(f, step_time=10.0, data_parallel=2, peak=1000.0)
    assert s["perf/tokens_per_s"] == pytest.approx(6552.0) and s["perf/tflops_per_gpu"] == pytest.approx(300.0)
    assert s["perf/mfu"] == pytest.approx(0.3) and s["perf/hfu"] == pytest.approx(0.4)
    assert set(perf_scalars(f, 10.0, 1, None)) == {"perf/tokens_per_s", "perf/tflops_per_gpu"}
    assert perf_scalars(None, 10.0, 1, 1000.0) == {}
