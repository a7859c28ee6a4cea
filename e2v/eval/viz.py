"""Seeing what the model learns: the seed `visualization` block, image strips for TensorBoard,
contact sheets (references | target | prediction), PNG / mp4 writers.

At every `visualization.frequency`-th step, rank 0 takes the first micro-batch's tensors:
    input_latents        x0, the clean target latents            [B,16,T,h,w]
    noisy_latents        x_t fed to the model                    [B,16,T,h,w]
    conditioned_latents  the VAE condition cat([mask4, lat16])   [B,20,T,h,w]
                         (clean_prefix: the reference frames     [B,C,N,h,w], each decoded alone)
    predicted_latents    the model's x0 estimate x_t - sigma * v [B,16,T,h,w]
    reference_images     VAE-path references, position order     [B,N,3,H,W] in [-1,1] (zero-padded to N;
                         all zero, i.e. blank grey tiles, where reference dropout removed them)
and runs the configured processors: `latent_save` (.pt or .safetensors) and `vae_decode` (PNG of
the chosen `frames` per sample, plus an mp4 with `video: true`). It also writes
`contact_sheet.png` and the same image to TensorBoard (`viz/contact_sheet`), and `meta.json`
with the ids, sigmas, and what the model was given: the prompts (empty where caption dropout
replaced them), the reference names, and the `ref_dropped` / `caption_dropped` flags. Other
steps cost nothing. VAE decodes run on the training thread (the Wan VAE keeps its causal cache on
the module, so it cannot decode while the loop encodes); file writing goes to a background
thread, and a failed write raises at the next dump (or at `close`), naming the file.

Legend: B batch, N references, C channels, T latent frames, h/w latent size, F pixel frames,
H/W pixels.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from e2v.conditioning.encode import decode_latents
from e2v.data.dataset import load_element_inputs
from e2v.models.load import load_vae
from e2v.train.flow import x0_from_velocity

GAP = 2  # white pixels between tiles


# --- pixels -> images ----------------------------------------------------------------------------


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """[-1,1] float [..., 3, H, W] -> uint8 [..., H, W, 3]."""
    x = ((pixels.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.movedim(-3, -1).cpu().numpy()


@torch.no_grad()
def decode_pixels(latents_BCTHW: torch.Tensor, vae, frames_alone: bool = False) -> torch.Tensor:
    """Normalised latents (the VAE's channels) -> pixels [B,3,F,H,W] in [-1,1] on the VAE's device.
    frames_alone: each latent frame decoded as an image of its own -> [B,3,T,H,W] (the clean_prefix
    layout's reference frames: each is one image's latent, not a frame of a clip)."""
    if not frames_alone:
        return decode_latents(latents_BCTHW, vae).clamp(-1, 1)
    b, c, t, h, w = latents_BCTHW.shape
    images = decode_latents(latents_BCTHW.transpose(1, 2).reshape(b * t, c, 1, h, w), vae).clamp(-1, 1)
    return images.view(b, t, *images.shape[1:2], *images.shape[3:]).transpose(1, 2)


def hstack(tiles: list[np.ndarray]) -> np.ndarray:
    """Tiles of one height side by side, white gaps between (taller tiles are cut, shorter padded)."""
    h = max(t.shape[0] for t in tiles)
    out = []
    for i, t in enumerate(tiles):
        if t.shape[0] < h:
            t = np.concatenate([t, np.full((h - t.shape[0], *t.shape[1:]), 255, np.uint8)])
        out.append(t)
        if i < len(tiles) - 1:
            out.append(np.full((h, GAP, 3), 255, np.uint8))
    return np.concatenate(out, axis=1)


def vstack(rows: list[np.ndarray]) -> np.ndarray:
    w = max(r.shape[1] for r in rows)
    padded = [np.concatenate([r, np.full((r.shape[0], w - r.shape[1], 3), 255, np.uint8)], 1) for r in rows]
    gaps = [np.full((GAP, w, 3), 255, np.uint8)] * len(rows)
    return np.concatenate([x for pair in zip(padded, gaps) for x in pair][:-1], axis=0)


def strip_frames(num_frames: int, every: int = 4) -> list[int]:
    """The frames frame_strip shows: every `every`-th, and the last."""
    frames = list(range(0, num_frames, every))
    return frames + [num_frames - 1] if (num_frames - 1) % every else frames


def frame_strip(refs: list[np.ndarray], video_FHWC: np.ndarray, every: int = 4) -> np.ndarray:
    """references | every `every`-th frame of a generated video (uint8 HWC), one row."""
    return hstack(list(refs) + [video_FHWC[f] for f in strip_frames(len(video_FHWC), every)])


def contact_sheet(refs_BNHWC: list[list[np.ndarray]], target_BFHWC: np.ndarray, pred_BFHWC: np.ndarray,
                  frames: list[int]) -> np.ndarray:
    """One row per sample: its references | target frames | predicted frames (uint8 HWC)."""
    rows = []
    for refs, target, pred in zip(refs_BNHWC, target_BFHWC, pred_BFHWC):
        rows.append(hstack(list(refs) + [target[f] for f in frames] + [pred[f] for f in frames]))
    return vstack(rows)


LABEL_BAND, LABEL_MARGIN = 14, 96  # px above the sheet (column headers) and left of it (row labels)


def label_sheet(sheet_HWC: np.ndarray, tile_w: int, headers: list[str], row_labels: list[str],
                row_h: int) -> np.ndarray:
    """The sheet with a header band (one label per tile column: which is a reference, the target,
    the prediction, and the frame) and a left margin naming each row (its sigma and sample), in
    Pillow's built-in font, so a sheet reads without its meta.json. The body keeps its pixels at
    an offset of (LABEL_BAND, LABEL_MARGIN)."""
    from PIL import Image, ImageDraw

    char_w = 6
    h, w = sheet_HWC.shape[:2]
    out = Image.new("RGB", (w + LABEL_MARGIN, h + LABEL_BAND), "white")
    out.paste(Image.fromarray(sheet_HWC), (LABEL_MARGIN, LABEL_BAND))
    draw = ImageDraw.Draw(out)
    for i, text in enumerate(headers):
        draw.text((LABEL_MARGIN + i * (tile_w + GAP) + 1, 1), text[: max(1, (tile_w + GAP) // char_w)], fill="black")
    for i, text in enumerate(row_labels):
        draw.text((2, LABEL_BAND + i * (row_h + GAP) + max(0, row_h // 2 - 5)), text[: LABEL_MARGIN // char_w - 1],
                  fill="black")
    return np.asarray(out)


def tile_spans(widths: list[int], labels: list[str], x0: int = 0) -> list[tuple[int, int, str]]:
    """(x, width, label) of each tile of an hstack row starting at x0."""
    spans, x = [], x0
    for w, text in zip(widths, labels):
        spans.append((x, w, text))
        x += w + GAP
    return spans


def label_rows(rows_HWC: list[np.ndarray], lines: list[list[list[tuple[int, int, str]]]]) -> np.ndarray:
    """Rows stacked (vstack), each under a band of text lines; `lines[i]` is row i's lines, each a
    list of (x, width, text) spans, the text cut to its span. For sheets whose rows differ (a
    sample without an object has a reference tile fewer), where one header for all rows would
    name the wrong tile."""
    from PIL import Image, ImageDraw

    char_w = 6  # Pillow's built-in font
    out = []
    for row, row_lines in zip(rows_HWC, lines):
        band = Image.new("RGB", (row.shape[1], LABEL_BAND * len(row_lines)), "white")
        draw = ImageDraw.Draw(band)
        for i, spans in enumerate(row_lines):
            for x, w, text in spans:
                draw.text((x + 1, i * LABEL_BAND + 1), text[: max(1, (w + GAP) // char_w)], fill="black")
        out.append(np.concatenate([np.asarray(band), row]))
    return vstack(out)


def labelled_sheet(ref_tiles: list[list[np.ndarray]], target_BFHWC: np.ndarray, pred_BFHWC: np.ndarray,
                   frames: list[int], meta: dict) -> np.ndarray:
    """contact_sheet with its labels from the dump's meta.json: the references by element name
    (of the first row), target / prediction with the frame, and each row's sigma and sample id.
    The one sheet of a dump, online (Visualizer) and offline (tools/dump_visualizations.py)."""
    body = contact_sheet(ref_tiles, target_BFHWC, pred_BFHWC, frames)
    n_refs = len(ref_tiles[0]) if ref_tiles else 0
    names = list((meta.get("references") or [[]])[0])[:n_refs]
    names += [f"ref {i + 1}" for i in range(len(names), n_refs)]
    rows = [f"s={float(np.ravel(sig)[0]):.2f} {sid}" for sid, sig in zip(meta.get("ids", []), meta.get("sigmas", []))]
    headers = sheet_labels(names, frames, target_BFHWC.shape[1])
    return label_sheet(body, target_BFHWC.shape[3], headers, rows, target_BFHWC.shape[2])


def sheet_labels(ref_names: list[str], frames: list[int], num_frames: int) -> list[str]:
    """Column headers of contact_sheet: the references by element name, then target and
    prediction at each of `frames` (negative indices counted from the end)."""
    shown = [f % num_frames for f in frames]
    return list(ref_names) + [f"target f{f}" for f in shown] + [f"pred f{f}" for f in shown]


def write_png(path: Path, image_HWC: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(image_HWC).save(path)


def write_mp4(path: Path, video_FHWC: np.ndarray, fps: int = 16) -> None:
    """H.264 via imageio-ffmpeg; sizes that are not a multiple of 16 are kept (no silent resize)."""
    import imageio.v2 as imageio

    imageio.mimwrite(str(path), list(video_FHWC), fps=fps, codec="libx264", macro_block_size=1, quality=8)


# --- the training-time dumper --------------------------------------------------------------------


def reference_pixels(batch: dict, kept: list[list[str]] | None, dropped: list[bool] | None = None,
                     cfg=None) -> torch.Tensor | None:
    """[B,N,3,H,W] VAE-path references each sample was conditioned on (position order), zero-padded.
    A sample whose references were dropped (reference dropout: zero condition) gets blank tiles,
    as many as it had: the sheet shows what the model saw, and keeps its layout. A batch from the
    cache holds no pixels: its element files are read again (`cfg` needed)."""
    refs = batch.get("vae_refs") or [load_element_inputs(cfg, files, *size)["vae_refs"]
                                     for files, size in zip(batch["element_files"], batch["size"])]
    rows = [[refs[i][k] for k in (kept[i] if kept else []) if k in refs[i]] for i in range(len(refs))]
    rows = [[torch.zeros_like(r) for r in row] if dropped and dropped[i] else row for i, row in enumerate(rows)]
    n = max((len(r) for r in rows), default=0)
    if n == 0:
        return None
    like = next(r[0] for r in rows if r)
    return torch.stack([torch.stack(r + [torch.zeros_like(like)] * (n - len(r))) for r in rows])


class Visualizer:
    """`maybe_dump` writes the configured files at every `frequency`-th step (once per step, on
    rank 0). `close` waits for the background writes."""

    def __init__(self, cfg, run_dir: Path, vae, *, rank: int = 0, tb=None, device="cpu"):
        """`vae` None (a run from the cache): the VAE is loaded onto `device` for each dump."""
        self.cfg, self.vae, self.rank, self.tb, self.device = cfg, vae, rank, tb, device
        vis = cfg.visualization
        out = Path(vis.output_dir.format(run_id=Path(run_dir).name))
        self.out = out if out.is_absolute() else Path(run_dir) / out
        self.enabled = vis.enabled and rank == 0
        self.last_step = -1
        self.pool = ThreadPoolExecutor(max_workers=1) if self.enabled else None
        self.pending: list[tuple[Path, object]] = []  # (file, future) of writes not yet checked

    def due(self, step: int) -> bool:
        return self.enabled and step != self.last_step and step % self.cfg.visualization.frequency == 0

    def maybe_dump(self, step: int, batch: dict, c, noisy_BCTHW: torch.Tensor, model_pred: torch.Tensor,
                   sigma_B: torch.Tensor) -> None:
        """model_pred is the velocity (flow objective) or already the x0 estimate (x0 objective)."""
        if not self.due(step):
            return
        self.last_step = step
        self._check(wait=False)
        pred_x0 = model_pred if self.cfg.flow.objective == "x0" else x0_from_velocity(noisy_BCTHW, model_pred, sigma_B)
        tensors = {"input_latents": c.latents_BCTHW, "noisy_latents": noisy_BCTHW,
                   "conditioned_latents": c.cond_BCTHW if c.cond_BCTHW is not None else c.ref_latents_BCNhw,
                   "predicted_latents": pred_x0,
                   "reference_images": reference_pixels(batch, c.kept, c.ref_dropped, self.cfg)}
        tensors = {k: v.detach().float().cpu().clone() for k, v in tensors.items() if v is not None}
        folder = self.out / f"step_{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        b = len(batch["id"])
        ref_dropped = [bool(x) for x in (c.ref_dropped or [False] * b)]
        caption_dropped = [bool(x) for x in (c.caption_dropped or [False] * b)]
        meta = {"step": step, "ids": list(batch["id"]), "sigmas": sigma_B.tolist(),
                # what the model was given: batch_conditions swaps a dropped caption for ""
                "prompts": ["" if d else p for p, d in zip(batch["prompt"], caption_dropped)],
                "caption_dropped": caption_dropped,
                "references": [[] if d else list(k) for k, d in zip(c.kept or [[]] * b, ref_dropped)],
                "ref_dropped": ref_dropped,
                "shapes": {k: list(v.shape) for k, v in tensors.items()}}
        self._write(folder / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2)))
        self.meta = meta  # the sheet's labels
        decoded = {}
        loaded = self.vae is None  # a run from the cache: the VAE only for this dump (0.5 GB for Wan's)
        if loaded:
            self.vae = load_vae(self.cfg, self.device)
        try:
            for proc in self.cfg.visualization.processors:
                PROCESSORS[proc.type](self, proc, tensors, decoded, folder)
            sheet = self.sheet(tensors, decoded)
        finally:
            if loaded:
                self.vae = None
        self._write(folder / "contact_sheet.png", lambda p: write_png(p, sheet))
        if self.tb is not None:
            self.tb.add_image("viz/contact_sheet", sheet, step, dataformats="HWC")

    def pixels(self, name: str, tensors: dict, decoded: dict) -> torch.Tensor:
        """[B,3,F,H,W] in [-1,1] for a data name, decoded once per step."""
        if name not in decoded:
            lat = tensors[name]
            alone = name == "conditioned_latents" and self.cfg.conditioning.target_layout == "clean_prefix"
            decoded[name] = decode_pixels(lat[:, -self.vae.config.z_dim:], self.vae, alone)  # cond: drop the mask
        return decoded[name]

    def sheet(self, tensors: dict, decoded: dict) -> np.ndarray:
        frames = self.cfg.visualization.sheet_frames
        target = to_uint8(self.pixels("input_latents", tensors, decoded).transpose(1, 2))  # [B,F,H,W,3]
        pred = to_uint8(self.pixels("predicted_latents", tensors, decoded).transpose(1, 2))
        refs = tensors.get("reference_images")
        ref_tiles = [[] for _ in target] if refs is None else [list(to_uint8(r)) for r in refs]
        return labelled_sheet(ref_tiles, target, pred, frames, self.meta)

    def _write(self, path: Path, fn) -> None:
        self.pending.append((path, self.pool.submit(fn, path)))

    def _check(self, wait: bool) -> None:
        """Forget finished writes and raise the first failure, naming its file (a visualization
        must not vanish silently). wait=False looks only at the writes already done."""
        done, still = [], []
        for item in self.pending:
            (done if wait or item[1].done() else still).append(item)
        self.pending = still
        for path, f in done:
            if f.exception() is not None:  # waits when wait=True
                raise RuntimeError(f"visualization: writing {path} failed: {f.exception()!r}") from f.exception()

    def close(self) -> None:
        """Wait for the writes and stop the writer thread; raise the first failure."""
        if self.pool is None:
            return
        try:
            self._check(wait=True)
        finally:
            self.pool.shutdown()


def _latent_save(vis: Visualizer, proc, tensors: dict, decoded: dict, folder: Path) -> None:
    chosen = {k: tensors[k] for k in proc.data if k in tensors}
    if proc.format == "safetensors":
        from safetensors.torch import save_file

        vis._write(folder / "latents.safetensors", lambda p: save_file({k: v.contiguous() for k, v in chosen.items()}, str(p)))
        return
    for name, t in chosen.items():
        vis._write(folder / f"{name}.pt", lambda p, t=t: torch.save(t, p))


def _vae_decode(vis: Visualizer, proc, tensors: dict, decoded: dict, folder: Path) -> None:
    for name in proc.data:
        if name not in tensors:
            continue
        sub = folder / name
        sub.mkdir(exist_ok=True)
        if name == "reference_images":
            images = to_uint8(tensors[name])  # [B,N,H,W,3]
            for i, row in enumerate(images):
                for j, img in enumerate(row):
                    vis._write(sub / f"sample{i}_ref{j}.png", lambda p, img=img: write_png(p, img))
            continue
        video = to_uint8(vis.pixels(name, tensors, decoded).transpose(1, 2))  # [B,F,H,W,3]
        for i, v in enumerate(video):
            for f in proc.frames:
                vis._write(sub / f"sample{i}_frame{f % len(v):03d}.png", lambda p, img=v[f]: write_png(p, img))
            if proc.video:
                vis._write(sub / f"sample{i}.mp4", lambda p, v=v: write_mp4(p, v))


PROCESSORS = {"latent_save": _latent_save, "vae_decode": _vae_decode}
