"""media.py: probing without decoding, npz frames, and clear errors for decord's width bug and short clips."""

import numpy as np
import pytest
import torch

from e2v.data.media import MediaError, TooShortError, load_video, probe_video


def test_npz_probe_reads_only_the_header_and_load_normalises(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", frames=frames)
    info = probe_video(tmp_path / "c.npz")
    assert (info.frames, info.height, info.width) == (9, 32, 48)
    video = load_video(tmp_path / "c.npz", 5, 32, 48, stride=2)
    assert video.shape == (3, 5, 32, 48)
    assert video.dtype == torch.uint8  # pixels in [-1, 1] are made on the device (e2v/runtime/device.py)
    torch.testing.assert_close(video, torch.from_numpy(frames[::2]).permute(3, 0, 1, 2))
    with pytest.raises(TooShortError, match="c.npz: too short"):
        load_video(tmp_path / "c.npz", 13, 32, 48)
    np.savez(tmp_path / "bad.npz", frames=frames.astype(np.float32))
    with pytest.raises(MediaError, match="uint8"):
        probe_video(tmp_path / "bad.npz")


@pytest.mark.parametrize("width", [48, 64])
def test_decord_width_bug_gives_a_clear_error(tmp_path, width):
    from e2v.data.demo import write_video

    frames = np.full((9, 32, width, 3), 120, np.uint8)
    write_video(tmp_path / "v.mp4", frames)
    if width == 48:  # decord 0.6.0 returns 4 "channels" for this width, then fails in get_batch
        for fn in (lambda: probe_video(tmp_path / "v.mp4"), lambda: load_video(tmp_path / "v.mp4", 9, 32, 32)):
            with pytest.raises(MediaError, match="48-px-wide video.*re-encode"):
                fn()
    else:
        assert probe_video(tmp_path / "v.mp4").width == 64
        assert load_video(tmp_path / "v.mp4", 9, 32, 64).shape == (3, 9, 32, 64)


@pytest.mark.parametrize("resize_mode,reshape_mode", [("center_crop", "bicubic"), ("resize", "bilinear"),
                                                      ("center_crop", "area")])
def test_clip_resize_matches_pil_per_frame(resize_mode, reshape_mode):
    """The whole-clip torch resize against the oracle: PIL on each frame with the image path's
    crop arithmetic (center_crop / resize of e2v.data.media)."""
    from PIL import Image

    from e2v.data.media import RESAMPLE, center_crop, frames_to_video, resize

    rng = np.random.default_rng(1)
    frames = (rng.integers(0, 256, (3, 36, 60, 3)) // 32 * 32).astype(np.uint8).repeat(2, 1).repeat(2, 2)
    got = frames_to_video(frames, 32, 48, resize_mode, reshape_mode).float() / 127.5 - 1
    pil = center_crop if resize_mode == "center_crop" else resize
    want = np.stack([np.asarray(pil(Image.fromarray(f), 32, 48, RESAMPLE[reshape_mode])) for f in frames])
    want = torch.from_numpy(want).permute(3, 0, 1, 2).float() / 127.5 - 1
    levels = (got - want).abs() * 127.5
    assert got.shape == (3, 3, 32, 48)
    assert levels.mean() < 0.05 and levels.max() <= (0 if reshape_mode == "area" else 1.01), (levels.mean(), levels.max())
