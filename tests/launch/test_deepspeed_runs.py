"""DeepSpeed for real: every shipped ds_config resolves; 2-process runs under ZeRO-2, and ZeRO-2 with
optimizer offload plus gradient checkpointing and the activation-offload key, give the losses of
the ZeRO-3-offload run; a non-finite loss stops a 2-process run naming step, ranks and samples, after
saving nothing from that step; under bf16 the modules diffusers keeps in fp32 stay fp32 (checked
against diffusers' own bf16 loading), and trainable weights keep fp32 master copies.

This file: the tests that train through the launcher; the in-process ones are in tests/unit/test_deepspeed.py."""

import json

import pytest
from helpers import ROOT, ZERO3_OFFLOAD_RUN, read_scalars
from helpers_launch import launch_python, launch_train, wait_all

pytestmark = pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run` (tests/conftest.py)


@pytest.fixture(scope="module")
def ds_runs(demo_data, tmp_path_factory) -> tuple:
    """Every 2-process run of this module, started side by side (each is mostly start-up):
    ZeRO-2, and ZeRO-2 with optimizer offload (the config's only normal 2-process run) plus
    gradient checkpointing and activation offload, 4 steps each; ZeRO-3 without offload, 3 steps;
    and the non-finite run (lr 1e30 turns the weights to ~1e30 in one step, so step 2's loss is
    inf/nan). Returns the output folder and each run's finished process."""
    out = tmp_path_factory.mktemp("ds")
    data, sets = f"data.datasets.0.data_root={demo_data}", [
        s for s in ZERO3_OFFLOAD_RUN if not s.startswith(("deepspeed.config", "train.max_steps"))]
    runs = {run_id: launch_train("configs/e2v_tiny_lora.yaml", data, f"output_dir={out}", f"run_id={run_id}", *extra,
                                 num_gpus=2)
            for run_id, extra in (
                ("plain", ["train.max_steps=4", "train.checkpoint_every=4", *sets, "deepspeed.config=ds_configs/zero2.json"]),
                ("ckpt", ["train.max_steps=4", "train.checkpoint_every=4", *sets,
                          "deepspeed.config=ds_configs/zero2_offload.json", "train.gradient_checkpointing=true",
                          "train.activation_offload=true"]),
                ("z3", ["train.max_steps=3", "train.checkpoint_every=3", "deepspeed.config=ds_configs/zero3.json", *sets]),
                ("nan", ["train.lr=1e30", "train.warmup_steps=0", "train.max_steps=4", "train.checkpoint_every=1",
                         "train.micro_batch_size=2", "validation.every_n_steps=0", "visualization.enabled=false",
                         "deepspeed.config=ds_configs/zero2_offload.json"]))}
    return out, dict(zip(runs, wait_all(*runs.values(), check=False)))


def _finished(ds_runs, run_id: str) -> dict:
    out, procs = ds_runs
    proc = procs[run_id]
    assert proc.returncode == 0, f"{run_id} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return read_scalars(out / run_id)


@pytest.fixture(scope="module")
def zero2_runs(ds_runs):
    return _finished(ds_runs, "plain"), _finished(ds_runs, "ckpt")


def test_zero2_offload_checkpointing_and_activation_offload_keep_the_losses(zero2_runs):
    """Optimizer offload runs the same torch AdamW on the same fp32 partitions, on the CPU; gradient
    checkpointing recomputes the same ops; activation offload is a no-op without CUDA. The first
    loss is bit-identical (the same forward); the gradient norm is summed over differently laid-out
    buffers with offload (DeepSpeed's CPU copies), which moves it by an ulp (1.01261663 against
    1.01261652 here), and clipping by that norm moves the later losses by as little: rel 1e-6."""
    plain, ckpt = zero2_runs
    assert sorted(plain) == sorted(ckpt) == [1, 2, 3, 4]
    assert ckpt[1]["train/loss"] == plain[1]["train/loss"]
    for step in plain:
        assert ckpt[step]["train/loss"] == pytest.approx(plain[step]["train/loss"], rel=1e-6, abs=0), step
        assert ckpt[step]["train/grad_norm"] == pytest.approx(plain[step]["train/grad_norm"], rel=1e-6, abs=0), step


def test_zero2_and_zero3_offload_train_the_same_model(zero2_runs, zero3_offload_run):
    """Same data, seed and optimizer: ZeRO stages differ only in float summation order."""
    plain, _ = zero2_runs
    reference = read_scalars(zero3_offload_run)
    for step in plain:
        assert plain[step]["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-6), step


def test_zero3_without_offload_trains_the_same_model(ds_runs, zero3_offload_run):
    """The fourth shipped config with 2 processes (zero2 and zero2_offload: above; zero3_offload:
    the shared run): the same losses as ZeRO-3 with offload."""
    ours, reference = _finished(ds_runs, "z3"), read_scalars(zero3_offload_run)
    assert sorted(ours) == [1, 2, 3]
    for step in ours:
        assert ours[step]["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-6), step
    assert (ds_runs[0] / "z3/lora/pytorch_lora_weights.safetensors").exists()


def test_nonfinite_loss_stops_naming_step_ranks_and_samples(ds_runs):
    """A real trigger: lr 1e30 turns the weights to ~1e30 in one step, so step 2's loss is inf/nan."""
    out, procs = ds_runs
    proc = procs["nan"]
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    msg = next(line for line in log.splitlines() if "FloatingPointError: non-finite" in line)
    assert "at step 2" in msg and "rank 0:" in msg and "rank 1:" in msg and "samples [" in msg
    ckpts = out / "nan/checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_000001"]
    assert (ckpts / "latest").read_text() == "step_000001"


# One process, no launcher: deepspeed.initialize a LoRA-only tiny model in bf16 under ZeRO stage N
# and compare with diffusers' own bf16 loading of the same weights (which keeps
# `_keep_in_fp32_modules` in fp32). ZeRO-3 uses persistence threshold 0, so every parameter is
# really partitioned.
BF16_SCRIPT = r"""
import os, sys, json, tempfile, torch
sys.path.insert(0, sys.argv[1])
stage = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import deepspeed
from diffusers import WanTransformer3DModel
from deepspeed.utils import safe_get_full_fp32_param
from e2v.runtime.distributed import init_distributed
from e2v.config.load import load_config
from e2v.models.precision import fp32_kept_params, restore_fp32_params
from e2v.models.tiny import build_tiny_parts
from e2v.models.trainable import setup_training

init_distributed()
model = build_tiny_parts(seed=0, with_encoders=False).transformer
tmp = tempfile.mkdtemp()
model.save_pretrained(tmp)
oracle = WanTransformer3DModel.from_pretrained(tmp, torch_dtype=torch.bfloat16)
original = {n: p.detach().clone() for n, p in model.named_parameters()}
cfg = load_config(os.path.join(sys.argv[1], "configs/e2v_tiny_lora.yaml"), ["train.trainable=[]"], check_paths=False)
setup_training(model, cfg, expanded=False)
initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
zero = {"stage": stage}
if stage == 3:
    zero.update(stage3_param_persistence_threshold=0)
ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
kept = fp32_kept_params(model)
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                         config=ds)
restore_fp32_params(model, kept)
named = dict(model.named_parameters())
params = list(named.values())
with deepspeed.zero.GatheredParameters(params) if stage == 3 else torch.no_grad():
    report = {"kept": sorted(kept),
              "diffusers_fp32": sorted(n for n, p in oracle.named_parameters() if p.dtype == torch.float32),
              "kept_exact": all(named[n].dtype == torch.float32 and torch.equal(named[n].data, original[n]) for n in kept),
              "others_bf16": sorted({str(p.dtype) for n, p in named.items() if n not in kept})}
masters = {n: safe_get_full_fp32_param(p) for n, p in named.items() if p.requires_grad}
report["masters_fp32"] = all(m.dtype == torch.float32 for m in masters.values())
# DeepSpeed makes the masters from the bf16-cast weights: training starts from the bf16 model it runs.
report["masters_start_at_bf16_values"] = all(torch.equal(m, initial[n].bfloat16().float()) for n, m in masters.items())
g = torch.Generator().manual_seed(0)
probe = dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g).bfloat16(), timestep=torch.tensor([700.5]),
             encoder_hidden_states=torch.randn(1, 512, 32, generator=g).bfloat16(),
             encoder_hidden_states_image=torch.randn(1, 51, 32, generator=g).bfloat16(), return_dict=False)
with torch.no_grad():
    ours, ref = engine(**probe)[0], oracle(**probe)[0]
report["max_diff_vs_diffusers_bf16"] = (ours.float() - ref.float()).abs().max().item()
loss = engine(**probe)[0].float().pow(2).mean()
engine.backward(loss)
engine.step()
report["finite_after_step"] = bool(torch.isfinite(loss))
after = [safe_get_full_fp32_param(p) for p in named.values() if p.requires_grad]
report["masters_finer_than_bf16"] = any(bool((m != m.bfloat16().float()).any()) for m in after)
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def bf16_reports(tmp_path_factory) -> dict:
    """BF16_SCRIPT under ZeRO-2 and ZeRO-3, side by side (each is mostly imports and start-up)."""
    from helpers import _free_port

    script = tmp_path_factory.mktemp("bf16") / "bf16_report.py"
    script.write_text(BF16_SCRIPT)
    launches = {stage: launch_python(script, str(ROOT), str(stage), str(_free_port())) for stage in (2, 3)}
    return dict(zip(launches, wait_all(*launches.values(), check=False)))


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_keeps_diffusers_fp32_modules_and_fp32_masters(stage, bf16_reports):
    proc = bf16_reports[stage]
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT")[1])
    assert report["kept"] and report["kept"] == report["diffusers_fp32"]
    assert report["kept_exact"], "fp32-kept parameters must hold their original fp32 values"
    assert report["others_bf16"] == ["torch.bfloat16"]
    assert report["masters_fp32"] and report["masters_start_at_bf16_values"]
    assert report["masters_finer_than_bf16"], "after a step the fp32 masters must hold more than bf16 precision"
    assert report["max_diff_vs_diffusers_bf16"] == 0.0, "the bf16 engine differs from diffusers' own bf16 model"
    assert report["finite_after_step"]
