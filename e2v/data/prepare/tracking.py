"""Following each element through the shot with a SAM video tracker: transformers'
Sam3TrackerVideoModel (loads from the facebook/sam3 checkpoint, the detector's own) or
Sam2VideoModel (a SAM 2.1 checkpoint, e.g. facebook/sam2.1-hiera-large).

Every element arrives with one mask prompt on one frame (the learned backend's best detection in
the shot). All elements are object ids of one inference session, so each frame's image features
are computed once for all of them. Each prompt is stored in the session and the model is run on
its frame (as transformers' documented video usage does after add_inputs_to_inference_session);
then propagate_in_video_iterator runs forward from the earliest prompted frame to the shot's end
and backward from it to the start (SAM 2's propagate_in_video order); each frame's mask is the
first one propagation gives it, so every track frame gets exactly one.

The session is built here from our own pixels (sam_input.py) rather than by the processor, whose
image and video processors import torchvision. The session keeps the frames (F x 3 x S x S
float32: 12 MB a frame at SAM 3's S = 1008) and its stored mask outputs (4.4 MB a frame and
element at 1008) in host memory; the memory features it encodes per frame and element (2 MB at
1008) stay where the model runs (transformers stores them there). clips.max_shot_seconds bounds
all three: a 30 s shot at 16 fps with two elements holds 5.8 + 4.2 GB on the host and 1.9 GB on
the GPU.

Scores: the sigmoid of the tracker's object-score logit, per frame and element (is it visible
here); on a prompted frame the tracker takes the mask as given (logit +10 when it is not empty).

Legend: N elements, F track frames, H/W frame height/width, S the tracker's input side;
frames_FHW3 uint8, masks_NFHW bool, presence_NF float32.
"""

from __future__ import annotations

import numpy as np
from transformers.image_utils import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
)

from .config import PrepareConfigError
from .sam_input import SamInput, to_frame

# tracker -> (model class, session class, checkpoint model_types it loads from, the mean / std its
# processor uses without a preprocessor_config.json: Sam3ImageProcessor's, Sam2VideoVideoProcessor's)
TRACKERS = {
    "sam3": ("Sam3TrackerVideoModel", "Sam3TrackerVideoInferenceSession", ("sam3_video", "sam3_tracker_video"),
             (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)),
    "sam2": ("Sam2VideoModel", "Sam2VideoInferenceSession", ("sam2_video",),
             (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)),
}


def check_checkpoint(kind: str, model_id: str, key: str) -> None:
    """Stop before any weight loads when the checkpoint holds no `kind` tracker: loading one anyway
    would leave the tracker's weights random, with only a warning."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_id).model_type
    wanted = TRACKERS[kind][2]
    if model_type not in wanted:
        raise PrepareConfigError(
            f"{key}: {model_id} is a {model_type!r} checkpoint, which has no {kind} tracker (elements.tracker: {kind} "
            f"loads {' or '.join(wanted)}); give the full SAM 3 checkpoint (e.g. facebook/sam3) for sam3 or a "
            f"SAM 2.1 one for sam2 in elements.tracker_model, or set elements.tracker=none")


class Tracker:
    def __init__(self, kind: str, model_id: str, device: str = "cpu"):
        import transformers

        model_class, session_class, _, (mean, std) = TRACKERS[kind]
        self.device, self.name = device, str(model_id)
        self.model = getattr(transformers, model_class).from_pretrained(model_id).to(device).eval()
        self.session_class = getattr(transformers, session_class)
        self.input = SamInput(model_id, self.model.config.image_size, mean, std)

    def track(self, frames_FHW3: np.ndarray, prompts: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """prompts: per element (frame index, mask_HW). Returns (masks_NFHW, presence_NF)."""
        n, (f, h, w) = len(prompts), frames_FHW3.shape[:3]
        session = self.session_class(video=self.input.pixels(frames_FHW3), video_height=h, video_width=w,
                                     inference_device=self.device, inference_state_device="cpu",
                                     video_storage_device="cpu", dtype=self.model.dtype)
        for obj_id, (frame, mask_HW) in enumerate(prompts):  # the processor's add_inputs, then the model on that frame
            session.add_mask_inputs(session.obj_id_to_idx(obj_id), frame, self.input.mask(mask_HW))
            session.obj_with_new_inputs = [obj_id]
            self.model(inference_session=session, frame_idx=frame)
        start = min(frame for frame, _ in prompts)
        masks_NFHW = np.zeros((n, f, h, w), bool)
        presence_NF = np.zeros((n, f), np.float32)
        done = set()
        for reverse in (False, True):
            for out in self.model.propagate_in_video_iterator(session, start_frame_idx=start, reverse=reverse):
                if out.frame_idx in done:  # the start frame comes again at the head of the backward pass
                    continue
                done.add(out.frame_idx)
                masks_NFHW[:, out.frame_idx] = to_frame(out.pred_masks, (h, w))
                presence_NF[:, out.frame_idx] = out.object_score_logits.float().sigmoid().reshape(n).cpu().numpy()
        assert len(done) == f, f"propagation reached {len(done)} of {f} frames"
        return masks_NFHW, presence_NF
