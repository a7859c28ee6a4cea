"""Every element and conditioning option of the E2V config, against independent oracles: A2's
arithmetic computed by hand, a second code path (hand-built condition videos through one VAE
encode, per-element encodes), diffusers' I2V pipeline patched the way A2's fork samples the
posterior, and the tiny VAE's known structure (latent frame k = pixel group k).

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_conditioning_options.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_launch import launch_train, wait_all

E2V_TYPES = {  # e2v_type -> extra --set values
    "vae": [],
    "clip": [],
    "none": ["model.base=t2v"],  # plain T2V: the 16-channel base, not expanded
}


@pytest.fixture(scope="module")
def e2v_type_runs(demo_data, tmp_path_factory) -> dict:
    """One 2-step run per e2v_type, started side by side (each is mostly start-up)."""
    out = tmp_path_factory.mktemp("e2v_types")
    runs = {t: launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}",
                            f"run_id={t}", f"e2v_type={t}", "train.max_steps=2", "train.checkpoint_every=2",
                            "train.micro_batch_size=2", "validation.every_n_steps=0", *E2V_TYPES[t])
            for t in sorted(E2V_TYPES)}
    wait_all(*runs.values())
    return {t: out / t for t in runs}


@pytest.mark.parametrize("e2v_type", sorted(E2V_TYPES))
def test_each_e2v_type_trains_and_exports(e2v_type, e2v_type_runs):
    import json

    run = e2v_type_runs[e2v_type]
    losses = [json.loads(line)["train/loss"] for line in (run / "scalars.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))
    shape = json.loads((run / "lora/e2v_model.json").read_text())
    # none: the T2V base stays 16 channels without image attention; vae/clip: the I2V base as is
    assert shape["in_channels"] == (16 if e2v_type == "none" else 36)
    assert (shape["added_kv_proj_dim"] is None) == (e2v_type == "none")
    assert Path(run / "lora/pytorch_lora_weights.safetensors").exists()
