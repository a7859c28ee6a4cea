"""What ComfyUI users get: the export names the trained tensors a stock ComfyUI LoRA load drops
(the modulation tables) and is silent when none trains; the single-file transformer under Wan's
original names (a full fine-tune's, a LoRA run's with the LoRA fused) converts back through
diffusers' own single-file conversion (the independent key map) to the fused transformer bit for
bit. With a ComfyUI checkout ($E2V_COMFYUI) its own loaders are the oracle: the single file loads
to the fused weights, and its LoRA load leaves exactly the named tensors unapplied.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_comfy_checkpoint.py."""

import json

import pytest
from helpers_comfy import TABLES, _assert_same, _back_to_diffusers, _diffusers_fused

from e2v.train.export import (
    COMFY_CHECKPOINT_FILE,
    MODEL_FILE,
)

pytestmark = pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run` (tests/conftest.py)


def test_shared_run_names_the_tables_and_writes_the_fused_file(zero3_offload_run):
    """The session's 2-process ZeRO-3 run (the tiny LoRA recipe trains the tables; its settings
    ask for the single file): the gathered, fused transformer is the diffusers one."""
    lora_dir = zero3_offload_run / "lora"
    assert json.loads((lora_dir / MODEL_FILE).read_text())["comfyui_lora_not_applied"] == TABLES
    _assert_same(_back_to_diffusers(lora_dir / COMFY_CHECKPOINT_FILE), _diffusers_fused(lora_dir))
