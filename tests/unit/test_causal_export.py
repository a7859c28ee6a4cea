"""The offline export of a causal run (tools/export_lora.py -> checkpoint.export_checkpoint) writes
CausVid's generator file, e2v_causvid.pt, as the end-of-run export does: a tiny causal LoRA run
(the seed's YAML at tiny sizes, trained in this process through train_e2v.main, a LoRA plus the
output head in full, a checkpoint at its last step), exported again from the checkpoint folder alone
and its run's config.yaml, gives the end-of-run file tensor for tensor; and that file holds the
trained weights: the tiny base the config builds, the exported LoRA fused by hand
(W + alpha / r * B A) and the head as trained, under CausVid's keys."""

import pytest
import torch
from helpers import ROOT, train_main
from helpers_t2v import make_csv_videos
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_thread")

FRAMES, SIZE = 9, 32  # 9 frames: 3 latent frames, one block of the seed's 3


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    data, out = tmp_path_factory.mktemp("causal_export_data"), tmp_path_factory.mktemp("causal_export")
    make_csv_videos(data, num_clips=2, num_frames=FRAMES, height=SIZE, width=SIZE)
    sets = ("model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}",
            f"data.datasets.0.media_root={data}", f"data.datasets.0.metadata_path={data / 'metadata.csv'}",
            f"data.num_frames={FRAMES}", f"data.resolution=[{SIZE},{SIZE}]", "train.mixed_precision='no'",
            "train.gradient_checkpointing=false", "train.lr=1e-2", "model.training_type=lora",
            "train.trainable=[proj_out]", "lora.alpha=32", "train.max_steps=1",
            "train.checkpoint_every=1", f"output_dir={out}", "run_id=lora")
    code = train_main("--config", str(ROOT / "configs/causal_regression.yaml"), *[a for s in sets for a in ("--set", s)])
    assert code is None, code
    return out / "lora"


def generator(path) -> dict:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert list(saved) == ["generator"]
    return saved["generator"]


def test_the_offline_export_writes_the_end_of_run_causvid_file(lora_run, tmp_path):
    from e2v.train.checkpoint import export_checkpoint
    from e2v.train.export import CAUSVID_FILE

    export_checkpoint(lora_run / "checkpoints/step_000001", tmp_path)
    offline, at_end = generator(tmp_path / CAUSVID_FILE), generator(lora_run / "lora" / CAUSVID_FILE)
    assert sorted(offline) == sorted(at_end)
    for key, value in at_end.items():
        assert offline[key].dtype == value.dtype and torch.equal(offline[key], value), key


def test_the_causvid_file_holds_the_trained_weights(lora_run):
    """Oracle: the config's tiny base, built afresh, with the run's exported LoRA fused here."""
    from e2v.config.load import load_config
    from e2v.models.causvid_ckpt import causvid_key
    from e2v.models.tiny import build_tiny_parts
    from e2v.train.export import CAUSVID_FILE, export_dtype

    cfg = load_config(lora_run / "config.yaml", check_paths=False)
    want = {k: v.clone() for k, v in build_tiny_parts(cfg.model.tiny_seed, base="t2v", with_encoders=False)
            .transformer.state_dict().items()}
    lora = load_file(str(lora_run / "lora/pytorch_lora_weights.safetensors"))
    scale = cfg.lora.alpha / cfg.lora.rank
    down = {k.removeprefix("transformer.").removesuffix(".lora_A.weight"): v
            for k, v in lora.items() if k.endswith(".lora_A.weight")}
    assert down
    for module, a in down.items():
        want[f"{module}.weight"] += scale * lora[f"transformer.{module}.lora_B.weight"] @ a
    head = load_file(str(lora_run / "lora/e2v_modules.safetensors"))
    assert sorted(head) == ["proj_out.bias", "proj_out.weight"]
    want.update(head)

    saved = generator(lora_run / "lora" / CAUSVID_FILE)
    assert sorted(saved) == sorted(causvid_key(k) for k in want)
    for name, value in want.items():
        got = saved[causvid_key(name)]
        assert got.dtype == export_dtype(name), name
        # one rounding to bf16 of the fused fp32 sum, whatever peft's order of additions: one bf16 step at most
        torch.testing.assert_close(got.float(), value.to(got.dtype).float(), atol=1e-6, rtol=2 ** -7, msg=name)
