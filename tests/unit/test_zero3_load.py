"""ZeRO-3 load of a pretrained transformer (load_transformer_zero3): built inside zero.Init, each
rank holding only its partitions, and streamed from rank 0 one tensor at a time from sharded
safetensors. It must train to exactly the losses of the whole-model load (diffusers'
from_pretrained on every rank, `model.zero3_init: false`): bf16, where the fp32-kept modules and
the rope tables must come out as from_pretrained leaves them, and fp32 under ZeRO-3 + offload.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_zero3_load_runs.py."""

import pytest
from helpers import ROOT


@pytest.mark.parametrize("bf16", [False, True])
def test_expanded_t2v_base_is_partitioned_at_load_with_the_whole_loads_weights(tmp_path, one_rank_group, bf16):
    """A T2V base expanded for elements (36 channels + image attention) loads partitioned too: every
    parameter, gathered, equals the whole load's (from_pretrained + expand_for_elements, the oracle),
    the base's from the shards, the new modules' init, the widened patch embedding."""
    import deepspeed
    import torch

    from e2v.config.load import load_config
    from e2v.models.load import load_transformer
    from e2v.models.tiny import build_tiny_parts

    build_tiny_parts(seed=3, base="t2v", with_encoders=False).transformer.save_pretrained(
        tmp_path / "transformer", max_shard_size="50KB")
    sets = ["model.preset=null", f"model.pretrained={tmp_path}", "model.base=t2v", "model.weight_dtype=fp32",
            f"train.mixed_precision={'bf16' if bf16 else 'no'}"]
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", sets, check_paths=False)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}}
    whole, _ = load_transformer(cfg, image_width=32)
    partitioned, _ = load_transformer(cfg, ds_config=ds, image_width=32)
    assert whole.config.in_channels == partitioned.config.in_channels == 36
    assert partitioned.config.added_kv_proj_dim == whole.config.added_kv_proj_dim is not None
    expected = dict(whole.named_parameters())
    got = dict(partitioned.named_parameters())
    assert sorted(got) == sorted(expected)
    assert all(hasattr(p, "ds_tensor") for p in got.values())  # partitioned, not whole
    for name, p in got.items():
        with deepspeed.zero.GatheredParameters([p]):
            want = expected[name].to(p.dtype)
            assert torch.equal(p.data, want), name
    added_v = [n for n in got if "add_v_proj" in n]
    assert added_v and all(not expected[n].any() for n in added_v)  # the image branch adds 0 at step 0
