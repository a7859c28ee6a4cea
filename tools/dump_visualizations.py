"""Render the latents a run saved (`visualization` processor `latent_save`) into pictures, later.

    python tools/dump_visualizations.py --config runs/<run>/config.yaml runs/<run>/visualizations [--every 4]

Each argument is a step folder (`step_000100/`) or a folder of them. For every step folder it
writes into `<step>/render/`:
    <data>_grid.png       one row per sample, every n-th decoded frame (input, noisy, predicted,
                          conditioned latents; the condition's 4 mask channels are dropped)
    <data>_sample<i>.mp4  each decoded video
    contact_sheet.png     references | target frames | predicted frames (when those were saved;
                          the frames of the config's visualization.sheet_frames, as the run drew it)
The VAE comes from the run's config (the tiny preset is rebuilt in code; real weights load from
`model.pretrained`'s vae/ folder), so only the VAE is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

if __name__ == "__main__" and not __package__:  # started as a file: is the package installed? (tools/_installed.py)
    import _installed  # noqa: F401

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.models.weights import require_weights

# torch and the VAE's stages (diffusers) are imported where they are used, after the config and the
# weights are checked: --help and a config error answer in a second.

LATENT_DATA = ("input_latents", "noisy_latents", "predicted_latents", "conditioned_latents")


def load_saved(step_dir: Path) -> dict:
    """name -> tensor, from <name>.pt files or one latents.safetensors."""
    import torch

    saved = {p.stem: torch.load(p, weights_only=True) for p in sorted(step_dir.glob("*.pt"))}
    st = step_dir / "latents.safetensors"
    if st.exists():
        from safetensors.torch import load_file

        saved.update(load_file(str(st)))
    return saved


def step_dirs(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        if not p.is_dir():
            raise SystemExit(f"{p}: not a folder (give a step_NNNNNN folder or the visualizations folder)")
        out += [p] if p.name.startswith("step_") else sorted(q for q in p.glob("step_*") if q.is_dir())
    if not out:
        raise SystemExit(f"no step_* folders under {', '.join(map(str, paths))}")
    return out


def render(step_dir: Path, vae, every: int, fps: int, sheet_frames: list[int], clean_prefix: bool = False
           ) -> list[Path]:
    """clean_prefix: the run's conditioned_latents are reference frames, each decoded alone."""
    from e2v.eval.viz import decode_pixels, frame_strip, labelled_sheet, to_uint8, vstack, write_mp4, write_png

    saved = load_saved(step_dir)
    out_dir = step_dir / "render"
    out_dir.mkdir(exist_ok=True)
    written, videos = [], {}
    for name in LATENT_DATA:
        if name not in saved:
            continue
        alone = clean_prefix and name == "conditioned_latents"
        video = to_uint8(decode_pixels(saved[name][:, -vae.config.z_dim:], vae, alone).transpose(1, 2))  # [B,F,H,W,3]
        videos[name] = video
        write_png(out_dir / f"{name}_grid.png", vstack([frame_strip([], v, every) for v in video]))
        written.append(out_dir / f"{name}_grid.png")
        for i, v in enumerate(video):
            write_mp4(out_dir / f"{name}_sample{i}.mp4", v, fps=fps)
            written.append(out_dir / f"{name}_sample{i}.mp4")
    if "input_latents" in videos and "predicted_latents" in videos:
        refs = saved.get("reference_images")
        tiles = [[] for _ in videos["input_latents"]] if refs is None else [list(to_uint8(r)) for r in refs]
        meta_file = step_dir / "meta.json"  # the dump's ids and sigmas label the rows
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        sheet = labelled_sheet(tiles, videos["input_latents"], videos["predicted_latents"], sheet_frames, meta)
        write_png(out_dir / "contact_sheet.png", sheet)
        written.append(out_dir / "contact_sheet.png")
    return written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path, help="step folders, or folders of them")
    p.add_argument("--config", required=True, help="the run's config.yaml (for the VAE)")
    p.add_argument("--every", type=int, default=4, help="grid: every n-th frame (and the last)")
    p.add_argument("--fps", type=int, default=16)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, check_paths=False)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    require_weights(cfg)  # the VAE is model.pretrained's: one line when it is not here
    from e2v.models.load import load_vae

    vae = load_vae(cfg, "cpu")
    for d in step_dirs(args.paths):
        files = render(d, vae, args.every, args.fps, cfg.visualization.sheet_frames,
                       cfg.conditioning.target_layout == "clean_prefix")
        print(f"[dump] {d}: {len(files)} file(s) in {d / 'render'}")


if __name__ == "__main__":
    main()
