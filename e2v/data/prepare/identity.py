"""The identity check: does a reference show the element its clip shows? A reference cut from the
wrong shot (a missed cut), from another person crossing the frame, or from a patch of background
teaches the model to ignore its references; nothing downstream can tell.

The reference's masked cut-out is compared with the same element, masked, on up to
CHECK_FRAMES frames of the clip's window; the score is the median similarity. Two measures:

- statistic (no weights): a colour and texture signature of the masked pixels, an HS histogram
  (8 x 4 bins), a value histogram (8) and a gradient-orientation histogram weighted by magnitude
  (8), compared by histogram intersection (1: the same distributions, 0: disjoint);
- model (identity.model set): the cosine similarity of an image embedding from a local vision
  model (a CLIP or SigLIP folder: get_image_features; any other AutoModel: its pooled output), the
  masked crop on grey at the model's input size.

A reference below the threshold is replaced by the next-best frame that passes; when none
passes the sample is dropped, counted (clips_dropped_identity) and named in its video's reasons.

Legend: H/W frame height/width; frame_HW3 uint8 RGB, mask_HW bool; signatures / embeddings 1-D.
"""

from __future__ import annotations

import cv2
import numpy as np

from .masks import bbox

CHECK_FRAMES = 4  # window frames the reference is compared with: enough for a median, cheap


def signature(frame_HW3: np.ndarray, mask_HW: np.ndarray) -> np.ndarray:
    """The statistic's colour and texture histograms of the masked pixels, each summing to 1/3."""
    hsv = cv2.cvtColor(np.ascontiguousarray(frame_HW3), cv2.COLOR_RGB2HSV)
    m = mask_HW.astype(np.uint8)
    hs = cv2.calcHist([hsv], [0, 1], m, [8, 4], [0, 180, 0, 256]).ravel()
    v = cv2.calcHist([hsv], [2], m, [8], [0, 256]).ravel()
    grey = cv2.cvtColor(np.ascontiguousarray(frame_HW3), cv2.COLOR_RGB2GRAY).astype(np.float32)
    gx, gy = cv2.Sobel(grey, cv2.CV_32F, 1, 0), cv2.Sobel(grey, cv2.CV_32F, 0, 1)
    inner = cv2.erode(m, np.ones((3, 3), np.uint8)).astype(bool)  # the outline's gradient is the surround's
    angle = (np.arctan2(gy, gx)[inner] % np.pi) / np.pi
    grad = np.histogram(angle, bins=8, range=(0, 1), weights=np.hypot(gx, gy)[inner])[0]
    parts = [hs, v, grad.astype(np.float32)]
    return np.concatenate([p / max(float(p.sum()), 1e-9) / 3 for p in parts])


class StatisticIdentity:
    name = "statistic"
    describe = staticmethod(signature)

    @staticmethod
    def compare(sa: np.ndarray, sb: np.ndarray) -> float:
        return float(np.minimum(sa, sb).sum())

    def similarity(self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
        return self.compare(self.describe(*a), self.describe(*b))


class ModelIdentity:
    """Cosine similarity of a local vision model's image embeddings (see the module docstring)."""

    def __init__(self, model_id: str, device: str = "cpu"):
        import json
        from pathlib import Path

        import torch
        from transformers import AutoModel

        self.torch, self.device, self.name = torch, device, f"model:{model_id}"
        self.model = AutoModel.from_pretrained(model_id).to(device).eval()
        vision = getattr(self.model.config, "vision_config", self.model.config)
        self.side = int(vision.image_size)
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # CLIP's
        pre = Path(model_id) / "preprocessor_config.json"
        if pre.exists():
            d = json.loads(pre.read_text())
            mean, std = d.get("image_mean", mean), d.get("image_std", std)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)

    def embed(self, frame_HW3: np.ndarray, mask_HW: np.ndarray) -> np.ndarray:
        torch = self.torch
        y0, y1, x0, x1 = bbox(mask_HW)
        crop = frame_HW3[y0:y1, x0:x1].copy()
        crop[~mask_HW[y0:y1, x0:x1]] = 128  # the surround is not the element
        x = cv2.resize(crop, (self.side, self.side), interpolation=cv2.INTER_AREA)
        x_13SS = (torch.from_numpy(x).permute(2, 0, 1)[None].float() / 255 - self.mean) / self.std
        with torch.no_grad():
            x_13SS = x_13SS.to(self.device, self.model.dtype)
            if hasattr(self.model, "get_image_features"):
                e = self.model.get_image_features(pixel_values=x_13SS)
                e = getattr(e, "pooler_output", e)
            else:
                out = self.model(pixel_values=x_13SS)
                e = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state[:, 0]
        return e.float().reshape(-1).cpu().numpy()

    def describe(self, frame_HW3: np.ndarray, mask_HW: np.ndarray) -> np.ndarray:
        return self.embed(frame_HW3, mask_HW)

    @staticmethod
    def compare(ea: np.ndarray, eb: np.ndarray) -> float:
        return float(ea @ eb / max(float(np.linalg.norm(ea) * np.linalg.norm(eb)), 1e-9))

    def similarity(self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
        return self.compare(self.embed(*a), self.embed(*b))


def make_identity(cfg, device: str = "cpu"):
    """(measure, threshold) from the prepare config's identity block; (None, 0) when it is off."""
    if not cfg.check:
        return None, 0.0
    if cfg.model:
        return ModelIdentity(cfg.model, device), cfg.model_threshold
    return StatisticIdentity(), cfg.statistic_threshold


def window_score(measure, frames_FHW3: np.ndarray, masks_FHW: np.ndarray, window: tuple[int, int],
                 reference: tuple[np.ndarray, np.ndarray], min_pixels: int = 16) -> float | None:
    """The median similarity of the reference to the element on up to CHECK_FRAMES evenly spaced
    window frames that show it; None when no window frame shows it."""
    shown = [p for p in range(*window) if masks_FHW[p].sum() >= min_pixels]
    if not shown:
        return None
    pick = [shown[i] for i in np.unique(np.linspace(0, len(shown) - 1, min(CHECK_FRAMES, len(shown))).round().astype(int))]
    ref = measure.describe(*reference)  # once, not once per window frame (a model forward each)
    return float(np.median([measure.compare(ref, measure.describe(frames_FHW3[p], masks_FHW[p])) for p in pick]))
