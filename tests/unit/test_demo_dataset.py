"""tools/make_demo_dataset.py: layout, decodability, reference/video agreement, generic prompts,
determinism and the .complete / .generating marker logic.  Runs the script as the user would."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

decord = pytest.importorskip("decord")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "make_demo_dataset.py"
N, SIZE, FRAMES = 4, 64, 17
SUFFIXES = (".mp4", ".txt", ".json", "_person.png", "_object.png", "_background.png")
FORBIDDEN_WORDS = re.compile(
    r"\b(red|green|blue|yellow|orange|purple|violet|pink|cyan|magenta|white|black|gr[ae]y|brown|teal|"
    r"turquoise|colou?r\w*|circle|circular|ellipse|oval|round|square|triangle|pentagon|hexagon|diamond|"
    r"polygon|blob|stripe\w*|check\w*|checker\w*)\b",
    re.I,
)


def load_tool():
    """The generator the command runs (e2v/data/demo.py)."""
    import e2v.data.demo as module

    return module


def run(out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(out), "--num-samples", str(N), "--write-meta", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def ids(n: int = N) -> list[str]:
    return [f"{i:03d}" for i in range(n)]


def decode(path: Path) -> np.ndarray:
    reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    return reader.get_batch(list(range(len(reader)))).asnumpy()


def file_bytes(folder: Path, suffixes=(".txt", ".json", "_person.png", "_object.png", "_background.png")):
    return {f"{i}{s}": (folder / f"{i}{s}").read_bytes() for i in ids() for s in suffixes}


@pytest.fixture(scope="module")
def tool():
    return load_tool()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "data"
    proc = run(out)
    assert re.search(rf"{N} samples, {SIZE}x{SIZE}, {FRAMES} frames, .*s$", proc.stdout.strip()), proc.stdout
    return out


@pytest.fixture
def copy(dataset, tmp_path) -> Path:
    """A private copy of the dataset for tests that modify it."""
    return Path(shutil.copytree(dataset, tmp_path / "data"))


def meta(folder: Path, ident: str) -> dict:
    return json.loads((folder / f"{ident}.json").read_text())


def disk(centre, radius: float, size: int = SIZE) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size] + 0.5
    return (x - centre[0]) ** 2 + (y - centre[1]) ** 2 < radius**2


# --- layout and content ------------------------------------------------------------------------


def test_every_id_has_all_files_and_markers_are_final(dataset):
    for ident in ids():
        for suffix in SUFFIXES:
            assert (dataset / f"{ident}{suffix}").is_file(), f"{ident}{suffix}"
    assert (dataset / ".complete").is_file()
    assert not (dataset / ".generating").exists() and not (dataset / ".tmp").exists()
    names = {p.name for p in dataset.iterdir()} - {".complete"}
    assert names == {f"{i}{s}" for i in ids() for s in SUFFIXES}


def test_videos_decode_to_the_rendered_frames(dataset, tool):
    for ident in ids():
        frames = decode(dataset / f"{ident}.mp4")
        assert frames.shape == (FRAMES, SIZE, SIZE, 3)
        rendered = tool.render_video(meta(dataset, ident))
        error = np.abs(frames.astype(int) - rendered).mean()
        assert error < 2.5, f"{ident}: mean abs colour error {error:.2f} after decode"


def test_person_is_rgba_with_transparent_surround(dataset):
    for ident in ids():
        img = Image.open(dataset / f"{ident}_person.png")
        assert img.mode == "RGBA" and img.size == (40, 56)  # (width, height): tall, not square
        alpha = np.asarray(img)[..., 3]
        h, w = alpha.shape
        assert alpha[0, 0] == alpha[0, -1] == alpha[-1, 0] == alpha[-1, -1] == 0
        assert alpha[h // 2, w // 2] == 255


def test_person_reads_the_same_whether_alpha_is_composited_or_dropped(dataset):
    """White under alpha 0 and no partial alpha: the white reading (A2's layouts) and Pillow's
    convert("RGB") (SkyReels-V3's, the sequence layout's) give the same pixels, the subject on white."""
    from e2v.data.media import load_image

    for ident in ids():
        rgba = np.asarray(Image.open(dataset / f"{ident}_person.png"))
        assert set(np.unique(rgba[..., 3])) == {0, 255} and (rgba[rgba[..., 3] == 0, :3] == 255).all()
        white, converted = (np.asarray(load_image(dataset / f"{ident}_person.png", read=r)) for r in ("white", "convert"))
        assert np.array_equal(white, converted)


def test_object_and_background_references(dataset):
    for ident in ids():
        obj = Image.open(dataset / f"{ident}_object.png")
        assert obj.mode == "RGB" and obj.size == (48, 48)
        assert (np.asarray(obj)[0, 0] == 255).all()  # on white
        bg = Image.open(dataset / f"{ident}_background.png")
        assert bg.mode == "RGB" and bg.size == (96, 64)  # wider than the square video
        # the video shows the background's centre crop (what `center_crop` preprocessing takes):
        # away from the shapes, pixels agree
        m = meta(dataset, ident)
        left = (bg.width - SIZE) // 2
        assert m["crop_left"] == left
        crop = np.asarray(bg)[:, left:left + SIZE].astype(int)
        first = decode(dataset / f"{ident}.mp4")[0].astype(int)
        free = ~disk(m["subject"]["path"][0], 1.5 * max(m["subject"]["radii"]) + 2)
        free &= ~disk(m["object"]["path"][0], 1.5 * max(m["object"]["radii"]) + 2)
        assert np.abs(first - crop)[free].mean() < 3


def test_subject_colour_in_reference_matches_video(dataset):
    for ident in ids():
        person = np.asarray(Image.open(dataset / f"{ident}_person.png"))
        h, w = person.shape[:2]
        ref_colour = person[h // 2, w // 2, :3].astype(int)
        m = meta(dataset, ident)
        assert ref_colour.tolist() == m["subject"]["colour"]
        first = decode(dataset / f"{ident}.mp4")[0]
        inside = disk(m["subject"]["path"][0], 0.4 * min(m["subject"]["radii"]))
        assert inside.sum() >= 5
        video_colour = first[inside].mean(0)
        assert np.abs(video_colour - ref_colour).max() < 8, (ident, video_colour, ref_colour)
        # ...and differs from the object's colour, so the references are not interchangeable
        assert np.abs(np.array(m["object"]["colour"]) - ref_colour).max() > 40


def test_prompts_name_no_colour_or_shape(dataset, tool):
    for prompt in tool.PROMPTS:
        assert not FORBIDDEN_WORDS.search(prompt), prompt
    for ident in ids():
        prompt = (dataset / f"{ident}.txt").read_text().strip()
        assert prompt in tool.PROMPTS


# --- determinism -------------------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_differs(dataset, tmp_path):
    again = tmp_path / "again"
    run(again)
    assert file_bytes(again) == file_bytes(dataset)
    for ident in ids():
        assert np.array_equal(decode(again / f"{ident}.mp4"), decode(dataset / f"{ident}.mp4"))
    other = tmp_path / "other"
    run(other, "--seed", "1")
    assert file_bytes(other, ("_person.png",)) != file_bytes(dataset, ("_person.png",))


# --- markers -----------------------------------------------------------------------------------


def test_complete_dataset_is_kept_unless_forced(copy):
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    assert run(copy).stdout.startswith("kept complete dataset")
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before
    assert "--force" in run(copy, "--force").stdout
    assert (copy / "000.mp4").stat().st_mtime_ns != before["000.mp4"]


def test_half_written_dataset_is_detected_and_regenerated(copy, tool, monkeypatch):
    real_write = tool.write_sample
    calls = []

    def crash_on_third(out, ident, spec, *rest):
        calls.append(ident)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash")
        real_write(out, ident, spec, *rest)

    monkeypatch.setattr(tool, "write_sample", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        tool.main([str(copy), "--num-samples", str(N), "--write-meta", "--force"])
    assert (copy / ".generating").exists() and not (copy / ".complete").exists()
    assert not (copy / "003.mp4").exists()

    assert "half-written" in run(copy).stdout
    assert (copy / ".complete").exists() and not (copy / ".generating").exists()
    assert all((copy / f"{i}{s}").exists() for i in ids() for s in SUFFIXES)


def test_missing_file_or_changed_parameters_regenerate(copy):
    (copy / "002_object.png").unlink()
    assert "files missing" in run(copy).stdout
    assert (copy / "002_object.png").exists()

    out = run(copy, "--num-samples", "2").stdout  # later flag wins: 2 samples
    assert "num_samples 4 -> 2" in out
    assert not (copy / "002.mp4").exists() and not (copy / "003.txt").exists()  # no stale ids left


def test_folder_without_our_marker_is_refused_unless_forced(tmp_path):
    out = tmp_path / "someone_elses"
    out.mkdir()
    (out / "000.mp4").write_bytes(b"not ours")
    proc = run(out, check=False)
    assert proc.returncode != 0 and "--force" in proc.stderr
    assert (out / "000.mp4").read_bytes() == b"not ours"
    run(out, "--force")
    assert (out / ".complete").exists()


def test_frames_must_be_4k_plus_1(tmp_path):
    proc = run(tmp_path / "x", "--frames", "18", check=False)
    assert proc.returncode != 0 and "4k+1" in proc.stderr
