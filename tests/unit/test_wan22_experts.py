"""Wan2.2-I2V-A14B's two experts (e2v/config/experts.py) against diffusers' WanImageToVideoPipeline as the
oracle: its boundary switch on base experts, and two runs of the real entry point whose LoRA
exports load into the pipeline (one expert: `load_into_transformer_2=True` only; both experts,
with image attention added for the CLIP pathway) and reproduce our sampler's trajectory. Plus the
config rules of `model.expert`, the per-expert sigma draw, the zero-initialised expansion, and the
memory plan of the released model. `pytest -k wan22` selects them all.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_wan22_experts_runs.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT
from helpers_wan22 import _image, _our_latents, _pipe, _pipeline_latents

from e2v.config.load import load_config
from e2v.config.schema import ConfigError

TINY = ("model.preset=tiny_wan22_a14b",)


ONE_ELEMENT = "data.elements=[{name: person, suffixes: [_person.png], vae: {repeat: 1, position: 0}}]"


def _cfg(*sets, check_paths=False):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", list(sets), check_paths=check_paths)


def _pipeline_folder(tmp_path, name: str, index: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_wan22_model_expert_rules_name_key_and_fix(tmp_path):
    from e2v.config.experts import boundary_ratio

    with pytest.raises(ConfigError, match=r"model.expert: both, but model.preset tiny has one transformer.*remove "
                                          r"model.expert.*tiny_wan22_a14b"):
        _cfg("model.expert=both")
    with pytest.raises(ConfigError, match=r"model.expert is required: .* two experts .*high_noise, low_noise .*both"):
        _cfg(*TINY)
    with pytest.raises(ConfigError, match=r"validation.sigmas \[0.1, 0.5\]: none is the high_noise expert's "
                                          r"\(sigma >= 0.9\)"):
        _cfg(*TINY, "model.expert=high_noise", "validation.sigmas=[0.1,0.5]")
    with pytest.raises(ConfigError, match=r"flow.denoising_step_list \[950.0\]: no timestep of the low_noise"):
        _cfg(*TINY, "model.expert=low_noise", "flow.denoising_step_list=[950]")
    # model.base t2v on the tiny preset picks Wan2.2-T2V-A14B-shaped experts (16 input channels); on a
    # released two-expert base it is refused (tests/unit/test_r2v_configs.py)
    from e2v.models.plan import transformer_config

    assert transformer_config(_cfg(*TINY, "model.expert=both", "model.base=t2v", "e2v_type=none"))["in_channels"] == 16
    assert transformer_config(_cfg(*TINY, "model.expert=both"))["in_channels"] == 36

    # a local pipeline folder: its model_index.json decides (diffusers writes [null, null] for no component)
    two = _pipeline_folder(tmp_path, "two", {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": 0.9,
                                      "transformer": ["diffusers", "WanTransformer3DModel"],
                                      "transformer_2": ["diffusers", "WanTransformer3DModel"]})
    cfg = _cfg("model.preset=null", f"model.pretrained={two}", "model.expert=low_noise", "e2v_type=vae")
    assert boundary_ratio(cfg) == 0.9
    with pytest.raises(ConfigError, match=r"e2v_type: dual needs a CLIP image encoder.*set model.image_encoder"):
        _cfg("model.preset=null", f"model.pretrained={two}", "model.expert=both")
    one = _pipeline_folder(tmp_path, "one", {"boundary_ratio": None, "transformer_2": [None, None],
                                             "expand_timesteps": True})
    with pytest.raises(ConfigError, match="its model_index.json has no transformer_2 and boundary_ratio"):
        _cfg("model.preset=null", f"model.pretrained={one}", "model.expert=low_noise")
    released = _cfg("model.preset=null", "model.pretrained=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.expert=both",
                    "model.image_encoder=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
    assert boundary_ratio(released) == 0.9


def test_wan22_pretrained_folder_written_by_diffusers_loads_the_expert(tmp_path):
    """A two-expert pipeline folder as diffusers' save_pretrained writes it (its model_index.json
    is the oracle of the format): the boundary is read from it, `low_noise` loads transformer_2's
    weights alone, and the plan builds from its config without reading weights."""
    from diffusers import WanImageToVideoPipeline

    from e2v.config.experts import boundary_ratio
    from e2v.models.load import load_parts
    from e2v.models.plan import build_meta_transformer
    from e2v.models.tiny import build_tiny_experts, build_tiny_parts

    p = build_tiny_parts(0, with_encoders=True)
    experts = build_tiny_experts(0, ("high_noise", "low_noise"))
    WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=None,
                            transformer=experts["high_noise"], transformer_2=experts["low_noise"],
                            boundary_ratio=0.875).save_pretrained(tmp_path / "pipe")
    cfg = _cfg("model.preset=null", f"model.pretrained={tmp_path / 'pipe'}", "model.expert=low_noise", "e2v_type=vae")
    assert boundary_ratio(cfg) == 0.875
    model = load_parts(cfg, with_encoders=False).transformer
    assert list(model.experts) == ["low_noise"] and model.boundary_ratio == 0.875
    want = experts["low_noise"].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.low_noise.state_dict().items())
    assert list(build_meta_transformer(cfg).experts) == ["low_noise"]


@pytest.mark.parametrize("flow", [("flow.sigma_sampling=uniform", "flow.shift=3"),
                                  ("flow.sigma_sampling=logit_normal", "flow.shift=5", "flow.logit_mean=0.5"),
                                  ("flow.denoising_step_list=[999,950,900,800,500,100]",)])
def test_wan22_sigma_draw_per_expert_and_both(flow):
    """One expert: every drawn sigma's timestep is its expert's by the pipeline's rule, and the
    draw is the unrestricted one conditioned on that range (oracle: unrestricted draws, filtered).
    Both: each micro-batch stays on one side, and the mixture is the unrestricted distribution."""
    from e2v.config.experts import EXPERTS, expert_for, sigma_range
    from e2v.train.flow import sample_sigmas
    from e2v.train.step import expert_sigma_range

    n = 4000
    free = _cfg(*flow).flow
    kw = dict(mode=free.sigma_sampling, shift=free.shift, logit_mean=free.logit_mean, logit_std=free.logit_std,
              timestep_list=free.denoising_step_list)
    unrestricted = sample_sigmas(20 * n, generator=torch.Generator().manual_seed(0), **kw)
    quantiles = torch.linspace(0.05, 0.95, 19)
    for expert in EXPERTS:
        cfg = _cfg(*TINY, f"model.expert={expert}", *flow)
        gen = torch.Generator().manual_seed(1)
        sigmas = torch.cat([sample_sigmas(4, generator=gen, **kw, sigma_range=expert_sigma_range(cfg, 1, i))
                            for i in range(n // 4)])
        assert {expert_for(1000 * s.view(1), 0.9) for s in sigmas} == {expert}
        lo, hi = sigma_range(expert, 0.9)
        inside = unrestricted[(unrestricted >= lo) & (unrestricted <= hi)]
        assert (sigmas.quantile(quantiles) - inside.quantile(quantiles)).abs().max() < 0.02
    # the edge on the fp32 grid: the last low-noise sigma and the first high-noise one are neighbours
    low_hi, high_lo = sigma_range("low_noise", 0.9)[1], sigma_range("high_noise", 0.9)[0]
    assert torch.nextafter(torch.tensor(low_hi), torch.tensor(1.0)).item() == high_lo

    cfg = _cfg(*TINY, "model.expert=both", *flow)
    gen = torch.Generator().manual_seed(2)
    batches = [sample_sigmas(4, generator=gen, **kw, sigma_range=expert_sigma_range(cfg, i // 4, i % 4))
               for i in range(n)]
    sides = [expert_for(1000 * b, 0.9) for b in batches]  # raises if a micro-batch straddled the boundary
    assert set(sides) == set(EXPERTS)
    mixed = torch.cat(batches)
    assert (mixed.quantile(quantiles) - unrestricted.quantile(quantiles)).abs().max() < 0.02
    high_share = (unrestricted >= high_lo).float().mean().item()
    assert abs(sides.count("high_noise") / n - high_share) < 0.03


def test_wan22_switch_matches_pipeline_trajectory():
    """Two tiny base experts, one reference (A2's layout is then the Wan I2V layout): our sampler
    on the TwoExperts module gives the trajectory of WanImageToVideoPipeline(transformer,
    transformer_2, boundary_ratio) exactly; the schedule's timesteps (999, 900, 750, 500) put the
    boundary timestep itself on the high-noise side, and both experts ran."""
    from e2v.models.load import load_parts

    cfg = _cfg(*TINY, "model.expert=both", "e2v_type=vae", ONE_ELEMENT)
    parts = load_parts(cfg)
    two = parts.transformer
    calls = []
    hooks = [e.register_forward_pre_hook(lambda m, a, k, n=n: calls.append((n, int(k["timestep"][0]))),
                                         with_kwargs=True) for n, e in two.experts.items()]
    image = _image()
    ours = _our_latents(two, parts, cfg, image)
    for h in hooks:
        h.remove()
    assert sorted(set(calls)) == [("high_noise", 900), ("high_noise", 999), ("low_noise", 500), ("low_noise", 750)]
    ref = _pipeline_latents(_pipe(parts, two.high_noise, two.low_noise), image)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8), timestep=torch.tensor([950]),
                 encoder_hidden_states=torch.randn(1, 512, 32), return_dict=False)
    with torch.no_grad():  # distinct experts: a wrong switch could not give the pipeline's trajectory
        assert (two.high_noise(**probe)[0] - two.low_noise(**probe)[0]).abs().max() > 1e-2


def test_wan22_clip_pathway_adds_zero_initialised_image_attention():
    """e2v_type dual on the two experts: each gains image attention (the T2V expansion's modules,
    trained in full) and keeps its 36-channel patch embedding (not retrained); at step 0 each
    expert's output with CLIP tokens equals the base expert's without them."""
    from e2v.models.load import load_parts
    from e2v.models.tiny import build_tiny_experts
    from e2v.train.engine import prepare_for_training

    cfg = _cfg(*TINY, "model.expert=both", "train.trainable=[]")
    parts = load_parts(cfg, with_encoders=False)
    base = build_tiny_experts(0, ("high_noise", "low_noise"))
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 36, 5, 8, 8, generator=g), torch.randn(1, 512, 32, generator=g)
    clip = torch.randn(1, 17 * 3, 32, generator=g)
    for name, expert in parts.transformer.experts.items():
        assert expert.config.in_channels == 36 and expert.config.added_kv_proj_dim == 24
        t = torch.tensor([950.0 if name == "high_noise" else 300.0])
        with torch.no_grad():
            got = expert(x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=clip, return_dict=False)[0]
            want = base[name](x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    full = prepare_for_training(parts, cfg)
    assert {n.split(".")[0] for n in full} == {"high_noise", "low_noise"}
    assert not any("patch_embedding" in n for n in full)
    assert any(n.startswith("low_noise.blocks.0.attn2.add_v_proj") for n in full)
    assert any("lora_A" in n for n, p in parts.transformer.low_noise.named_parameters() if p.requires_grad)


def test_wan22_memory_plan_of_the_released_model():
    """--dry_run's model on the meta device from the published config (no download): each expert
    has the 14B shape with 36 input channels and no image attention; `both` is exactly twice one
    expert; the dry run says so; tools/estimate_memory plans the shipped config."""
    from diffusers import WanTransformer3DModel

    from e2v.models.plan import KNOWN_WAN_CONFIGS, build_meta_transformer, count_params, describe_plan

    sets = ("model.preset=null", "model.pretrained=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "e2v_type=vae")
    one = build_meta_transformer(load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", [*sets, "model.expert=low_noise"],
                                             check_paths=False))
    cfg = load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", [*sets, "model.expert=both"], check_paths=False)
    both = build_meta_transformer(cfg)
    c = one.low_noise.config
    assert (c.num_layers, c.num_attention_heads * c.attention_head_dim, c.ffn_dim, c.in_channels, c.image_dim) == \
           (40, 5120, 13824, 36, None)
    assert list(one.experts) == ["low_noise"] and list(both.experts) == ["high_noise", "low_noise"]
    with torch.device("meta"):
        t2v_14b = WanTransformer3DModel.from_config(KNOWN_WAN_CONFIGS["Wan-AI/Wan2.1-T2V-14B-Diffusers"])
    assert count_params(one) == count_params(t2v_14b) + 20 * 5120 * 4  # 20 more input channels x (1, 2, 2)
    assert count_params(both) == 2 * count_params(one)
    assert "experts: both trained in one module" in describe_plan(both, cfg, {"zero_optimization": {"stage": 3}}, [])
    from e2v.train import memory as estimate_memory

    shipped = load_config(ROOT / "configs/e2v_wan22_i2v_a14b.yaml", ["cache.enabled=true"], check_paths=False)
    r = estimate_memory.estimate(shipped, 1, 24)
    lora = 64 * (5120 + 5120) * 8 * 40  # rank 64 on 8 square 5120 projections in each of 40 blocks
    assert r["trainable"] == lora + 5120 * 36 * 4 + 5120  # + the patch embedding in full
    assert r["trainable"] + r["frozen"] == count_params(one) + lora
    assert r["best"] is not None  # one expert from the cache fits a 24 GB GPU
