"""T2V -> E2V expansion (`pytest -k expand`): the widened model equals the T2V model exactly at
step 0, the new modules get gradients and train in full, the plan of the real Wan sizes is right
without weights, and a tiny T2V-base E2V run's export rebuilds the trained model in plain diffusers.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_expand.py."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from helpers_expand import _inputs
from helpers_launch import run_train

from e2v.config.load import load_config
from e2v.models.expand import expand_for_elements
from e2v.models.tiny import build_tiny_parts


@pytest.fixture(scope="module")
def expand_run(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("expand_runs")
    run_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=x",
              "model.base=t2v", "train.max_steps=3", "train.checkpoint_every=3", "train.micro_batch_size=2",
              "validation.every_n_steps=0")
    return out / "x"


def test_expand_end_to_end_t2v_base_export_rebuilds_the_model(expand_run):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from e2v.eval.sampling import load_trained
    from e2v.models.expand import expand_from_export, expansion_modules
    from e2v.models.trainable import setup_training
    from e2v.train.export import load_extra_modules

    lora = expand_run / "lora"
    shape = json.loads((lora / "e2v_model.json").read_text())
    assert (shape["in_channels"], shape["image_dim"], shape["added_kv_proj_dim"]) == (36, 32, 24)
    extra = set(shape["extra_modules"])
    for name in ("patch_embedding.weight", "blocks.1.attn2.add_v_proj.weight", "blocks.0.attn2.add_k_proj.bias",
                 "blocks.0.attn2.norm_added_k.weight", "condition_embedder.image_embedder.ff.net.2.weight"):
        assert name in extra, name

    # The inference side: a plain T2V transformer, widened from e2v_model.json, LoRA + modules loaded.
    p = build_tiny_parts(seed=0, base="t2v")
    pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                       transformer=expand_from_export(p.transformer, lora),
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True))
    pipe.load_lora_weights(str(lora))
    assert set(load_extra_modules(pipe.transformer, lora)) == extra
    assert pipe.transformer.blocks[0].attn2.add_v_proj.weight.abs().sum() > 0, "add_v_proj started at 0: it trained"
    with torch.no_grad():
        exported = pipe.transformer(**_inputs(36, 3))[0]

    # tools/sample.py's loader (e2v.eval.sampling.load_trained) builds the same model, and quietly: peft's
    # warning about the zero LoRA that diffusers adds for the image projections is not shown.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ours = load_trained(expand_from_export(build_tiny_parts(seed=0, base="t2v").transformer, lora), lora)
    with torch.no_grad():
        # Two loaders of the same files: the weights may sit at another alignment in each (a mapped
        # file's tensor or a copy), which the CPU's BLAS may sum in another order. fp32 over the tiny
        # model's blocks on outputs of magnitude ~1: 1e-5; a missing module or LoRA moves them by far more.
        torch.testing.assert_close(ours(**_inputs(36, 3))[0], exported, atol=1e-5, rtol=1e-5)

    # Second path: the DeepSpeed checkpoint's weights in a freshly expanded peft model.
    cfg = load_config(expand_run / "config.yaml", check_paths=False)
    fresh = expand_for_elements(build_tiny_parts(seed=0, base="t2v", with_encoders=False).transformer, 36, 32)
    full = setup_training(fresh, cfg, expanded=True)
    assert all(any(re.search(pat, n) for n in full) for pat in expansion_modules(cfg))
    from helpers import load_checkpoint_module

    state = torch.load(expand_run / "checkpoints/step_000003/mp_rank_00_model_states.pt", weights_only=False)["module"]
    load_checkpoint_module(fresh, state)
    with torch.no_grad():
        engine_out = fresh(**_inputs(36, 3))[0]
    torch.testing.assert_close(exported, engine_out, atol=1e-5, rtol=0)
