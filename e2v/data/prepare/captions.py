"""Captions: a sidecar the source already has (VIDEO.txt beside it, or a row of a CSV / JSONL table
in the input folder), else a local vision-language model through transformers
(AutoModelForImageTextToText, e.g. a Qwen2.5-VL checkpoint, from a folder or hub id) asked the
config's prompt about frames of the clip, else the words of the source file's name.

Legend: frames_FHW3 uint8 RGB frames of one clip.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np

from .config import Captions


def load_table(input_dir: Path, cfg: Captions) -> dict[str, str]:
    """Source file name (relative to the input folder, or bare) -> caption, from captions.table."""
    if not cfg.table:
        return {}
    path = input_dir / cfg.table
    if not path.exists():
        raise FileNotFoundError(f"captions.table: {path} does not exist; fix the path or set captions.table: null")
    if path.suffix.lower() == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    out = {}
    for i, row in enumerate(rows):
        if cfg.file_column not in row or cfg.caption_column not in row:
            raise ValueError(f"{path} row {i + 1}: needs the columns '{cfg.file_column}' and '{cfg.caption_column}' "
                             "(captions.file_column / captions.caption_column)")
        out[str(row[cfg.file_column])] = str(row[cfg.caption_column]).strip()
    return out


def sidecar(video: Path, input_dir: Path, table: dict[str, str]) -> str | None:
    txt = video.with_suffix(".txt")
    if txt.exists():
        text = txt.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            return text
    rel = str(video.relative_to(input_dir))
    return table.get(rel) or table.get(video.name) or None


def filename_words(video: Path) -> str:
    """'My holiday_clip-03.mp4' -> 'My holiday clip 03'."""
    return re.sub(r"[\W_]+", " ", video.stem).strip() or "a video"


class ModelCaptioner:
    """One AutoModelForImageTextToText and its processor, loaded once per run; captions a clip from
    cfg.num_images evenly spaced frames with the config's prompt (greedy decoding)."""

    def __init__(self, cfg: Captions, device: str = "cpu"):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.cfg, self.device = cfg, device
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=dtype).to(device).eval()
        self.name = str(cfg.model)

    def __call__(self, frames_FHW3: np.ndarray) -> str:
        import torch
        from PIL import Image

        pick = np.linspace(0, len(frames_FHW3) - 1, self.cfg.num_images).round().astype(int)
        images = [Image.fromarray(frames_FHW3[i]) for i in pick]
        messages = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                                 {"type": "text", "text": self.cfg.prompt}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=images, return_tensors="pt").to(self.device)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.cfg.max_new_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        return self.processor.batch_decode(new, skip_special_tokens=True)[0].strip()
