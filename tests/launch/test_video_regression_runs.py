"""The video-regression recipe (configs/video_regression.yaml, docs/formats.md): a CSV of
clips, `flow.objective: x0` (loss on the clean-latent estimate x_t - sigma * v), timesteps drawn
only from `denoising_step_list`, and the seed's logged names.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_video_regression.py."""

import random

import pytest
import torch
from helpers_launch import run_train
from helpers_t2v import make_csv_videos
from helpers_video_regression import BATCH, CONFIG, NUM_FRAMES, SIZE, STEP_LIST, STEPS


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("regression_csv")
    make_csv_videos(data, num_clips=4, num_frames=NUM_FRAMES, height=SIZE, width=SIZE)
    out = tmp_path_factory.mktemp("regression_runs")
    proc = run_train(CONFIG, "model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}",
                     f"data.num_frames={NUM_FRAMES}", f"data.resolution=[{SIZE},{SIZE}]",
                     "train.mixed_precision='no'", "train.gradient_checkpointing=false",
                     f"train.micro_batch_size={BATCH}", f"train.max_steps={STEPS}", f"train.checkpoint_every={STEPS}",
                     f"output_dir={out}", "run_id=reg")
    return out / "reg", proc


@pytest.fixture(scope="module")
def scalars(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(trained_run[0] / "tb"))
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def test_run_logs_the_seed_names_and_only_listed_timesteps(scalars):
    buckets = {t for t in scalars if t.startswith("train/loss_at_time_")}
    assert buckets and buckets <= {f"train/loss_at_time_{t}" for t in STEP_LIST}, buckets
    for tag in ("train/target_latent_mean", "train/target_latent_std", "train/pred_latent_mean",
                "train/pred_latent_std", "train/loss"):
        assert sorted(scalars[tag]) == list(range(1, STEPS + 1)), tag


def test_first_logged_loss_is_the_hand_computed_x0_loss(trained_run, scalars):
    """Rebuild the run's first batch, sigmas and noise from its config and seed (the order
    train_e2v.py draws them), run the untrained transformer, and compute the x0 loss by hand."""
    from e2v.conditioning.layout import batch_conditions
    from e2v.config.load import load_config
    from e2v.data.dataset import index_samples, make_loader
    from e2v.models.load import load_parts
    from e2v.models.trainable import setup_training
    from e2v.train.flow import sample_sigmas

    run, _ = trained_run
    cfg = load_config(run / "config.yaml")
    parts = load_parts(cfg)
    setup_training(parts.transformer, cfg, expanded=False)
    rng, gen = random.Random(cfg.seed * 1000), torch.Generator().manual_seed(cfg.seed * 1000)
    batch = next(iter(make_loader(cfg, index_samples(cfg, verbose=False), rank=0, world=1)))
    with torch.no_grad():
        c = batch_conditions(batch, parts, cfg, rng=rng, generator=gen)
        x0 = c.latents_BCTHW
        sigma = sample_sigmas(BATCH, generator=gen, timestep_list=cfg.flow.denoising_step_list)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        v = parts.transformer(x_t, timestep=1000 * sigma, encoder_hidden_states=c.text_BLD, return_dict=False)[0]
        x0_hat = x_t - s * v
    per_sample = ((x0_hat - x0) ** 2).flatten(1).mean(1)

    assert scalars["train/loss"][1] == pytest.approx(per_sample.mean().item(), rel=1e-5)
    assert scalars["train/target_latent_mean"][1] == pytest.approx(x0.mean().item(), rel=1e-5, abs=1e-6)
    assert scalars["train/target_latent_std"][1] == pytest.approx(x0.std().item(), rel=1e-5)
    assert scalars["train/pred_latent_mean"][1] == pytest.approx(x0_hat.mean().item(), rel=1e-4, abs=1e-6)
    assert scalars["train/pred_latent_std"][1] == pytest.approx(x0_hat.std().item(), rel=1e-5)
    step1 = {}
    for t, l in zip((1000 * sigma).round().int().tolist(), per_sample.tolist()):
        step1.setdefault(f"train/loss_at_time_{t}", []).append(l)
    logged = {tag: vals[1] for tag, vals in scalars.items() if tag.startswith("train/loss_at_time_") and 1 in vals}
    assert logged.keys() == step1.keys()
    for tag, vals in step1.items():
        assert logged[tag] == pytest.approx(sum(vals) / len(vals), rel=1e-5)
