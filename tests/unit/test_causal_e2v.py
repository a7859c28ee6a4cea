"""Causal elements-to-video (docs/causal.md, "Elements to video"): with conditioning.target_layout
clean_prefix the references' latent frames are a block of their own in front of the video, block 0.
Against the rule written here: a token of a reference frame sees every reference token and no video
token, a video token sees every reference token and the video blocks up to its own (both attention
paths, read off the attention); through the model, the video never moves the references' output
and the references move every video block's; the cached rollout, which writes the references' block
into the KV cache first at t = 0, gives the latents of masked full forwards over [references at
t = 0, finished blocks at t = 0, block b at t] (fp32, 1e-5); configs/causal_e2v_tiny.yaml trains
in this process through train_e2v.main (and its checkpoint exports offline to the end-of-run CausVid
file); the loss is the video's noisy frames' alone."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from helpers import ROOT, train_main
from helpers_causal import SHIFT, STEPS, rollout_step

from e2v.conditioning.encode import Conditions
from e2v.eval.sampling import CausalRollout, denoise
from e2v.models.causal import (
    block_spans,
    blocks_attention,
    build_block_mask,
    enable_causal,
    flex_block_attention,
    frame_timesteps,
    reference_block,
)
from e2v.models.tiny import seeded, tiny_transformer_config
from e2v.train.step import predict

pytestmark = pytest.mark.usefixtures("one_thread")

# (frames per block, first frame alone, video latent frames, reference frames)
LAYOUTS = [(2, True, 5, 3), (3, False, 6, 1), (1, False, 3, 2)]


def video_block(frame: int, k: int, first_alone: bool) -> int:
    if first_alone:
        return 0 if frame == 0 else (frame - 1) // k + 1
    return frame // k


def rule(refs: int, frames: int, n: int, k: int, first_alone: bool) -> torch.Tensor:
    """[L, L] bool, query token i may see key token j: the references are block 0, the video's
    blocks are numbered from 1 (tokens frame-major, n per frame, the references' frames first)."""
    block = [0] * refs + [1 + video_block(f, k, first_alone) for f in range(frames)]
    b = torch.tensor([block[i // n] for i in range(len(block) * n)])
    return b[None, :] <= b[:, None]


def seen_mask(attend, length: int) -> torch.Tensor:
    """The mask an attention function applies, read off its output: zero queries give every visible
    key the same weight, and one-hot values put that weight in the key's column."""
    q, k, v = torch.zeros(1, length, 1, length), torch.randn(1, length, 1, length), torch.eye(length).view(1, length, 1, length)
    with torch.no_grad():
        return attend(q, k, v)[0, :, 0] > 0


@pytest.mark.parametrize("k, first_alone, frames, refs", LAYOUTS)
@pytest.mark.parametrize("path", ["blocks", "flex"])
def test_the_reference_block_is_seen_by_every_video_block_and_sees_none(path, k, first_alone, frames, refs):
    n = 24  # tokens per frame: > 128 tokens in all, so the flex mask has full, partial and empty tiles
    spans = [(a * n, b * n) for a, b in block_spans(refs + frames, k, first_alone, refs)]
    if path == "blocks":
        seen = seen_mask(lambda q, k_, v: blocks_attention(q, k_, v, spans), (refs + frames) * n)
    else:
        mask = build_block_mask(spans, "cpu")
        seen = seen_mask(lambda q, k_, v: flex_block_attention(q, k_, v, mask), (refs + frames) * n)
    assert torch.equal(seen, rule(refs, frames, n, k, first_alone))
    r = refs * n
    assert seen[r:, :r].all() and not seen[:r, r:].any() and seen[:r, :r].all()


def tiny(k, first_alone):
    with seeded(0):
        model = WanTransformer3DModel(**tiny_transformer_config("t2v")).eval()
    return enable_causal(model, k, first_alone, "blocks")


def conditions(refs_BCNhw, text):
    return Conditions(torch.zeros(1, 16, 1, 4, 4), text, ref_latents_BCNhw=refs_BCNhw, ref_layout="clean_prefix")


def test_through_the_model_the_references_lead_and_the_video_never_reaches_them():
    """e2v.train.step.predict (the one transformer call) places the references in front at t = 0
    and makes them block 0: a later frame's input moves no earlier output, the references' input
    moves every video frame's."""
    model = tiny(2, True)
    with seeded(1):
        x = torch.randn(1, 16, 5, 4, 4)
        refs, text = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 8, 32)
        t_BT = torch.tensor([[1000.0, 757.0, 757.0, 522.0, 522.0]])
    c = conditions(refs, text)
    with torch.no_grad():
        base, ref_out = predict(model, x, t_BT, c, text, torch.float32, with_references=True)
        assert base.shape == (1, 16, 5, 4, 4) and ref_out.shape == (1, 16, 2, 4, 4)
        moved = x.clone()
        moved[:, :, 3:] += 1.0  # the last block
        out, ref_again = predict(model, moved, t_BT, c, text, torch.float32, with_references=True)
        assert torch.equal(out[:, :, :3], base[:, :, :3]) and torch.equal(ref_again, ref_out)
        assert not torch.allclose(out[:, :, 3:], base[:, :, 3:])
        other = predict(model, x, t_BT, conditions(refs + 1.0, text), text, torch.float32)
    for a, z in ((0, 1), (1, 3), (3, 5)):
        assert (other[:, :, a:z] - base[:, :, a:z]).abs().max() > 1e-4, (a, z)


def test_the_loss_is_the_videos_noisy_frames_alone():
    """The training rule (e2v.train.step.forward_loss) with references in front: the model's output
    for the reference frames and for the clean (t = 0) video frames reaches no loss."""
    from e2v.config.schema import Config
    from e2v.train.flow import timestep_sigmas
    from e2v.train.step import forward_loss

    cfg = Config(task="causal")
    cfg.flow.objective, cfg.flow.denoising_step_list = "x0", [1000, 757, 522, 0]
    with seeded(4):
        x0, refs, v = torch.randn(1, 16, 6, 4, 4), torch.randn(1, 16, 2, 4, 4), torch.randn(1, 16, 8, 4, 4)
    c = Conditions(x0, torch.zeros(1, 8, 32), ref_latents_BCNhw=refs, ref_layout="clean_prefix")
    sigma = timestep_sigmas(torch.tensor([[757.0] * 3 + [0.0] * 3]), cfg.flow.shift)  # block 2 clean
    seen = []

    def model(x, timestep, **_):
        seen.append((x.shape[2], timestep[0, :: 4].tolist()))  # one timestep per frame (4 tokens a frame)
        return (v_now,)

    v_now = v
    loss, *_ = forward_loss(model, c, sigma, torch.zeros_like(x0), x0.clone(), cfg, torch.float32)
    v_now = v.clone()
    v_now[:, :, :2] += 100.0  # the references' output
    v_now[:, :, 5:] += 100.0  # the clean video frames'
    again, *_ = forward_loss(model, c, sigma, torch.zeros_like(x0), x0.clone(), cfg, torch.float32)
    assert loss.item() == again.item()
    assert seen[0] == (8, [0.0, 0.0] + [757.0] * 3 + [0.0] * 3)  # the references at t = 0, in front
    s = sigma[0, 0].item()
    torch.testing.assert_close(loss, ((x0[:, :, :3] - s * v[:, :, 2:5] - x0[:, :, :3]) ** 2).mean())


def full_forward_rollout(model, text, refs, noise, spans, generator):
    """The rule without a cache: each prediction is one masked full forward over [references at
    t = 0, the finished blocks at t = 0, block b at t], the model told the references' count."""
    b, _, _, h, w = noise.shape
    n, r = (h // 2) * (w // 2), refs.shape[2]
    done = []
    for a, z in spans:
        x = noise[:, :, a:z]
        for i, t in enumerate(STEPS):
            x_in = torch.cat([refs] + done + [x], 2)
            t_BT = torch.tensor([[0.0] * (r + a) + [t] * (z - a)])
            reference_block(model, r)
            with torch.no_grad():
                v = model(x_in, timestep=t_BT.repeat_interleave(n, 1), encoder_hidden_states=text,
                          return_dict=False)[0][:, :, r + a:r + z]
            x0, x = rollout_step(x, v, i, generator)
        done.append(x0)
    return torch.cat(done, 2)


@pytest.mark.parametrize("k, first_alone, frames, refs", LAYOUTS[:2])
def test_the_rollout_with_a_reference_block_equals_masked_full_forwards(k, first_alone, frames, refs):
    model = tiny(k, first_alone)
    with seeded(2):
        noise, refs_BCNhw = torch.randn(1, 16, frames, 4, 4), torch.randn(1, 16, refs, 4, 4)
        text = torch.randn(1, 512, 32)
    rollout = CausalRollout(k, first_alone, "blocks", STEPS, SHIFT)
    cached = denoise(model, conditions(refs_BCNhw, text), None, noise, num_steps=0, guidance_scale=1.0, shift=0.0,
                     rollout=rollout, generator=torch.Generator().manual_seed(3))
    full = full_forward_rollout(model, text, refs_BCNhw, noise, block_spans(frames, k, first_alone),
                                torch.Generator().manual_seed(3))
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)
    without = denoise(model, conditions(torch.zeros_like(refs_BCNhw), text), None, noise, num_steps=0,
                      guidance_scale=1.0, shift=0.0, rollout=rollout, generator=torch.Generator().manual_seed(3))
    assert (without - cached).abs().max() > 1e-4  # the references steer every sample


def test_the_tiny_config_trains_in_process(demo_data, tmp_path):
    """Two steps of the whole tiny transformer; its checkpoint exports offline (tools/export_lora.py's
    export_checkpoint, a full fine-tune's path) to the end-of-run CausVid file, tensor for tensor."""
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}", "run_id=e2v", "train.max_steps=2",
            "train.checkpoint_every=2", "train.warmup_steps=0", "train.log_every=1", "validation.every_n_steps=0",
            "cache.enabled=false", "visualization.enabled=false", "train.micro_batch_size=2")
    assert train_main("--config", str(ROOT / "configs/causal_e2v_tiny.yaml"), *[a for s in sets for a in ("--set", s)]) is None
    from helpers import read_scalars

    scalars = read_scalars(tmp_path / "e2v")
    assert sorted(scalars) == [1, 2]
    assert all(0 < s["train/loss"] < 10 for s in scalars.values())
    from e2v.train.checkpoint import export_checkpoint

    export_checkpoint(tmp_path / "e2v/checkpoints/step_000002", tmp_path / "offline")
    at_end, offline = (torch.load(p, map_location="cpu", weights_only=True)["generator"]
                       for p in (tmp_path / "e2v/lora/e2v_causvid.pt", tmp_path / "offline/e2v_causvid.pt"))
    assert sorted(at_end) == sorted(offline) and all(torch.equal(offline[k], v) for k, v in at_end.items())


def test_an_engine_forwarding_its_modules_attributes_holds_one_causal_transformer():
    """DeepSpeed's engine answers an unknown attribute with its module's (its __getattr__): the
    engine is not a second causal transformer (validation samples a causal run through it)."""
    from e2v.models.causal import causal_transformer

    class Engine(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.module, name)

    model = tiny(2, True)
    engine = Engine(model)
    assert engine.causal_state is model.causal_state and causal_transformer(engine) is model


def test_one_grid_with_another_count_of_references_gets_its_own_flex_mask():
    """Blocks of 1: 2 references + 5 video frames and 3 + 4 are one 7-frame grid with other blocks."""
    model = enable_causal(tiny(1, False), 1, False, "flex")
    with seeded(5):
        x, text = torch.randn(1, 16, 7, 4, 4), torch.randn(1, 8, 32)
    t = frame_timesteps(torch.zeros(1, 7), 4)
    masks = []
    for refs in (2, 3):
        reference_block(model, refs)
        with torch.no_grad():
            model(x, timestep=t, encoder_hidden_states=text, return_dict=False)
        masks.append(model.blocks[0].attn1.processor.block_mask("cpu"))
    for refs, mask in zip((2, 3), masks):  # each the rule of its own count (4 tokens a frame)
        seen = seen_mask(lambda q, k, v, m=mask: flex_block_attention(q, k, v, m), 28)
        assert torch.equal(seen, rule(refs, 7 - refs, 4, 1, False)), refs
