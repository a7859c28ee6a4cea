"""The learned backend's tracker (e2v/data/prepare/tracking.py) on tiny random-weight SAM 3 and
SAM 2.1 checkpoints built here (nothing downloads), on CPU: propagation against transformers'
documented streaming usage (the model fed one frame at a time), each prompted frame against the
detection that prompted it, the detector's frames counted with forward hooks, its shared image
features against one pixel forward per element, the whole tools/prepare_data.py path, and the
tracker's config errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from e2v.data.prepare.config import PrepareConfigError, load_prepare_config
from e2v.data.prepare.masks import bbox, iou

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensors
ROOT = Path(__file__).resolve().parents[2]
H, W = 48, 80  # frames the size of no model's input: every resize is exercised
# 17-frame 64x64 clips at 8 fps (tests/unit/test_prepare_data.py's), detections on every 4th track frame,
# the filters opened (random weights: scores and masks mean nothing)
SETS = ["clips.num_frames=17", "clips.fps=8", "clips.resolution=[64, 64]", "check.run=false",
        "elements.detect_every=4", "elements.min_score=0", "elements.min_sharpness=0", "elements.min_area_share=0",
        "elements.max_foreground_share=1", "identity.check=false", "gates.action=flag"]  # random masks: gates open


@pytest.fixture(scope="module")
def sam3(tmp_path_factory) -> Path:
    from helpers_prepare import save_tiny_sam3

    return save_tiny_sam3(tmp_path_factory.mktemp("sam3"))


@pytest.fixture(scope="module")
def sam2(tmp_path_factory) -> Path:
    from helpers_prepare import save_tiny_sam2_video

    return save_tiny_sam2_video(tmp_path_factory.mktemp("sam2"))


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """A bright square moving right over noise: frames_FHW3."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 120, (n, H, W, 3), dtype=np.uint8)
    for i in range(n):
        frames[i, 12:36, 8 + 4 * i:32 + 4 * i] = 230
    return frames


def _box(y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
    m = np.zeros((H, W), bool)
    m[y0:y1, x0:x1] = True
    return m


def _streamed(tracker, frames_FHW3: np.ndarray, mask_HW: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' documented streaming usage: a session without a video; the prompt is added
    before the first frame, then each frame is handed to the model as it comes. The mask prompt is
    what the processor's add_inputs_to_inference_session stores for it."""
    from e2v.data.prepare.sam_input import to_frame

    session = tracker.session_class(video_height=H, video_width=W, dtype=torch.float32)
    session.add_mask_inputs(session.obj_id_to_idx(0), 0, tracker.input.mask(mask_HW))
    session.obj_with_new_inputs = [0]
    masks, presence = [], []
    for frame_HW3 in frames_FHW3:
        out = tracker.model(inference_session=session, frame=tracker.input.pixels(frame_HW3[None])[0])
        masks.append(to_frame(out.pred_masks, (H, W))[0])
        presence.append(float(out.object_score_logits.sigmoid()))
    return np.stack(masks), np.array(presence, np.float32)


@pytest.mark.parametrize("kind", ["sam3", "sam2"])
def test_propagation_matches_streaming(kind, sam3, sam2):
    """Forward from a prompt in the middle: the frames after it are what streaming them from the
    prompt gives. Backward from a prompt on the last frame: what streaming the reversed shot gives.
    The prompted frame's mask is the prompt's (through the model's input and mask resolutions)."""
    from e2v.data.prepare.tracking import Tracker

    tracker = Tracker(kind, sam3 if kind == "sam3" else sam2)
    frames, prompt = _frames(8), _box(12, 36, 20, 44)
    masks_NFHW, presence_NF = tracker.track(frames, [(3, prompt)])
    assert masks_NFHW.shape == (1, 8, H, W) and presence_NF.shape == (1, 8)
    assert iou(masks_NFHW[0, 3], prompt) >= 0.9, iou(masks_NFHW[0, 3], prompt)
    assert presence_NF[0, 3] == pytest.approx(torch.tensor(10.0).sigmoid().item())  # the mask, taken as given
    streamed_FHW, streamed_F = _streamed(tracker, frames[3:], prompt)
    assert (masks_NFHW[0, 3:] == streamed_FHW).all()
    np.testing.assert_allclose(presence_NF[0, 3:], streamed_F, rtol=1e-5)
    assert masks_NFHW[0, 4:].any(axis=(1, 2)).all()  # tracked frames have masks (not a blank pass)

    masks_NFHW, presence_NF = tracker.track(frames, [(7, prompt)])
    streamed_FHW, streamed_F = _streamed(tracker, frames[::-1], prompt)
    assert (masks_NFHW[0] == streamed_FHW[::-1]).all()
    np.testing.assert_allclose(presence_NF[0], streamed_F[::-1], rtol=1e-5)


def test_elements_are_object_ids_of_one_session(sam3):
    """Two prompts on different frames: each element's mask on its own prompted frame is its own
    prompt; the image encoder runs once per frame for both, not once per frame and element."""
    from e2v.data.prepare.tracking import Tracker

    tracker = Tracker("sam3", sam3)
    frames, a, b = _frames(6), _box(4, 20, 4, 30), _box(24, 44, 40, 76)
    encoded: list[int] = []
    hook = tracker.model.vision_encoder.register_forward_hook(lambda m, args, out: encoded.append(1))
    masks_NFHW, _ = tracker.track(frames, [(1, a), (4, b)])
    hook.remove()
    assert iou(masks_NFHW[0, 1], a) >= 0.9 and iou(masks_NFHW[1, 4], b) >= 0.9
    assert iou(masks_NFHW[0, 1], b) < 0.1 and iou(masks_NFHW[1, 4], a) < 0.1
    # every frame once, each prompt's frame once more, the start frame again when the backward pass
    # begins (one session per element would encode every frame once per element: 12 and more)
    assert len(encoded) == 6 + 2 + 1


def _count_frames(model) -> tuple[list[int], object]:
    """A forward hook on the detector's image backbone (ViT and FPN neck) that lists the frames
    each of its calls saw (its pixel_values' batch)."""
    seen: list[int] = []

    def hook(module, args, out):
        seen.append(len(args[0]))

    return seen, model.vision_encoder.register_forward_hook(hook)


def _plant(model, scores: list[list[float]]):
    """A forward hook that replaces the random detector's answer (its scores hardly differ between
    frames and its masks cover most of the frame) with a known one: on the c-th call's i-th frame
    one instance, of score scores[c % len(scores)][i], whose mask is a box that moves right with i."""
    calls = []

    def hook(module, args, kwargs, out):
        c, (b, _, h, w) = len(calls), out.pred_masks.shape
        calls.append(b)
        out.pred_logits[:] = -10.0
        out.pred_logits[:, 0] = torch.tensor(scores[c % len(scores)]).logit()
        out.presence_logits[:] = 10.0
        out.pred_masks[:] = -10.0
        for i in range(b):
            out.pred_masks[i, 0, h // 4:3 * h // 4, i * w // 16:(i + 5) * w // 16] = 10.0

    return model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("every", [1, 3])
def test_detector_runs_on_key_frames_only(every, sam3):
    """With a tracker the detector sees every `every`-th frame, once for all elements; each element's
    best detection is its prompt, so the tracked mask on that frame is that detection's mask and
    its score that detection's score (x the tracker's visibility, 1 on a prompted frame)."""
    from e2v.data.prepare.learned import LearnedBackend

    cfg = load_prepare_config(None, [f"elements.sam_model={sam3}", f"elements.detect_every={every}",
                                     "elements.sam_batch=16"])  # one call per element: the plant's c
    backend = LearnedBackend(cfg.elements)
    frames, keys = _frames(10), list(range(0, 10, every))
    planted = [[0.2 + 0.05 * ((i + 2 * c) % len(keys)) for i in range(len(keys))] for c in range(2)]  # per element
    seen, counting = _count_frames(backend.model)
    planting = _plant(backend.model, planted)
    shot = backend.analyse(frames, "person", ["object"])
    names = ("person", "object")
    found = dict(zip(names, backend.detect(frames[keys], [backend.prompts[n] for n in names])))
    counting.remove(), planting.remove()
    assert seen == [len(keys)] * 2  # analyse's, then the test's own: one backbone pass each for both elements
    for c, name in enumerate(("person", "object")):
        masks_KHW, scores_K = found[name]
        best = int(np.argmax(planted[c]))
        assert best == int(np.argmax(scores_K)) and keys[best] > 0
        assert iou(shot.masks[name][keys[best]], masks_KHW[best]) >= 0.9
        assert iou(shot.masks[name][keys[best]], masks_KHW[best - 1]) < 0.9  # not some other key frame's
        assert shot.scores[name][keys[best]] == pytest.approx(planted[c][best], rel=1e-4)
        assert shot.masks[name].shape == (10, H, W) and (shot.scores[name] <= planted[c][best] + 1e-6).all()


def test_without_a_tracker_every_frame_is_detected(sam3):
    from e2v.data.prepare.learned import LearnedBackend

    cfg = load_prepare_config(None, [f"elements.sam_model={sam3}", "elements.tracker=none"])
    backend = LearnedBackend(cfg.elements)
    frames = _frames(5)
    seen, hook = _count_frames(backend.model)
    shot = backend.analyse(frames, "person", ["object"])
    hook.remove()
    assert sum(seen) == 5 and backend.tracker is None and shot.models == [str(sam3)]
    ((masks_FHW, scores_F),) = backend.detect(frames, [backend.prompts["person"]])
    assert (shot.masks["person"] == masks_FHW).all() and (shot.scores["person"] == scores_F).all()


def test_shared_image_features_equal_a_pixel_forward_per_element(sam3):
    """detect runs the image backbone once per batch of frames for all prompts, and each prompt's
    outputs are bit for bit those of the model called from pixels once per prompt and batch (the
    oracle: the same tensors through the same modules, only the backbone's output reused), so the
    masks and scores are equal, not close. Three prompts over 5 frames in batches of 2 (2, 2, 1)."""
    from e2v.data.prepare.learned import TEXT_LEN, LearnedBackend

    cfg = load_prepare_config(None, [f"elements.sam_model={sam3}", "elements.tracker=none", "elements.sam_batch=2"])
    backend = LearnedBackend(cfg.elements)
    frames, prompts = _frames(5), ["person", "object", "a red cup"]
    shared: list = []
    capture = backend.model.register_forward_hook(lambda m, args, out: shared.append(out))
    seen, counting = _count_frames(backend.model)
    found = backend.detect(frames, prompts)
    counting.remove(), capture.remove()
    assert seen == [2, 2, 1]  # once per batch, not once per batch and prompt (9 passes)
    for p, prompt in enumerate(prompts):
        text = backend.tokenizer([prompt], padding="max_length", max_length=TEXT_LEN, truncation=True,
                                 return_tensors="pt")
        masks, scores = [], []
        for c, i in enumerate(range(0, 5, 2)):
            x_B3SS = backend.input.pixels(frames[i:i + 2])
            with torch.no_grad():
                out = backend.model(pixel_values=x_B3SS, input_ids=text["input_ids"].repeat(len(x_B3SS), 1),
                                    attention_mask=text["attention_mask"].repeat(len(x_B3SS), 1))
            for key in ("pred_logits", "presence_logits", "pred_masks"):
                assert torch.equal(shared[c * len(prompts) + p][key], out[key]), (prompt, i, key)
            mask_BHW, score_B = backend._best(out, (H, W))
            masks.append(mask_BHW)
            scores.append(score_B)
        assert (found[p][0] == np.concatenate(masks)).all() and (found[p][1] == np.concatenate(scores)).all()
    assert not np.array_equal(found[0][1], found[1][1])  # the prompts are told apart: a swap would fail


def test_tracking_end_to_end(sam3, tmp_path):
    """tools/prepare_data.py's path with the tiny SAM 3 tracking (filters opened: random weights):
    the detector sees every 4th track frame, the tracker every frame, the manifest names both
    models, and every frame of the window has a mask although most were never detected."""
    from transformers import Sam3Model, Sam3TrackerVideoModel

    from bench.make_raw_footage import generate
    from e2v.data.prepare.run import prepare

    raw, out = tmp_path / "raw", tmp_path / "out"
    generate(raw, videos=1, shots=1, shot_seconds=3.5)
    detected: list[int] = []
    tracked: set[int] = set()

    def hook(module, args, kwargs, result):
        if isinstance(module, Sam3Model):
            detected.append(len(kwargs["vision_embeds"].fpn_hidden_states[0]))  # a decoder pass's frames
        elif isinstance(module, Sam3TrackerVideoModel):
            tracked.add(kwargs["frame_idx"])

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        summary = prepare(load_prepare_config(ROOT / "configs/prepare.yaml", [*SETS, f"elements.sam_model={sam3}"]),
                          raw, out, no_caption=True)
    finally:
        handle.remove()
    assert summary["counts"]["clips"] == 1, summary
    n = len(tracked)
    assert tracked == set(range(n)) and n >= 17
    assert sum(detected) == 2 * len(range(0, n, 4))
    (r,) = [json.loads(line) for line in (out / "prepare_manifest.jsonl").read_text().splitlines()]
    assert r["backend"] == "learned" and r["models"] == [str(sam3), str(sam3)]
    assert r["config"]["elements"]["tracker"] == "sam3"
    assert all(a > 0 for a in r["mask_areas"]["person"]) and len(r["mask_areas"]["person"]) == 17
    person = np.asarray(Image.open(out / f"{r['id']}_person.png"))
    y0, y1, x0, x1 = r["references"]["person"]["box"]
    assert person.shape == (y1 - y0, x1 - x0, 4) and bbox(person[..., 3] > 0) is not None
    assert (out / f"{r['id']}.mp4").exists() and (out / f"{r['id']}_background.png").exists()


def test_tracker_config_errors(tmp_path, capsys):
    def fails(match: str, *sets: str) -> None:
        with pytest.raises(PrepareConfigError, match=match):
            load_prepare_config(None, list(sets))

    fails(r"elements.tracker: 'sam4' is not one of none, sam3, sam2", "elements.tracker=sam4")
    fails(r"elements.detect_every: 0 must be at least 1", "elements.detect_every=0")
    fails(r"elements.detect_every: 4 needs a tracker.*elements.detect_every=1", "elements.tracker=none",
          "elements.detect_every=4")
    fails(r"elements.tracker_model: m is set but elements.tracker is none", "elements.tracker=none",
          "elements.tracker_model=m")
    fails(r"elements.tracker: sam2 needs elements.tracker_model", "elements.tracker=sam2")
    assert load_prepare_config(None, ["elements.tracker=none"]).elements.detect_every is None  # 1 by default

    from transformers import Sam3Config

    detector_only = tmp_path / "detector_only"
    Sam3Config().save_pretrained(detector_only)  # a Sam3Model folder: no tracker in it (config only: nothing loads)
    raw = tmp_path / "raw"
    from bench.make_raw_footage import generate
    from tools.prepare_data import main

    generate(raw, videos=1, shots=1, shot_seconds=1.0)
    code = main(["--config", str(ROOT / "configs/prepare.yaml"), "--input", str(raw), "--output", str(tmp_path / "out"),
                 "--set", f"elements.sam_model={detector_only}", "--no-caption"])
    err = capsys.readouterr().err
    assert code == 2 and f"config error: elements.sam_model: {detector_only} is a 'sam3' checkpoint" in err, err
    assert "elements.tracker=none" in err
