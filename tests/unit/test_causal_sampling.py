"""The causal task's sampler (e2v/eval/sampling.py: `denoise` with a `CausalRollout`) against CausVid's
rule, restated here without the KV cache: for block b, at each listed t, the x0 estimate of the
block is what ONE masked full forward over [the finished earlier blocks at t = 0, block b at t]
predicts for block b's frames (x0 = x_t - sigma v, sigma the training grid's nearest point);
between listed timesteps the estimate is re-noised with fresh noise (or, causal.renoise: predicted,
with the flow's own noise estimate: DDIM). The cached rollout must give
the same latents (fp32, 1e-5), with and without guidance (each pass its own cache), also with the
first frame alone; a causal config samples through `generate`; a later block's noise never moves
an earlier block."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from helpers_causal import SHIFT, STEPS, grid_sigma, rollout_step

from e2v.conditioning.encode import Conditions
from e2v.eval.sampling import CausalRollout, causal_rollout, denoise
from e2v.models.causal import enable_causal
from e2v.models.tiny import seeded, tiny_transformer_config
from e2v.runtime.device import randn


def blocks_of(frames: int, k: int, first_alone: bool) -> list[tuple[int, int]]:
    edges = ([0, 1] if first_alone else [0]) + list(range(1 + k if first_alone else k, frames + 1, k))
    return list(zip(edges[:-1], edges[1:]))


def full_forward_rollout(model, text, negative, cond, clip, noise, k, first_alone, guidance, generator, renoise):
    """The rule without a cache: every prediction is one full forward over the prefix, with the
    block-causal mask (the model's) and a timestep per frame on diffusers' per-token path."""
    b, _, frames, h, w = noise.shape
    n = (h // 2) * (w // 2)
    done = []
    for a, z in blocks_of(frames, k, first_alone):
        x = noise[:, :, a:z]
        for i, t in enumerate(STEPS):
            x_in = torch.cat(done + [x], 2)
            t_BT = torch.tensor([[0.0] * a + [t] * (z - a)]).expand(b, -1)
            model_in = torch.cat([x_in, cond[:, :, :z]], 1)

            def v_of(txt):
                with torch.no_grad():
                    out = model(model_in, timestep=t_BT.repeat_interleave(n, 1), encoder_hidden_states=txt,
                                encoder_hidden_states_image=clip, return_dict=False)[0]
                return out[:, :, a:z]
            v = v_of(text)
            if guidance > 1:
                v_u = v_of(negative)
                v = v_u + guidance * (v - v_u)
            x0, x = rollout_step(x, v, i, generator, renoise)
        done.append(x0)
    return torch.cat(done, 2)


def tiny_i2v(k, first_alone):
    with seeded(0):
        model = WanTransformer3DModel(**tiny_transformer_config("i2v")).eval()
    return enable_causal(model, k, first_alone, "blocks")


@pytest.mark.parametrize("k, first_alone, frames, guidance, renoise", [
    (2, True, 5, 1.0, "fresh"), (1, False, 3, 3.0, "fresh"), (3, False, 6, 1.0, "fresh"), (2, False, 4, 3.0, "predicted")])
def test_the_cached_rollout_equals_masked_full_forwards(k, first_alone, frames, guidance, renoise):
    model = tiny_i2v(k, first_alone)
    with seeded(1):
        noise = torch.randn(1, 16, frames, 4, 4)
        cond = torch.randn(1, 20, frames, 4, 4)
        text, negative = torch.randn(1, 512, 32), torch.randn(1, 512, 32)
        clip = torch.randn(1, 17, 32)
    c = Conditions(latents_BCTHW=torch.zeros_like(noise), text_BLD=text, cond_BCTHW=cond, clip_BLD=clip)
    rollout = CausalRollout(k, first_alone, "blocks", STEPS, SHIFT, renoise)
    seen = []
    cached = denoise(model, c, negative, noise, num_steps=0, guidance_scale=guidance, shift=0.0, rollout=rollout,
                     generator=torch.Generator().manual_seed(3), on_step=lambda i, t, v: seen.append(t))
    expected = full_forward_rollout(model, text, negative, cond, clip, noise, k, first_alone, guidance,
                                    torch.Generator().manual_seed(3), renoise)
    assert seen == list(STEPS) * len(blocks_of(frames, k, first_alone))
    torch.testing.assert_close(cached, expected, atol=1e-5, rtol=1e-5)


def test_a_later_blocks_noise_never_moves_an_earlier_block():
    model = tiny_i2v(2, False)
    with seeded(1):
        noise = torch.randn(1, 16, 4, 4, 4)
        c = Conditions(latents_BCTHW=torch.zeros_like(noise), text_BLD=torch.randn(1, 512, 32),
                       cond_BCTHW=torch.randn(1, 20, 4, 4, 4), clip_BLD=torch.randn(1, 17, 32))
    other = noise.clone()
    other[:, :, 2:] = torch.randn_like(other[:, :, 2:])
    rollout = CausalRollout(2, False, "blocks", STEPS, SHIFT)
    a, b = (denoise(model, c, None, x, num_steps=0, guidance_scale=1.0, shift=0.0, rollout=rollout) for x in (noise, other))
    assert torch.equal(a[:, :, :2], b[:, :, :2])
    assert not torch.equal(a[:, :, 2:], b[:, :, 2:])


def causal_config(**sets):
    from helpers import ROOT

    from e2v.config.load import load_config

    base = {"task": "causal", "causal.frames_per_block": "2", "causal.independent_first_frame": "true",
            "flow.denoising_step_list": "[1000,757,522,0]", "flow.shift": "8", "flow.objective": "x0", "data.frame_buckets": "[17]"}
    return load_config(ROOT / "configs/e2v_tiny.yaml", [f"{k}={v}" for k, v in {**base, **sets}.items()],
                       check_paths=False)


def test_the_rollout_of_a_config():
    cfg = causal_config()
    assert causal_rollout(cfg) == CausalRollout(2, True, "auto", STEPS, 8.0)
    warped = causal_rollout(causal_config(**{"flow.denoising_step_list": "[1000,750,500,250]",
                                            "flow.warp_denoising_step": "true"}))
    # CausVid's warp at shift 8: the grid's timestep 1000 - t places from its noisy end
    assert [round(t, 1) for t in warped.timesteps] == [1000.0, round(1000 * grid_sigma(960.0), 1),
                                                       round(1000 * grid_sigma(888.9), 1), round(1000 * grid_sigma(727.3), 1)]
    assert causal_rollout(causal_config(**{"causal.renoise": "predicted"})).renoise == "predicted"
    cfg.task = "bidirectional"
    assert causal_rollout(cfg) is None


def test_a_causal_config_samples_through_generate():
    """generate() of a causal config makes a fresh transformer causal and rolls out block by block:
    the same latents as denoise with the config's rollout on the same conditions and noise."""
    from e2v.eval.sampling import encode_conditions, generate, latent_shape, noise_generator
    from e2v.models.tiny import build_tiny_parts

    cfg = causal_config()
    parts = build_tiny_parts(seed=0)
    latents = generate(parts.transformer, parts, cfg, ["a shape moves"], seed=4, guidance_scale=1.0)
    assert latents.shape == latent_shape(cfg, parts.vae) and torch.isfinite(latents).all()
    assert parts.transformer.causal_state.frames_per_block == 2

    from e2v.conditioning.encode import encode_text
    from e2v.data.dataset import collate
    from e2v.eval.sampling import element_item

    generator = noise_generator(4)
    noise = randn(latent_shape(cfg, parts.vae), generator, "cpu")
    c = encode_conditions(parts, cfg, collate([element_item(cfg, "a shape moves", {})]), generator)
    again = denoise(parts.transformer, c, encode_text([""], parts.tokenizer, parts.text_encoder), noise, num_steps=0,
                    guidance_scale=1.0, shift=0.0, rollout=causal_rollout(cfg), generator=generator)
    assert torch.equal(latents, again)


def test_the_sample_command_samples_a_causal_run(tmp_path):
    """tools/sample.py on a causal config: a base with model.generator_ckpt (a CausVid file) samples
    block by block into a video of data.num_frames frames; --steps (the UniPC loop's) is refused."""
    from helpers import ROOT

    from e2v.data.media import probe_video
    from e2v.eval import sample_cli
    from e2v.models.causvid_ckpt import save_causvid_checkpoint

    with seeded(9):  # the config's tiny shape, other weights
        shape = causal_config().model.tiny
        save_causvid_checkpoint(WanTransformer3DModel(**tiny_transformer_config("i2v", shape)).state_dict(),
                                tmp_path / "g.pt")
    sets = ["task=causal", "causal.frames_per_block=2", "causal.independent_first_frame=true", "flow.objective=x0",
            "flow.denoising_step_list=[1000,757,522,0]", "flow.shift=8", "data.frame_buckets=[17]",
            f"model.generator_ckpt={tmp_path / 'g.pt'}"]
    argv = ["--config", str(ROOT / "configs/e2v_tiny.yaml"), "--prompt", "a shape moves", "--guidance", "1",
            "--device", "cpu", *[a for s in sets for a in ("--set", s)]]
    with pytest.raises(SystemExit, match="--steps / --shift set the UniPC loop"):
        sample_cli.main([*argv, "--steps", "4", "--out", str(tmp_path / "refused.mp4")])
    sample_cli.main([*argv, "--out", str(tmp_path / "v.mp4")])
    assert probe_video(tmp_path / "v.mp4").frames == 17
