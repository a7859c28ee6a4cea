"""The export check of the smoke run: the live engine's output on a fixed input, captured at the end
of training (train_e2v.py run through a wrapper that calls the transformer just before
export.export_lora, as tests/launch/test_resume_runs.py does), against the run's `lora/` export reloaded into a
fresh transformer read from the base folder the plain diffusers way: expand_from_export (the
recorded shape), e2v.eval.sampling.load_trained (diffusers' Wan LoRA loader with the adapter metadata,
then export.load_extra_modules for the modules trained in full).

Both sides run in bf16 as the trainer sets them up: the transformer read with torch_dtype bf16
(diffusers keeps its fp32 modules in fp32; the engine restores those after DeepSpeed's cast,
e2v/models/precision.py), the trained values the bf16 rounding of the fp32 masters the export writes (the
modules trained in full keep the bf16 dtype expansion gave them). A blanket `.to(bf16)` of the
reload would instead round the frozen fp32 modules and move the output by about one bf16 ulp.
The control is the untrained expanded base on the same input: the export must be far closer to the
engine than the base is, or the check could not tell a lost LoRA from a loaded one."""

from __future__ import annotations

from pathlib import Path

import torch

WRAPPER = r"""
import runpy, sys, torch
sys.path.insert(0, {root!r})
from e2v.train import export

real_export = export.export_lora

def export_after_probe(transformer, out_dir, full_names, rank=0, **options):
    probe = torch.load({probe!r})
    dtype = transformer.patch_embedding.weight.dtype
    probe = {{k: v.to(dtype) if k != "timestep" else v for k, v in probe.items()}}
    with torch.no_grad():
        out = transformer(**probe, return_dict=False)[0]
    if rank == 0:
        torch.save(out, {out!r})
    return real_export(transformer, out_dir, full_names, rank=rank, **options)

export.export_lora = export_after_probe
runpy.run_path({train!r}, run_name="__main__")
"""


def make_probe(path: Path, latent_thw: tuple[int, int, int], text_dim: int = 4096, clip_tokens: int = 3 * 257,
               clip_dim: int = 1280) -> Path:
    """A fixed transformer input of the run's latent shape: 36 channels (16 noisy + 4 mask + 16
    condition), 512 text tokens, three CLIP references."""
    g = torch.Generator().manual_seed(0)
    probe = dict(hidden_states=torch.randn(1, 36, *latent_thw, generator=g), timestep=torch.tensor([700.0]),
                 encoder_hidden_states=torch.randn(1, 512, text_dim, generator=g),
                 encoder_hidden_states_image=torch.randn(1, clip_tokens, clip_dim, generator=g))
    torch.save(probe, path)
    return path


def write_wrapper(path: Path, root: Path, probe: Path, out: Path) -> Path:
    path.write_text(WRAPPER.format(root=str(root), probe=str(probe), out=str(out), train=str(root / "train_e2v.py")))
    return path


def check_export(t2v_folder: Path, lora_dir: Path, probe_path: Path, engine_out_path: Path) -> dict:
    """Reload the export into a fresh transformer from the T2V folder and compare on the probe."""
    from diffusers import WanTransformer3DModel

    from e2v.eval.sampling import load_trained
    from e2v.models.expand import expand_from_export

    dtype = torch.bfloat16
    probe = {k: v.to(dtype) if k != "timestep" else v for k, v in torch.load(probe_path).items()}
    engine = torch.load(engine_out_path).float()
    t2v = WanTransformer3DModel.from_pretrained(str(t2v_folder), subfolder="transformer", torch_dtype=dtype)
    model = expand_from_export(t2v, lora_dir)
    with torch.no_grad():
        base = model(**probe, return_dict=False)[0].float()
        model = load_trained(model, lora_dir)
        exported = model(**probe, return_dict=False)[0].float()
    scale = engine.abs().max().item()
    diff, control = (exported - engine).abs().max().item(), (base - engine).abs().max().item()
    # bf16 keeps 8 significant bits: one ulp at the output's largest magnitude is 2^-7 of it (at
    # most). The two sides run the same modules on the same bf16 weights; measured here they differ
    # by at most one such ulp, so the tolerance is one ulp of the largest output.
    tolerance = 2**-7 * scale
    return {"max_abs_output": scale, "export_vs_engine": diff, "untrained_vs_engine": control,
            "tolerance": tolerance, "passed": diff <= tolerance and control > 10 * max(diff, tolerance / 10)}
