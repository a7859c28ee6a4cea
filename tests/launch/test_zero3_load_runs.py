"""ZeRO-3 load of a pretrained transformer (load_transformer_zero3): built inside zero.Init, each
rank holding only its partitions, and streamed from rank 0 one tensor at a time from sharded
safetensors. It must train to exactly the losses of the whole-model load (diffusers'
from_pretrained on every rank, `model.zero3_init: false`): bf16, where the fp32-kept modules and
the rope tables must come out as from_pretrained leaves them, and fp32 under ZeRO-3 + offload.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_zero3_load.py."""

import shutil

import pytest
from helpers import ZERO3_OFFLOAD_RUN, read_scalars
from helpers_launch import launch_train, wait_all

pytestmark = pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run` (tests/conftest.py)

PARTITIONED = "[e2v] transformer partitioned at load (zero.Init, {}), streamed from 3 shard files"


WHOLE = "[e2v] note: ZeRO-3, but every rank loads the whole transformer: model.zero3_init is false"


@pytest.fixture(scope="module")
def sharded_folder(pipeline_folder, tmp_path_factory):  # noqa: F811
    """The tiny pipeline with its transformer in 3 shards plus an index, as the 14B checkpoints come."""
    from diffusers import WanTransformer3DModel

    out = tmp_path_factory.mktemp("sharded") / "Wan-tiny-I2V-Diffusers"
    shutil.copytree(pipeline_folder, out)
    (out / "transformer/diffusion_pytorch_model.safetensors").unlink()
    WanTransformer3DModel.from_pretrained(pipeline_folder / "transformer").save_pretrained(
        out / "transformer", max_shard_size="50KB")
    assert len(list((out / "transformer").glob("diffusion_pytorch_model-*.safetensors"))) == 3
    return out


def assert_same_steps(a: dict, b: dict, steps: list[int]) -> None:
    assert sorted(a) == steps, sorted(a)
    for step in steps:
        for key in ("train/loss", "train/grad_norm"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


@pytest.fixture(scope="module")
def load_runs(sharded_folder, demo_data, tmp_path_factory) -> tuple:
    """The module's three 2-process runs, started side by side: bf16 ZeRO-3 with the partitioned
    load (new) and with the whole-model load (old), 3 steps; fp32 ZeRO-3 + offload with the
    partitioned load, the shared run's settings (fp32)."""
    out = tmp_path_factory.mktemp("zero3_load")
    bf16 = [f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "train.max_steps=3",
            "train.checkpoint_every=3", "train.micro_batch_size=2", "validation.every_n_steps=0",
            "visualization.enabled=false", "train.mixed_precision=bf16", "model.weight_dtype=fp32",
            "model.preset=null", f"model.pretrained={sharded_folder}", "deepspeed.config=ds_configs/zero3.json"]
    new, old, fp32 = wait_all(
        launch_train("configs/e2v_tiny_lora.yaml", *bf16, "run_id=new", num_gpus=2),
        launch_train("configs/e2v_tiny_lora.yaml", *bf16, "run_id=old", "model.zero3_init=false", num_gpus=2),
        launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}",
                     "run_id=fp32", "train.checkpoint_every=8", *ZERO3_OFFLOAD_RUN, "model.preset=null",
                     f"model.pretrained={sharded_folder}", "model.weight_dtype=fp32", num_gpus=2))
    return out, new, old, fp32


def test_bf16_zero3_load_trains_like_the_whole_model_load(load_runs):
    out, new, old, _ = load_runs
    assert PARTITIONED.format("bfloat16") in new.stdout and WHOLE not in new.stdout
    assert WHOLE in old.stdout and "partitioned at load" not in old.stdout
    assert "transformer 0.04M params" in new.stdout  # counted from ds_numel, not the empty partitions' numel
    assert_same_steps(read_scalars(out / "new"), read_scalars(out / "old"), [1, 2, 3])


def test_fp32_zero3_offload_load_trains_like_the_preset(load_runs, zero3_offload_run):
    """The shared ZeRO-3 + offload run of the tiny preset (fp32, e2v_tiny_lora's default) is the oracle:
    test_pretrained_folder shows the whole-model load of this folder trains exactly like the preset
    (with the encoders in fp32, as the preset builds them)."""
    out, _, _, proc = load_runs
    assert PARTITIONED.format("float32") in proc.stdout
    new, preset = read_scalars(out / "fp32"), read_scalars(zero3_offload_run)
    assert_same_steps(new, preset, sorted(preset))
