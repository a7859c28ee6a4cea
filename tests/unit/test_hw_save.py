"""The streamed safetensors writer (e2v/runtime/stream_safetensors.py) against safetensors' own
reader and writer, and the base-module save that uses it: the same file as a whole-dict save,
with never more than one gathered tensor alive on the writing rank."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from e2v.runtime.stream_safetensors import StreamedSafetensors

ROOT = Path(__file__).resolve().parents[2]


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w.bf16": torch.randn(3, 5, generator=g).bfloat16(), "b.f32": torch.randn(7, generator=g),
            "scalar": torch.tensor(2.5), "idx": torch.arange(6).view(2, 3), "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4), "half": torch.randn(2, 2, generator=g).half(),
            "strided": torch.randn(4, 6, generator=g).t()}  # not contiguous: written in its logical order


def test_streamed_file_reads_back_like_save_file(tmp_path):
    tensors = _mixed()
    with StreamedSafetensors(tmp_path / "s.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
                             metadata={"format": "pt"}) as out:
        for k, v in tensors.items():
            out.write(k, v)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"),
              metadata={"format": "pt"})
    ours, ref = load_file(str(tmp_path / "s.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert ours.keys() == ref.keys() == tensors.keys()
    for k in tensors:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_out_of_order_or_missing_tensors_are_errors(tmp_path):
    layout = {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}
    with pytest.raises(ValueError, match="expected a"):
        with StreamedSafetensors(tmp_path / "x.safetensors", layout) as out:
            out.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="expected b torch.float32 \\(3,\\)"):
        with StreamedSafetensors(tmp_path / "y.safetensors", layout) as out:
            out.write("a", torch.zeros(2))
            out.write("b", torch.zeros(4))
    with pytest.raises(ValueError, match="1 tensors never written, first b"):
        with StreamedSafetensors(tmp_path / "z.safetensors", layout) as out:
            out.write("a", torch.zeros(2))


def test_base_modules_stream_one_tensor_at_a_time(tmp_path, monkeypatch):
    """configs/e2v_tiny_lora.yaml's modules trained in full: the file holds exactly their fp32
    values (the oracle: the module's own parameters), and while it is written no more than one
    gathered copy is alive at a time (the whole-dict save held all of them)."""
    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.train import export

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    full_names = setup_training(model, cfg, expanded=False)
    assert len(full_names) > 3
    alive, most = [], [0]
    real = export._full_fp32

    def counted(param, keep=True):
        most[0] = max(most[0], sum(r() is not None for r in alive) + 1)
        value = real(param, keep)
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(export, "_full_fp32", counted)
    path = export.save_base_modules(model, full_names, tmp_path)
    assert most[0] == 1, f"{most[0]} gathered tensors alive at once"
    saved, named = load_file(str(path)), dict(model.named_parameters())
    assert sorted(saved) == sorted(n.replace(".base_layer", "") for n in full_names)
    for n in full_names:
        assert torch.equal(saved[n.replace(".base_layer", "")], named[n].detach().float()), n


@pytest.mark.parametrize("max_shard_bytes", [10**10, 40_000])
def test_full_export_streams_what_save_pretrained_writes(tmp_path, max_shard_bytes):
    """A full fine-tune's export, streamed, against the whole-dict path it replaces (save_full:
    diffusers' save_pretrained and the ComfyUI file): diffusers loads the same weights in the same
    dtypes from both, sharded with an index or in one file, and the ComfyUI files hold the same
    tensors under the same names."""
    from diffusers import WanTransformer3DModel

    from e2v.models.tiny import build_tiny_parts
    from e2v.train.export import COMFY_CHECKPOINT_FILE, FULL_DIR, export_dtype, export_full, save_full

    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    export_full(model, tmp_path / "ours" / FULL_DIR, max_shard_bytes=max_shard_bytes)
    state = {n: p.detach().float().to(export_dtype(n)) for n, p in model.named_parameters()}
    save_full(state, dict(model.config), tmp_path / "ref" / FULL_DIR)
    files = sorted(p.name for p in (tmp_path / "ours" / FULL_DIR).iterdir())
    if max_shard_bytes < 10**10:
        assert "diffusion_pytorch_model.safetensors.index.json" in files and len(files) > 3, files
    else:
        assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    ours = WanTransformer3DModel.from_pretrained(tmp_path / "ours" / FULL_DIR).state_dict()
    ref = WanTransformer3DModel.from_pretrained(tmp_path / "ref" / FULL_DIR).state_dict()
    assert ours.keys() == ref.keys()
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k
    a, b = (load_file(str(tmp_path / d / COMFY_CHECKPOINT_FILE)) for d in ("ours", "ref"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)


def test_lora_export_streams_the_modules_trained_in_full(tmp_path, monkeypatch):
    """export_lora of a 'trained' tiny LoRA run (configs/e2v_tiny_lora.yaml: LoRA plus modules in
    full) writes the same files as the whole-dict path (trained_state then write_lora_exports
    given dicts, whose files tests/unit/test_export.py and test_comfy_checkpoint.py check against
    the trained and base weights), while no more than one gathered module tensor is alive."""
    import json

    from e2v.config.load import load_config
    from e2v.models.tiny import build_tiny_parts
    from e2v.models.trainable import setup_training
    from e2v.train import export

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False)
    model = build_tiny_parts(seed=0, with_encoders=False).transformer
    full_names = setup_training(model, cfg, expanded=False)
    export.save_base_modules(model, full_names, tmp_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    named = dict(model.named_parameters())
    full_ids = {id(named[n]) for n in full_names}
    alive, most = [], [0]
    real = export._full_fp32

    def counted(param, keep=True):
        value = real(param, keep)
        if id(param) in full_ids:
            most[0] = max(most[0], sum(r() is not None for r in alive) + 1)
            alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(export, "_full_fp32", counted)
    export.export_lora(model, tmp_path / "lora", full_names)
    assert most[0] == 1 and len(alive) == len(full_names)
    monkeypatch.undo()

    lora, extra = export.trained_state(model, full_names)
    export.write_lora_exports(tmp_path / "oracle", lora, extra, export.export_meta(model),
                              base=export.read_base(tmp_path / export.BASE_FILE))
    files = sorted(p.name for p in (tmp_path / "oracle").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "lora").iterdir())
    assert {export.COMFY_FILE, export.EXTRA_FILE, export.COMFY_EXTRA_FILE} <= set(files)
    for f in files:
        if f.endswith(".json"):
            assert json.loads((tmp_path / "lora" / f).read_text()) == json.loads((tmp_path / "oracle" / f).read_text())
            continue
        ours, want = load_file(str(tmp_path / "lora" / f)), load_file(str(tmp_path / "oracle" / f))
        assert ours.keys() == want.keys(), f
        assert all(ours[k].dtype == want[k].dtype and torch.equal(ours[k], want[k]) for k in want), f
