"""What ComfyUI users get: the export names the trained tensors a stock ComfyUI LoRA load drops
(the modulation tables) and is silent when none trains; the single-file transformer under Wan's
original names (a full fine-tune's, a LoRA run's with the LoRA fused) converts back through
diffusers' own single-file conversion (the independent key map) to the fused transformer bit for
bit. With a ComfyUI checkout ($E2V_COMFYUI) its own loaders are the oracle: the single file loads
to the fused weights, and its LoRA load leaves exactly the named tensors unapplied.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_comfy_checkpoint_runs.py."""

import json

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from helpers import ROOT
from helpers_comfy import TABLES, _assert_same, _back_to_diffusers, _base, _diffusers_fused, comfyui_or_skip
from safetensors.torch import load_file

from e2v.train.export import (
    BASE_FILE,
    COMFY_CHECKPOINT_FILE,
    COMFY_FILE,
    FULL_DIR,
    MODEL_FILE,
    export_dtype,
    export_meta,
    fused_state,
    read_base,
    save_base_modules,
    save_comfy_checkpoint,
    save_full,
    trained_state,
    write_lora_exports,
)

# A shape ComfyUI's Wan detection reads (it takes 128-wide heads, a 256-wide time embedding, UMT5's
# 4096-wide text and CLIP's 1280-wide image features as given), small enough for a CPU test.
COMFY_SHAPE = dict(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, in_channels=36,
                   out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, image_dim=1280, added_kv_proj_dim=128)


def _lora_run(tmp_path, trainable: list[str], shape: dict | None = None):
    """The tiny LoRA recipe on a base (the tiny preset, or `shape`) with `trainable` in full, its
    base modules saved, every trained tensor moved, exported to tmp_path/lora."""
    from e2v.config.load import load_config
    from e2v.models.trainable import setup_training

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"train.trainable={json.dumps(trainable)}"],
                      check_paths=False)
    model = _base(shape)
    full_names = setup_training(model, cfg, expanded=False)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_base_modules(model, full_names, tmp_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    lora, extra = trained_state(model, full_names)
    meta = export_meta(model)
    write_lora_exports(tmp_path / "lora", lora, extra, meta, base=read_base(tmp_path / BASE_FILE))
    return model, lora, extra, meta


def test_export_names_the_tables_comfyui_drops_and_is_silent_without(tmp_path, capsys):
    _lora_run(tmp_path / "with", ["patch_embedding", "proj_out", "scale_shift_table"])
    out = capsys.readouterr().out
    shape = json.loads((tmp_path / "with/lora" / MODEL_FILE).read_text())
    assert shape["comfyui_lora_not_applied"] == TABLES
    assert f"a stock ComfyUI LoRA load does not apply 3 trained tensor(s): {', '.join(TABLES)}" in out
    assert COMFY_CHECKPOINT_FILE in out and "train.export_comfyui_checkpoint" in shape["comfyui_note"]
    assert "diffusion_model.head.modulation.diff" in load_file(str(tmp_path / "with/lora" / COMFY_FILE))

    _lora_run(tmp_path / "without", ["patch_embedding", "proj_out"])
    assert "ComfyUI" not in capsys.readouterr().out
    assert "comfyui_lora_not_applied" not in json.loads((tmp_path / "without/lora" / MODEL_FILE).read_text())


def test_lora_runs_single_file_converts_back_to_the_fused_transformer(tmp_path):
    model, lora, extra, meta = _lora_run(tmp_path, ["patch_embedding", "condition_embedder", "proj_out",
                                                    "scale_shift_table"])
    path = save_comfy_checkpoint(fused_state(model, lora, extra, meta), tmp_path / COMFY_CHECKPOINT_FILE)
    keys = set(load_file(str(path)))
    assert {"blocks.0.self_attn.q.weight", "blocks.1.modulation", "head.modulation", "head.head.weight",
            "img_emb.proj.1.weight", "blocks.0.cross_attn.k_img.weight", "blocks.0.norm3.weight"} <= keys
    assert not any(k.startswith("diffusion_model.") or "lora" in k for k in keys)
    _assert_same(_back_to_diffusers(path), _diffusers_fused(tmp_path / "lora"))


def test_full_fine_tune_writes_the_single_file_beside_the_diffusers_folder(tmp_path):
    model = _base(None)
    with torch.no_grad():
        model.scale_shift_table.add_(1.0)
    state = {k: v.to(export_dtype(k)) for k, v in model.state_dict().items()}
    save_full(state, dict(model.config), tmp_path / FULL_DIR)
    reloaded = WanTransformer3DModel.from_pretrained(str(tmp_path / FULL_DIR), torch_dtype=torch.bfloat16).state_dict()
    _assert_same(_back_to_diffusers(tmp_path / COMFY_CHECKPOINT_FILE), reloaded)


def _comfy_weights(patcher) -> dict:
    """A ComfyUI model's weights in diffusers names (diffusers' conversion), fp32."""
    state = {k: v.float() for k, v in patcher.model.diffusion_model.state_dict().items()}
    return convert_wan_transformer_to_diffusers(state)


def test_comfyui_loads_the_single_file_to_the_fused_weights_and_drops_only_the_named_tables(tmp_path, capsys):
    sd, _ = comfyui_or_skip()
    base = _base(COMFY_SHAPE).state_dict()  # fp32: the LoRA route below is compared in fp32
    model, lora, extra, meta = _lora_run(tmp_path, ["patch_embedding", "condition_embedder", "proj_out",
                                                    "scale_shift_table"], shape=COMFY_SHAPE)
    named = json.loads((tmp_path / "lora" / MODEL_FILE).read_text())["comfyui_lora_not_applied"]
    assert named == TABLES
    fused = fused_state(model, lora, extra, meta)
    path = save_comfy_checkpoint(fused, tmp_path / COMFY_CHECKPOINT_FILE)

    loaded = _comfy_weights(sd.load_diffusion_model_state_dict(load_file(str(path))))
    assert loaded.keys() == fused.keys()
    worst = max((loaded[k] - fused[k].float()).abs().max().item() for k in fused)
    print(f"ComfyUI's load of the single file vs the fused diffusers weights: max |diff| {worst:.3g}")
    assert worst <= 1e-6

    # The LoRA route: ComfyUI's LoRA loader on the fp32 base, its patches applied as sampling applies
    # them, against the fp32 fused model: every patch lands (to fp32 rounding) except the named tables.
    patcher = sd.load_diffusion_model_state_dict(save_and_load(base, tmp_path / "base.safetensors"))
    patched, _ = sd.load_lora_for_models(patcher, None, load_file(str(tmp_path / "lora" / COMFY_FILE)), 1.0, 0)
    patched.patch_model()
    got, want = _comfy_weights(patched), _diffusers_fused(tmp_path / "lora", COMFY_SHAPE, cast=False)
    off = {k: (got[k] - want[k]).abs().max().item() for k in want}
    dropped = sorted(k for k, d in off.items() if d > 1e-5)
    applied = max(d for k, d in off.items() if k not in dropped)
    print(f"ComfyUI's LoRA load: {dropped} off by up to {max(off.values()):.3g}, the rest by at most {applied:.3g}")
    assert dropped == named, "the export must name exactly the tensors ComfyUI's LoRA load leaves out"


def save_and_load(state: dict, path) -> dict:
    return load_file(str(save_comfy_checkpoint(state, path)))
