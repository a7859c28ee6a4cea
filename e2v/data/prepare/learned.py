"""The learned backend: transformers' Sam3Model finds each element by its text prompt (the
highest-scoring instance per frame), from a local folder or hub id (e.g. the facebook/sam3
checkpoint). With a tracker (elements.tracker, tracking.py; on by default) the detector runs on
every elements.detect_every-th track frame only, and each element's best detection in the shot
becomes its mask prompt for the tracker, which follows it forward and backward through every
track frame; an element's score on a frame is then its prompt's detection score x the tracker's
visibility for that frame. Without one, every track frame is detected on its own. The subject and
objects are cut from the chosen frames with these masks; the background is the outside-window
frame the foreground covers least, with every foreground mask removed and filled
(e2v.data.prepare.fill).

Pre- and post-processing are Sam3Processor's (sam_input.py, without torchvision); an instance's
score is sigmoid(logit) x sigmoid(presence logit). Quality with real weights was not measured in
this repository (no weights on the machine it was written on).

Legend: B frames in a batch, Q queries, K detected (key) frames, F track frames, H/W target
height/width; frames_FHW3 uint8, x_B3SS float (S the model's input side), masks_KHW bool,
scores_K float.
"""

from __future__ import annotations

import numpy as np
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD

from .config import Elements, detect_every
from .fill import fill_background, foreground_share
from .masks import ShotMasks
from .sam_input import SamInput, to_frame

TEXT_LEN = 32  # Sam3's text encoder positions (its CLIP text config's max_position_embeddings)


class LearnedBackend:
    name = "learned"

    def __init__(self, cfg: Elements, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer, Sam3Model

        self.cfg, self.device, self.torch = cfg, device, torch
        self.every = detect_every(cfg)
        self.tracker = None
        if cfg.tracker != "none":
            from .tracking import Tracker, check_checkpoint

            key = "elements.tracker_model" if cfg.tracker_model else "elements.sam_model"
            model_id = cfg.tracker_model or cfg.sam_model
            check_checkpoint(cfg.tracker, model_id, key)  # before any weight loads
            self.tracker = Tracker(cfg.tracker, model_id, device)
        self.model = Sam3Model.from_pretrained(cfg.sam_model).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.sam_model)
        side = self.model.config.vision_config.backbone_config.image_size
        self.input = SamInput(cfg.sam_model, side, IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)
        self.prompts = {it.name: it.prompt or it.name for it in cfg.items}
        self.models = [str(cfg.sam_model)] + ([self.tracker.name] if self.tracker else [])

    def detect(self, frames_KHW3: np.ndarray, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """The best instance of `prompt` on every given frame: (masks_KHW, scores_K)."""
        torch = self.torch
        text = self.tokenizer([prompt], padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="pt")
        masks, scores = [], []
        for i in range(0, len(frames_KHW3), self.cfg.sam_batch):
            x_B3SS = self.input.pixels(frames_KHW3[i:i + self.cfg.sam_batch]).to(self.device, self.model.dtype)
            b = len(x_B3SS)
            with torch.no_grad():
                out = self.model(pixel_values=x_B3SS, input_ids=text["input_ids"].repeat(b, 1).to(self.device),
                                 attention_mask=text["attention_mask"].repeat(b, 1).to(self.device))
            score_BQ = out.pred_logits.float().sigmoid()
            if getattr(out, "presence_logits", None) is not None:
                score_BQ = score_BQ * out.presence_logits.float().sigmoid()
            best_B = score_BQ.argmax(dim=1)
            masks.append(to_frame(out.pred_masks[torch.arange(b), best_B][:, None], frames_KHW3.shape[1:3]))
            scores.append(score_BQ[torch.arange(b), best_B].cpu().numpy())
        return np.concatenate(masks), np.concatenate(scores).astype(np.float32)

    def analyse(self, frames_FHW3: np.ndarray, subject: str, objects: list[str]) -> ShotMasks:
        out = ShotMasks(subject=subject, backend=self.name, models=self.models)
        names = [subject, *objects]
        keys = range(0, len(frames_FHW3), self.every)
        found = {name: self.detect(frames_FHW3[::self.every], self.prompts[name]) for name in names}  # a view
        if self.tracker is None:  # keys are every frame
            for name in names:
                out.masks[name], out.scores[name] = found[name]
            return out
        best = {name: int(np.argmax(found[name][1])) for name in names}
        prompts = [(keys[best[name]], found[name][0][best[name]]) for name in names]
        masks_NFHW, presence_NF = self.tracker.track(frames_FHW3, prompts)
        for i, name in enumerate(names):
            out.masks[name] = masks_NFHW[i]
            out.scores[name] = presence_NF[i] * found[name][1][best[name]]
        return out

    def background(self, frames_FHW3: np.ndarray, shot: ShotMasks, positions: list[int]) -> tuple[np.ndarray, float]:
        """The frame at `positions` the foreground covers least, its foreground filled; and that share."""
        fg_FHW = shot.foreground()
        shares = [foreground_share(fg_FHW[p]) for p in positions]
        best = positions[int(np.argmin(shares))]
        return fill_background(frames_FHW3[best], fg_FHW[best]), float(min(shares))
