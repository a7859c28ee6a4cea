"""Exports of a 2-process ZeRO-3 + CPU-offload run (fp32): the diffusers LoRA loads in a plain
diffusers pipeline in a process that never imports DeepSpeed and reproduces the weights the
engine trained (read back from the DeepSpeed checkpoint with DeepSpeed's own zero_to_fp32); the
ComfyUI file (LoRA, plus the fully-trained modules as `.diff` differences from the base weights)
holds only keys ComfyUI's LoRA loader takes, maps back through diffusers' own Wan conversions and,
applied as ComfyUI applies it, gives the same output, also for a LoRA outside the blocks; modules
the base lacks stay full weights; exported files get the umask's permissions; tools/export_lora.py
rebuilds the same files offline from the checkpoint folder; a full fine-tune exports a bf16
diffusers model that keeps diffusers' fp32 modules in fp32.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_export_runs.py."""

import sys

import pytest
import torch
from helpers import ROOT
from helpers_comfy import split
from helpers_export import _from_original_wan
from safetensors.torch import load_file


def _tiny_lora_run(tmp_path, exclude=()):
    """A tiny LoRA model set up like a run (e2v_tiny_lora: LoRA plus modules in full), its base modules
    saved, then 'trained' (every trainable tensor moved)."""
    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.train.export import export_meta, save_base_modules, trained_state

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    full_names = setup_training(model, cfg, expanded=False)
    save_base_modules(model, full_names, tmp_path, exclude=list(exclude))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    lora, extra = trained_state(model, full_names)
    return lora, extra, export_meta(model)


def test_modules_the_base_lacks_stay_full_weights(tmp_path, capsys):
    """An expanded T2V base: the widened patch embedding cannot be a difference."""
    from e2v.train.export import BASE_FILE, COMFY_EXTRA_FILE, COMFY_FILE, read_base, write_lora_exports

    lora, extra, meta = _tiny_lora_run(tmp_path, exclude=[r"^patch_embedding\."])
    write_lora_exports(tmp_path / "lora", lora, extra, meta, base=read_base(tmp_path / BASE_FILE))
    _, diffs = split(load_file(str(tmp_path / "lora" / COMFY_FILE)))
    assert not any("patch_embedding" in k for k in diffs) and "diffusion_model.head.head.diff" in diffs
    assert "diffusion_model.patch_embedding.weight" in load_file(str(tmp_path / "lora" / COMFY_EXTRA_FILE))
    assert "2 trained tensors the base model lacks (e.g. patch_embedding.bias)" in capsys.readouterr().out


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_exported_files_get_the_umask_permissions(tmp_path, umask):
    """safetensors creates its files 0600; the exports must read like the run's other files."""
    import os
    import stat

    from e2v.train.export import BASE_FILE, read_base, write_lora_exports

    lora, extra, meta = _tiny_lora_run(tmp_path)
    old = os.umask(umask)
    try:
        write_lora_exports(tmp_path / "lora", lora, extra, meta, base=read_base(tmp_path / BASE_FILE))
        (tmp_path / "other").write_text("")  # a file the run writes with open()
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "lora").iterdir()}
    want = stat.S_IMODE((tmp_path / "other").stat().st_mode)
    assert want == 0o666 & ~umask
    assert len(modes) == 5 and modes == dict.fromkeys(modes, want), modes


def test_every_transformer_parameter_has_an_original_wan_name():
    """All parameters of an I2V-layout transformer (norms, modulation, image embedder included):
    our diffusers -> Wan table, then diffusers' Wan -> diffusers conversion, is the identity."""
    from e2v.models.tiny import build_tiny_parts
    from e2v.train.comfy import wan_original_key

    names = [n for n, _ in build_tiny_parts(seed=0, with_encoders=False).transformer.named_parameters()]
    original = {f"diffusion_model.{wan_original_key(n)}": n for n in names}
    assert len(original) == len(names)
    assert {"diffusion_model.blocks.0.norm3.weight",
            "diffusion_model.blocks.0.cross_attn.norm_k_img.weight"} <= set(original)
    back = _from_original_wan(dict(original))
    assert back == {n: n for n in names}


def test_lora_outside_the_blocks_loads_from_the_comfyui_copy():
    """A LoRA on proj_out and time_proj too (alpha != rank): diffusers' converter rejects `.alpha`
    there, so the ComfyUI copy folds it; loaded in diffusers it gives the peft model's output."""
    from diffusers.loaders import WanLoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from e2v.models.tiny import build_tiny_parts
    from e2v.train.comfy import check_comfy_mappable, comfy_lora, lora_module_names

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    model.add_adapter(LoraConfig(r=8, lora_alpha=4, target_modules=["to_q", "ffn.net.2", "proj_out", "time_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)  # peft starts B at zero: no effect to compare otherwise
    targets = lora_module_names(model)
    assert {"proj_out", "condition_embedder.time_proj", "blocks.1.attn2.to_q"} <= set(targets)
    check_comfy_mappable(targets)
    comfy = comfy_lora(get_peft_model_state_dict(model), alpha=4)
    assert "diffusion_model.head.head.alpha" not in comfy and "diffusion_model.blocks.0.ffn.2.alpha" in comfy
    fresh = build_tiny_parts(seed=0, with_encoders=False).transformer
    state = WanLoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in comfy.items()})
    fresh.load_lora_adapter(state, prefix="transformer")
    probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8), timestep=torch.tensor([700.0]),
                 encoder_hidden_states=torch.randn(1, 512, 32), encoder_hidden_states_image=torch.randn(1, 51, 32),
                 return_dict=False)
    with torch.no_grad():
        ours, loaded = model(**probe)[0], fresh(**probe)[0]
        model.disable_adapters()
        base = model(**probe)[0]
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(loaded, ours, atol=1e-6, rtol=0)


@pytest.mark.parametrize("targets, culprit", [(["to_q", "patch_embedding"], "patch_embedding"),
                                              (["add_k_proj"], "blocks.0.attn2.add_k_proj"),
                                              (["proj_out"], "proj_out")])
def test_lora_the_comfyui_copy_cannot_carry_fails_at_setup(targets, culprit):
    """Conv3d patch embedding: no converter entry; k_img without v_img: diffusers converts them only
    as a pair; no block at all: the converter needs blocks."""
    from peft import LoraConfig

    from e2v.models.tiny import build_tiny_parts
    from e2v.train.comfy import check_comfy_mappable, lora_module_names

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets))
    with pytest.raises(ValueError, match=rf"lora\.target_modules: .*'{culprit}'.*would not load in diffusers"):
        check_comfy_mappable(lora_module_names(model))


def test_full_finetune_exports_bf16_and_keeps_diffusers_fp32_modules(tmp_path):
    from diffusers import WanTransformer3DModel

    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.train.export import export_lora

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", ["model.training_type=full"], check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    full_names = setup_training(model, cfg, expanded=False)
    with torch.no_grad():
        model.patch_embedding.weight.add_(0.25)  # "trained"
        model.scale_shift_table.add_(1e-4)  # below bf16 resolution near 1: lost if rounded to bf16
    out = export_lora(model, tmp_path, full_names)
    assert out == tmp_path / "transformer"
    saved = {}
    for f in out.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    named = dict(model.named_parameters())
    assert set(saved) == set(named)
    # Oracle for what stays fp32: diffusers' own bf16 loading of the fp32 model.
    model.save_pretrained(str(tmp_path / "fp32"))
    bf16 = WanTransformer3DModel.from_pretrained(str(tmp_path / "fp32"), torch_dtype=torch.bfloat16)
    want = {n: p.dtype for n, p in bf16.named_parameters()}
    assert torch.float32 in want.values() and torch.bfloat16 in want.values()
    for name, p in named.items():
        assert saved[name].dtype == want[name], name
        assert torch.equal(saved[name], p.detach().to(want[name])), name
    loaded = WanTransformer3DModel.from_pretrained(str(out), torch_dtype=torch.float32)
    probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8), timestep=torch.tensor([700.0]),
                 encoder_hidden_states=torch.randn(1, 512, 32), encoder_hidden_states_image=torch.randn(1, 51, 32),
                 return_dict=False)
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(p.to(want[name]).float())
        torch.testing.assert_close(loaded(**probe)[0], model(**probe)[0], atol=1e-6, rtol=0)


def test_unmappable_lora_still_exports_for_diffusers_and_skips_only_the_comfyui_copy(tmp_path, capsys):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from e2v.models.tiny import build_tiny_parts
    from e2v.train.export import COMFY_FILE, write_lora_exports

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "patch_embedding"]))
    meta = {"lora": model.peft_config["default"].to_dict(), "transformer_config": dict(model.config)}
    write_lora_exports(tmp_path, get_peft_model_state_dict(model), {}, meta)
    assert (tmp_path / "pytorch_lora_weights.safetensors").exists() and not (tmp_path / COMFY_FILE).exists()
    assert f"no {COMFY_FILE}: lora.target_modules" in capsys.readouterr().out


def test_unmappable_lora_target_is_named_at_start(demo_data, capsys, monkeypatch):
    """Said before training (here: the dry run), not discovered at the export after it."""
    import train_e2v

    monkeypatch.setattr(sys, "argv", ["train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml", "--dry_run",
                                      "--set", f"data.datasets.0.data_root={demo_data}",
                                      "--set", "lora.target_modules=[to_q,to_k,patch_embedding]"])
    train_e2v.main()
    out = capsys.readouterr().out
    assert "[e2v] note: lora.target_modules:" in out and "'patch_embedding'" in out
    assert "The export will skip pytorch_lora_weights_comfyui.safetensors" in out
