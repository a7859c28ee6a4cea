"""T2V -> E2V expansion (`pytest -k expand`): the widened model equals the T2V model exactly at
step 0, the new modules get gradients and train in full, the plan of the real Wan sizes is right
without weights, and a tiny T2V-base E2V run's export rebuilds the trained model in plain diffusers.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_expand_runs.py."""

from __future__ import annotations

import pytest
import torch
from helpers import save_t2v_and_clip_folders
from helpers_expand import _inputs

from e2v.config.load import load_config
from e2v.models.expand import expand_for_elements
from e2v.models.plan import build_meta_transformer, count_params
from e2v.models.tiny import build_tiny_parts


@pytest.mark.parametrize("in_channels,image_dim", [(36, 32), (32, 32), (36, None), (16, 32)],
                         ids=["dual", "dual_no_mask", "vae_only", "clip_only"])
def test_expand_output_equals_t2v_exactly_in_fp32(in_channels, image_dim):
    """Random condition channels and random CLIP tokens (3 blocks): bit-identical output."""
    t2v = build_tiny_parts(seed=0, base="t2v", with_encoders=False).transformer
    e2v = expand_for_elements(t2v, in_channels=in_channels, image_dim=image_dim, seed=0)
    assert e2v.config.in_channels == in_channels
    assert (e2v.config.added_kv_proj_dim == 24) == (image_dim is not None)
    x = _inputs(in_channels, 3 if image_dim else None)
    with torch.no_grad():
        expected = t2v(x["hidden_states"][:, :16], x["timestep"], x["encoder_hidden_states"], return_dict=False)[0]
        out = e2v(**x)[0]
    assert torch.equal(out, expected)
    if image_dim:  # the image branch exists and is live as soon as add_v_proj moves
        with torch.no_grad():
            e2v.blocks[0].attn2.add_v_proj.weight.normal_()
            assert not torch.equal(e2v(**x)[0], expected)


def test_expand_new_modules_get_gradients_at_step_0():
    """At step 0 the new patch-embedding channels and add_v_proj get gradients (the
    other new modules sit behind the zero add_v_proj and get them from step 1)."""
    t2v = build_tiny_parts(seed=0, base="t2v", with_encoders=False).transformer
    e2v = expand_for_elements(t2v, 36, 32)
    e2v(**_inputs(36, 2))[0].square().mean().backward()
    assert e2v.patch_embedding.weight.grad[:, 16:].abs().sum() > 0
    assert all(b.attn2.add_v_proj.weight.grad.abs().sum() > 0 for b in e2v.blocks)
    assert all(b.attn2.add_k_proj.weight.grad.abs().sum() == 0 for b in e2v.blocks)


@pytest.mark.parametrize("pretrained,base,billions", [
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "t2v", 1.42), ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "t2v", 14.29),
    ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "i2v", 16.40)])
def test_expand_meta_plan_has_the_real_wan_sizes(pretrained, base, billions):
    """The known Wan configs built on the meta device (no download) have the released
    models' parameter counts; a T2V base expanded for dual elements gains 36 channels and image attention."""
    raw = {"model": {"pretrained": pretrained, "base": base}, "e2v_type": "none",
           "data": {"datasets": [{"data_root": "."}], "elements": [{"name": "s", "suffixes": ["_s.png"]}]}}
    plain = build_meta_transformer(load_config(raw=raw, check_paths=False))
    assert abs(count_params(plain) / 1e9 - billions) < 0.01  # I2V: 16.395 B
    assert all(p.is_meta for p in plain.parameters())
    if base == "t2v":
        expanded = build_meta_transformer(load_config(raw={**raw, "e2v_type": "dual"}, check_paths=False))
        c = expanded.config
        assert c.in_channels == 36 and c.added_kv_proj_dim == c.num_attention_heads * 128 and c.image_dim == 1280


@pytest.mark.parametrize("layout", ["pipeline", "plain"])
def test_a_t2v_base_is_expanded_to_its_clip_width_without_loading_the_clip(tmp_path, layout):
    """The image attention of an expanded T2V base reads the CLIP of model.image_encoder. A cached
    run loads no encoder and the plan loads nothing: both take the width from the CLIP's config.json
    (a pipeline folder's image_encoder/ or a plain CLIP folder), as the run with the encoder loaded
    does, not ViT-H/14's 1280."""
    from e2v.models.load import load_parts

    t2v, clip, width = save_t2v_and_clip_folders(tmp_path, layout)
    assert width != 1280
    cfg = load_config("configs/e2v_tiny_lora.yaml", ["model.preset=null", f"model.pretrained={t2v}",
                                                     "model.base=t2v", f"model.image_encoder={clip}"], check_paths=False)
    online = load_parts(cfg).transformer.config
    cached = load_parts(cfg, with_encoders=False).transformer.config
    planned = build_meta_transformer(cfg).config
    assert online.image_dim == cached.image_dim == planned.image_dim == width
    assert online.in_channels == cached.in_channels == planned.in_channels == 36

    (clip / ("image_encoder" if layout == "pipeline" else "") / "config.json").write_text("{\"model_type\": 1}")
    with pytest.raises(ValueError, match="config.json: not a CLIP vision config with a hidden_size"):
        build_meta_transformer(cfg)


def test_expand_shipped_t2v_config_dry_run(demo_data, capsys, monkeypatch):
    """`train_e2v.py --config configs/e2v_t2v_1.3b.yaml --dry_run` (in-process: same main())."""
    import sys

    import train_e2v

    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", "configs/e2v_t2v_1.3b.yaml", "--dry_run",
                                      "--set", f"data.datasets.0.data_root={demo_data}"])
    train_e2v.main()
    out = capsys.readouterr().out
    # the demo's 17-frame clips are too short for the config's 81: the start-up check says so
    assert "config OK; 0 usable samples" in out and "8 unusable (listed above)" in out
    assert "30 layers x 12 heads x 128, in_channels 36, image attention yes (expanded from a T2V base)" in out
    cfg = load_config("configs/e2v_t2v_1.3b.yaml", check_paths=False)
    assert cfg.model.base == "t2v" and cfg.e2v_type == "dual"
