"""model.vae_tf32: the fp32 VAE runs its matmuls and cuDNN convolutions in TF32 on Ampere+ GPUs,
on by default, off with the key, never on pre-Ampere or without CUDA; the process's settings are
restored after each call (the transformer's fp32 matmuls are not the VAE's)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ROOT

from e2v.config.load import load_config
from e2v.runtime.device import TF32_ATTR


def test_the_key_reaches_the_loaded_vae():
    from e2v.models.load import load_parts

    for value in (True, False):
        cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"model.vae_tf32={str(value).lower()}"],
                          check_paths=False)
        assert getattr(load_parts(cfg, with_transformer=False).vae, TF32_ATTR) is value
    assert load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False).model.vae_tf32 is True


@pytest.mark.parametrize("key,capability,want", [(True, (9, 0), True), (False, (9, 0), False), (True, (7, 5), False)],
                         ids=["default_hopper", "opted_out", "turing"])
def test_vae_calls_run_in_tf32_on_ampere_and_later(key, capability, want, tiny_parts, monkeypatch):
    from e2v.conditioning.encode import decode_latents, encode_video

    vae = copy.deepcopy(tiny_parts.vae)
    setattr(vae, TF32_ATTR, key)
    seen = []
    real_encode, real_decode = vae.encode, vae.decode

    def watch(fn):
        def call(*a, **kw):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(vae, "encode", watch(real_encode))
    monkeypatch.setattr(vae, "decode", watch(real_decode))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    before = torch.backends.cuda.matmul.allow_tf32
    with torch.no_grad():
        latents = encode_video(torch.randint(0, 256, (1, 3, 5, 32, 32), dtype=torch.uint8), vae)
        decode_latents(latents, vae)
    assert seen == [(want, want)] * 2
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (before, False)
