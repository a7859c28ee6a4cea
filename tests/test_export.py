"""Exports of a 2-process ZeRO-3 + CPU-offload run (fp32): the diffusers LoRA loads in a plain
diffusers pipeline in a process that never imports DeepSpeed and reproduces the weights the
engine trained (read back from the DeepSpeed checkpoint with DeepSpeed's own zero_to_fp32); the
ComfyUI file (LoRA, plus the fully-trained modules as `.diff` differences from the base weights)
holds only keys ComfyUI's LoRA loader takes, maps back through diffusers' own Wan conversions and,
applied as ComfyUI applies it, gives the same output, also for a LoRA outside the blocks; modules
the base lacks stay full weights; exported files get the umask's permissions; tools/export_lora.py
rebuilds the same files offline from the checkpoint folder; a full fine-tune exports a bf16
diffusers model that keeps diffusers' fp32 modules in fp32."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers_comfy import diffusers_name, split
from safetensors.torch import load_file

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


def _from_original_wan(state: dict) -> dict:
    """diffusers' own original-Wan -> diffusers weight conversion (what its single-file loader runs)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    assert all(k.startswith("diffusion_model.") for k in state)
    return convert_wan_transformer_to_diffusers({k.removeprefix("diffusion_model."): v for k, v in state.items()})


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
