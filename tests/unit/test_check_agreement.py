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
               if kind not in ("variable_fps", "prompt_too_long", "element_absent")}  # those train: warnings
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


def _start_up_check(tmp_path, config=CONFIG):
    """Training's start-up check on tmp_path/data under on_bad_sample: error: (the sample count its
    message states, the problem count it states, its problem lines, the count `left out` prints,
    the warnings it prints)."""
    import re

    import pytest

    from e2v.data.dataset import BadSampleError, index_samples
    from e2v.data.preflight import unusable

    with pytest.raises(BadSampleError) as e:
        index_samples(_cfg(tmp_path, config), verbose=False)
    stated, problems = map(int, re.match(r"(\d+) sample\(s\) unusable \((\d+) problem\(s\)\)", str(e.value)).groups())
    lines = [line.strip() for line in str(e.value).splitlines()[1:] if line.startswith("  ")]
    excluded, warnings = [], []
    index_samples(_cfg(tmp_path, config), verbose=False, stop_on_bad=False, excluded=excluded, warnings=warnings)
    return stated, problems, lines, len(unusable(excluded)), {(p.sample, p.kind) for p in warnings}


def test_the_check_and_the_start_up_check_count_the_same_unusable_samples(tmp_path, monkeypatch):
    """On the defect set (one sample refused at discovery for a missing reference, one for a
    duplicate id, five by their files): training's message states as many unusable samples as
    its lines name and as the run's `left out` line counts, and tools/check_dataset.py's summary
    adds up to the same (samples = ok + unusable, each sample once however many errors it has);
    the optional-reference warning is in both."""
    from helpers_check_dataset import defect_set

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    data, expected = defect_set(tmp_path / "data")
    (data / "013.txt").write_text("   ")  # a second error on one sample: still one unusable sample
    stated, problems, lines, left_out, warnings = _start_up_check(tmp_path)
    proc, report = run_check(tmp_path, data)
    summary = report["summary"]
    errors = [p for p in report["problems"] if p["severity"] == "error"]
    refused = {p["sample"] for p in errors}
    assert refused == {"010", "011", "012", "013", "014", "015", "017"}
    assert stated == left_out == summary["unusable"] == len(refused) == 7
    # one line a problem (no kind is met often enough here to be counted on one line), each naming
    # the file the check names for it
    assert problems == len(lines) == summary["sample_errors"] == len(errors) == 8
    assert sorted(line.split()[2].rstrip(":") for line in lines) == sorted(p["file"].split(" line ")[0] for p in errors)
    assert summary["samples"] == summary["samples_ok"] + summary["unusable"]
    assert summary["samples"] == 17 and f"samples          17 = {summary['samples_ok']} ok + 7 unusable" in proc.stdout
    absent = {(p["sample"], p["kind"]) for p in report["problems"] if p["kind"] == "element_absent"}
    assert absent == {w for w in warnings if w[1] == "element_absent"} == {x for x in expected if x[1] == "element_absent"}


def test_a_missing_clip_is_not_found_with_its_line_in_both(tmp_path, monkeypatch):
    """A CSV row whose clip is not there: "not found" with the CSV's line, from discovery (so the
    check and training name it alike), not a decoder's "cannot open" without its cause."""
    from helpers_check_dataset import CSV_CONFIG, csv_set

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    meta = csv_set(tmp_path / "data", [("000", "clip 0"), ("001", "clip 1"), ("002", "clip 2")])
    (tmp_path / "data/001.mp4").unlink()
    stated, problems, lines, left_out, _ = _start_up_check(tmp_path, CSV_CONFIG)
    assert (stated, problems, left_out) == (1, 1, 1)
    assert lines[0].split()[1:4] == ["video_missing", str(meta), "line"] and "not found" in lines[0]
    _, report = run_check(tmp_path, tmp_path / "data", config=CSV_CONFIG)
    (p,) = [p for p in report["problems"] if p["severity"] == "error"]
    assert (p["sample"], p["kind"], p["file"]) == ("000001_001", "video_missing", f"{meta} line 3")
    assert p["problem"] == f"video '../001.mp4' not found (looked for {meta.parent / '../001.mp4'})"
    assert report["summary"]["samples"] == 3 and report["summary"]["unusable"] == 1
