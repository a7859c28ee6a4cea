"""The conditioning cache against a second code path: batch_conditions on the same raw batch with the
same RNG states must give what it assembles from the cached entries (every
cacheable mode, dropouts, posterior samples). Then the real tools: precompute, stale and missing
entries, and a cached training run against an encoding one (mixed sizes, 2 processes, batch 2).

This file: the tests that start processes (training through the launcher, the encoder guard's
negative control in an interpreter of its own); the in-process ones are in tests/unit/test_cache.py."""

import contextlib
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, read_scalars
from helpers_cache import encoder_guard_env, make_mixed_dataset
from helpers_launch import launch_train, wait_all

from e2v.config.load import load_config
from e2v.data.dataset import index_samples
from e2v.data.store import CacheError, CacheStore

MIXED = ("data.resolution_buckets=[[64,64],[64,112]]", "data.auto_frame_buckets=true", "data.frame_buckets=[9,17]",
         "validation.every_n_steps=0", "visualization.enabled=false", "train.micro_batch_size=2",
         "train.max_steps=3", "train.checkpoint_every=100", "data.num_workers=1", "data.on_bad_sample=skip")


@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory):
    """The same mixed-size data and seed trained twice with 2 processes and batch 2: encoding every
    step, and from a cache filled by tools/precompute.py; the cached run under the encoder guard."""
    tmp = tmp_path_factory.mktemp("mixed")
    # buckets of 4 = batch 2 x 2 ranks; the two bad samples are left out by the start-up check
    data = make_mixed_dataset(tmp / "data", n_square=4, bad_element=True)
    sets = (f"data.datasets.0.data_root={data}", f"output_dir={tmp / 'runs'}", f"cache.dir={tmp / 'cache'}", *MIXED)
    from tools.precompute import main as precompute

    enc = launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=encoded", num_gpus=2)  # meanwhile: precompute
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert precompute(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                               *[a for s in sets for a in ("--set", s)]]) == 0
        pre = printed.getvalue()
    except BaseException:
        enc.kill()
        raise
    cac = launch_train("configs/e2v_tiny_lora.yaml", *sets, "run_id=cached", "cache.enabled=true", num_gpus=2,
                       env=encoder_guard_env(tmp))
    enc, cac = wait_all(enc, cac)
    return tmp, pre, enc, cac


def test_mixed_sizes_train_with_two_processes(mixed_runs):
    tmp, pre, enc, cac = mixed_runs
    assert "wrote 8 entries (0 bad samples recorded)" in pre  # the broken ones never reach it
    assert "17x64x64" in enc.stdout and "9x64x112" in enc.stdout  # the printed bucket table
    for run, proc in (("encoded", enc), ("cached", cac)):  # the broken samples: left out at start, named, counted
        assert "element 'person' unreadable" in proc.stdout and "bad_person.png" in proc.stdout, run
        assert "required element 'person' missing -> add one of noref_person.png" in proc.stdout, run
        assert "[e2v] left out 2 bad sample(s) at the start" in proc.stdout, run
        assert "skipped bad sample" not in proc.stdout + proc.stderr, run  # nothing is found mid-run
        last = read_scalars(tmp / "runs" / run)[3]  # TensorBoard's counts: every rank's skips, and the start's
        assert last.get("data/skipped_samples", 0) == 0 and last["data/excluded_samples"] == 2, run
    losses = [read_scalars(tmp / "runs/encoded")[s]["train/loss"] for s in (1, 2, 3)]
    assert all(np.isfinite(losses))


def test_cached_run_matches_encoded_run_without_encoders(mixed_runs):
    tmp, _, enc, cac = mixed_runs
    assert "frozen encoders loaded: vae, text_encoder, image_encoder" in enc.stdout
    assert "frozen encoders loaded: none" in cac.stdout
    # The cached run succeeded under the guard (it raises on any VAE / UMT5 / CLIP construction),
    # and the guard was loaded in the launcher and both ranks.
    pids = set((tmp / "encoder_guard/pids.txt").read_text().split())
    assert len(pids) >= 3, pids
    a, b = read_scalars(tmp / "runs/encoded"), read_scalars(tmp / "runs/cached")
    for step in (1, 2, 3):
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-5, abs=1e-6), step


def test_entries_recorded_bad_are_listed_when_on_bad_sample_is_error(mixed_runs, tmp_path):
    """An entry a skip run recorded as bad (a sample that broke while precompute ran); with
    on_bad_sample: error, the start-up check and precompute itself list it instead of training until
    the first step that draws it. A sample broken before the start never reaches the cache."""
    tmp = mixed_runs[0]
    shutil.copytree(tmp / "cache", tmp_path / "cache")  # the module's cache stays as precompute left it
    sets = [f"data.datasets.0.data_root={tmp / 'data'}", f"cache.dir={tmp_path / 'cache'}", *MIXED]
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", sets + ["cache.enabled=true", "data.on_bad_sample=skip"])
    samples = index_samples(cfg, verbose=False)
    victim = next(s for s in samples if s.id == "001")
    CacheStore(cfg).write_bad(victim, f"{victim.elements['person']}: broke while precompute read it")
    CacheStore(cfg).verify_all(samples)  # skip: a recorded bad sample is fine
    cfg.data.on_bad_sample = "error"
    with pytest.raises(CacheError, match=r"1 cache entry is recorded as bad.*\n  sample 001: .*001_person.png"):
        CacheStore(cfg).verify_all(samples)
    from e2v.data.dataset import BadSampleError
    from tools.precompute import main

    for f in ("noref.mp4", "noref.txt"):  # else indexing stops first, on its missing required element
        (tmp / "data" / f).unlink()
    with pytest.raises(BadSampleError, match=r"1 sample\(s\) unusable .*\n.*element_unreadable .*bad_person.png"):
        main(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), *[a for s in sets for a in ("--set", s)],
              "--set", "data.on_bad_sample=error"])


def test_precompute_resumes_and_training_refuses_a_stale_cache(mixed_runs, capsys):
    from tools.precompute import main

    tmp, _, _, _ = mixed_runs
    sets = [f"data.datasets.0.data_root={tmp / 'data'}", f"cache.dir={tmp / 'cache'}", *MIXED]
    assert main(["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), *[a for s in sets for a in ("--set", s)]]) == 0
    assert "8 cached and valid, 0 to compute" in capsys.readouterr().out
    (tmp / "data/002.txt").write_text("a new caption")
    cfg = load_config(ROOT / "configs/e2v_tiny_lora.yaml", sets + ["cache.enabled=true"])
    from e2v.data.dataset import make_loader

    with pytest.raises(CacheError, match="sample 002: .*'prompt' changed"):
        make_loader(cfg, index_samples(cfg, verbose=False), rank=0, world=1)


def test_encoder_guard_stops_every_encoder_construction(tmp_path):
    """The guard's negative control: under it, e2v's tiny builders fail on the VAE, UMT5 and CLIP
    (the transformer alone still builds), so a cached run that built one could not pass."""
    script = """
import sys
sys.path.insert(0, {root!r})
from e2v.models.tiny import build_tiny_parts
from e2v.models.tiny_vae import build_tiny_vae
from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection, UMT5Config, UMT5EncoderModel
build_tiny_parts(seed=0, with_encoders=False)
for build in (lambda: build_tiny_vae(0), lambda: UMT5EncoderModel(UMT5Config(d_model=8, num_layers=1)),
              lambda: CLIPVisionModel(CLIPVisionConfig(hidden_size=8, num_attention_heads=2)),
              lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=8, num_attention_heads=2))):
    try:
        build()
    except RuntimeError as e:
        print(e)
""".format(root=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, **encoder_guard_env(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:4] == [f"encoder guard: {c} constructed" for c in (
        "AutoencoderKLWan", "UMT5EncoderModel", "CLIPVisionModel", "CLIPVisionModelWithProjection")]
