"""References read as SkyReels-V3's pipeline reads them (`data.reference_read`, by default `convert`
in the sequence layout): the oracle is V3's own call, diffusers' `load_image` (EXIF transpose, then
Pillow's `convert("RGB")`), and its `resize_ref_images` arithmetic as tests/helpers_r2v.py writes
it from V3's code. A transparent cut-out keeps the colour under alpha 0, a 16-bit grey is clipped
at 255, a reference whose fitted side truncates to 0 px fails (V3 fails there too) and is refused
in one line naming the file; the A2 layouts keep compositing on white. Also: the cache and the
check's fingerprints hold the rule, the check warns where the two readings differ, the preparer's
cut-outs read alike under both, and the generator device of sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT
from helpers_r2v import R2V_TINY, v3_resize_ref, v3_to_tensor
from PIL import Image

from e2v.config.load import load_config
from e2v.data.media import DegenerateImageError, fit_pad_white, load_image, reading_difference

H = W = 64


def v3_load(path) -> Image.Image:
    """SkyReels-V3's generate_video.py: `diffusers.utils.load_image(path)`."""
    from diffusers.utils import load_image as diffusers_load_image

    return diffusers_load_image(str(path))


@pytest.fixture
def cutout(tmp_path):
    """A 40 x 56 RGBA cut-out: a red disc (alpha 255), a half-transparent ring, and green stored under
    alpha 0 around it (what a segmenter that only writes alpha leaves)."""
    y, x = np.mgrid[0:56, 0:40]
    r = np.hypot(x - 20, y - 28)
    rgba = np.zeros((56, 40, 4), np.uint8)
    rgba[..., :3] = (20, 200, 40)
    rgba[r < 14, :3] = (230, 30, 30)
    rgba[..., 3] = np.where(r < 12, 255, np.where(r < 16, 128, 0))
    path = tmp_path / "cutout.png"
    Image.fromarray(rgba, "RGBA").save(path)
    return path, rgba


def _cfg(config, *sets):
    return load_config(config, ["data.num_frames=9", f"data.resolution=[{H},{W}]", *sets], check_paths=False)


def test_sequence_layout_reads_an_rgba_cutout_as_v3_keeping_the_colour_under_alpha_0(cutout):
    from e2v.data.dataset import load_element_inputs

    path, rgba = cutout
    assert _cfg(R2V_TINY).reference_reading == "convert"
    assert _cfg(ROOT / "configs/e2v_tiny_lora.yaml").reference_reading == "white"  # A2's layouts as before
    ours = np.asarray(load_image(path, read="convert"))
    assert np.array_equal(ours, np.asarray(v3_load(path)))
    assert (ours[0, 0] == (20, 200, 40)).all()  # alpha 0: the stored colour, not white
    white = np.asarray(load_image(path, read="white"))
    assert (white[0, 0] == 255).all() and np.array_equal(white[rgba[..., 3] == 255], ours[rgba[..., 3] == 255])
    # the slot's pixels: V3's resize_ref_images and to_tensor on V3's load, tensor for tensor
    refs = load_element_inputs(_cfg(R2V_TINY), {"person": path}, H, W)["vae_refs"]["person"]
    assert torch.equal(refs, v3_to_tensor(v3_resize_ref(v3_load(path), W, H)))
    assert reading_difference(Image.open(path)).startswith("colour stored under its transparent pixels")


def test_a_16_bit_grey_is_clipped_as_v3_reads_it_and_scaled_in_the_white_reading(tmp_path):
    levels = np.array([[0, 100, 255, 256, 40000, 65535]], np.uint16)
    path = tmp_path / "grey16.png"
    Image.fromarray(levels).save(path)
    assert Image.open(path).mode == "I;16"
    converted = np.asarray(load_image(path, read="convert"))
    assert np.array_equal(converted, np.asarray(v3_load(path)))
    assert converted[0, :, 0].tolist() == np.clip(levels[0], 0, 255).tolist()  # Pillow's I;16 -> RGB clips
    scaled = np.asarray(load_image(path, read="white"))
    assert scaled[0, :, 0].tolist() == np.round(levels[0] / 257).astype(int).tolist()
    assert "clips them at 255" in reading_difference(Image.open(path))


@pytest.mark.parametrize(("size", "fitted"), [((1, 200), "0x64"), ((1000, 2), "64x0")])  # (w, h): 1 x N, N x 2
def test_a_reference_fitted_to_0_px_fails_as_v3_and_is_refused_in_one_line(tmp_path, size, fitted):
    from e2v.data.preflight import sample_problems
    from e2v.data.sample import Sample

    img = Image.new("RGB", size, (9, 99, 199))
    with pytest.raises(ValueError):  # V3's resize_ref_images: Pillow refuses the 0-px side
        v3_resize_ref(img, W, H)
    with pytest.raises(DegenerateImageError, match=rf"{size[0]}x{size[1]} fitted inside the {W}x{H} video"):
        fit_pad_white(img, H, W)
    # the start-up check (and tools/check_dataset.py) names the file before step 1
    path = tmp_path / "strip.png"
    img.save(path)
    s = Sample("000", tmp_path / "000.mp4", "a strip", {"person": path})
    facts = {"video_error": None, "frames": 9, "height": H, "width": W, "cut_error": None,
             "elements": {"person": {"size": list(size)}}}
    (p,) = sample_problems(s, facts, _cfg(R2V_TINY))
    assert (p.kind, p.severity, p.file) == ("element_degenerate", "error", str(path))
    assert p.problem.startswith(f"element 'person' is {size[0]}x{size[1]} fitted inside the {W}x{H} video keeping "
                                f"its aspect is {fitted} px") and "crop the reference" in p.fix


@pytest.mark.parametrize("size", [(1000, 20), (1, 64), (333, 17)])
def test_a_thin_reference_v3_accepts_is_fitted_as_v3_fits_it(size):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    assert np.array_equal(np.asarray(fit_pad_white(img, H, W)), np.asarray(v3_resize_ref(img, W, H)))


def test_the_reading_rule_is_in_the_cache_and_check_fingerprints(tmp_path):
    from e2v.data import preflight, store
    from e2v.data.sample import Sample

    s = Sample("000", tmp_path / "000.mp4", "p", {})
    cfg, white = _cfg(R2V_TINY), _cfg(R2V_TINY, "data.reference_read=white")
    fp, fp_white = store.fingerprint(s, cfg, (9, H, W)), store.fingerprint(s, white, (9, H, W))
    assert (fp["data.reference_read"], fp_white["data.reference_read"]) == ('"auto"', '"white"')
    assert {k for k in fp if fp[k] != fp_white[k]} == {"data.reference_read"}
    assert preflight.fingerprint(s, cfg) != preflight.fingerprint(s, white)


def test_the_check_warns_in_the_sequence_layout_where_the_readings_differ(cutout, tmp_path):
    from e2v.data.sample import Sample
    from e2v.eval.dataset_check import mode_warnings

    path, rgba = cutout
    agreed = rgba.copy()
    agreed[agreed[..., 3] == 0, :3] = 255  # white under alpha 0 ...
    agreed[..., 3] = np.where(agreed[..., 3] > 0, 255, 0)  # ... and the edge opaque: both read it alike
    Image.fromarray(agreed, "RGBA").save(tmp_path / "agreed.png")
    facts = {"elements": {"person": {"size": [40, 56]}}}
    warned = {}
    for name, config in (("sequence", R2V_TINY), ("a2", ROOT / "configs/e2v_tiny_lora.yaml")):
        for file in (path, tmp_path / "agreed.png"):
            s = Sample("000", tmp_path / "000.mp4", "p", {"person": file})
            warned[name, file.name] = [p.kind for p in mode_warnings(s, facts, _cfg(config))]
    assert warned == {("sequence", "cutout.png"): ["element_reading"], ("sequence", "agreed.png"): [],
                      ("a2", "cutout.png"): [], ("a2", "agreed.png"): []}
    assert reading_difference(Image.open(tmp_path / "agreed.png")) is None


def test_the_preparer_writes_cutouts_both_readings_read_alike(tmp_path):
    from e2v.data.prepare.references import cutout_rgba

    frame = np.random.default_rng(1).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    mask = np.zeros((32, 48), bool)
    mask[8:20, 10:30] = True
    mask[12:16, 14:20] = False  # a hole: background inside the box
    rgba = cutout_rgba(frame, mask, margin=2)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "person.png")
    white, converted = (np.asarray(load_image(tmp_path / "person.png", read=r)) for r in ("white", "convert"))
    assert np.array_equal(white, converted)
    assert np.array_equal(converted, np.asarray(v3_load(tmp_path / "person.png")))
    inside = rgba[..., 3] == 255
    assert np.array_equal(converted[inside], frame[6:22, 8:32][inside]) and (converted[~inside] == 255).all()


def test_the_generator_device_is_the_sampling_device_only_when_asked():
    from e2v.eval.sampling import noise_generator
    from e2v.runtime.device import randn

    cpu = randn((2, 3), noise_generator(5, "cpu", "cpu"), "cpu")
    assert torch.equal(cpu, torch.randn((2, 3), generator=torch.Generator().manual_seed(5)))
    assert torch.equal(randn((2, 3), noise_generator(5, "device", "cpu"), "cpu"), cpu)  # on a CPU device: one
    assert noise_generator(5, "cpu", "meta").device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: V3 draws its noise on a CUDA generator")
def test_sampling_with_the_device_generator_draws_v3s_cuda_noise_and_posteriors():
    """On CUDA, `generator_device: device` gives the latents V3's pipeline starts from: its noise
    drawn by randn_tensor on torch.Generator(device="cuda"), then each reference's posterior sample
    from the same generator; the CPU generator gives other numbers."""
    from diffusers.utils.torch_utils import randn_tensor

    from e2v.eval import sampling
    from e2v.models.load import for_sampling, load_parts

    cfg = _cfg(R2V_TINY, "model.vae_tf32=false")  # the oracle's VAE call below runs in full fp32 too
    parts = load_parts(cfg, device="cuda")
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    seen, real = {}, sampling.denoise

    def first(model, c, negative, noise, **kw):
        seen["noise"], seen["slots"] = noise, c.ref_latents_BCNhw
        return real(model, c, negative, noise, **kw)

    sampling.denoise = first
    try:
        sampling.generate(for_sampling(parts.transformer, "cuda", torch.float32), parts, cfg, ["a red shape"],
                          [{"person": img}], seed=7, num_steps=1, guidance_scale=1.0, shift=5.0, device="cuda",
                          generator_device="device")
    finally:
        sampling.denoise = real
    g = torch.Generator(device="cuda").manual_seed(7)  # V3's ReferenceToVideoPipeline.generate_video
    noise = randn_tensor(tuple(seen["noise"].shape), generator=g, device=torch.device("cuda"), dtype=torch.float32)
    assert torch.equal(seen["noise"], noise)
    assert not torch.equal(seen["noise"].cpu(), torch.randn(tuple(noise.shape), generator=torch.Generator().manual_seed(7)))
    with torch.no_grad():  # prepare_latents: the reference encoded alone, its posterior sampled from g next
        z = parts.vae.encode(v3_to_tensor(v3_resize_ref(img, W, H)).cuda()[None, :, None]).latent_dist.sample(g)
    mean = torch.tensor(parts.vae.config.latents_mean, device="cuda").view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(parts.vae.config.latents_std, device="cuda").view(1, -1, 1, 1, 1)
    # our pixels are uint8 / 127.5 - 1, V3's (x / 255 - 0.5) / 0.5: an ulp apart before a shallow fp32 encoder
    torch.testing.assert_close(seen["slots"][:, :, :1].float(), (z - mean) * inv_std, rtol=0, atol=1e-4)
