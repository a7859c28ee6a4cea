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

The detector's image backbone (ViT and FPN neck; at SAM 3's 1008 input a 32-layer, 1024-wide ViT
over 72x72 patches, most of the detector's work beside a 6-layer, 256-wide DETR encoder and 32
text tokens) runs once per batch of key frames, and its features serve every element's prompt:
Sam3Model's own get_vision_features, then one forward per element with vision_embeds, which gives
the same masks and scores as a forward from pixels. Peak memory is one batch's features plus one
prompt's DETR and mask-decoder pass, as when one element was detected from pixels; batching all
prompts into one forward instead would hold every element's decoder pass at once. The text
encoder still runs per element and batch.

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

    def detect(self, frames_KHW3: np.ndarray, prompts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each prompt's best instance on every given frame, in prompt order: [(masks_KHW, scores_K)].
        The image backbone runs once per batch of frames for all prompts (module docstring)."""
        torch = self.torch
        text = self.tokenizer(prompts, padding="max_length", max_length=TEXT_LEN, truncation=True,
                              return_tensors="pt").to(self.device)
        found = [([], []) for _ in prompts]
        for i in range(0, len(frames_KHW3), self.cfg.sam_batch):
            x_B3SS = self.input.pixels(frames_KHW3[i:i + self.cfg.sam_batch]).to(self.device, self.model.dtype)
            b = len(x_B3SS)
            with torch.no_grad():
                vision = self.model.get_vision_features(pixel_values=x_B3SS)
                for p, (masks, scores) in enumerate(found):
                    out = self.model(vision_embeds=vision, input_ids=text["input_ids"][p:p + 1].expand(b, -1),
                                     attention_mask=text["attention_mask"][p:p + 1].expand(b, -1))
                    mask_BHW, score_B = self._best(out, frames_KHW3.shape[1:3])
                    masks.append(mask_BHW)
                    scores.append(score_B)
        return [(np.concatenate(masks), np.concatenate(scores).astype(np.float32)) for masks, scores in found]

    def _best(self, out, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """A Sam3Model output's highest-scoring instance per frame: (masks_BHW at `size`, scores_B)."""
        score_BQ = out.pred_logits.float().sigmoid()
        if getattr(out, "presence_logits", None) is not None:
            score_BQ = score_BQ * out.presence_logits.float().sigmoid()
        best_B = score_BQ.argmax(dim=1)
        rows = self.torch.arange(len(best_B))
        return to_frame(out.pred_masks[rows, best_B][:, None], size), score_BQ[rows, best_B].cpu().numpy()

    def analyse(self, frames_FHW3: np.ndarray, subject: str, objects: list[str]) -> ShotMasks:
        out = ShotMasks(subject=subject, backend=self.name, models=self.models)
        names = [subject, *objects]
        keys = range(0, len(frames_FHW3), self.every)
        found = dict(zip(names, self.detect(frames_FHW3[::self.every], [self.prompts[n] for n in names])))  # a view
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

    def background(self, frames_FHW3: np.ndarray, shot: ShotMasks, positions: list[int], emitted: list[str],
                   view: int) -> tuple[np.ndarray, float, float]:
        """The frame at `positions` the emitted elements cover least, them filled; that share, twice
        (the foreground's and the filled share are one here; `view` is the classical backend's, for
        a moving camera: a detector's frame is its own view)."""
        fg_FHW = np.logical_or.reduce([shot.masks[n] for n in emitted])
        shares = [foreground_share(fg_FHW[p]) for p in positions]
        best = positions[int(np.argmin(shares))]
        return fill_background(frames_FHW3[best], fg_FHW[best]), float(min(shares)), float(min(shares))
