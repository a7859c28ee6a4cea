"""The launch half of tests/unit/test_wan22_ti2v.py (Wan2.2 TI2V-5B):
the tests that train through the launcher; that file's docstring says what the two halves check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import ROOT, read_scalars
from helpers_launch import launch_train
from helpers_wan22 import S, _image

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_TI2V = str(ROOT / "configs/e2v_wan22_ti2v_tiny.yaml")
RUN_SETS = ("data.resolution=[64,64]", "train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=2",
            "validation.every_n_steps=2", "validation.num_samples=2", "validation.num_videos=1",
            "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.frequency=2")


@pytest.fixture(scope="module")
def ti2v_run(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ti2v")
    launch_train(TINY_TI2V, f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=ti2v",
                 *RUN_SETS).wait()
    return out / "ti2v"


def test_wan22_ti2v_tiny_run_trains_validates_visualizes_and_exports(ti2v_run, tmp_path):
    """`deepspeed train_e2v.py --config configs/e2v_wan22_ti2v_tiny.yaml`: finite losses, the
    reference gaps at steps 0, 2, 4, sampled clips of the clip's 17 frames, the reference frames
    decoded one by one in the visualization, a 48-channel model in the export; tools/sample.py and
    tools/dump_visualizations.py on the run."""
    import imageio.v3 as iio

    from tools.dump_visualizations import main as dump

    scalars = read_scalars(ti2v_run)
    assert all(np.isfinite(scalars[k]["train/loss"]) for k in (1, 2, 3, 4))
    assert all("val/reference_gap_shuffle" in scalars[k] and "val/reference_gap_drop" in scalars[k] for k in (0, 2, 4))
    assert iio.imread(ti2v_run / "samples/step_000004/00.mp4").shape == (17, 64, 64, 3)
    step = ti2v_run / "visualizations/step_000004"
    assert torch.load(step / "conditioned_latents.pt", weights_only=True).shape[:3] == (2, 48, 3)
    assert sorted(p.name for p in (step / "conditioned_latents").glob("sample0_*.png")) == [
        "sample0_frame000.png", "sample0_frame002.png"]  # frames 0 and -1 of the 3 reference images
    assert (step / "contact_sheet.png").exists()
    shape = json.loads((ti2v_run / "lora/e2v_model.json").read_text())
    assert shape["in_channels"] == 48 and shape["added_kv_proj_dim"] is None
    dump(["--config", str(ti2v_run / "config.yaml"), str(step)])
    assert iio.imread(step / "render/conditioned_latents_sample0.mp4").shape[0] == 3

    import importlib.util

    spec = importlib.util.spec_from_file_location("sample_tool", ROOT / "tools/sample.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _image(3).save(tmp_path / "person.png")
    tool.main(["--config", str(ti2v_run / "config.yaml"), "--lora", str(ti2v_run / "lora"), "--element",
               f"person={tmp_path / 'person.png'}", "--prompt", "a shape moves", "--steps", "2", "--drop-frames", "ref",
               "--device", "cpu", "--out", str(tmp_path / "video.mp4")])
    assert iio.imread(tmp_path / "video.mp4").shape == (17, 64, 64, 3)  # the references took no frame


def test_wan22_ti2v_export_loads_into_the_diffusers_pipeline_and_changes_its_output(ti2v_run, ti2v_parts):
    """The run's lora/ folder in a plain WanImageToVideoPipeline(expand_timesteps=True):
    load_lora_weights + the modules trained in full (e2v.train.export.load_extra_modules) change its
    output, to exactly what the trainer's sampler gives with the weights tools/sample.py loads."""
    from diffusers import WanImageToVideoPipeline

    from e2v.config.load import load_config
    from e2v.eval.sampling import generate, latent_shape, load_trained, make_scheduler
    from e2v.models.tiny import build_tiny_parts
    from e2v.runtime.device import randn
    from e2v.train.export import load_extra_modules

    p, image = ti2v_parts, _image(2)
    cfg = load_config(ti2v_run / "config.yaml", check_paths=False)
    noise = randn(latent_shape(cfg, p.vae), torch.Generator().manual_seed(7), "cpu")
    latents = torch.cat([torch.zeros(1, 48, 1, 4, 4), noise], 2)

    def sample(transformer):
        pipe = WanImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                                       transformer=transformer, scheduler=make_scheduler(3.0), expand_timesteps=True)
        return pipe, lambda: pipe(image=image, prompt="a shape moves", height=S, width=S, num_frames=21,
                                  num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                                  latents=latents.clone()).frames

    _, base = sample(build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer)
    pipe, trained = sample(build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer)
    pipe.load_lora_weights(ti2v_run / "lora")
    assert load_extra_modules(pipe.transformer, ti2v_run / "lora")  # patch_embedding, condition_embedder, ...
    before, after = base(), trained()
    assert (after[:, :, 1:] - before[:, :, 1:]).abs().max() > 1e-3
    loaded = load_trained(build_tiny_parts(seed=0, base="ti2v", with_encoders=False).transformer, ti2v_run / "lora")
    ours = generate(loaded, p, cfg, ["a shape moves"], [{"person": image}], seed=7, num_steps=2, guidance_scale=1.0,
                    shift=3.0)
    torch.testing.assert_close(ours, after[:, :, 1:], atol=2e-5, rtol=0)
