"""Do generated videos follow their references (e2v/eval/fidelity.py, run by e2v/eval/validation.py)?

The subject colour is measured right on frames drawn with known colours (a hit, and the misses a
wrong colour, a louder distractor or no background reference would cause); videos that copy their
samples score 1 on match and swap, and a model that ignores its references scores near chance (1/N):
output that is the same whatever the references, and end to end the tiny transformer with its
references zeroed, through the sampler; the CLIP element-similarity gap is 0
for identical references and positive for output that copies its reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT

SUBJECT = (230.0, 40.0, 40.0)  # red
CANDIDATES = [np.array(c, np.float32) for c in (SUBJECT, (200, 90, 40), (40, 200, 60), (20, 30, 240), (230, 200, 40))]
OBJECT = (20.0, 30.0, 240.0)  # candidate 3's subject colour, on another element, farther from the background


def synthetic_video(subject=SUBJECT, obj=None, frames: int = 17, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(video uint8 [F,H,W,3], its background): a disc of radius 13 crossing two-colour diagonal
    stripes, optionally over a static 24 px square of colour `obj`."""
    y, x = np.mgrid[0:size, 0:size]
    stripes = ((x + y) // 12) % 2 == 0
    background = np.where(stripes[..., None], [120, 110, 100], [170, 160, 140]).astype(np.float32)
    video = []
    for f in range(frames):
        frame = background.copy()
        if obj is not None:
            frame[36:60, 4:28] = obj
        cx, cy = 14 + 36 * f / (frames - 1), 20 + 12 * np.sin(f / 3)
        frame[(x - cx) ** 2 + (y - cy) ** 2 <= 13 ** 2] = subject
        video.append(frame)
    return np.stack(video).round().astype(np.uint8), background.astype(np.uint8)


def blocky(video: np.ndarray) -> np.ndarray:
    """What the tiny VAE decodes: every 8 x 8 block its mean colour."""
    from e2v.eval.fidelity import block_colours

    return block_colours(video, 8).repeat(8, axis=-3).repeat(8, axis=-2).round().astype(np.uint8)


def test_subject_colour_on_frames_of_known_colours():
    from e2v.eval.fidelity import element_colour, hit_rate, nearest, subject_colour

    video, background = synthetic_video()
    measured = subject_colour(video, background)
    np.testing.assert_allclose(measured, SUBJECT, atol=0.5)  # the fully covered blocks: the colour itself
    assert nearest(measured, CANDIDATES) == 0
    assert nearest(subject_colour(blocky(video), background), CANDIDATES) == 0  # as the tiny VAE decodes it
    assert nearest(subject_colour(video), CANDIDATES) == 0  # no background reference: each block's median

    # a video whose subject took another sample's colour is a miss for its own references
    other, _ = synthetic_video(subject=CANDIDATES[2])
    assert nearest(subject_colour(other, background), CANDIDATES) == 2
    assert hit_rate([measured, subject_colour(other, background)], CANDIDATES, [0, 0]) == 0.5

    # a bigger object in a louder colour (another candidate's) wins unless named as a distractor
    busy, _ = synthetic_video(obj=OBJECT)
    assert nearest(subject_colour(busy, background), CANDIDATES) == 3
    assert nearest(subject_colour(busy, background, [OBJECT]), CANDIDATES) == 0
    # a generated object is not painted in its reference's exact colour: ~47 levels off, across the
    # line to the background, it is still the object
    stray = (0.0, 70.0, 254.0)
    off, _ = synthetic_video(obj=stray)
    assert 45 < np.linalg.norm(np.subtract(stray, OBJECT)) < 50
    assert nearest(subject_colour(off, background, [OBJECT]), CANDIDATES) == 0

    # a reference's colour: its pixels off the white surround, antialiased edge or not
    ref = np.full((56, 40, 3), 255, np.uint8)
    ref[8:48, 6:34] = SUBJECT
    ref[7, 6:34] = (242, 148, 148)  # an edge half-way to white
    np.testing.assert_array_equal(element_colour(ref), SUBJECT)
    np.testing.assert_array_equal(element_colour(np.full((4, 4, 3), 255, np.uint8)), [255, 255, 255])


@pytest.fixture(scope="module")
def validator(tiny_parts, demo_data, tmp_path_factory):
    """A Validator on the 6 held-out samples of the 8-sample demo data, subject colour on."""
    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples
    from e2v.eval.validation import Validator, split_held_out

    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={demo_data}", "validation.every_n_steps=1", "validation.num_videos=6",
        "validation.num_inference_steps=4",
        "validation.subject_colour={subject: person, background: background, distractors: [object]}"])
    _, held_out = split_held_out(index_samples(cfg, verbose=False), cfg)
    assert len(held_out) == 6
    return Validator(cfg, held_out, tiny_parts, tmp_path_factory.mktemp("fidelity"), rank=0, device="cpu",
                     dtype=torch.float32)


def clips(validator) -> np.ndarray:
    """The held-out samples' own clips, uint8 [N,F,H,W,3]: what a perfect model would generate."""
    from e2v.data.dataset import E2VDataset

    ds = E2VDataset(validator.cfg, validator.samples)
    return np.stack([ds[i]["video"].permute(1, 2, 3, 0).numpy() for i in range(len(ds))])


def test_copying_videos_hit_and_a_reference_blind_output_scores_chance(validator, tiny_parts):
    videos = clips(validator)
    n = len(videos)
    swapped = videos[[validator.partner(k) for k in range(n)]]  # the partner's clip for the partner's references
    out = validator.fidelity(videos, swapped, tiny_parts)
    assert out["val/sample_reference_match"] == 1.0 and out["val/sample_reference_swap"] == 1.0

    # Output that does not depend on the references: the same video whatever they are, here each
    # held-out clip in turn. Each is measured against the references it was "made" with (the
    # background and distractors a video is read against are its references'), so the hits
    # are not exactly 1 of n per output: on average over the n outputs, near chance (1/n).
    blind = [validator.fidelity(np.stack([clip] * n), np.stack([clip] * n), tiny_parts) for clip in videos]
    for tag in ("val/sample_reference_match", "val/sample_reference_swap"):
        rates = [b[tag] for b in blind]
        assert min(rates) >= 1 / n  # the clip's own sample always hits: that video IS its sample
        assert np.mean(rates) < 2 / n, rates


def test_a_model_with_its_references_zeroed_scores_near_chance(validator, tiny_parts):
    """End to end through the sampler: the tiny transformer blinded to its condition channels and
    image tokens gives the same video for the own and the swapped references (same prompt, same
    noise); scored against 6 candidates, both rates stay at chance level (1/6 expected)."""

    from helpers import blind

    count, out = validator.videos(blind(tiny_parts.transformer).eval(), 1)
    assert count == 6
    assert out["val/sample_reference_match"] <= 2 / 6 and out["val/sample_reference_swap"] <= 2 / 6, out
    assert (validator.out / "step_000001/sheet.png").exists()


def test_element_similarity_gap_is_zero_for_identical_references_and_positive_for_a_copy(validator, tiny_parts):
    import copy
    from dataclasses import replace

    refs = validator.element_inputs()
    n = len(refs)
    # output that copies its references: for each element a third of the frames show it, as CLIP takes it
    copies = np.stack([np.concatenate([np.stack([r] * 6) for r in refs[k]["clip"].values()])[:17] for k in range(n)])
    out = validator.fidelity(copies, None, tiny_parts)
    for name in ("person", "object", "background"):
        assert out[f"val/element_similarity_{name}"] == pytest.approx(1.0, abs=1e-5)  # a frame is the reference
        assert out[f"val/element_similarity_gap_{name}"] > 0.01, name
    assert out["val/element_similarity_gap"] > 0.01

    same = copy.copy(validator)  # every held-out sample with sample 0's references
    same.samples = [replace(s, elements=validator.samples[0].elements) for s in validator.samples]
    same.images = same.refs = None
    noise = np.random.default_rng(0).integers(0, 256, copies.shape, dtype=np.uint8)
    flat = same.fidelity(noise, None, tiny_parts)
    for name in ("person", "object", "background", ""):
        assert flat[f"val/element_similarity_gap{'_' + name if name else ''}"] == pytest.approx(0.0, abs=1e-6)


def test_config_keys_of_the_demo_and_their_errors():
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError
    from e2v.models.plan import transformer_config

    demo = load_config(ROOT / "configs/e2v_tiny.yaml", check_paths=False)
    shape = transformer_config(demo)  # the demo's bigger transformer, through the tiny preset
    assert (shape["num_layers"], shape["num_attention_heads"] * shape["attention_head_dim"]) == (4, 128)
    assert shape["added_kv_proj_dim"] == 128 and demo.model.training_type == "full"
    quick = transformer_config(load_config(ROOT / "configs/e2v_tiny_lora.yaml", check_paths=False))
    assert (quick["num_layers"], quick["attention_head_dim"], quick["ffn_dim"]) == (2, 12, 32)  # the tests' tiny model

    assert demo.validation.subject_colour.subject == "person"
    for sets, match in [
        (["validation.subject_colour={subject: persn}"], r"validation.subject_colour: unknown element\(s\) \['persn'\]"),
        (["validation.subject_colour.distractors=[hat]"], r"unknown element\(s\) \['hat'\]"),
        (["validation.sets=[{prompt: a, elements: {}}]"], r"subject_colour measures videos generated from held-out"),
        (["validation.num_videos=0"], r"num_videos >= 1"),
        (["model.tiny.head_dim=13"], r"model.tiny.head_dim=13 must be even"),
        (["model.tiny.head_dim=4"], r"model.tiny.head_dim=4 must be >= 6"),
        (["model.tiny.layers=0"], r"model.tiny.layers=0 must be >= 1"),
        (["model.preset=null", "model.pretrained=/x", "model.tiny.layers=3"], r"model.tiny sizes a tiny preset"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(ROOT / "configs/e2v_tiny.yaml", sets, check_paths=False)


def test_copying_videos_hit_in_the_sequence_layout_whose_background_is_letterboxed(tiny_parts, demo_data, tmp_path):
    """SkyReels-V3's loader letterboxes the demo's wide background between white bands; the subject
    colour is still read against the background where the clip shows it, so the samples' own clips
    score 1 (read against the letterboxed condition, the bands' departure hid the subject)."""
    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples
    from e2v.eval.fidelity import subject_colour
    from e2v.eval.validation import Validator, split_held_out

    cfg = load_config(ROOT / "configs/r2v_tiny.yaml", [f"data.datasets.0.data_root={demo_data}",
                                                       "data.elements.2.vae.preprocess=fit_pad_white"])
    _, held_out = split_held_out(index_samples(cfg, verbose=False), cfg)
    v = Validator(cfg, held_out, tiny_parts, tmp_path, rank=0, device="cpu", dtype=torch.float32)
    videos = clips(v)
    swapped = videos[[v.partner(k) for k in range(len(videos))]]
    out = v.fidelity(videos, swapped, tiny_parts)
    assert out["val/sample_reference_match"] == 1.0 and out["val/sample_reference_swap"] == 1.0

    condition = v.element_inputs()[0]["vae"]["background"]
    assert (condition[0] == 255).all() and not (v.plate(v.held_out_images()[0]["background"])[0] == 255).all()
    colours = [subject_colour(x, condition) for x in videos]  # the old reading, against the white bands
    hits = sum(int(np.argmin([np.linalg.norm(c - element_colour_of(v, j)) for j in range(len(videos))])) == k
               for k, c in enumerate(colours))
    assert hits < len(videos), hits


def element_colour_of(v, j: int) -> np.ndarray:
    from e2v.eval.fidelity import element_colour

    return element_colour(np.asarray(v.held_out_images()[j]["person"]))
