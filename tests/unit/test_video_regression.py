"""The video-regression recipe (configs/video_regression.yaml, docs/formats.md): a CSV of
clips, `flow.objective: x0` (loss on the clean-latent estimate x_t - sigma * v), timesteps drawn
only from `denoising_step_list`, and the seed's logged names.

This file: the in-process tests; the ones that train through the launcher are in tests/launch/test_video_regression_runs.py."""

import pytest
import torch
from helpers_video_regression import CONFIG, SIZE, STEP_LIST


def test_shipped_config_maps_the_seed_keys():
    from e2v.config.load import load_config

    cfg = load_config(CONFIG, check_paths=False)
    ds = cfg.data.datasets[0]
    assert (ds.dataset_type, ds.data_root, ds.metadata_path) == ("csv", "data/regression", "metadata.csv")
    assert (cfg.data.num_frames, cfg.data.resolution, cfg.data.time_division_factor) == (81, [480, 832], 4)
    assert cfg.flow.objective == "x0" and cfg.flow.denoising_step_list == STEP_LIST
    assert cfg.e2v_type == "none" and cfg.model.base == "t2v"
    assert (cfg.train.micro_batch_size, cfg.train.checkpoint_every) == (1, 500)


def test_seed_keys_load_literally(tmp_path, monkeypatch, capsys):
    """A config written with the seed's own key names maps onto the same schema, with a note per key."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    seed = tmp_path / "seed.yaml"
    seed.write_text("dataset_base_path: data\nmetadata_path: data/metadata.csv\nnum_frames: 81\nheight: 480\n"
                    "width: 832\ntime_division_factor: 4\nbatch_size: 2\nlr: 2.0e-5\nmax_steps: 300\n"
                    "save_interval: 100\ndenoising_step_list: [1000, 750, 500, 250]\n"
                    "model: {preset: tiny, base: t2v}\n")
    cfg = load_config(seed)
    ds = cfg.data.datasets[0]
    assert (ds.dataset_type, ds.data_root, ds.metadata_path) == ("csv", "data", str(tmp_path / "data/metadata.csv"))
    assert ds.media_root == "data" and cfg.data.auto_frame_buckets
    assert (cfg.data.num_frames, cfg.data.resolution, cfg.data.time_division_factor) == (81, [480, 832], 4)
    assert (cfg.train.micro_batch_size, cfg.train.lr, cfg.train.max_steps, cfg.train.checkpoint_every) == (2, 2e-5, 300, 100)
    assert cfg.flow.denoising_step_list == STEP_LIST and cfg.flow.objective == "x0" and cfg.e2v_type == "none"
    out = capsys.readouterr().out
    assert "seed key 'save_interval' -> train.checkpoint_every = 100" in out and "flow.objective = x0" in out
    seed.write_text(seed.read_text() + "train: {lr: 1.0e-4}\n")
    with pytest.raises(ConfigError, match="seed key 'lr' and train.lr are both set"):
        load_config(seed)


def test_only_a_recognisable_seed_file_is_mapped(tmp_path, monkeypatch, capsys):
    """The seed mapping applies only to a YAML with a top-level dataset_base_path (docs/formats.md);
    it says when it sets e2v_type: none, and refuses to drop elements the file names."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    seed = tmp_path / "seed.yaml"
    seed.write_text("dataset_base_path: data\nmetadata_path: data/metadata.csv\nheight: 32\nwidth: 32\n"
                    "num_frames: 9\nmodel: {preset: tiny, base: t2v}\n")
    assert load_config(seed).e2v_type == "none"
    assert "e2v_type = none (plain T2V, no elements; set e2v_type to change it)" in capsys.readouterr().out
    with_elements = tmp_path / "with_elements.yaml"
    with_elements.write_text(seed.read_text() + "data: {elements: [{name: person, suffixes: [_person.png]}]}\n")
    with pytest.raises(ConfigError, match="trains plain T2V .* but data.elements is set: set e2v_type"):
        load_config(with_elements)
    no_mark = tmp_path / "no_mark.yaml"  # seed keys without dataset_base_path: our YAML, keys misplaced
    no_mark.write_text("save_interval: 100\nmodel: {preset: tiny, base: t2v}\n")
    with pytest.raises(ConfigError, match=r"save_interval: not a top-level key; did you mean "
                                          r"train.checkpoint_every\? \('save_interval' is a video-regression seed "
                                          r"key: a seed file is recognised by its top-level dataset_base_path"):
        load_config(no_mark)


def test_seed_csv_elsewhere_and_short_clips_train_at_their_largest_4k_plus_1(tmp_path, monkeypatch):
    """The seed's paths are relative to dataset_base_path even when its CSV lives elsewhere, and
    time_division_factor 4 trims each clip to k * 4 + 1 frames: with num_frames 17 an 11-frame clip
    trains at 9 (its first 9 frames), a 20-frame clip at 17, and a 3-frame clip is too short."""
    import numpy as np
    from helpers_t2v import make_clip

    from e2v.config.load import load_config
    from e2v.data.dataset import BadSampleError, E2VDataset, index_samples

    monkeypatch.chdir(tmp_path)
    (tmp_path / "media/clips").mkdir(parents=True)
    (tmp_path / "lists").mkdir()
    frames = {n: make_clip(n, n, SIZE, SIZE) for n in (11, 20, 3)}
    for n, f in frames.items():
        np.savez(tmp_path / f"media/clips/{n}.npz", frames=f)
    (tmp_path / "lists/train.csv").write_text("video,prompt\n" + "".join(f"clips/{n}.npz,clip {n}\n" for n in frames))
    seed = tmp_path / "seed.yaml"
    seed.write_text(f"dataset_base_path: media\nmetadata_path: lists/train.csv\nnum_frames: 17\nheight: {SIZE}\n"
                    f"width: {SIZE}\ntime_division_factor: 4\nmodel: {{preset: tiny, base: t2v}}\n")
    with pytest.raises(BadSampleError, match="3.npz: too short: 3 frames, the shortest frame bucket 5"):
        index_samples(load_config(seed), verbose=False)
    cfg = load_config(seed, ["data.on_bad_sample=skip"])
    samples = index_samples(cfg, verbose=False)
    assert {s.video.name: s.bucket[0] for s in samples} == {"11.npz": 9, "20.npz": 17}
    item = E2VDataset(cfg, samples)[0]
    assert item["id"] == "000000_11" and item["video"].shape == (3, 9, SIZE, SIZE)
    expected = torch.from_numpy(frames[11][:9]).permute(3, 0, 1, 2)  # uint8: [-1, 1] on the device
    torch.testing.assert_close(item["video"], expected, atol=0, rtol=0)


def test_x0_loss_equals_the_euler_jump_to_sigma_zero():
    """Oracle: diffusers' FlowMatchEulerDiscreteScheduler stepping from sigma to 0 with the model's
    velocity gives its clean-latent estimate; the x0 loss is the MSE of that against x0. A second
    identity: x0_hat - x0 = sigma * (v_target - v), so the x0 loss is sigma^2 times the flow loss."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from e2v.train.flow import add_noise, per_sample_mse, velocity_target, x0_from_velocity

    g = torch.Generator().manual_seed(3)
    x0, noise, v = (torch.randn(3, 16, 2, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([1.0, 0.75, 0.25])
    x_t = add_noise(x0, noise, sigma)
    loss = per_sample_mse(x0_from_velocity(x_t, v, sigma), x0)

    oracle = []
    for i, s in enumerate(sigma.tolist()):
        sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
        sched.set_timesteps(sigmas=[s])
        x_t_i = (1 - s) * x0[i:i + 1] + s * noise[i:i + 1]
        x0_hat = sched.step(v[i:i + 1], sched.timesteps[0], x_t_i).prev_sample
        oracle.append(((x0_hat - x0[i:i + 1]) ** 2).mean())
    torch.testing.assert_close(loss, torch.stack(oracle), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, sigma ** 2 * per_sample_mse(v, velocity_target(x0, noise)), rtol=1e-5, atol=0)


def test_only_listed_timesteps_are_sampled():
    from e2v.train.flow import sample_sigmas

    g = torch.Generator().manual_seed(0)
    for mode in ("uniform", "logit_normal"):
        sigma = sample_sigmas(4000, generator=g, mode=mode, shift=5.0, timestep_list=STEP_LIST)
        values, counts = torch.unique(sigma, return_counts=True)
        assert values.tolist() == [0.25, 0.5, 0.75, 1.0]  # unshifted: the listed timesteps / 1000
        assert (counts.float() / 4000 - 0.25).abs().max() < 0.03  # each equally likely
    free = sample_sigmas(4000, generator=g, shift=5.0)
    assert len(torch.unique(free)) > 3900  # without a list: continuous
