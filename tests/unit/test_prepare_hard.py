"""tools/prepare_data.py on footage it did not make, with known truth (bench/make_raw_footage.py
write_hard_footage: scikit-image's photographs, a pan and a zoom, a subject that stands still for
half its shot, two subjects, a dissolve, a hard cut between two textures of similar colours, a
portrait clip, two shots of one place, a still shot with a large subject): every cut and dissolve found, no reference showing another subject, the still
subject dropped and named, pans registered, the portrait kept portrait; the identity check on a
wrong reference with both measures; a run that writes nothing exits non-zero with the fix.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_prepare_hard_runs.py."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers_prepare import ROOT, _prepare
from PIL import Image

from bench.make_raw_footage import generate
from e2v.data.prepare.clips import best_crop, choose_target, orientation_sizes
from e2v.data.prepare.config import load_prepare_config
from e2v.data.prepare.identity import ModelIdentity, StatisticIdentity, window_score
from e2v.data.prepare.truth import score_hard


def _only(raw: Path, name: str, dest: Path) -> Path:
    """A raw folder holding one of the hard videos and its truth."""
    (dest / "truth").mkdir(parents=True)
    shutil.copy(raw / f"{name}.mp4", dest)
    shutil.copy(raw / "truth" / f"{name}.npz", dest / "truth")
    truth = json.loads((raw / "truth_hard.json").read_text())
    (dest / "truth_hard.json").write_text(json.dumps({name: truth[name]}))
    return dest


def test_hard_footage_against_the_truth(hard_raw, hard_prepared):
    out, summary = hard_prepared
    cases = score_hard(hard_raw, out)
    for name, c in cases.items():
        if name != "same_place":  # a cut only the subjects tell apart: missed (next test)
            assert c["cuts_within_1_frame"] == c["cuts"] and c["cuts_extra"] == 0, (name, c)
        assert c["dissolves_found"] == c["dissolves"], (name, c)
        assert c["wrong_subject"] == 0, (name, c)  # no reference shows another subject (or none)
        if c["samples"]:
            assert c["subject_iou_min"] >= 0.8 and c["background_mae_max"] <= 8, (name, c)
    pans = cases["pan_zoom"]
    assert pans["samples"] == 2 and pans["subject_iou_min"] >= 0.85, pans  # the pan and the zoom, registered
    assert cases["dissolve"]["samples"] == 2  # both shots around the cross-fade give a clip
    assert cases["similar_cut"]["samples"] == 2
    assert cases["same_place"]["samples"] == 0 and cases["same_place"]["dropped_or_flagged"]["clips_dropped_subject_identity"] == 1
    assert cases["portrait"]["orientations"] == ["portrait"]
    still = cases["still_then_moving"]
    assert still["samples"] == 0 and sum(still["dropped_or_flagged"].values()) >= 1, still  # dropped and named
    videos = {v["source"]: v for v in summary["inputs"]}
    assert videos["still_then_moving.mp4"]["reasons"], videos["still_then_moving.mp4"]
    # a still camera and a subject 90% of the frame high: not called a moving camera; its plate is
    # mostly painted (the subject covers most pixels most of the time), so the gate drops it, named
    large = videos["large_subject.mp4"]["reasons"]
    assert "shots_moving_camera" not in large and large.get("clips_dropped_gate_background_filled") == 1, large
    # the second subject moves through the whole shot: evidence of an object, which is emitted
    assert videos["two_subjects.mp4"]["samples"] == 1 and "elements_none_object" not in videos["two_subjects.mp4"]["reasons"]
    assert summary["sample_sizes_hw"] == [[96, 160], [160, 96]]
    # the trainer's own rules accept the portrait sample (the check runs with data.resolution_buckets)
    assert summary["check_exit_code"] == 0
    report = json.loads((out / ".prepare/check_report.json").read_text())
    kinds = Counter(p["kind"] for p in report["problems"])
    assert kinds["orphan_file"] == 0, report["problems"]  # prepare_manifest.jsonl, prepare_summary.json
    assert kinds["duplicate_caption"] <= 5  # one per video whose clips share a caption, not one per clip
    rows = [json.loads(line) for line in (out / "prepare_manifest.jsonl").read_text().splitlines()]
    pan = next(r for r in rows if r["id"].startswith("pan_zoom") and r["shot"] == 0)
    assert pan["camera"]["camera"] == "registered" and pan["quality"]["presence"] == 1.0
    record = json.loads(next(p for p in (out / ".prepare/records").glob("*.json")
                             if "dissolve" in p.read_text()[:200]).read_text())
    assert record["boundaries"]["dissolves"][0]["residual"] <= 0.3


def test_contact_sheets_are_labelled(hard_prepared):
    out, _ = hard_prepared
    sheet = np.asarray(Image.open(next((out / "contact_sheets").glob("portrait*.png"))).convert("L"))
    assert (sheet[:14] < 100).any()  # the title line (sample id, source, shot, window)
    assert (sheet[17:30] < 100).any()  # the tiles' labels


def test_missed_cut_is_caught_by_the_identity_check(hard_raw, tmp_path):
    """Two shots of one place with a different subject each: both detectors miss the cut (only the
    subjects change), the shots are one, and the references from outside a window show the other
    subject. Without the check such samples are written; with it, none is: each is dropped and named."""
    raw = _only(hard_raw, "same_place", tmp_path / "raw")
    _prepare(raw, tmp_path / "off", "clips.windows_per_shot=2", "identity.check=false")
    off = score_hard(raw, tmp_path / "off")["same_place"]
    assert off["cuts_within_1_frame"] == 0 and off["samples"] == 2 and off["wrong_subject"] == 2, off
    summary = _prepare(raw, tmp_path / "on", "clips.windows_per_shot=2")
    on = score_hard(raw, tmp_path / "on")["same_place"]
    assert on["wrong_subject"] == 0 and summary["counts"]["clips_dropped_subject_identity"] == 2, (on, summary["counts"])
    assert summary["inputs"][0]["reasons"]["clips_dropped_subject_identity"] == 2


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensors
def test_identity_measures_on_a_wrong_reference(hard_raw, tmp_path):
    """A reference of the other shot's subject against a window of this shot's: the statistic
    scores it below its threshold and another frame of the same subject above; the learned measure
    (a tiny random CLIP tower: plumbing, not quality) loads, embeds and scores an identical crop 1."""
    import decord
    from helpers_prepare import save_tiny_vision_encoder

    truth = np.load(hard_raw / "truth/similar_cut.npz")
    frames_FHW3 = decord.VideoReader(str(hard_raw / "similar_cut.mp4")).get_batch(list(range(128))).asnumpy()
    masks_FHW, ids = truth["subject"], truth["subject_id"]
    window = (10, 30)  # shot 0 (subject 0)
    wrong, right = int(np.flatnonzero(ids == 1)[20]), 50
    cfg = load_prepare_config(None)
    stat = StatisticIdentity()
    wrong_score = window_score(stat, frames_FHW3, masks_FHW, window, (frames_FHW3[wrong], masks_FHW[wrong]))
    right_score = window_score(stat, frames_FHW3, masks_FHW, window, (frames_FHW3[right], masks_FHW[right]))
    assert wrong_score < cfg.identity.statistic_threshold <= right_score, (wrong_score, right_score)
    model = ModelIdentity(str(save_tiny_vision_encoder(tmp_path / "clip")))
    same = model.similarity((frames_FHW3[right], masks_FHW[right]), (frames_FHW3[right], masks_FHW[right]))
    assert abs(same - 1) < 1e-5
    assert window_score(model, frames_FHW3, masks_FHW, window, (frames_FHW3[wrong], masks_FHW[wrong])) < 1


@pytest.mark.usefixtures("one_thread")
def test_learned_identity_through_the_preparer(hard_raw, tmp_path):
    """identity.model in a run: a threshold nothing reaches drops every clip, counted and named;
    one everything reaches keeps them, each reference's score in the manifest."""
    from helpers_prepare import save_tiny_vision_encoder

    raw = _only(hard_raw, "portrait", tmp_path / "raw")
    clip = save_tiny_vision_encoder(tmp_path / "clip")
    strict = _prepare(raw, tmp_path / "strict", f"identity.model={clip}", "identity.model_threshold=1.01")
    assert strict["counts"].get("clips", 0) == 0 and strict["counts"]["clips_dropped_subject_identity"] == 1
    assert strict["inputs"][0]["reasons"]["clips_dropped_subject_identity"] == 1
    _prepare(raw, tmp_path / "open", f"identity.model={clip}", "identity.model_threshold=-1")
    (row,) = [json.loads(line) for line in (tmp_path / "open/prepare_manifest.jsonl").read_text().splitlines()]
    assert row["identity_measure"] == f"model:{clip}" and -1 <= row["references"]["person"]["identity"] <= 1


def test_nothing_written_exits_nonzero_with_the_fix(tmp_path, capsys):
    """2.5 s shots against the default 81 frames at 16 fps (5 s): exit 3, the numbers and the keys."""
    from tools.prepare_data import main

    raw = tmp_path / "raw"
    generate(raw, videos=1, shots=2, shot_seconds=2.5)
    rc = main(["--config", str(ROOT / "configs/prepare.yaml"), "--input", str(raw), "--output", str(tmp_path / "out"),
               "--no-caption", "--set", "clips.resolution=[64, 64]", "--set", "check.run=false"])
    captured = capsys.readouterr()
    assert rc == 3
    assert "no sample was written" in captured.err and "clips.num_frames 81 at clips.fps 16 needs 5.00 s" in captured.err
    assert "--set clips.num_frames=33" in captured.err and "17, 33" in captured.err, captured.err
    assert "shots_too_short 2" in captured.out  # the per-video reason


def test_crop_and_orientation_rules():
    """best_crop against hand-placed masks; choose_target by aspect at one pixel count."""
    keep = np.zeros((2, 64, 100), bool)
    assert best_crop(keep, (64, 64)) == (0, 18)  # nothing to keep: the centre
    keep[:, 10:30, 2:12] = True  # near the left edge: the centre crop (x 18-82) would lose it
    assert best_crop(keep, (64, 64)) == (0, 2)  # offsets 0-2 keep it all; 2 is nearest the centre
    keep[:] = False
    keep[:, 10:30, 90:98] = True
    assert best_crop(keep, (64, 64)) == (0, 34)  # offsets 34-36 keep x 90-97; 34 is nearest the centre
    keep[:] = False
    keep[:, 10:30, 40:60] = True  # fits the centre crop: stays centred
    assert best_crop(keep, (64, 64)) == (0, 18)
    sizes = orientation_sizes([480, 832], ["landscape", "portrait", "square"])
    assert sizes == {"landscape": (480, 832), "portrait": (832, 480), "square": (624, 624)}
    assert choose_target(720, 1280, sizes) == ("landscape", (480, 832))
    assert choose_target(1280, 720, sizes) == ("portrait", (832, 480))
    assert choose_target(1000, 1080, sizes) == ("square", (624, 624))
