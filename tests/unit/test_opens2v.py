"""The `opens2v` source on a fixture in OpenS2V-5M's own JSON schema (docs/formats.md, "OpenS2V-5M"),
built here from generated clips and masks RLE-encoded with pycocotools: the references equal the
masks' pixels, the crop box reaches video and references alike, the valid frame range is kept,
every defect is named by the validator, and a tiny run trains from it through the launcher.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_opens2v_runs.py."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
from helpers import ROOT
from helpers_opens2v import ANN_FRAME, CH, CROP, CUP_A, CUT, CW, FACE_CUT, PERSON_A, dataset_sets, rle
from PIL import Image


def config(root, *sets, **opts):
    from e2v.config.load import load_config

    return load_config(str(ROOT / "configs/e2v_tiny_lora.yaml"), dataset_sets(root, **opts) + list(sets))


def index(root, **opts):
    from e2v.data.opens2v import read_opens2v

    cfg = config(root, **opts)
    return cfg, read_opens2v(cfg.data.datasets[0], cfg.data.elements)


def decoded_frames(path, indices):
    import decord

    return decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1).get_batch(indices).asnumpy()


def test_rle_reader_agrees_with_pycocotools_and_refuses_what_would_overrun_it():
    from e2v.data.opens2v_json import RLEError, checked_rle, decode_mask

    for mask in (PERSON_A, CUP_A, np.zeros((CH, CW), np.uint8), np.ones((CH, CW), np.uint8)):
        r = rle(mask)
        assert (decode_mask(checked_rle(r)) == mask.astype(bool)).all()
    good = rle(PERSON_A)
    for bad, why in [({**good, "counts": good["counts"][:-3]}, "runs cover"), ({**good, "size": [CH, CW + 1]}, "runs cover"),
                     ({**good, "counts": good["counts"] + "~"}, "not an RLE digit"), ({"counts": "x"}, "size")]:
        with pytest.raises(RLEError, match=why):
            checked_rle(bad)


def test_entries_become_samples_problems_and_counted_drops(fixture_root):
    _, idx = index(fixture_root)
    assert idx.entries == 6
    assert sorted(s.id for s in idx.samples) == ["clip_a_part1", "clip_b_part1", "clip_c_nexus", "crop_outside"]
    assert {(p.sample, p.kind) for p in idx.problems} == {("bad_rle", "bad_rle"), ("missing_video", "video_missing")}
    bad = next(p for p in idx.problems if p.kind == "bad_rle")
    assert "total_part1.json entry bad_rle" in bad.file and "mask_annotation.6.1" in bad.problem
    a = next(s for s in idx.samples if s.id == "clip_a_part1")
    assert a.prompt == "The video features the clip a.mp4."  # face_cap_qwen before cap
    assert a.frame_range == tuple(FACE_CUT) and a.crop == (8, 0, 88, 64)  # (x1, y1, x2, y2)
    assert sorted(a.elements) == ["background", "object", "person"]
    b = next(s for s in idx.samples if s.id == "clip_b_part1")
    assert sorted(b.elements) == ["person"]  # 75% foreground: the background is left out, not required
    assert idx.dropped == {"gme_score below min_gme": 1, "background class": 1, "over max_subjects": 1,
                           "background left out (foreground over 45%)": 1}
    _, roomy = index(fixture_root, max_subjects=3)  # room for the woman, but the one subject element is taken
    assert roomy.dropped["no free subject element"] == 1 and "over max_subjects" not in roomy.dropped
    _, capped = index(fixture_root, max_subjects=1, caption_fields=["cap"], frame_range_fields=["cut"])
    a1 = next(s for s in capped.samples if s.id == "clip_a_part1")
    assert sorted(a1.elements) == ["background", "person"] and capped.dropped["over max_subjects"] >= 1
    assert a1.prompt == "Short caption of a.mp4." and a1.frame_range == tuple(CUT)


def test_references_are_the_masks_pixels_and_share_the_videos_crop(fixture_root):
    from e2v.data.media import load_video

    _, idx = index(fixture_root)
    a = next(s for s in idx.samples if s.id == "clip_a_part1")
    a.make_elements.ensure()
    stamps = {n: p.stat().st_mtime_ns for n, p in a.elements.items()}
    a.make_elements.ensure()  # written once: a second call (another worker) reads what is there
    assert stamps == {n: p.stat().st_mtime_ns for n, p in a.elements.items()}
    frame = decoded_frames(a.video, [ANN_FRAME])[0][CROP[2]:CROP[3], CROP[0]:CROP[1]]
    # the subject: RGBA, alpha exactly the mask over the mask's box, RGB the frame's pixels under it
    person = np.asarray(Image.open(a.elements["person"]))
    rows, cols = np.flatnonzero(PERSON_A.any(1)), np.flatnonzero(PERSON_A.any(0))
    box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
    assert person.shape == (*PERSON_A[box].shape, 4)
    assert (person[..., 3] == PERSON_A[box] * 255).all()
    inside = PERSON_A[box].astype(bool)
    assert (person[..., :3][inside] == frame[box][inside]).all() and (person[..., :3][~inside] == 255).all()
    # the object: RGB on white
    cup = np.asarray(Image.open(a.elements["object"]))
    assert cup.shape == (16, 20, 3) and (cup == frame[40:56, 50:70]).all()
    # the background: the classical fill of the frame, the same size as the crop
    assert Image.open(a.elements["background"]).size == (CW, CH)
    # the video: the valid range from its first frame, cut to the same box as the references
    n = FACE_CUT[1] - FACE_CUT[0]
    video_CFHW = load_video(a.video, n, CH, CW, frame_range=a.frame_range, crop=a.crop)
    want = decoded_frames(a.video, list(range(*FACE_CUT)))[:, CROP[2]:CROP[3], CROP[0]:CROP[1]]
    assert (video_CFHW.permute(1, 2, 3, 0).numpy() == want).all()
    assert (video_CFHW[:, ANN_FRAME - FACE_CUT[0]].permute(1, 2, 0).numpy()[box][inside] == person[..., :3][inside]).all()
    by_time = load_video(a.video, n, CH, CW, fps=8.0, frame_range=a.frame_range, crop=a.crop)  # the clip's own rate
    assert (by_time == video_CFHW).all()
    from e2v.data.media import TooShortError

    with pytest.raises(TooShortError):  # one frame more than the range holds: never read past its end
        load_video(a.video, n + 1, CH, CW, frame_range=a.frame_range, crop=a.crop)


def test_nexus_views_and_cross_video_pairs(fixture_root):
    from e2v.data.opens2v_json import decode_mask

    _, idx = index(fixture_root, cross_pairs_path=str(fixture_root / "pairs.json"))
    c = next(s for s in idx.samples if s.id == "clip_c_nexus")
    assert c.elements["person"] == fixture_root / "gpt_frames" / "clip_c_nexus" / "0_man.png"  # read as it is
    b = next(s for s in idx.samples if s.id == "clip_b_part1")
    cut = b.make_elements.cuts["person"]  # clip b's woman is clip a's person, cut from clip a's frame
    assert cut.video.name == "a.mp4" and (decode_mask(cut.rle) == PERSON_A.astype(bool)).all()


def test_cache_key_holds_the_window_and_the_recipe(fixture_root):
    from e2v.data.store import fingerprint

    cfg, idx = index(fixture_root)
    a = next(s for s in idx.samples if s.id == "clip_a_part1")
    fp = fingerprint(a, cfg, (17, 64, 64))
    assert fp["frame_range"] == "[4, 22]" and fp["crop"] == "[8, 0, 88, 64]"
    assert fp["element.person"].startswith("opens2v ") and fp["element.person"] == a.make_elements.stamps["person"]
    _, other = index(fixture_root, frame_range_fields=["cut"])
    assert fingerprint(next(s for s in other.samples if s.id == a.id), cfg, (17, 64, 64))["frame_range"] == "[0, 24]"


def test_buckets_count_the_valid_range_and_measure_the_crop(fixture_root):
    from e2v.data.preflight import check_samples

    cfg = config(fixture_root, max_subjects=2)
    cfg.data.auto_frame_buckets, cfg.data.frame_buckets = True, [9, 17, 21]
    from e2v.data.opens2v import read_opens2v

    idx = read_opens2v(cfg.data.datasets[0], cfg.data.elements)
    problems = [p for p in check_samples(cfg, idx.samples, workers=1, progress=False) if p.severity == "error"]
    assert {p.sample for p in problems} == {"crop_outside"}  # its references cannot be cut either
    assert ("crop_outside", "crop_outside_video") in [(p.sample, p.kind) for p in problems]
    a = next(s for s in idx.samples if s.id == "clip_a_part1")
    assert a.bucket == (17, 64, 64)  # 18 frames in face_cut (24 in the clip: 21 would fit the whole clip)


def test_validator_names_each_defect_and_training_refuses_the_same(fixture_root, tmp_path, monkeypatch):
    from e2v.data.dataset import index_samples
    from tools import check_dataset

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((ROOT / "configs/e2v_tiny_lora.yaml").read_text())
    report = tmp_path / "report.json"
    sets = [*dataset_sets(fixture_root), "train.micro_batch_size=1", "validation.every_n_steps=0"]  # per sample
    argv = ["--config", str(cfg), "--json", str(report), "--workers", "1", *[a for s in sets for a in ("--set", s)]]
    out = io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(out):
        code = check_dataset.main(argv)
    assert code == 1, out.getvalue()
    errors = {(p["sample"], p["kind"]) for p in json.loads(report.read_text())["problems"] if p["severity"] == "error"}
    assert errors == {("bad_rle", "bad_rle"), ("missing_video", "video_missing"),
                      ("crop_outside", "crop_outside_video")}, out.getvalue()
    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    refused = []
    index_samples(config(fixture_root, "train.micro_batch_size=1"), verbose=False, stop_on_bad=False, excluded=refused)
    assert {(p.sample, p.kind) for p in refused} == errors  # the start-up check: the same samples, the same kinds


def test_importer_writes_the_folder_layout_resumably(fixture_root, tmp_path):
    from e2v.data.elements import discover
    from tools import import_opens2v

    out_dir = tmp_path / "e2v"
    argv = ["--metadata", str(fixture_root / "Jsons/total_part1.json"), "--media-root",
            str(fixture_root / "Videos/{part}"), "--output", str(out_dir), "--config",
            str(ROOT / "configs/e2v_tiny_lora.yaml"), "--set", "data.datasets.0.opens2v.min_gme=0.3"]
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(io.StringIO()):
        assert import_opens2v.main(argv) == 1  # some entries could not be imported: named, exit 1
    assert "bad_rle" in log.getvalue() and "crop_outside" in log.getvalue()
    names = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith("."))
    assert names == ["clip_a_part1.mp4", "clip_a_part1.txt", "clip_a_part1_background.png", "clip_a_part1_object.png",
                     "clip_a_part1_person.png", "clip_b_part1.mp4", "clip_b_part1.txt", "clip_b_part1_person.png",
                     "clip_c_nexus.mp4", "clip_c_nexus.txt", "clip_c_nexus_background.png", "clip_c_nexus_person.png"]
    mp4 = decoded_frames(out_dir / "clip_a_part1.mp4", list(range(FACE_CUT[1] - FACE_CUT[0])))
    assert mp4.shape == (FACE_CUT[1] - FACE_CUT[0], CH, CW, 3)
    stamp = (out_dir / "clip_a_part1.mp4").stat().st_mtime_ns
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(io.StringIO()):
        import_opens2v.main(argv)
    assert (out_dir / "clip_a_part1.mp4").stat().st_mtime_ns == stamp and "3 already imported" in log.getvalue()
    cfg = config(fixture_root)
    from e2v.config.schema import Dataset

    samples, problems = discover(Dataset(data_root=str(out_dir)), cfg.data.elements)
    assert sorted(s.id for s in samples) == ["clip_a_part1", "clip_b_part1", "clip_c_nexus"] and not problems
