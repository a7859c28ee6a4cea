"""The end-of-run lines: every folder a run wrote, with what each holds and the command that
reads it, so nobody has to search the run folder."""

from __future__ import annotations

from pathlib import Path


def output_lines(run_dir: Path, exported: Path, what: str, cfg) -> list[str]:
    """One line per output that exists: the exported LoRA (or model), generated samples,
    visualizations, TensorBoard logs, checkpoints and the resolved config."""
    run_dir = Path(run_dir)
    vis = Path(cfg.visualization.output_dir.format(run_id=run_dir.name))
    vis = vis if vis.is_absolute() else run_dir / vis  # relative to the run folder (schema)
    rows = [
        (Path(exported), f"{what}: {exported} (diffusers load_lora_weights / ComfyUI: docs/outputs.md)"),
        (run_dir / "lora_ema", f"EMA weights: {run_dir / 'lora_ema'} (the same files from the averaged weights, "
                               "train.ema_weight; docs/outputs.md)"),
        (run_dir / "samples", f"samples: {run_dir / 'samples'} (videos and sheets generated at validation)"),
        (vis, f"visualizations: {vis} (contact sheets: references | target | prediction per sigma)"),
        (run_dir / "tb", f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}"),
        (run_dir / "checkpoints", f"checkpoints: {run_dir / 'checkpoints'} (--resume latest; "
                                  "tools/export_lora.py exports any of them)"),
        (run_dir / "config.yaml", f"config: {run_dir / 'config.yaml'} (what trained; tools/sample.py --run "
                                  f"{run_dir} reads it)"),
    ]
    return [line for path, line in rows if path.exists()]
