"""The `opens2v` source on a fixture in OpenS2V-5M's own JSON schema (docs/formats.md, "OpenS2V-5M"),
built here from generated clips and masks RLE-encoded with pycocotools: the references equal the
masks' pixels, the crop box reaches video and references alike, the valid frame range is kept,
every defect is named by the validator, and a tiny run trains from it through the launcher.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_opens2v.py."""

from __future__ import annotations

from helpers import ROOT
from helpers_launch import run_train
from helpers_opens2v import dataset_sets


def test_cache_then_a_tiny_run_through_the_launcher(fixture_root, tmp_path, capsys):
    """tools/precompute.py fills the cache (the crop-outside entry left out by the start-up check); the entries stay
    valid when the cut references are deleted (keyed by what shaped them, not the files' mtimes);
    then a tiny run trains from the cache through the launcher."""
    import shutil

    from tools.precompute import main

    sets = dataset_sets(fixture_root) + [f"cache.dir={tmp_path / 'cache'}", "data.on_bad_sample=skip",
                                         "data.num_frames=17", "train.micro_batch_size=1"]
    argv = ["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), *[a for s in sets for a in ("--set", s)]]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # one count for the run: the two entries discovery refused (bad RLE, missing video) and the crop outside
    assert "left out: 3 sample(s) unusable (3 problem(s))" in out and "crop_outside" in out, out
    assert "wrote 3 entries (0 bad samples recorded)" in out, out
    shutil.rmtree(fixture_root / ".e2v_opens2v")
    assert main(argv) == 0
    assert "3 cached and valid, 0 to compute" in capsys.readouterr().out
    runs = tmp_path / "runs"
    proc = run_train(str(ROOT / "configs/e2v_tiny_lora.yaml"), *sets, "cache.enabled=true", f"output_dir={runs}",
                     "run_id=o", "train.max_steps=2", "validation.every_n_steps=0")
    text = proc.stdout + proc.stderr
    assert "opens2v Jsons/total_part*.json: 6 entries -> 4 samples" in text, text[-3000:]
    assert (runs / "o").exists()
