"""Do generated videos follow their references? Two measurements that look only at generated pixels
and at reference images (README, "Look at what it learns"; e2v/eval/validation.py runs them).

Subject colour (`validation.subject_colour`, for data whose subject is one flat colour, such as the
demo's). The subject's colour is read from its reference: the median of the pixels that are not the
white surround (`element_colour`). In a generated video it is measured on blocks of VAE_S x VAE_S
pixels, VAE_S the VAE's spatial stride (what one latent position holds: the tiny VAE decodes each block to one colour, a real VAE
blurs a little across them): every block's departure from the background reference at the same
place (the background reference through the clip's own resize, whatever preprocessing the condition
gives it; without one, the block's median over the frames),
blocks on the mixing line between the background and a distractor's colour (the object) left out,
and the median colour of the 1% of blocks that depart most (`subject_colour`). Those are the blocks
the subject covers most: a partly covered block is a mix with the background, and the fewer of
those the estimate takes, the closer it stays to the subject's own colour. A generated object is
not painted in its reference's exact colour (the trained demo model's stray 35-50 levels of RGB
distance), so the band around the mixing line is wide (MIX_TOL 80); the demo draws the object's hue
at least a quarter turn from the subject's, so the band does not reach the subject. On the demo's
VAE-encoded and decoded clips themselves (the best a model can do) the measured colour is nearest
its own subject's among 6 samples for 96 of 96 clips (95 with a band of 25; tests/unit/test_fidelity.py
checks the rule on frames with known colours).

    val/sample_reference_match: sample i generated with its own references (the validation seed);
        a hit when its subject colour is nearer its own subject reference's colour than any other
        held-out sample's. Chance is 1 / N.
    val/sample_reference_swap: sample i generated with the references of sample j = i + 1 (mod N),
        same prompt and noise; a hit when the colour follows j. A model that copies a memorised
        sample instead of reading its references scores near chance here whatever it does on match.

Element similarity (any data, with the CLIP already loaded for conditioning): the cosine similarity
between the CLIP image embedding (the vision tower's pooled, post-layernorm CLS: Wan's image
encoder has no projection head) of an element's reference and of each generated frame, the best
frame kept, as the element-consistency scores of multi-reference video papers compute it. Per
element, the mean over the generated held-out videos (`val/element_similarity_<name>`), and the
same video against the references of the next held-out sample (`..._gap_<name>` = own - other):
a model that ignores its references scores 0 on the gap, whatever its videos look like.

Legend: F frames, H/W pixels, D embedding width, N held-out samples, E elements.
"""

from __future__ import annotations

import numpy as np
import torch

from e2v.runtime.device import module_device

WHITE_TOL = 60.0  # RGB distance (0-255 levels) from white beyond which a reference pixel is the element
TOP_SHARE = 0.01  # share of the blocks, those departing most from the background, the subject colour is read from
MIX_TOL = 80.0  # a block this close to the line between the background and a distractor's colour is that distractor


# --- subject colour ------------------------------------------------------------------------------


def element_colour(image_HWC: np.ndarray) -> np.ndarray:
    """The colour of an element on a white surround (a cut-out on white, as the demo stores its
    subjects: both reading rules of data.reference_read see it so):
    the per-channel median of the pixels farther than WHITE_TOL from white (white if none is)."""
    pixels = np.asarray(image_HWC, np.float32).reshape(-1, 3)
    inside = pixels[np.linalg.norm(pixels - 255.0, axis=1) > WHITE_TOL]
    return np.median(inside, axis=0) if len(inside) else np.full(3, 255.0, np.float32)


def block_colours(frames_FHWC: np.ndarray, block: int) -> np.ndarray:
    """Mean colour of each block x block tile: [..., H, W, 3] -> [..., H/block, W/block, 3], float."""
    x = np.asarray(frames_FHWC, np.float32)
    *lead, h, w, c = x.shape
    if h % block or w % block:
        raise ValueError(f"frames of {h}x{w} do not split into {block}x{block} blocks")
    return x.reshape(*lead, h // block, block, w // block, block, c).mean(axis=(-4, -2))


def _distance_to_segment(points: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Distance of each point [n,3] to the segment from start [n,3] to end [3]."""
    span = end - start
    t = np.clip(((points - start) * span).sum(1) / np.maximum((span * span).sum(1), 1e-6), 0.0, 1.0)
    return np.linalg.norm(points - (start + t[:, None] * span), axis=1)


def subject_colour(video_FHWC: np.ndarray, background_HWC: np.ndarray | None = None,
                   distractors: tuple = (), block: int = 8) -> np.ndarray:
    """The subject's colour in a video (uint8 [F,H,W,3]): the median colour of the TOP_SHARE of
    blocks that depart most from the background (the reference at the video's size, else each
    block's median over the frames), leaving out blocks that a distractor colour mixed with the
    background explains."""
    blocks = block_colours(video_FHWC, block)
    background = (block_colours(background_HWC, block)[None] if background_HWC is not None
                  else np.median(blocks, axis=0, keepdims=True))
    colours = blocks.reshape(-1, 3)
    behind = np.broadcast_to(background, blocks.shape).reshape(-1, 3)
    departure = np.linalg.norm(colours - behind, axis=1)
    for colour in distractors:
        departure[_distance_to_segment(colours, behind, np.asarray(colour, np.float32)) <= MIX_TOL] = -1.0
    top = np.argsort(-departure, kind="stable")[: max(1, round(TOP_SHARE * len(colours)))]
    return np.median(colours[top], axis=0)


def nearest(colour: np.ndarray, candidates: list[np.ndarray]) -> int:
    """Index of the candidate colour nearest `colour` (RGB distance)."""
    return int(np.argmin([np.linalg.norm(np.asarray(colour, np.float32) - c) for c in candidates]))


def hit_rate(measured: list[np.ndarray], candidates: list[np.ndarray], owners: list[int]) -> float:
    """Share of videos whose measured colour is nearest the candidate of the sample whose
    references it was generated with (owners[k] for video k)."""
    return sum(nearest(c, candidates) == o for c, o in zip(measured, owners)) / len(measured)


# --- CLIP element similarity ---------------------------------------------------------------------


@torch.no_grad()
def clip_embeddings(images: list[np.ndarray], image_encoder, image_processor, chunk: int = 32) -> torch.Tensor:
    """uint8 HWC images -> unit-length pooled CLIP embeddings [n, D] on the encoder's device, in
    chunks (81 frames of a real video at 224 px through ViT-H at once would hold ~10 GB of activations)."""
    device, out = module_device(image_encoder), []
    for start in range(0, len(images), chunk):
        pixel_values = image_processor(images=list(images[start:start + chunk]), return_tensors="pt").pixel_values
        pooled = image_encoder(pixel_values=pixel_values.to(device, image_encoder.dtype)).pooler_output
        out.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return torch.cat(out)


def element_similarity(videos_FHWC: list[np.ndarray], references: list[dict[str, np.ndarray]], partner: list[int],
                       image_encoder, image_processor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per element name: (own, other), each [n] on the encoder's device: for video k, the best
    cosine similarity over its frames with its own reference of that element, and with the
    reference of held-out sample partner[k]. references[j] holds sample j's element images (uint8
    HWC; the first len(videos) are the videos' own); an element another sample lacks is skipped
    for that video (NaN in `other`)."""
    frames = [f for video in videos_FHWC for f in video]
    frame_D = clip_embeddings(frames, image_encoder, image_processor)
    per_video = frame_D.split([len(v) for v in videos_FHWC])
    keys = [(j, name) for j, refs in enumerate(references) for name in refs]
    ref_D = dict(zip(keys, clip_embeddings([references[j][name] for j, name in keys], image_encoder, image_processor)))
    names = sorted({name for refs in references[: len(videos_FHWC)] for name in refs})
    nan = torch.tensor(float("nan"), device=frame_D.device)
    out = {}
    for name in names:
        own, other = [], []
        for k, video_D in enumerate(per_video):
            if (k, name) not in ref_D:
                continue
            own.append((video_D @ ref_D[k, name]).max())
            theirs = ref_D.get((partner[k], name))
            other.append((video_D @ theirs).max() if theirs is not None else nan)
        out[name] = (torch.stack(own), torch.stack(other))
    return out
