"""The real-model path (`model.pretrained`, diffusers' from_pretrained for every part) is the code a
GPU cluster runs and the tiny preset skips. Here it loads a diffusers pipeline folder saved from the
tiny parts and must train to exactly the losses of the same weights built in code, under bf16
(where the transformer is read in bf16, the fp32-kept modules in fp32, and DeepSpeed's cast must
then change nothing)."""

from helpers import read_scalars
from helpers_launch import launch_train, wait_all


def test_pretrained_folder_trains_like_the_weights_built_in_code(pipeline_folder, demo_data, tmp_path):
    common = [f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}", "train.max_steps=3",
              "train.checkpoint_every=3", "train.micro_batch_size=2", "validation.every_n_steps=0",
              "visualization.enabled=false", "train.mixed_precision=bf16", "model.weight_dtype=fp32"]
    _, proc = wait_all(launch_train("configs/e2v_tiny_lora.yaml", *common, "run_id=preset"),  # side by side
                       launch_train("configs/e2v_tiny_lora.yaml", *common, "run_id=folder", "model.preset=null",
                                    f"model.pretrained={pipeline_folder}"))
    assert "frozen encoders loaded: vae, text_encoder, image_encoder" in proc.stdout
    preset, folder = read_scalars(tmp_path / "preset"), read_scalars(tmp_path / "folder")
    assert sorted(folder) == [1, 2, 3]
    for step in folder:
        assert folder[step]["train/loss"] == preset[step]["train/loss"], (step, folder[step], preset[step])
        assert folder[step]["train/grad_norm"] == preset[step]["train/grad_norm"], step
    assert (tmp_path / "folder/lora/pytorch_lora_weights.safetensors").exists()
