"""The shipped sequence-layout configs plan offline: the dry run's meta-device transformer is the
base as released (16 input channels, no image attention, nothing widened), the token count holds
the reference slots, and the memory estimate runs on them."""

from __future__ import annotations

import pytest
from helpers import ROOT

CONFIGS = {  # config -> (base hub id, latent frames, h/2, w/2 tokens)
    "r2v_t2v_1.3b_24gb": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 21, 30, 52),
    "r2v_t2v_14b": ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 21, 30, 52),
    "r2v_skyreels_v3_14b_lora": ("Skywork/SkyReels-V3-R2V-14B", 31, 45, 80),
    "r2v_skyreels_v3_14b": ("Skywork/SkyReels-V3-R2V-14B", 31, 45, 80),
    "r2v_wan22_t2v_a14b": ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 21, 30, 52),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_r2v_configs_plan_the_released_base_with_four_slots(name):
    from e2v.config.load import load_config
    from e2v.models.plan import knows_shape_offline, per_token_time, preflight, tokens

    cfg = load_config(str(ROOT / f"configs/{name}.yaml"), check_paths=False)
    base, t, h, w = CONFIGS[name]
    assert cfg.model.pretrained == base and knows_shape_offline(cfg)
    assert cfg.conditioning.target_layout == "sequence" and cfg.conditioning.sequence.slots == 4
    transformer, full_names = preflight(cfg)
    c = transformer.config
    assert c.in_channels == 16 and c.added_kv_proj_dim is None
    assert full_names == [] or cfg.model.training_type == "full"  # nothing widened, nothing added
    s, ctx = tokens(cfg)
    assert s == (t + 4) * h * w and ctx == 512 and not per_token_time(cfg)


def test_r2v_v3_config_samples_as_v3_and_its_slots_cost_13_percent():
    from e2v.config.load import load_config

    cfg = load_config(str(ROOT / "configs/r2v_skyreels_v3_14b_lora.yaml"), check_paths=False)
    v = cfg.validation
    assert (v.num_inference_steps, v.guidance_scale, v.sample_shift) == (8, 1.0, 5.0)
    assert cfg.processors.vae.default_preprocess == "fit_pad_white" and cfg.processors.vae.sample_mode == "sample"
    assert round((31 + 4) / 31 - 1, 2) == 0.13  # the "four frames are ~13% more tokens at 121 frames"


@pytest.mark.parametrize("name, gpus", [("r2v_t2v_1.3b_24gb", 1), ("r2v_skyreels_v3_14b_lora", 8)])
def test_r2v_memory_estimate_runs_offline(name, gpus, capsys, monkeypatch):
    import sys

    import tools.estimate_memory as em

    monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "--config", str(ROOT / f"configs/{name}.yaml"),
                                      "--gpu-mem-gb", "24" if gpus == 1 else "80", "--gpus", str(gpus)])
    em.main()
    out = capsys.readouterr().out
    assert "configured" in out and "fits" in out


def test_r2v_wan22_t2v_config_trains_one_released_expert_at_875():
    """Wan2.2-T2V-A14B: two experts, the switch at timestep 875 (its model_index.json), each expert
    a plain 16-channel T2V transformer taken as released; model.base t2v (which widens a
    one-transformer base) is refused with the fix."""
    from e2v.config.experts import boundary_ratio, trained_experts
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    path = str(ROOT / "configs/r2v_wan22_t2v_a14b.yaml")
    cfg = load_config(path, check_paths=False)
    assert boundary_ratio(cfg) == 0.875 and trained_experts(cfg) == ("high_noise",)
    with pytest.raises(ConfigError, match=r"model.base: t2v .*remove model.base"):
        load_config(path, ["model.base=t2v"], check_paths=False)
