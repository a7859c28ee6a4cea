"""ComfyUI for tests: its own code from a checkout when $E2V_COMFYUI names one (comfyui_or_skip),
and, for the tests that run everywhere, its LoRA loader emulated: its key map accepts, for every model
weight `diffusion_model.<name>.weight`, the key `diffusion_model.<name>` and, for every other model
tensor, its full key; `<key>.diff` is added to that tensor, `<key>.diff_b` to the bias of the same
module; LoRA keys (`.lora_A.weight`, `.lora_B.weight`, `.alpha`) are LoRA. Which diffusers
parameter a Wan key is, diffusers' own single-file conversion decides (the independent oracle)."""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import load_file

from e2v.train.export import (
    LORA_FILE,
    export_dtype,
    load_extra_modules,
)

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".alpha")


def split(comfy: dict) -> tuple[dict, dict]:
    """(LoRA keys, `.diff` / `.diff_b` keys); anything else is a key ComfyUI would not load."""
    lora = {k: v for k, v in comfy.items() if k.endswith(LORA_SUFFIXES)}
    diffs = {k: v for k, v in comfy.items() if k.endswith((".diff", ".diff_b"))}
    odd = set(comfy) - set(lora) - set(diffs)
    assert not odd, f"keys ComfyUI's LoRA loader would not load: {sorted(odd)[:5]}"
    return lora, diffs


def diffusers_name(diff_key: str, params: dict) -> str:
    """The diffusers parameter a ComfyUI `.diff` / `.diff_b` key patches, or KeyError."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    assert diff_key.startswith("diffusion_model."), diff_key
    stem = diff_key.removeprefix("diffusion_model.")
    if stem.endswith(".diff_b"):
        candidates = [stem.removesuffix(".diff_b") + ".bias"]
    else:
        stem = stem.removesuffix(".diff")
        candidates = [stem + ".weight", stem]  # a module's weight, else a tensor named in full
    for wan_key in candidates:
        (name,) = convert_wan_transformer_to_diffusers({wan_key: torch.zeros(1)})
        if name in params:
            return name
    raise KeyError(f"{diff_key}: no model tensor ComfyUI would patch")


def apply_diffs(transformer: torch.nn.Module, diffs: dict) -> list[str]:
    """Add each difference to the tensor ComfyUI would patch (the weight under a peft wrapper lives
    at `<module>.base_layer`). Returns the diffusers names patched."""
    params = {n.replace(".base_layer", ""): p for n, p in transformer.named_parameters()}
    done = []
    with torch.no_grad():
        for key, diff in diffs.items():
            name = diffusers_name(key, params)
            assert params[name].shape == diff.shape, key
            params[name].add_(diff.to(params[name].dtype))
            done.append(name)
    return done


# --- ComfyUI's own code, where a checkout is available ------------------------------------------

COMFYUI_ENV = "E2V_COMFYUI"  # a ComfyUI checkout (its root folder); the tests that use it skip without


def comfyui_or_skip():
    """ComfyUI's modules `comfy.sd` and `comfy.utils`, imported on CPU from the checkout named by
    $E2V_COMFYUI, or pytest.skip naming the variable. ComfyUI imports torchvision at module level
    for models these tests never build: where torchvision is not installed an empty stand-in
    package takes its place (any attribute is a placeholder class)."""
    import importlib.abc
    import importlib.machinery
    import os
    import sys
    import types
    from pathlib import Path

    import pytest

    root = os.environ.get(COMFYUI_ENV)
    if not root or not (Path(root) / "comfy/sd.py").is_file():
        pytest.skip(f"no ComfyUI checkout: set {COMFYUI_ENV} to one (git clone https://github.com/Comfy-Org/ComfyUI)")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        class Stub(types.ModuleType):
            __path__: list = []

            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return type(name, (), {"__init__": lambda self, *a, **k: None})

        class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name == "torchvision" or name.startswith("torchvision."):
                    return importlib.machinery.ModuleSpec(name, self, is_package=True)
                return None

            def create_module(self, spec):
                return Stub(spec.name)

            def exec_module(self, module):
                pass

        stub = StubFinder()
        sys.meta_path.append(stub)
    else:
        stub = None
    argv, sys.argv = sys.argv, sys.argv[:1]  # ComfyUI parses the command line at import
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        import comfy.sd
        import comfy.utils
    finally:
        sys.argv = argv
        if stub is not None:  # for ComfyUI's import only: transformers and diffusers must not see it
            sys.meta_path.remove(stub)
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    return comfy.sd, comfy.utils

TABLES = ["blocks.0.scale_shift_table", "blocks.1.scale_shift_table", "scale_shift_table"]


def _base(shape: dict | None) -> WanTransformer3DModel:
    from e2v.models.tiny import build_tiny_parts

    if shape is None:
        return build_tiny_parts(seed=0, with_encoders=False).transformer
    torch.manual_seed(0)
    return WanTransformer3DModel(**shape)


def _diffusers_fused(lora_dir, shape: dict | None = None, cast: bool = True) -> dict:
    """The oracle: a fresh base with the exported LoRA and modules loaded the plain diffusers way
    (from the files), the LoRA fused by diffusers, in the export dtypes (`cast`) or fp32."""
    model = _base(shape)
    model.load_lora_adapter(str(lora_dir), weight_name=LORA_FILE, prefix="transformer")
    assert load_extra_modules(model, lora_dir)
    model.fuse_lora()
    model.unload_lora()
    return {k: v.to(export_dtype(k)) if cast else v for k, v in model.state_dict().items()}


def _back_to_diffusers(path) -> dict:
    """The single file through diffusers' own conversion of original Wan checkpoints."""
    return convert_wan_transformer_to_diffusers(dict(load_file(str(path))))


def _assert_same(got: dict, want: dict):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, differ[:5]
