"""Hostile and odd data: every Pillow mode a reference may come in, EXIF orientation, oversized
images, prompts that are not UTF-8, paths that leave the data root, variable frame rate clips and
over-long prompts; the validator and training name each, and the validator never crashes."""

import json

import numpy as np
import pytest
from helpers import ROOT
from helpers_check_dataset import CONFIG, CSV_CONFIG, _cfg, clean_set, csv_set, hostile_set, run_check, unprinted
from PIL import Image

from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.data.media import ImageTooLargeError, MediaError, load_image

# --- references: modes, orientation, size ------------------------------------------------------

# mode -> (the image as a 2x1 array or a builder, the expected RGB pixels)
MODE_TABLE = {
    "I;16": (np.array([[0, 65535]], np.uint16), [(0, 0, 0), (255, 255, 255)]),
    "I;16-mid": (np.array([[257 * 100, 257 * 200]], np.uint16), [(100,) * 3, (200,) * 3]),
    "I-8bit": (np.array([[10, 250]], np.int32), [(10,) * 3, (250,) * 3]),
    "I-16bit": (np.array([[0, 257 * 128]], np.int32), [(0,) * 3, (128,) * 3]),
    "F-unit": (np.array([[0.0, 0.5]], np.float32), [(0,) * 3, (128,) * 3]),
    "F-8bit": (np.array([[3.0, 200.0]], np.float32), [(3,) * 3, (200,) * 3]),
    "1": (np.array([[False, True]]), [(0,) * 3, (255,) * 3]),
    "L": (np.array([[7, 77]], np.uint8), [(7,) * 3, (77,) * 3]),
    "LA": (np.array([[[0, 0], [100, 255]]], np.uint8), [(255,) * 3, (100,) * 3]),
    "RGB": (np.array([[[1, 2, 3], [4, 5, 6]]], np.uint8), [(1, 2, 3), (4, 5, 6)]),
    "RGBA": (np.array([[[255, 0, 0, 0], [0, 0, 255, 255]]], np.uint8), [(255, 255, 255), (0, 0, 255)]),
    "CMYK": (np.array([[[0, 0, 0, 0], [255, 0, 0, 0]]], np.uint8), [(255, 255, 255), (0, 255, 255)]),
    "YCbCr": (np.array([[[128, 128, 128], [255, 128, 128]]], np.uint8), [(128,) * 3, (255,) * 3]),
}


def _image(mode):
    arr, _ = MODE_TABLE[mode]
    pil_mode = mode.split("-")[0]
    if pil_mode in ("I;16", "CMYK", "YCbCr"):
        return Image.frombytes(pil_mode, (2, 1), arr.tobytes())
    if pil_mode == "1":
        return Image.fromarray(arr.astype(np.uint8) * 255).convert("1")
    return Image.fromarray(arr)


@pytest.mark.parametrize("mode", MODE_TABLE)
def test_every_mode_loads_to_the_right_8bit_rgb(tmp_path, mode):
    img = _image(mode)
    assert img.mode == mode.split("-")[0]
    # TIFF keeps every one of these modes on disk (PNG would store F / CMYK / YCbCr otherwise)
    path = tmp_path / ("ref.png" if img.mode in ("I;16", "1", "L", "LA", "RGB", "RGBA") else "ref.tiff")
    img.save(path)
    assert Image.open(path).mode == img.mode
    out = load_image(path)
    assert out.mode == "RGB"
    assert [tuple(p) for p in np.asarray(out)[0]] == MODE_TABLE[mode][1]


def test_palette_modes_composite_transparency_on_white(tmp_path):
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    pal.putdata([0, 1])
    pal.info["transparency"] = 0
    pal.save(tmp_path / "p.png", transparency=0)
    assert [tuple(p) for p in np.asarray(load_image(tmp_path / "p.png"))[0]] == [(255, 255, 255), (10, 20, 30)]
    pa = Image.frombytes("PA", (2, 1), bytes([1, 0, 1, 255]))
    pa.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    from e2v.data.media import to_rgb8

    assert [tuple(p) for p in np.asarray(to_rgb8(pa))[0]] == [(255, 255, 255), (10, 20, 30)]


def test_unscalable_float_image_stops_naming_the_file(tmp_path):
    Image.fromarray(np.array([[-5.0, 1000.0]], np.float32)).save(tmp_path / "hdr.tiff")
    with pytest.raises(MediaError, match=r"hdr.tiff: F image with values -5\.\.1000.*8-bit RGB PNG"):
        load_image(tmp_path / "hdr.tiff")


def test_exif_orientation_is_applied(tmp_path):
    """Stored 32 wide x 16 high, red left / blue right, EXIF orientation 6 (shown rotated 90 degrees
    clockwise): it loads 16 wide x 32 high with red on top, as diffusers' load_image shows it."""
    arr = np.zeros((16, 32, 3), np.uint8)
    arr[:, :16] = (255, 0, 0)
    arr[:, 16:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    out = np.asarray(load_image(tmp_path / "phone.jpg")).astype(int)
    assert out.shape == (32, 16, 3)
    assert out[4, 8, 0] > 200 and out[4, 8, 2] < 50  # top: red
    assert out[28, 8, 2] > 200 and out[28, 8, 0] < 50  # bottom: blue


def test_image_over_max_pixels_is_refused_before_decoding(tmp_path):
    Image.new("RGB", (100, 60)).save(tmp_path / "big.png")
    with pytest.raises(ImageTooLargeError, match=r"big.png: 100x60 = 0.0 MP is over data.max_image_pixels.*downscale"):
        load_image(tmp_path / "big.png", max_pixels=5999)
    assert load_image(tmp_path / "big.png", max_pixels=6000).size == (100, 60)


def test_max_image_pixels_bound_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="data.max_image_pixels=0 must be >= 1"):
        load_config(ROOT / "configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={tmp_path}", "data.max_image_pixels=0"])


# --- prompts that are not UTF-8, paths outside the root, oversized references: both policies ---


def _index_both_policies(tmp_path, config, named, sample_id, kind, *sets):
    """error: index_samples stops, naming `named`; skip: the sample is left out and counted."""
    from e2v.data.dataset import BadSampleError, index_samples

    with pytest.raises(BadSampleError, match=named):
        index_samples(_cfg(tmp_path, config, *sets), verbose=False)
    excluded = []
    samples = index_samples(_cfg(tmp_path, config, "data.on_bad_sample=skip", *sets), verbose=False,
                            excluded=excluded)
    assert [(p.sample, p.kind) for p in excluded] == [(sample_id, kind)]
    assert sample_id not in {s.id for s in samples} and len(samples) == 3
    return excluded[0]


def test_folder_prompt_not_utf8_is_a_named_bad_sample(tmp_path):
    data = clean_set(tmp_path / "data")
    (data / "001.txt").write_bytes(b"a caf\xe9 scene")  # latin-1
    p = _index_both_policies(tmp_path, CONFIG, r"001.txt: prompt is not UTF-8 text.*iconv", "001", "not_utf8")
    assert p.file == str(data / "001.txt")


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_manifest_row_not_utf8_names_file_and_line(tmp_path, kind):
    meta = csv_set(tmp_path / "data", [("000", "clip 0"), ("001", "clip 1"), ("002", "clip 2"), ("003", "clip 3")])
    config = CSV_CONFIG
    if kind == "jsonl":
        meta = meta.parent / "train.jsonl"
        meta.write_bytes(b"".join(json.dumps({"path": f"../{i:03d}.mp4", "prompt": f"clip {i}",
                                              "person": f"../{i:03d}_person.png"}).encode() + b"\n" for i in range(4)))
        config = CSV_CONFIG.replace("dataset_type: csv, metadata_path: lists/meta.csv",
                                    "dataset_type: jsonl, metadata_path: lists/train.jsonl")
    meta.write_bytes(meta.read_bytes().replace(b"clip 1", b"clip \xe91"))
    line = 3 if kind == "csv" else 2
    p = _index_both_policies(tmp_path, config, rf"{meta.name} line {line}: 'prompt' not UTF-8 text",
                             "000001_001", "not_utf8")
    assert p.file == f"{meta} line {line}"


def test_paths_outside_the_root_are_refused_unless_allowed(tmp_path):
    meta = csv_set(tmp_path / "data", [("000", "clip 0"), ("001", "clip 1"), ("002", "clip 2"), ("003", "clip 3")])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes((tmp_path / "data/001_person.png").read_bytes())
    text = meta.read_text()
    for variant in (f"{outside}/secret.png", "../../outside/secret.png", "../link.png"):
        if variant == "../link.png":
            (tmp_path / "data/link.png").symlink_to(outside / "secret.png")
        meta.write_text(text.replace("../001_person.png", variant))
        p = _index_both_policies(tmp_path, CSV_CONFIG, r"meta.csv line 3: 'person' path .*outside the dataset root "
                                 r".*data.allow_outside_root: true", "000001_001", "outside_root")
        assert str(outside / "secret.png") in p.problem
        from e2v.data.dataset import index_samples

        allowed = index_samples(_cfg(tmp_path, CSV_CONFIG, "data.allow_outside_root=true"), verbose=False)
        assert len(allowed) == 4
    # an e2v folder: a symlinked reference that leads out
    data = tmp_path / "data"
    (data / "001_person.png").unlink()
    (data / "001_person.png").symlink_to(outside / "secret.png")
    _index_both_policies(tmp_path, CONFIG, "001_person.png: element 'person' symlink", "001", "outside_root")


def test_oversized_reference_is_a_bad_sample_in_training(tmp_path):
    from e2v.data.dataset import BadSampleError, E2VDataset, index_samples

    data = clean_set(tmp_path / "data", n=3)
    Image.new("RGB", (400, 300)).save(data / "001_person.png")
    cfg = _cfg(tmp_path, CONFIG, "data.max_image_pixels=100000")
    with pytest.raises(BadSampleError, match=r"001_person.png: element 'person' 400x300 = 0.1 MP is over "
                                             r"data.max_image_pixels"):
        index_samples(cfg, verbose=False)  # the start-up check names it
    samples = index_samples(_cfg(tmp_path, CONFIG), verbose=False)  # checked under the default limit: the loader's own
    with pytest.raises(BadSampleError, match=r"001_person.png: 400x300 = 0.1 MP is over data.max_image_pixels"):
        E2VDataset(cfg, samples)[1]
    cfg = _cfg(tmp_path, CONFIG, "data.max_image_pixels=100000", "data.on_bad_sample=skip")
    item = E2VDataset(cfg, samples)[1]
    assert item["id"] == "002" and [s for s, _ in item["skipped"]] == ["001"]


# --- the validator on a folder with every hostile input -----------------------------------------


def test_validator_names_every_hostile_input_once_and_writes_its_report(tmp_path):
    data, expected = hostile_set(tmp_path / "data")
    proc, report = run_check(tmp_path, data, "--set", "data.max_image_pixels=100000")
    assert "Traceback" not in proc.stderr and report is not None, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stdout
    found = [(p["sample"], p["kind"]) for p in report["problems"]]
    assert sorted(found) == sorted(expected), f"missing {expected - set(found)}, unexpected {set(found) - expected}"
    by_kind = {p["kind"]: p for p in report["problems"]}
    assert by_kind["not_utf8"]["file"] == str(data / "030.txt")
    assert "counted with the configured tokenizer" in by_kind["prompt_too_long"]["problem"]
    assert "0.125 to 0.188 s apart" in by_kind["variable_fps"]["problem"]
    assert unprinted(report, proc.stdout) == []
