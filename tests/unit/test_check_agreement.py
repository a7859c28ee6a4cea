"""The start-up check (training's index_samples, e2v/data/preflight.py) and the validator
(tools/check_dataset.py) decide alike: on a folder of hostile samples, every sample training
refuses is an error of the same kind in the validator's report, and every per-sample error the
validator reports is a sample training refuses. Both call the same per-sample rules
(e2v/data/preflight.py: sample_facts, sample_problems); this keeps a rule from being restated, or
changed, on one side only."""

import numpy as np
from helpers_check_dataset import CONFIG, _cfg, clip, hostile_set, run_check, sample
from PIL import Image

DATASET_LEVEL = ("bucket ", "dataset ", "-")  # problems of the whole set, not of one sample


def hostile_folder(root):
    """hostile_set's samples plus one more broken file each -> {sample: kind} of those that cannot
    train (with data.max_image_pixels 100000)."""
    _, expected = hostile_set(root)
    refused = {sample_id: kind for sample_id, kind in expected
               if kind not in ("variable_fps", "prompt_too_long")}  # those two train: warnings
    sample(root, "040")
    mp4 = (root / "040.mp4").read_bytes()
    (root / "040.mp4").write_bytes(mp4[: len(mp4) // 2])  # truncated
    (root / "041.mp4").write_bytes(b"\x00not a video" * 100)  # not a video at all
    (root / "041.txt").write_text("clip 041")
    Image.new("RGB", (40, 48)).save(root / "041_person.png")
    sample(root, "042", w=48)  # a width decord 0.6.0 cannot decode
    sample(root, "043", frames=5)  # too short for 9 frames
    sample(root, "044", prompt="  ")  # empty caption
    sample(root, "045", person=False)  # required reference missing
    sample(root, "046")
    (root / "046_person.png").write_bytes(b"garbage, not a png")  # required reference unreadable
    sample(root, "047")
    (root / "047_object.png").write_bytes(b"\x89PNG\r\n")  # optional reference unreadable
    sample(root, "048")
    (root / "048_object.png").mkdir()  # a reference that is a folder
    sample(root, "049")
    clip(root / "049.mov", seed=49)  # two videos, one id
    sample(root, "050")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "050_object.png")  # tiny: a warning only
    return refused | {"040": "video_unreadable", "041": "video_unreadable", "042": "video_unreadable",
                      "043": "too_short", "044": "empty_caption", "045": "element_missing",
                      "046": "element_unreadable", "047": "element_unreadable", "048": "element_unreadable",
                      "049": "duplicate_id"}


def test_training_and_the_validator_refuse_the_same_samples_for_the_same_reasons(tmp_path, monkeypatch):
    from e2v.data.dataset import index_samples

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    expected = set(hostile_folder(data).items())
    sets = ["data.max_image_pixels=100000"]
    refused = []
    usable = index_samples(_cfg(tmp_path, CONFIG, *sets), verbose=False, stop_on_bad=False, excluded=refused)
    training = {(p.sample, p.kind) for p in refused}
    _, report = run_check(tmp_path, data, *[a for s in sets for a in ("--set", s)])
    validator = {(p["sample"], p["kind"]) for p in report["problems"]
                 if p["severity"] == "error" and not p["sample"].startswith(DATASET_LEVEL)}
    assert training == validator, f"training only: {training - validator}, validator only: {validator - training}"
    assert training == expected, f"missing {expected - training}, unexpected {training - expected}"
    passed = {r["id"] for r in report["samples"]} - {sample_id for sample_id, _ in validator}
    assert {s.id for s in usable} == passed  # and the samples both let through are the same
