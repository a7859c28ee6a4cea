"""The conditioning cache against a second code path: batch_conditions on the same raw batch with the
same RNG states must give what it assembles from the cached entries (every
cacheable mode, dropouts, posterior samples). Then the real tools: precompute, stale and missing
entries, and a cached training run against an encoding one (mixed sizes, 2 processes, batch 2)."""

import contextlib
import dataclasses
import io
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT, read_scalars
from helpers_launch import launch_train, wait_all

from e2v.conditioning.cached import compute_entry, shared_entry
from e2v.conditioning.layout import batch_conditions
from e2v.config.load import load_config
from e2v.config.schema import ConfigError
from e2v.data.dataset import E2VDataset, collate, index_samples
from e2v.data.store import CacheError, CacheStore


def _cfg(data, cache_dir, *sets):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", [
        f"data.datasets.0.data_root={data}", f"cache.dir={cache_dir}", "validation.every_n_steps=0",
        "visualization.enabled=false", *sets])


def _fill(cfg, parts, samples):
    store = CacheStore(cfg)
    ds = E2VDataset(cfg, samples)
    for s in samples:
        item = ds.load(s)
        store.write(s, compute_entry(item, parts, cfg), item["element_names"])
    store.write_shared(*shared_entry(parts))
    return store


def _both(cfg, parts, samples, store, seed=3):
    raw = collate([E2VDataset(cfg, samples)[i] for i in range(len(samples))])
    cached = collate([{**store.load(s), "skipped": []} for s in samples])
    out = []
    for batch in (raw, cached):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        with torch.no_grad():
            out.append((batch_conditions(batch, parts, cfg, rng=rng, generator=gen), rng.random(),
                        torch.rand(1, generator=gen).item()))
    return out


MODES = {  # name -> overrides; each a cacheable layout
    "full_before_argmax": (),
    "index_before_sample_dropouts": ("processors.vae.frame_conditioning=index", "processors.vae.frame_index=1",
                                     "processors.vae.sample_mode=sample", "conditioning.target_sample_mode=sample",
                                     "conditioning.reference_dropout=0.5", "conditioning.caption_dropout=0.5"),
    "random_after": ("processors.vae.combine=after", "processors.vae.frame_conditioning=random",
                     "processors.vae.sample_mode=sample", "conditioning.reference_dropout=0.3"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_cached_conditions_equal_encoded(mode, demo_data, tiny_parts, tmp_path):
    cfg = _cfg(demo_data, tmp_path / "cache", *MODES[mode])
    samples = index_samples(cfg, verbose=False)[:3]
    store = _fill(cfg, tiny_parts, samples)
    (enc, enc_rng, enc_gen), (cac, cac_rng, cac_gen) = _both(cfg, tiny_parts, samples, store)
    assert (enc_rng, enc_gen) == (cac_rng, cac_gen), "the cached path must consume rng and generator identically"
    assert enc.kept == cac.kept and enc.ref_dropped == cac.ref_dropped and enc.caption_dropped == cac.caption_dropped
    for f in ("latents_BCTHW", "cond_BCTHW", "clip_BLD", "text_BLD"):
        a, b = getattr(enc, f), getattr(cac, f)
        assert a.shape == b.shape, f
        # batch-of-4 vs batch-of-1 encodes differ only by summation order
        torch.testing.assert_close(b, a, atol=5e-5, rtol=1e-5, msg=f"{mode}: {f}")
    if mode == "full_before_argmax":
        assert torch.count_nonzero(cac.cond_BCTHW[:, :4]) > 0 and torch.count_nonzero(cac.clip_BLD) > 0


def test_stale_and_missing_entries_name_sample_and_field(demo_data, tiny_parts, tmp_path):
    cfg = _cfg(demo_data, tmp_path / "cache")
    samples = index_samples(cfg, verbose=False)[:2]
    store = _fill(cfg, tiny_parts, samples)
    store.verify_all(samples)  # fresh: no error
    changed = dataclasses.replace(samples[0], prompt="a different caption")
    with pytest.raises(CacheError, match=f"sample {samples[0].id}: .*'prompt' changed"):
        store.verify_all([changed, samples[1]])
    os.utime(samples[1].elements["person"], ns=(1, 1))  # touched element image: mtime differs
    assert "'element.person' changed" in store.problem(samples[1])
    other = dataclasses.replace(samples[0], id="not_cached")
    with pytest.raises(CacheError, match="sample not_cached: no cache entry"):
        store.verify_all([other])
    res = _cfg(demo_data, tmp_path / "cache", "model.tiny_seed=1")
    assert "'model.tiny_seed' changed" in CacheStore(res).problem(samples[0])


def test_uncacheable_modes_are_refused(demo_data, tmp_path):
    with pytest.raises(ConfigError, match="combine: after"):
        _cfg(demo_data, tmp_path, "cache.enabled=true", "processors.vae.frame_conditioning=prefix")
    with pytest.raises(ConfigError, match="prepend"):
        _cfg(demo_data, tmp_path, "cache.enabled=true", "conditioning.target_layout=prepend")


# --- the real entry points -----------------------------------------------------------------------


def make_mixed_dataset(root, n_square=4, n_wide=4, bad_element=False):
    """Square 17-frame clips and wide 9-12-frame clips (two buckets), each with a person image;
    bad_element adds a square sample whose image is unreadable (found at load, not at indexing)
    and one with no person image at all (the required element: left out at indexing)."""
    from PIL import Image

    from e2v.data.demo import write_video

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    specs = [(17, 64, 64)] * n_square + [(9 + i % 4, 64, 112) for i in range(n_wide)]
    for i, (f, h, w) in enumerate(specs):
        base = rng.integers(0, 255, 3)
        frames = np.clip(base + rng.integers(-40, 40, (f, h, w, 3)), 0, 255).astype(np.uint8)
        write_video(root / f"{i:03d}.mp4", frames)
        (root / f"{i:03d}.txt").write_text(f"clip number {i} of colour {base.tolist()}")
        Image.fromarray(rng.integers(0, 255, (40, 32, 3), dtype=np.uint8)).save(root / f"{i:03d}_person.png")
    if bad_element:
        write_video(root / "bad.mp4", np.zeros((17, 64, 64, 3), np.uint8))
        (root / "bad.txt").write_text("a sample whose reference image is broken")
        (root / "bad_person.png").write_bytes(b"not a png")
        write_video(root / "noref.mp4", np.zeros((17, 64, 64, 3), np.uint8))
        (root / "noref.txt").write_text("a sample without its required person image")
    return root


MIXED = ("data.resolution_buckets=[[64,64],[64,112]]", "data.auto_frame_buckets=true", "data.frame_buckets=[9,17]",
         "validation.every_n_steps=0", "visualization.enabled=false", "train.micro_batch_size=2",
         "train.max_steps=3", "train.checkpoint_every=100", "data.num_workers=1", "data.on_bad_sample=skip")


# Put on PYTHONPATH, Python imports this as `sitecustomize` in every process (the deepspeed
# launcher and each rank): constructing the VAE, UMT5 or CLIP vision model raises, whether through
# from_pretrained or e2v's tiny builders (both call the class). Each process logs its pid, so the
# test knows the guard was active in the ranks.
ENCODER_GUARD = """
import importlib.abc
import importlib.machinery
import os
import sys

GUARDED = {"diffusers.models.autoencoders.autoencoder_kl_wan": ("AutoencoderKLWan",),
           "transformers.models.umt5.modeling_umt5": ("UMT5EncoderModel",),
           "transformers.models.clip.modeling_clip": ("CLIPVisionModel", "CLIPVisionModelWithProjection")}


def _forbid(cls):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"encoder guard: {cls.__name__} constructed")
    cls.__init__ = __init__


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    # patch when the module is first imported, so processes that never import it pay nothing
    def find_spec(self, name, path, target=None):
        if name not in GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for cls in GUARDED[name]:
                _forbid(getattr(module, cls))
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
with open(os.environ["E2V_GUARD_LOG"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


def encoder_guard_env(tmp) -> dict:
    guard = tmp / "encoder_guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(ENCODER_GUARD)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "E2V_GUARD_LOG": str(guard / "pids.txt")}


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
    with pytest.raises(BadSampleError, match="bad: .*bad_person.png"):
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


def test_a_cached_run_validates_and_visualizes_with_encoders_loaded_on_demand(demo_data, tiny_parts, tmp_path):
    """With cache.enabled the encoders are not resident: validation that needs them (here a
    negative prompt the cache does not hold; tests/test_hw_validation.py covers validation from
    the cache) loads them for the time it runs, visualization loads the VAE for each dump. Oracle: the same Validator / Visualizer given
    the resident encoders; the numbers and the contact sheet must be identical."""
    from PIL import Image

    from e2v.eval.validation import Validator, split_held_out
    from e2v.eval.viz import Visualizer
    from e2v.models.parts import Parts
    from e2v.train.step import draw_flow

    cfg = _cfg(demo_data, tmp_path / "cache", "cache.enabled=true", "validation.every_n_steps=2",
               "validation.num_samples=3", "validation.num_videos=1", "validation.num_inference_steps=2",
               "validation.guidance_scale=2", "validation.negative_prompt=blurry",
               "visualization.enabled=true", "visualization.frequency=1")
    _, held = split_held_out(index_samples(cfg, verbose=False), cfg)
    model = tiny_parts.transformer
    resident = Validator(cfg, held, tiny_parts, tmp_path / "resident", rank=0, device="cpu", dtype=torch.float32)
    on_demand = Validator(cfg, held, Parts(model), tmp_path / "on_demand", rank=0, device="cpu", dtype=torch.float32)
    want, got = resident.maybe_run(model, 0), on_demand.maybe_run(model, 0)
    assert "val/reference_gap_shuffle" in got and got == want
    assert (tmp_path / "on_demand/samples/step_000000/00.mp4").exists()

    batch = collate([E2VDataset(cfg, held)[i] for i in range(2)])
    with torch.no_grad():
        c = batch_conditions(batch, tiny_parts, cfg, rng=random.Random(0), generator=torch.Generator().manual_seed(0))
        sigma, _, noisy = draw_flow(c, cfg.flow, torch.Generator().manual_seed(0))
        pred = model(torch.cat([noisy, c.cond_BCTHW], 1), timestep=1000 * sigma, encoder_hidden_states=c.text_BLD,
                     encoder_hidden_states_image=c.clip_BLD, return_dict=False)[0]
    sheets = []
    for name, vae in (("resident", tiny_parts.vae), ("on_demand", None)):
        vis = Visualizer(cfg, tmp_path / name, vae, rank=0, device="cpu")
        vis.maybe_dump(1, batch, c, noisy, pred, sigma)
        vis.close()
        assert vis.vae is vae  # the loaded VAE is released after the dump
        sheets.append(np.asarray(Image.open(tmp_path / name / "visualizations/step_000001/contact_sheet.png")))
    assert np.array_equal(sheets[0], sheets[1])

    # A batch read from the cache holds no pixels: the sheet's references are read from the element
    # files again, the same tiles as the raw batch's (this crashed a cached demo at its first dump).
    store = _fill(cfg, tiny_parts, held[:2])
    from_cache = collate([E2VDataset(cfg, held[:2], store)[i] for i in range(2)])
    assert "vae_refs" not in from_cache
    vis = Visualizer(cfg, tmp_path / "from_cache", tiny_parts.vae, rank=0, device="cpu")
    vis.maybe_dump(1, from_cache, c, noisy, pred, sigma)
    vis.close()
    assert np.array_equal(np.asarray(Image.open(tmp_path / "from_cache/visualizations/step_000001/contact_sheet.png")),
                          sheets[0])
