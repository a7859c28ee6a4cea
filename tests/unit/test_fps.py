"""data.fps: frames sampled by time from the container's timestamps. The index choice against
hand-computed oracles, a real variable-rate clip (made by ffmpeg with explicit timestamps), a
constant-rate clip where by time at its own rate equals by index, one frame count for the buckets
of training and of tools/check_dataset.py, the cache fingerprint, and `.npz` clips (no clock)."""

import decord
import numpy as np
import pytest
import torch
from helpers_check_dataset import CONFIG, _cfg, clean_set, clip, run_check, sample, vfr_clip
from PIL import Image

from e2v.config.schema import ConfigError
from e2v.data.dataset import E2VDataset, index_samples
from e2v.data.media import (
    NoClockError,
    TooShortError,
    frame_indices,
    frames_at_rate,
    frames_to_video,
    load_video,
    supported_frames,
    time_indices,
)
from e2v.data.store import fingerprint

# vfr_clip's frame times: 0.125 s apart for 13 frames, then 0.1875 s (checked against decord below)
VFR_TIMES = np.array([0.125 * i for i in range(13)] + [1.5 + 0.1875 * i for i in range(1, 12)])
# at 4 fps (t_k = k / 4): the frame nearest each target, by hand. 1.75 s lies between 1.6875 (13)
# and 1.875 (14): 13; 2.0 between 1.875 (14) and 2.0625 (15): 15; and so on. 3.5625 s give 15 targets.
VFR_AT_4FPS = [0, 2, 4, 6, 8, 10, 12, 13, 15, 16, 17, 19, 20, 21, 23]


def test_time_indices_against_hand_oracles():
    # uneven times (binary fractions: exact ties) at 8 fps: 0.25 s is equally far from 0.125 and
    # 0.375 (the earlier wins); 0.5 is nearest 0.4375, 0.625 nearest 0.75; the last frame at 0.75 s
    # lets 0.75 * 8 + 1 = 7 targets fit
    times = np.array([0.0, 0.125, 0.375, 0.4375, 0.75])
    assert frames_at_rate(times, 8) == 7
    assert time_indices(times, 8, 7) == [0, 1, 1, 2, 3, 4, 4]
    assert frames_at_rate(VFR_TIMES, 4) == 15
    assert time_indices(VFR_TIMES, 4, 15) == VFR_AT_4FPS
    # stride applies on top: every 2nd sample at 8 fps is a sample at 4 fps
    assert time_indices(VFR_TIMES, 8, 8, stride=2) == VFR_AT_4FPS[:8]
    with pytest.raises(TooShortError, match=r"needs 16 frames at data.fps 4 .* give 15"):
        time_indices(VFR_TIMES, 4, 16)
    # a constant rate at its own rate is index sampling, also with a stride and a start offset of 3 s
    cfr = 3.0 + np.arange(81) / 16
    assert frames_at_rate(cfr, 16) == 81
    assert time_indices(cfr, 16, 81) == frame_indices(81, 81)
    assert time_indices(cfr, 16, 21, stride=4) == frame_indices(81, 21, stride=4)
    # 29.97 asked of an NTSC clip (30000/1001 fps): every frame still, not one short by rounding
    ntsc = np.arange(81) * 1001 / 30000
    assert frames_at_rate(ntsc, 29.97) == 81 and time_indices(ntsc, 29.97, 81) == list(range(81))
    # above the clip's rate frames repeat: 16 fps of an 8 fps clip
    assert time_indices(np.arange(5) / 8, 16, 9) == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_variable_rate_clip_is_sampled_by_time(tmp_path):
    path = tmp_path / "vfr.mp4"
    vfr_clip(path)
    all_FHWC = decord.VideoReader(str(path)).get_batch(list(range(24))).asnumpy()
    assert np.allclose(decord.VideoReader(str(path)).get_frame_timestamp(list(range(24)))[:, 0], VFR_TIMES)
    assert supported_frames(path, 24, 4) == 15 and supported_frames(path, 24, None) == 24
    by_time = load_video(path, 15, 64, 64, fps=4)
    assert torch.equal(by_time, frames_to_video(all_FHWC[VFR_AT_4FPS], 64, 64))
    # by index the same count takes other frames: the second half plays faster
    assert not torch.equal(by_time, load_video(path, 15, 64, 64))
    with pytest.raises(TooShortError, match=r"vfr.mp4: too short: needs 17 frames at data.fps 4"):
        load_video(path, 17, 64, 64, fps=4)


def test_constant_rate_clip_by_time_at_its_rate_equals_by_index(tmp_path):
    clip(tmp_path / "c.mp4", frames=9, fps=8)
    assert supported_frames(tmp_path / "c.mp4", 9, 8) == 9
    assert torch.equal(load_video(tmp_path / "c.mp4", 9, 64, 64, fps=8), load_video(tmp_path / "c.mp4", 9, 64, 64))
    assert torch.equal(load_video(tmp_path / "c.mp4", 5, 64, 64, stride=2, fps=8),
                       load_video(tmp_path / "c.mp4", 5, 64, 64, stride=2))
    # at half its rate, every other frame
    assert torch.equal(load_video(tmp_path / "c.mp4", 5, 64, 64, fps=4),
                       load_video(tmp_path / "c.mp4", 5, 64, 64, stride=2))


BUCKETS = ("data.num_frames=17", "data.auto_frame_buckets=true", "data.frame_buckets=[9,13,17]")


def test_training_and_check_dataset_agree_on_the_frames_at_fps(tmp_path):
    """The VFR clip has 24 frames (bucket 17 by index) but 15 at 4 fps: bucket 13 in training's
    index, in the loaded video, and in tools/check_dataset.py's report."""
    data = tmp_path / "data"
    data.mkdir()
    sample(data, "000", frames=17, fps=4)
    sample(data, "001")
    vfr_clip(data / "001.mp4")
    cfg = _cfg(tmp_path, CONFIG, *BUCKETS, "data.fps=4")
    buckets = {s.id: s.bucket for s in index_samples(cfg, verbose=False)}
    assert buckets == {"000": (17, 64, 64), "001": (13, 64, 64)}
    assert {s.id: s.bucket for s in index_samples(_cfg(tmp_path, CONFIG, *BUCKETS), verbose=False)}["001"][0] == 17
    samples = index_samples(cfg, verbose=False)
    item = E2VDataset(cfg, samples)[[s.id for s in samples].index("001")]
    assert item["video"].shape == (3, 13, 64, 64)
    config = CONFIG.replace("num_frames: 9", "num_frames: 17\n  auto_frame_buckets: true\n  frame_buckets: [9, 13, 17]"
                            "\n  fps: 4")
    proc, report = run_check(tmp_path, data, "--set", "data.small_bucket=repeat", config=config)
    assert report is not None, proc.stderr[-3000:]
    assert {r["id"]: tuple(r["bucket"]) for r in report["samples"]} == buckets
    # by time the variable rate keeps its speed: no variable_fps warning
    assert "variable_fps" not in {p["kind"] for p in report["problems"]}, report["problems"]


def test_fingerprint_names_fps(tmp_path):
    """data.fps is one of the schema's cache-shaping fields: a change makes an entry stale by name."""
    clean_set(tmp_path / "data", n=2)
    s = index_samples(_cfg(tmp_path, CONFIG), verbose=False)[0]
    by_index = fingerprint(s, _cfg(tmp_path, CONFIG), (9, 64, 64))
    by_time = fingerprint(s, _cfg(tmp_path, CONFIG, "data.fps=8"), (9, 64, 64))
    assert by_index["data.fps"] == "null" and by_time["data.fps"] == "8.0"
    assert {k for k in by_index if by_index[k] != by_time[k]} == {"data.fps"}


def test_npz_clip_with_fps_is_an_error_naming_the_file_and_the_fix(tmp_path):
    data = clean_set(tmp_path / "data", n=2)
    (data / "001.mp4").unlink()
    np.savez(data / "001.npz", frames=np.zeros((9, 64, 64, 3), np.uint8))
    with pytest.raises(NoClockError, match=r"001.npz: .npz frames have no timestamps.*remove data.fps"):
        load_video(data / "001.npz", 9, 64, 64, fps=8)
    assert load_video(data / "001.npz", 9, 64, 64).shape == (3, 9, 64, 64)
    for policy in ("error", "skip"):  # a config error, not a bad sample to skip
        with pytest.raises(ConfigError, match=r"sample 001: .*001.npz: .npz frames have no timestamps, so data.fps "
                                              r"cannot sample them by time; remove data.fps"):
            index_samples(_cfg(tmp_path, CONFIG, "data.fps=8", f"data.on_bad_sample={policy}"), verbose=False)
    proc, report = run_check(tmp_path, data, "--set", "data.fps=8")
    no_clock = [p for p in report["problems"] if p["kind"] == "no_clock"]
    assert [p["file"] for p in no_clock] == [str(data / "001.npz")]
    assert no_clock[0]["fix"].startswith("remove data.fps") and proc.returncode == 1


def test_fps_bound(tmp_path):
    clean_set(tmp_path / "data", n=1)
    for bad in ("0", "-16"):
        with pytest.raises(ConfigError, match=r"data.fps"):
            _cfg(tmp_path, CONFIG, f"data.fps={bad}")
    assert _cfg(tmp_path, CONFIG, "data.fps=16").data.fps == 16
    assert _cfg(tmp_path, CONFIG).data.fps is None


def test_validation_and_sample_references_obey_max_image_pixels(tmp_path):
    from e2v.data.media import ImageTooLargeError
    from e2v.eval.sample_cli import read_elements
    from e2v.eval.validation import Validator

    clean_set(tmp_path / "data", n=2)
    big = tmp_path / "big.png"
    Image.new("RGB", (400, 300)).save(big)
    sets = 'validation.sets=[{prompt: "a person", elements: {person: "%s"}}]' % big
    cfg = _cfg(tmp_path, CONFIG, "validation.every_n_steps=1", "validation.num_samples=0", sets,
               "data.max_image_pixels=100000")
    validator = Validator(cfg, [], None, tmp_path, rank=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ImageTooLargeError, match=r"big.png: 400x300 = 0.1 MP is over data.max_image_pixels"):
        validator.video_inputs()

    class Args:
        element, config = [f"person={big}"], "cfg.yaml"
    with pytest.raises(SystemExit, match=r"--element person=.*big.png: 400x300 = 0.1 MP is over data.max_image_pixels"):
        read_elements(Args, cfg)  # tools/sample.py: one line
    assert read_elements(Args, _cfg(tmp_path, CONFIG))["person"].size == (400, 300)
