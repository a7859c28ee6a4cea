"""tools/check_dataset.py on a dataset with one defect per sample: it must name each defect (sample
and kind) and nothing else, exit 1 because some would fail training, and exit 0 on a clean set."""


import pytest
from helpers_check_dataset import CONFIG, CSV_CONFIG, clean_set, csv_set, defect_set, run_check, unprinted
from PIL import Image


def test_every_defect_named_and_nothing_else(tmp_path):
    data, expected = defect_set(tmp_path / "data")
    proc, report = run_check(tmp_path, data, "--contact-sheet", str(tmp_path / "sheets"))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some samples would fail training
    found = {(p["sample"], p["kind"]) for p in report["problems"]}
    assert found == expected, f"missing {expected - found}, unexpected {found - expected}"
    orphans = sorted(p["file"] for p in report["problems"] if p["kind"] == "orphan_file")
    assert orphans == [str(data / "001_persn.png"), str(data / "099_person.png")]
    assert unprinted(report, proc.stdout) == []  # a line per problem (file: problem -> fix), a frequent warning counted
    assert "decord" in next(p["problem"] for p in report["problems"] if p["sample"] == "011")
    errors = {p["kind"] for p in report["problems"] if p["severity"] == "error"}
    assert errors == {"video_unreadable", "too_short", "element_unreadable", "element_missing", "empty_caption",
                      "duplicate_id"}
    assert report["summary"]["samples_per_s"] > 0 and "samples/s" in proc.stdout
    sheets = sorted(p.name for p in (tmp_path / "sheets").glob("*.png"))
    assert "0_000.png" in sheets and "0_010.png" not in sheets  # a sheet per decodable sample
    sheet = Image.open(tmp_path / "sheets/0_019.png")
    assert sheet.height == 96 and sheet.width > 4 * 96  # references + first, middle, last frame


def test_clean_set_passes_and_small_bucket_is_named(tmp_path):
    data = clean_set(tmp_path / "data")
    proc, report = run_check(tmp_path, data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(p["sample"], p["kind"]) for p in report["problems"]] == [(f"{i:03d}", "element_absent") for i in range(4)]
    assert report["summary"]["samples_ok"] == 4
    proc, report = run_check(tmp_path, data, "--world_size", "4")  # 4 samples < batch 2 x 4 ranks
    assert proc.returncode == 1
    assert [(p["sample"], p["kind"]) for p in report["problems"] if p["severity"] == "error"] == [
        ("bucket 9x64x64", "small_bucket")]


@pytest.mark.parametrize("bad", ["corrupt", "empty_prompt"])
def test_training_data_skips_and_counts_or_stops_naming_the_file(tmp_path, bad):
    """on_bad_sample: error names the file; skip replaces the sample and reports it in the batch."""
    from e2v.config.load import load_config
    from e2v.data.dataset import BadSampleError, E2VDataset, index_samples

    data = clean_set(tmp_path / "data", n=3)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(CONFIG.replace("DATA", str(data)))
    cfg = load_config(cfg_path)
    samples = index_samples(cfg, verbose=False)  # the start-up check passes; the file breaks mid-run
    if bad == "corrupt":
        (data / "001.mp4").write_bytes(b"\x00" * 500)
    else:
        (data / "001.txt").write_text("")
        samples[1].prompt = ""
    named = "001.mp4" if bad == "corrupt" else f"{data / '001.txt'}: empty prompt"
    with pytest.raises(BadSampleError, match=named):
        E2VDataset(cfg, samples)[1]
    cfg = load_config(cfg_path, ["data.on_bad_sample=skip"])
    dataset = E2VDataset(cfg, samples)
    item = dataset[1]
    assert item["id"] == "002" and [s for s, _ in item["skipped"]] == ["001"]
    # the next epoch: the known-bad sample is neither loaded again nor reported (counted) again
    loaded, load = [], dataset.load
    dataset.load = lambda s: loaded.append(s.id) or load(s)
    item = dataset[1]
    assert item["id"] == "002" and item["skipped"] == [] and loaded == ["002"]


def test_csv_repeated_row_warns_and_empty_prompt_names_its_line(tmp_path):
    meta = csv_set(tmp_path / "data", [("000", "clip 0"), ("001", "clip 1"), ("002", "clip 2"), ("000", "clip 0 again")])
    proc, report = run_check(tmp_path, tmp_path / "data", config=CSV_CONFIG)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a repeated row trains twice: nothing fails
    assert [(p["sample"], p["kind"], p["severity"], p["file"]) for p in report["problems"]
            if p["kind"] != "element_absent"] == [("000003_000", "duplicate_id", "warning", f"{meta} line 5")]
    meta.write_text(meta.read_text().replace("clip 1", ""))
    proc, report = run_check(tmp_path, tmp_path / "data", config=CSV_CONFIG)
    assert proc.returncode == 1
    empty = next(p for p in report["problems"] if p["kind"] == "empty_caption")
    assert empty["sample"] == "000001_001" and empty["file"] == f"{meta} line 3"


@pytest.mark.parametrize("defect", ["missing", "malformed"])
def test_unreadable_metadata_is_a_reported_problem(tmp_path, defect):
    meta = csv_set(tmp_path / "data", [("000", "clip 0")])
    config = CSV_CONFIG
    if defect == "missing":
        meta.unlink()
        where = str(meta)
    else:
        config = config.replace("dataset_type: csv, metadata_path: lists/meta.csv",
                                "dataset_type: jsonl, metadata_path: lists/train.jsonl")
        (meta.parent / "train.jsonl").write_text('{"path": "../000.mp4", "prompt": "p"}\n{"path": oops}\n')
        where = f"{meta.parent / 'train.jsonl'} line 2"
    proc, report = run_check(tmp_path, tmp_path / "data", config=config)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (p,) = report["problems"]
    assert (p["kind"], p["severity"], p["file"]) == ("metadata_unreadable", "error", where)
    assert f"{p['file']}: {p['problem']} -> {p['fix']}" in proc.stdout


def test_bucket_occupancy_counts_repeats_as_training_does(tmp_path):
    """4 clips with repeat 2 fill a batch of 2 x 4 ranks: not a small bucket, and the checker's
    table is the one training prints."""
    from e2v.config.load import load_config
    from e2v.data.buckets import bucket_table
    from e2v.data.dataset import index_samples

    data = clean_set(tmp_path / "data")
    config = CONFIG.replace("datasets: [{data_root: DATA}]", "datasets: [{data_root: DATA, repeat: 2}]")
    proc, report = run_check(tmp_path, data, "--world_size", "4", config=config)
    assert proc.returncode == 0 and {p["kind"] for p in report["problems"]} == {"element_absent"}, proc.stdout
    cfg = load_config(tmp_path / "cfg.yaml")
    table, small = bucket_table(index_samples(cfg, verbose=False), cfg, world=4)
    assert small == [] and table in proc.stdout and "9x64x64         8" in table
