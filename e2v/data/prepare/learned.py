"""The learned backend: transformers' Sam3Model finds each element by its text prompt on every
track frame (the highest-scoring instance per frame), from a local folder or hub id (e.g. the
facebook/sam3 checkpoint). The subject and objects are cut from the chosen frames with these
masks; the background is the outside-window frame the foreground covers least, with every
foreground mask removed and filled (e2v.data.prepare.fill).

Pre- and post-processing are Sam3Processor's, written out here so that torchvision (which
transformers' Sam3 image processor imports) is not needed: resize to the model's square input,
scale to [0, 1], normalise with the checkpoint's preprocessor_config.json mean / std; an instance's
score is sigmoid(logit) x sigmoid(presence logit); its mask is the sigmoid of the mask logits,
resized bilinearly to the frame and cut at 0.5.

Not done here: following a mask through the shot with a tracker (Sam3TrackerModel /
Sam2VideoModel); every frame is detected on its own, which costs one forward per frame and
element. Quality with real weights was not measured in this repository.

Legend: B frames in a batch, Q queries, F track frames, H/W target height/width; frames_FHW3 uint8,
pixels_B3SS float (S the model's input side), masks_FHW bool, scores_F float.
"""

from __future__ import annotations

import json

import numpy as np

from .config import Elements
from .fill import fill_background, foreground_share
from .masks import ShotMasks

TEXT_LEN = 32  # Sam3's text encoder positions (its CLIP text config's max_position_embeddings)


def _preprocessor(model_id: str) -> dict:
    from transformers.utils import cached_file

    path = cached_file(model_id, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    return json.loads(open(path, encoding="utf-8").read()) if path else {}


class LearnedBackend:
    name = "learned"

    def __init__(self, cfg: Elements, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer, Sam3Model

        self.cfg, self.device, self.torch = cfg, device, torch
        self.model = Sam3Model.from_pretrained(cfg.sam_model).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.sam_model)
        pre = _preprocessor(cfg.sam_model)
        side = self.model.config.vision_config.backbone_config.image_size
        size = pre.get("size") or {"height": side, "width": side}
        self.input_hw = (int(size["height"]), int(size["width"]))
        self.mean = torch.tensor(pre.get("image_mean", [0.5, 0.5, 0.5])).view(1, 3, 1, 1)
        self.std = torch.tensor(pre.get("image_std", [0.5, 0.5, 0.5])).view(1, 3, 1, 1)
        self.prompts = {it.name: it.prompt or it.name for it in cfg.items}
        self.model_name = str(cfg.sam_model)

    def detect(self, frames_FHW3: np.ndarray, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """The best instance of `prompt` on every frame: (masks_FHW, scores_F)."""
        torch = self.torch
        text = self.tokenizer([prompt], padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="pt")
        h, w = frames_FHW3.shape[1:3]
        masks, scores = [], []
        for i in range(0, len(frames_FHW3), self.cfg.sam_batch):
            u8_BHW3 = torch.from_numpy(np.ascontiguousarray(frames_FHW3[i:i + self.cfg.sam_batch]))
            x_B3SS = torch.nn.functional.interpolate(u8_BHW3.permute(0, 3, 1, 2).float() / 255, size=self.input_hw,
                                                     mode="bilinear", align_corners=False, antialias=True)
            x_B3SS = ((x_B3SS - self.mean) / self.std).to(self.device)
            b = len(x_B3SS)
            with torch.no_grad():
                out = self.model(pixel_values=x_B3SS, input_ids=text["input_ids"].repeat(b, 1).to(self.device),
                                 attention_mask=text["attention_mask"].repeat(b, 1).to(self.device))
            score_BQ = out.pred_logits.float().sigmoid()
            if getattr(out, "presence_logits", None) is not None:
                score_BQ = score_BQ * out.presence_logits.float().sigmoid()
            best_B = score_BQ.argmax(dim=1)
            logits_B1hw = out.pred_masks.float()[torch.arange(b), best_B][:, None]
            mask_BHW = torch.nn.functional.interpolate(logits_B1hw, size=(h, w), mode="bilinear",
                                                       align_corners=False)[:, 0].sigmoid() > 0.5
            masks.append(mask_BHW.cpu().numpy())
            scores.append(score_BQ[torch.arange(b), best_B].cpu().numpy())
        return np.concatenate(masks), np.concatenate(scores).astype(np.float32)

    def analyse(self, frames_FHW3: np.ndarray, subject: str, objects: list[str]) -> ShotMasks:
        out = ShotMasks(subject=subject, backend=self.name, models=[self.model_name])
        for name in [subject, *objects]:
            out.masks[name], out.scores[name] = self.detect(frames_FHW3, self.prompts[name])
        return out

    def background(self, frames_FHW3: np.ndarray, shot: ShotMasks, positions: list[int]) -> tuple[np.ndarray, float]:
        """The frame at `positions` the foreground covers least, its foreground filled; and that share."""
        fg_FHW = shot.foreground()
        shares = [foreground_share(fg_FHW[p]) for p in positions]
        best = positions[int(np.argmin(shares))]
        return fill_background(frames_FHW3[best], fg_FHW[best]), float(min(shares))
