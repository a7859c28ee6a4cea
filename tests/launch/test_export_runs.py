"""The launch half of tests/unit/test_export.py (exports):
the tests that train through the launcher; that file's docstring says what the two halves check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers_comfy import diffusers_name, split
from helpers_export import _from_original_wan
from safetensors.torch import load_file

pytestmark = pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run` (tests/conftest.py)

# Runs in a fresh interpreter: plain diffusers + the exported files, and proof that no DeepSpeed
# module was imported. Prints the output tensors' path.
PLAIN_DIFFUSERS = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from safetensors.torch import load_file
from e2v.models.tiny import build_tiny_parts
from e2v.train.export import load_extra_modules
from helpers_comfy import apply_diffs, split

def pipe():
    p = build_tiny_parts(seed=0)
    return WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
        image_encoder=p.image_encoder, image_processor=p.image_processor, transformer=p.transformer,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0))

g = torch.Generator().manual_seed(0)
probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
             encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
             encoder_hidden_states_image=torch.randn(1, 17 * 3, 32, generator=g), return_dict=False)
out = {}
p = pipe()
with torch.no_grad():
    out["base"] = p.transformer(**probe)[0]
p.load_lora_weights(sys.argv[2], weight_name="pytorch_lora_weights.safetensors")
with torch.no_grad():
    out["diffusers_lora_only"] = p.transformer(**probe)[0]
load_extra_modules(p.transformer, sys.argv[2])
with torch.no_grad():
    out["diffusers"] = p.transformer(**probe)[0]
# ComfyUI: one file; its LoRA part through diffusers' ComfyUI/Wan LoRA converter, the differences
# added to the base weights as ComfyUI's loader adds them
lora, diffs = split(load_file(sys.argv[2] + "/pytorch_lora_weights_comfyui.safetensors"))
p = pipe()
p.load_lora_weights(lora)
with torch.no_grad():
    out["comfyui_lora_only"] = p.transformer(**probe)[0]
apply_diffs(p.transformer, diffs)
with torch.no_grad():
    out["comfyui"] = p.transformer(**probe)[0]
out["probe"] = probe
torch.save(out, sys.argv[3])
assert not any(m.split(".")[0] == "deepspeed" for m in sys.modules), "deepspeed was imported"
"""


@pytest.fixture(scope="module")
def plain_outputs(zero3_offload_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "out.pt"
    proc = subprocess.run([sys.executable, "-c", PLAIN_DIFFUSERS, str(ROOT), str(zero3_offload_run / "lora"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _engine_weights_output(run: Path, probe: dict) -> torch.Tensor:
    """Oracle: the trained fp32 weights as DeepSpeed's zero_to_fp32 reads them from the last
    checkpoint (module naming, `.default` adapter infix), in a freshly built peft model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training

    state = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag="step_000008",
                                                     exclude_frozen_parameters=True)
    cfg = load_config(run / "config.yaml", check_paths=False)
    fresh = build_tiny_parts(seed=0, with_encoders=False).transformer
    setup_training(fresh, cfg, expanded=False)
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert set(state) == trainable
    fresh.load_state_dict(state, strict=False)
    with torch.no_grad():
        return fresh(**probe)[0]


def test_zero3_lora_export_reproduces_engine_weights_in_plain_diffusers(zero3_offload_run, plain_outputs):
    o = plain_outputs
    assert (o["diffusers_lora_only"] - o["base"]).abs().max() > 1e-4, "the LoRA did not change the output"
    engine = _engine_weights_output(zero3_offload_run, o["probe"])
    torch.testing.assert_close(o["diffusers"], engine, atol=1e-5, rtol=0)


def test_comfyui_copy_gives_the_same_output(plain_outputs):
    o = plain_outputs
    torch.testing.assert_close(o["comfyui_lora_only"], o["diffusers_lora_only"], atol=1e-6, rtol=0)
    torch.testing.assert_close(o["comfyui"], o["diffusers"], atol=1e-6, rtol=0)


def test_comfyui_keys_all_map_back_to_the_diffusers_keys(zero3_offload_run):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    lora_dir = zero3_offload_run / "lora"
    ours = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    comfy, _ = split(load_file(str(lora_dir / "pytorch_lora_weights_comfyui.safetensors")))
    assert all(k.startswith("diffusion_model.") for k in comfy)
    assert not any(".attn1." in k or ".to_q." in k for k in comfy), "diffusers names left in the ComfyUI copy"
    alphas = {k: v.item() for k, v in comfy.items() if k.endswith(".alpha")}
    assert len(alphas) == len(ours) // 2 and set(alphas.values()) == {4.0}
    # diffusers' own converter (original Wan -> diffusers) is the independent oracle for the names;
    # it folds alpha / rank = 4 / 8 into the weights.
    back = _convert_non_diffusers_wan_lora_to_diffusers(dict(comfy))
    assert set(back) == set(ours)
    for k, v in back.items():  # diffusers folds alpha / rank (0.5) into lora_A
        torch.testing.assert_close(v, ours[k] * (0.5 if ".lora_A." in k else 1.0), atol=0, rtol=0)


def test_comfyui_file_carries_the_trained_modules_as_differences(zero3_offload_run):
    """Every module trained in full is in the ComfyUI file as `.diff` / `.diff_b` = trained - base,
    under the name ComfyUI patches (diffusers' Wan conversion maps it back)."""
    from e2v.models.tiny import build_tiny_parts

    lora_dir = zero3_offload_run / "lora"
    trained = load_file(str(lora_dir / "e2v_modules.safetensors"))
    _, diffs = split(load_file(str(lora_dir / "pytorch_lora_weights_comfyui.safetensors")))
    base = dict(build_tiny_parts(seed=0, with_encoders=False).transformer.named_parameters())  # the run's base
    names = {k: diffusers_name(k, base) for k in diffs}
    assert sorted(names.values()) == sorted(trained), "one difference per trained module, nothing else"
    assert {"diffusion_model.patch_embedding.diff", "diffusion_model.patch_embedding.diff_b",
            "diffusion_model.head.modulation.diff", "diffusion_model.blocks.0.modulation.diff",
            "diffusion_model.text_embedding.0.diff_b", "diffusion_model.img_emb.proj.0.diff"} <= set(diffs)
    for key, name in names.items():
        assert torch.equal(diffs[key], trained[name] - base[name].detach()), key
    assert any(d.abs().max() > 0 for d in diffs.values())


def test_comfyui_modules_copy_maps_back_through_diffusers_conversion(zero3_offload_run):
    lora_dir = zero3_offload_run / "lora"
    ours = load_file(str(lora_dir / "e2v_modules.safetensors"))
    comfy = load_file(str(lora_dir / "e2v_modules_comfyui.safetensors"))
    assert {"diffusion_model.patch_embedding.weight", "diffusion_model.head.modulation",
            "diffusion_model.img_emb.proj.0.weight", "diffusion_model.time_projection.1.weight"} <= set(comfy)
    back = _from_original_wan(comfy)
    assert set(back) == set(ours)
    for k, v in back.items():
        assert torch.equal(v, ours[k]), k


def test_export_tool_rebuilds_the_same_files_offline(zero3_offload_run, tmp_path, monkeypatch):
    """tools/export_lora.py's main() in this process: from the checkpoint folder alone."""
    from tools.export_lora import main

    ckpt = zero3_offload_run / "checkpoints" / "latest"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["export_lora.py", str(ckpt), "--out", str(tmp_path)])
    main()
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors",
                 "e2v_modules.safetensors", "e2v_modules_comfyui.safetensors"):
        a, b = load_file(str(tmp_path / name)), load_file(str(zero3_offload_run / "lora" / name))
        assert a.keys() == b.keys(), name
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    assert json.loads((tmp_path / "e2v_model.json").read_text()) == \
        json.loads((zero3_offload_run / "lora/e2v_model.json").read_text())
