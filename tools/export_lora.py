"""Convert a DeepSpeed checkpoint folder of a run into the files the run exports at its end, offline:
no GPU, no process group, no training data (the checkpoint carries e2v_export.json).

    python tools/export_lora.py runs/<run_id>/checkpoints/step_000500 --out exported/
    python tools/export_lora.py runs/<run_id>/checkpoints/latest --out exported/

LoRA runs: pytorch_lora_weights.safetensors (diffusers, with adapter metadata),
pytorch_lora_weights_comfyui.safetensors (original Wan names, `diffusion_model.` prefix; the
modules trained in full as `.diff` differences from the base weights in the checkpoint's
e2v_base_modules.safetensors), e2v_modules.safetensors (modules trained in full), e2v_modules_comfyui.safetensors (the same
under original Wan names) and e2v_model.json. Full fine-tunes: transformer/ (bf16, and fp32 for
the modules diffusers keeps in fp32; save_pretrained). A causal run (task: causal) also gets
e2v_causvid.pt, the whole transformer in CausVid's generator layout (a LoRA run's LoRA fused into
the base its run folder's config.yaml loads). Works for any ZeRO stage (DeepSpeed's
zero_to_fp32). `--ema`: the same files from the checkpoint's EMA weights (ema.safetensors, a run
with train.ema_weight; what the run writes as lora_ema/). The checkpoint's files must match the
sizes and SHA-256 in its COMPLETE manifest, and are read as data only (a file that would run code
is refused).
"""

from __future__ import annotations

import argparse
from pathlib import Path

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder (step_NNNNNN), or the run's checkpoints/latest file")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--ema", action="store_true",
                   help="export the checkpoint's EMA weights (train.ema_weight) instead of its trained ones")
    args = p.parse_args()
    path = Path(args.checkpoint)
    if not path.exists():  # before torch's import: a wrong path answers at once
        raise SystemExit(f"[export] {path} does not exist: give a checkpoint folder (runs/<run>/checkpoints/step_N) "
                         "or the run's checkpoints/latest file")
    # The base weights are not read: the checkpoint holds what trained, the base modules' copies
    # (e2v_base_modules.safetensors) and the transformer's config, so no model folder is needed;
    # except for a causal LoRA run's e2v_causvid.pt, the LoRA fused into its base (model.pretrained).
    from e2v.runtime.integrity import UnsafeCheckpoint
    from e2v.train.checkpoint import export_checkpoint, read_latest

    if path.is_file() and path.name == "latest":
        path, why = read_latest(path.parent)
        if path is None:
            raise SystemExit(f"[export] {why}: name a checkpoint folder instead")
    try:
        out = export_checkpoint(path, Path(args.out), ema=args.ema)
    except (UnsafeCheckpoint, FileNotFoundError) as e:
        raise SystemExit(f"[export] {e}")
    print(f"[export] {path} -> {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")


if __name__ == "__main__":
    main()
