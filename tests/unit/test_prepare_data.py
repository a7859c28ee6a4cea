"""tools/prepare_data.py: raw footage -> e2v dataset, scored against generated truth
(bench/make_raw_footage.py), on bad inputs, on real photographs, and through the learned backend
with a tiny random-weight SAM 3. Every run here is the classical backend or the tiny model on CPU, in
this process: a few seconds each. The command killed mid-run and run again:
tests/launch/test_prepare_data_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers_prepare import SMALL_SETS
from PIL import Image

from bench.make_raw_footage import generate, write_bad_inputs, write_photo_footage
from e2v.data.prepare.clips import windows
from e2v.data.prepare.config import PrepareConfigError, config_key, load_prepare_config
from e2v.data.prepare.masks import iou
from e2v.data.prepare.run import prepare
from e2v.data.prepare.truth import reference_mask, score, truth_mask
from tools.check_dataset import main as check_dataset

ROOT = Path(__file__).resolve().parents[2]
TARGET = (64, 64)
CHECK = "check.run=true"  # the dataset check on the output: on where the test is about it


def _prepare(raw: Path, out: Path, *sets: str, no_caption: bool = False) -> dict:
    return prepare(load_prepare_config(ROOT / "configs/prepare.yaml", [*SMALL_SETS, *sets]), raw, out, no_caption=no_caption,
                   check=check_dataset)


@pytest.fixture(scope="module")
def footage(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    generate(raw, videos=2, shots=3, shot_seconds=4.0)  # >= 3.6 s: a 2 s window, the 0.5 s gap, 1 s outside
    return raw


@pytest.fixture(scope="module")
def prepared(footage, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prepared")
    return out, _prepare(footage, out, CHECK)


def test_ground_truth_small_case(footage, prepared):
    """Cuts within one frame, subject IoU >= 0.85, background error <= 6/255, references outside."""
    out, summary = prepared
    s = score(footage, out, TARGET)
    assert s["cuts_within_1_frame"] == s["cuts"] == 4 and s["cuts_extra"] == 0, s
    assert s["clips"] == 6 and s["backgrounds"] == 6, s
    assert s["subject_iou_mean"] >= 0.85, s
    assert s["background_mae_mean"] <= 6, s
    assert s["references_outside_window"] == 1.0, s  # every shot has room outside its window
    assert summary["check_exit_code"] == 0
    assert summary["counts"]["captions_sidecar"] == 3 and summary["counts"]["captions_filename"] == 3


def test_manifest_and_files(prepared):
    out, summary = prepared
    counts = summary["counts"]
    # the generator's props stand still: no second moving region, so no evidence of an object and
    # none invented (classical.static_objects finds them: tests/unit/test_prepare_hard.py)
    assert counts["elements_none_object"] == 6 and "elements_object" not in counts
    assert not list(out.glob("*_object.png"))
    rows = [json.loads(line) for line in (out / "prepare_manifest.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for r in rows:
        assert {"source", "shot", "window", "references", "mask_areas", "backend", "models", "config"} <= set(r)
        assert r["backend"] == "classical" and r["config"]["clips"]["num_frames"] == 17
        w = r["window"]
        for ref in r["references"].values():
            times = ref.get("times_s") or [ref["time_s"]]
            assert all(t < w["start_s"] or t > w["end_s"] for t in times), (r["id"], ref, w)
        person = Image.open(out / f"{r['id']}_person.png")
        assert person.mode == "RGBA" and person.getchannel("A").getextrema() == (0, 255)
        assert Image.open(out / f"{r['id']}_background.png").size == (64, 64)
        assert (out / "contact_sheets" / f"{r['id']}.png").exists()
        import decord

        vr = decord.VideoReader(str(out / f"{r['id']}.mp4"))
        assert len(vr) == 17 and vr[0].shape == (64, 64, 3) and abs(vr.get_avg_fps() - 8) < 0.01


def test_windows_leave_room_for_references():
    assert windows(16, 17, 1) == []
    assert windows(40, 17, 1) == [(0, 17)]
    assert windows(40, 17, 2) == [(2, 19), (21, 38)]


def test_config_errors_name_the_key():
    with pytest.raises(PrepareConfigError, match=r"unknown key 'clips.num_frame'; did you mean 'num_frames'"):
        load_prepare_config(None, ["clips.num_frame=17"])
    with pytest.raises(PrepareConfigError, match=r"clips.num_frames: 16 is not 4k\+1"):
        load_prepare_config(None, ["clips.num_frames=16"])
    with pytest.raises(PrepareConfigError, match=r"elements.items.0.role"):
        load_prepare_config(None, ["elements.items=[{name: person, role: hero}]"])
    with pytest.raises(PrepareConfigError, match=r"clips.fps: expected a number"):
        load_prepare_config(None, ["clips.fps=fast"])
    cfg = load_prepare_config(ROOT / "configs/prepare.yaml")  # the documented file loads as it is
    # a finished video is redone when a setting that shapes its samples changed, not the check's
    assert config_key(cfg) == config_key(load_prepare_config(None, ["check.run=false"]))
    assert config_key(cfg) != config_key(load_prepare_config(None, ["elements.margin_px=3"]))
    assert [it.name for it in cfg.elements.items] == ["person", "object", "background"]


def test_bad_inputs_are_named_and_never_stop_the_run(tmp_path, capsys):
    raw, out = tmp_path / "raw", tmp_path / "out"
    expected = write_bad_inputs(raw)
    summary = _prepare(raw, out)
    named = {n["source"]: n for n in summary["inputs"]}
    assert set(named) == set(expected), named  # every input said what happened (ok ones via a note)
    for name, status in expected.items():
        assert named[name]["status"] == status, named[name]
    assert named["audio_only.m4a"]["kind"] == "no_video_stream"
    assert named["zero length.mp4"]["kind"] == "empty_file"
    assert named["tiny.mp4"]["kind"] == "too_small"
    assert "variable frame rate" in " ".join(named["vfr_phone.mp4"]["notes"])
    assert "ASCII name" in " ".join(named["Mi vídeo de playa ☀.mp4"]["notes"])
    assert summary["counts"]["clips"] == 4
    printed = capsys.readouterr().out
    assert "BAD      unreadable.mp4" in printed and "SKIPPED  tiny.mp4 [too_small]" in printed
    records = {p: p.stat().st_mtime_ns for p in (out / ".prepare/records").iterdir()}
    _prepare(raw, out)  # a second run finds everything finished, bad inputs included
    assert "8 finished before, 0 to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (out / ".prepare/records").iterdir()} == records


def test_real_photographs(tmp_path):
    """scikit-image's photographs with a pasted moving cut-out: the still shot gives a clip whose
    subject matches the truth; the panned and zoomed shots are found moving and skipped."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    truth = write_photo_footage(raw, shot_frames=56)  # 3.5 s shots: a 2 s window, the gap and 1 s outside
    summary = _prepare(raw, out, CHECK)
    record = json.loads(next((out / ".prepare/records").glob("*.json")).read_text())
    assert all(min(abs(c - t) for c in record["cuts"]) <= 1 for t in truth["cuts"]), record["cuts"]
    assert summary["counts"]["shots_moving_camera"] == 2 and summary["counts"]["clips"] == 1
    assert summary["check_exit_code"] == 0
    (sample,) = record["samples"]
    ref = sample["references"]["person"]
    assert ref["outside_window"]
    true_HW = truth_mask(np.load(raw / "truth/photos.npz")["subject"][ref["source_frame"]], sample)
    assert iou(reference_mask(out, sample, "person"), true_HW) >= 0.7


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensors
def test_learned_path_plumbing(tmp_path):
    """A tiny random-weight Sam3Model and a tiny captioner (nothing downloaded) through the whole
    learned path, detecting on every frame (tracking: tests/unit/test_prepare_tracking.py): masks are
    random, so the filters are opened; the elements are cut with the model's masks and the caption
    is the model's."""
    from helpers_prepare import save_tiny_captioner, save_tiny_sam3

    raw, out = tmp_path / "raw", tmp_path / "out"
    generate(raw, videos=1, shots=1, shot_seconds=3.5)
    (raw / "footage_000.txt").unlink()  # no sidecar: the model captions
    sam, captioner = save_tiny_sam3(tmp_path / "sam3"), save_tiny_captioner(tmp_path / "captioner")
    summary = _prepare(raw, out, f"elements.sam_model={sam}", "elements.tracker=none", "elements.min_score=0",
                       "elements.min_sharpness=0", "elements.min_area_share=0", "elements.max_foreground_share=1",
                       "identity.check=false", "gates.action=flag",
                       f"captions.model={captioner}", "captions.max_new_tokens=4")
    assert summary["counts"]["clips"] == 1, summary
    (r,) = [json.loads(line) for line in (out / "prepare_manifest.jsonl").read_text().splitlines()]
    assert r["backend"] == "learned" and r["models"] == [str(sam)]
    assert r["caption_from"] == f"model:{captioner}" and r["caption"], r["caption"]
    assert (out / f"{r['id']}.txt").read_text().strip() == r["caption"]
    frame = r["references"]["person"]
    person = np.asarray(Image.open(out / f"{r['id']}_person.png"))
    assert person.shape[2] == 4 and set(np.unique(person[..., 3])) <= {0, 255}
    y0, y1, x0, x1 = frame["box"]
    assert person.shape[:2] == (y1 - y0, x1 - x0)
    obj = np.asarray(Image.open(out / f"{r['id']}_object.png"))
    assert obj.ndim == 3 and obj.shape[2] == 3
    assert Image.open(out / f"{r['id']}_background.png").size == (64, 64)


def test_caption_sources(tmp_path):
    """A sidecar .txt wins, then a CSV / JSONL row (by path relative to the input or by name),
    then the file name's words."""
    from e2v.data.prepare import captions as cap
    from e2v.data.prepare.config import Captions

    (tmp_path / "trip").mkdir()
    for name in ("a.mp4", "trip/b c.mp4", "d_e-01.mov"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "a.txt").write_text("from the sidecar\n")
    (tmp_path / "caps.csv").write_text("file,caption\ntrip/b c.mp4,from the csv\na.mp4,not used\n")
    table = cap.load_table(tmp_path, Captions(table="caps.csv"))
    assert cap.sidecar(tmp_path / "a.mp4", tmp_path, table) == "from the sidecar"
    assert cap.sidecar(tmp_path / "trip/b c.mp4", tmp_path, table) == "from the csv"
    assert cap.sidecar(tmp_path / "d_e-01.mov", tmp_path, table) is None
    assert cap.filename_words(tmp_path / "d_e-01.mov") == "d e 01"
    (tmp_path / "caps.jsonl").write_text('{"path": "d_e-01.mov", "text": "from the jsonl"}\n')
    table = cap.load_table(tmp_path, Captions(table="caps.jsonl", file_column="path", caption_column="text"))
    assert cap.sidecar(tmp_path / "d_e-01.mov", tmp_path, table) == "from the jsonl"
    with pytest.raises(ValueError, match="needs the columns 'file' and 'caption'"):
        cap.load_table(tmp_path, Captions(table="caps.jsonl"))


def test_static_objects_on_request(footage, tmp_path):
    """classical.static_objects: the generator's flat polygons are found and emitted, and then (only
    then) painted out of the background: scored against the clean plate with the object's area in."""
    summary = _prepare(footage, tmp_path / "out", "elements.classical.static_objects=true", no_caption=True)
    counts = summary["counts"]
    assert counts["elements_object"] + sum(v for k, v in counts.items() if k.startswith("elements_dropped_object")) == 6
    s = score(footage, tmp_path / "out", TARGET)
    assert s["background_mae_mean"] <= 6 and s["subject_iou_mean"] >= 0.85, s
