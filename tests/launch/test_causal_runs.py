"""The causal task through the launcher (docs/causal.md): the seed's own YAML
(configs/causal_regression.yaml: generator_task causal_video, num_frame_per_block 3, the trailing 0)
at tiny sizes trains the whole transformer under ZeRO-2 in 2 processes, a resume from its step-2
checkpoint continues with the uninterrupted losses, a LoRA trains under ZeRO-3 in 2 processes from the
full run's exported CausVid file (model.generator_ckpt), a config the causal model cannot serve
(ring attention) stops at start in one line, and 2 processes at Ulysses 2 train and validate what 1
process does. The rule itself is checked in-process against CausVid's (tests/unit/test_causal_rule.py),
and under Ulysses against the unsplit model (tests/unit/test_context_parallel.py)."""

import pytest
import torch
from helpers import ROOT, read_scalars
from helpers_launch import launch_python, launch_train, run_train, wait_all
from helpers_t2v import make_csv_videos

CONFIG = str(ROOT / "configs/causal_regression.yaml")
FRAMES, SIZE, STEPS = 21, 32, 4  # 21 frames: 6 latent frames, two blocks of the seed's 3
EMA = ("train.ema_weight=0.5", "train.ema_start_step=2", "train.checkpoint_every=1")  # Self-Forcing's EMA, from step 2


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    data = tmp_path_factory.mktemp("causal_csv")
    make_csv_videos(data, num_clips=4, num_frames=FRAMES, height=SIZE, width=SIZE)
    return data


def tiny(data, out, run_id: str, *sets: str) -> tuple:
    """The seed file's keys overridden to the tiny preset, the clips, and fp32 (bit-exact resume)."""
    return ("model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}",
            f"data.datasets.0.media_root={data}", f"data.datasets.0.metadata_path={data / 'metadata.csv'}",
            f"data.num_frames={FRAMES}", f"data.resolution=[{SIZE},{SIZE}]", "train.mixed_precision='no'",
            "train.gradient_checkpointing=false", "train.lr=1e-3", f"output_dir={out}", f"run_id={run_id}", *sets)


@pytest.fixture(scope="module")
def full_zero2(clips, tmp_path_factory):
    """The seed's regression as it is (the whole transformer), ZeRO-2, 2 processes, a save every step,
    an EMA of the weights from step 2."""
    out = tmp_path_factory.mktemp("causal_runs")
    proc = run_train(CONFIG, *tiny(clips, out, "full", f"train.max_steps={STEPS}", *EMA), num_gpus=2)
    return out / "full", proc


def test_the_seed_yaml_trains_the_causal_task_through_the_launcher(full_zero2):
    run, proc = full_zero2
    log = proc.stdout + proc.stderr
    assert "seed key 'generator_task' -> task = 'causal'" in log and "model.training_type = full" in log
    assert "full fine-tune" in log and f"done: {STEPS} steps" in log
    scalars = read_scalars(run)
    assert sorted(scalars) == list(range(1, STEPS + 1))
    for step, logged in scalars.items():
        for name in ("train/loss", "train/target_latent_mean", "train/target_latent_std", "train/pred_latent_mean",
                     "train/pred_latent_std"):
            assert name in logged, (step, name)
        buckets = {k for k in logged if k.startswith("train/loss_at_time_")}
        assert buckets and buckets <= {f"train/loss_at_time_{k}" for k in (0, 250, 500, 750, 1000)}, buckets
    assert (run / "lora/transformer/config.json").is_file()  # the whole transformer, exported
    # and CausVid's generator file beside it: the same weights under CausVid's names
    from diffusers import WanTransformer3DModel

    from e2v.models.causvid_ckpt import load_causvid_checkpoint
    from e2v.models.tiny import tiny_transformer_config

    exported = WanTransformer3DModel.from_pretrained(run / "lora/transformer")
    fresh = WanTransformer3DModel(**tiny_transformer_config("t2v"))
    load_causvid_checkpoint(fresh, run / "lora/e2v_causvid.pt")
    for name, value in exported.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_resume_continues_with_the_uninterrupted_losses(full_zero2, clips):
    run, _ = full_zero2
    out = run.parent
    resumed = run_train(CONFIG, *tiny(clips, out, "resumed", f"train.max_steps={STEPS}", *EMA),
                        num_gpus=2, extra=("--resume", str(run / "checkpoints/step_000002")))
    assert "resumed from" in resumed.stdout + resumed.stderr
    whole, again = read_scalars(run), read_scalars(out / "resumed")
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step]["train/loss"] == pytest.approx(whole[step]["train/loss"], rel=1e-6, abs=0), step
    # the EMA went on from the checkpoint's: the resumed run's equals the uninterrupted one's
    from safetensors.torch import load_file

    ema, ema_again = (load_file(r / "checkpoints/step_000004/ema.safetensors") for r in (run, out / "resumed"))
    assert sorted(ema) == sorted(ema_again)
    for name, value in ema.items():
        torch.testing.assert_close(ema_again[name], value, rtol=1e-6, atol=1e-7)


def test_the_ema_is_the_average_of_the_steps_weights_and_exports_as_lora_ema(full_zero2, tmp_path):
    """Oracle: the checkpoints' trained weights after steps 2, 3 and 4 (DeepSpeed's zero_to_fp32);
    with weight 0.5 from step 2 the average is 0.25 W2 + 0.25 W3 + 0.5 W4. lora_ema/ holds it in the
    export's dtypes, and its CausVid file the same weights; the offline export of the last
    checkpoint with --ema writes the same transformer."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from e2v.models.causvid_ckpt import load_causvid_checkpoint
    from e2v.models.tiny import tiny_transformer_config
    from e2v.train.checkpoint import state_from_checkpoint

    run, proc = full_zero2
    w2, w3, w4 = (state_from_checkpoint(run / f"checkpoints/step_00000{k}")[0] for k in (2, 3, 4))
    ema = load_file(run / "checkpoints/step_000004/ema.safetensors")
    assert sorted(ema) == sorted(w4)
    for name in w4:
        torch.testing.assert_close(ema[name], 0.25 * w2[name] + 0.25 * w3[name] + 0.5 * w4[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(ema[n], w4[n]) for n in w4)  # not the last weights
    exported = WanTransformer3DModel.from_pretrained(run / "lora_ema/transformer").state_dict()
    fresh = WanTransformer3DModel(**tiny_transformer_config("t2v"))
    load_causvid_checkpoint(fresh, run / "lora_ema/e2v_causvid.pt")
    for name, value in exported.items():
        torch.testing.assert_close(value.float(), ema[name], rtol=1e-2, atol=1e-2)  # bf16 where the export rounds
        assert torch.equal(fresh.state_dict()[name], value.to(fresh.state_dict()[name].dtype)), name
    assert f"EMA weights: {run / 'lora_ema'}" in proc.stdout + proc.stderr
    from e2v.train.checkpoint import export_checkpoint

    export_checkpoint(run / "checkpoints/step_000004", tmp_path / "offline", ema=True)
    offline = WanTransformer3DModel.from_pretrained(tmp_path / "offline/transformer").state_dict()
    assert sorted(offline) == sorted(exported) and all(torch.equal(offline[n], exported[n]) for n in exported)


def test_a_lora_trains_under_zero3_in_two_processes_from_a_generator_ckpt(full_zero2, clips, tmp_path_factory):
    """The seed's generator_ckpt: the LoRA run starts from the full run's CausVid file, so a module the
    LoRA leaves frozen (the patch embedding) is exported as the full run trained it."""
    import torch

    from e2v.models.tiny import seeded, tiny_transformer_config

    start = full_zero2[0] / "lora/e2v_causvid.pt"
    out = tmp_path_factory.mktemp("causal_lora")
    refused = launch_python(ROOT / "train_e2v.py", "--config", CONFIG, "--set", "parallel.ring_degree=2",
                            *sum((["--set", s] for s in tiny(clips, out, "refused")), []))
    proc = run_train(CONFIG, *tiny(clips, out, "lora", "model.training_type=lora", "train.max_steps=2",
                                   "train.checkpoint_every=2", "deepspeed.config=ds_configs/zero3.json",
                                   f"model.generator_ckpt={start}"), num_gpus=2)
    log = proc.stdout + proc.stderr
    assert "done: 2 steps" in log and "full fine-tune" not in log
    assert (out / "lora/lora/pytorch_lora_weights.safetensors").is_file() and not (out / "lora/lora/transformer").exists()
    fused = torch.load(out / "lora/lora/e2v_causvid.pt", weights_only=True)["generator"]  # the LoRA fused in
    trained = torch.load(start, weights_only=True)["generator"]
    from diffusers import WanTransformer3DModel

    with seeded(0):
        init = WanTransformer3DModel(**tiny_transformer_config("t2v")).state_dict()["patch_embedding.weight"]
    key = "model.patch_embedding.weight"
    assert torch.equal(fused[key], trained[key]) and not torch.equal(trained[key], init)
    scalars = read_scalars(out / "lora")
    assert all(0 < s["train/loss"] < 1e3 for s in scalars.values())
    (stopped,) = wait_all(refused, check=False)
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("config error")]
    assert stopped.returncode != 0 and lines == [
        "config error: task: causal with parallel.ring_degree: 2: diffusers' ring attention takes no mask, so it "
        "cannot apply the block-causal rule; set parallel.ring_degree: 1 and split with parallel.ulysses_degree "
        "instead (its exchange gives attention the whole sequence, which the rule needs)"], stopped.stderr[-2000:]


# 3 steps from the seed file, validated at steps 0 and 3 (losses at 5 sigmas, one held-out video
# sampled block by block); 3 clips train, 1 is held out.
VALIDATED = ("train.max_steps=3", "validation.every_n_steps=3", "validation.num_samples=1",
             "validation.num_videos=1", "validation.guidance_scale=1")


@pytest.fixture(scope="module")
def ulysses_pair(clips, tmp_path_factory):
    """The seed's causal run in 1 process and in 2 at Ulysses 2, side by side (one intra-op thread
    each: the ranks share the machine's cores, tests/launch/test_context_parallel_runs.py)."""
    out = tmp_path_factory.mktemp("causal_cp")
    env = {"OMP_NUM_THREADS": "1"}
    one = launch_train(CONFIG, *tiny(clips, out, "one", *VALIDATED), num_gpus=1, env=env)
    u2 = launch_train(CONFIG, *tiny(clips, out, "u2", *VALIDATED, "parallel.ulysses_degree=2"), num_gpus=2, env=env)
    one_done, u2_done = wait_all(one, u2)
    return out, u2_done


def test_ulysses_causal_run_equals_one_process_run(ulysses_pair):
    """2 processes at Ulysses 2 (the block rule applied after the exchange, each frame's timestep split
    with its tokens) train what 1 process trains: every step's loss and gradient norm and the
    validation losses at steps 0 and 3 within 1e-5 relative; the validation video (the causal sampler,
    run on the unsplit model under context parallelism) is the same file."""
    out, proc = ulysses_pair
    log = proc.stdout + proc.stderr
    assert "context parallel: 2 processes = 1 data-parallel group(s) x 2 Ulysses x 1 ring" in log
    assert "done: 3 steps" in log
    cp, one = read_scalars(out / "u2"), read_scalars(out / "one")
    assert sorted(s for s in cp if "train/loss" in cp[s]) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("train/loss", "train/grad_norm"):
            assert cp[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=0), (step, key)
    val = [k for k in one[3] if k.startswith("val/loss")]
    assert val and all(k in cp[s] for s in (0, 3) for k in val)
    for step in (0, 3):
        for key in val:
            assert cp[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=0), (step, key)
    videos = sorted((out / "one" / "samples").rglob("*.mp4"))
    assert videos and [p.relative_to(out / "one") for p in videos] == [
        p.relative_to(out / "u2") for p in sorted((out / "u2" / "samples").rglob("*.mp4"))]
    for video in videos:
        assert video.read_bytes() == (out / "u2" / video.relative_to(out / "one")).read_bytes(), video
