"""What a SAM model (the Sam3Model detector, the Sam3TrackerVideoModel / Sam2VideoModel trackers)
is fed, written out so that torchvision is not needed: transformers' Sam2 / Sam3 image and video
processors import it, and this project does not install it. Their steps: resize to the model's
square input (bilinear, antialiased), scale to [0, 1], normalise with the checkpoint's
preprocessor_config.json mean / std (the processor class's own defaults when the file is absent);
a mask prompt is resized the same way and cut at 0.5 (Sam3TrackerVideoProcessor's
process_new_mask_for_video_frame).

Legend: F frames, H/W frame height/width, S the model's input side; frames_FHW3 uint8 RGB,
pixels_F3SS float32, mask_HW bool, mask_11SS float32 (0 or 1).
"""

from __future__ import annotations

import json

import numpy as np


def preprocessor_config(model_id: str) -> dict:
    """The checkpoint's preprocessor_config.json (a local folder or hub id), or {} without one."""
    from transformers.utils import cached_file

    path = cached_file(model_id, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    return json.loads(open(path, encoding="utf-8").read()) if path else {}


class SamInput:
    def __init__(self, model_id: str, side: int, mean: list[float], std: list[float]):
        import torch

        pre = preprocessor_config(model_id)
        size = pre.get("size") or {"height": side, "width": side}
        self.input_hw = (int(size["height"]), int(size["width"]))
        self.mean = torch.tensor(pre.get("image_mean", mean), dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(pre.get("image_std", std), dtype=torch.float32).view(1, 3, 1, 1)
        self.torch = torch

    def pixels(self, frames_FHW3: np.ndarray):
        """pixels_F3SS on the CPU."""
        torch = self.torch
        u8_FHW3 = torch.from_numpy(np.ascontiguousarray(frames_FHW3))
        x_F3SS = torch.nn.functional.interpolate(u8_FHW3.permute(0, 3, 1, 2).float() / 255, size=self.input_hw,
                                                 mode="bilinear", align_corners=False, antialias=True)
        return (x_F3SS - self.mean) / self.std

    def mask(self, mask_HW: np.ndarray):
        """mask_11SS: a mask prompt at the model's input size."""
        torch = self.torch
        m_11HW = torch.from_numpy(np.ascontiguousarray(mask_HW))[None, None].float()
        m_11SS = torch.nn.functional.interpolate(m_11HW, size=self.input_hw, mode="bilinear", align_corners=False,
                                                 antialias=True)
        return (m_11SS >= 0.5).float()


def to_frame(logits_N1hw, frame_hw: tuple[int, int]) -> np.ndarray:
    """Mask logits at the model's resolution -> masks_NHW bool at the frame's size: the processors'
    post_process_masks (bilinear resize, logit > 0), in one resize."""
    import torch

    up_N1HW = torch.nn.functional.interpolate(logits_N1hw.float(), size=frame_hw, mode="bilinear", align_corners=False)
    return (up_N1HW[:, 0] > 0).cpu().numpy()
