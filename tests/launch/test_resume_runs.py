"""The launch half of tests/unit/test_resume.py (preemption and resume):
the tests that train through the launcher; that file's docstring says what the two halves check."""

import json
import os
import signal
import time

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from helpers import ROOT, ZERO3_OFFLOAD_RUN, read_scalars
from helpers_launch import launch_train, run_train, wait_all

# The real entry point with one test-only step: before the end-of-run export every rank runs the
# live engine on a fixed probe (a collective under ZeRO-3), rank 0 saves the output (the wrapper
# make smoke-real uses too).
from bench.smokelib.probe import WRAPPER as ENGINE_PROBE_WRAPPER
from e2v.models.tiny import build_tiny_parts
from e2v.train.checkpoint import MANIFEST, checkpoint_problem, find_resume
from e2v.train.export import load_extra_modules

pytestmark = pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run` (tests/conftest.py)


def _probe() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 36, 5, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
                encoder_hidden_states_image=torch.randn(1, 17 * 3, 32, generator=g))


# The real entry point, plus one test-only gate for the interrupted run: the loop reads
# `stop["signal"]` (what distributed.install_stop_handlers returns) once per step, in its stop check, and
# the check of step GATE_STEP waits (at most 120 s) until this rank has received the test's
# SIGTERM. The test signals once step SIGNAL_AFTER is logged, so the signal lands at step
# SIGNAL_AFTER or GATE_STEP, however slowly a loaded machine runs the test's poll; the tests
# read which from the run and hold it to exactly that step.
SIGNAL_AFTER, GATE_STEP = 2, 3


STOP_GATE_WRAPPER = r"""
import runpy, sys, time
sys.path.insert(0, {root!r})
from e2v.runtime import distributed

real_install = distributed.install_stop_handlers


class GatedStop(dict):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.reads = inner, 0

    def __getitem__(self, key):
        if key == "signal":
            self.reads += 1
            deadline = time.time() + 120
            while self.reads == {gate} and self.inner["signal"] is None and time.time() < deadline:
                time.sleep(0.01)
        return self.inner[key]


distributed.install_stop_handlers = lambda: GatedStop(real_install())
runpy.run_path({train!r}, run_name="__main__")
"""


def _wrapper(path, template: str, **fields):
    path.write_text(template.format(root=str(ROOT), train=str(ROOT / "train_e2v.py"), **fields))
    return path


@pytest.fixture(scope="module")
def interrupted(demo_data, tmp_path_factory):
    """The same run as zero3_offload_run, with gradient checkpointing and no periodic checkpoint
    before the end (checkpoint_every 100 > max_steps 8), preempted once step SIGNAL_AFTER is
    logged: SIGTERM to every rank, as a scheduler sends it. (Signalling the deepspeed launcher too
    also works, but the launcher kills the ranks 30 s later, which a heavily loaded 2-core machine
    can exceed.)"""
    out = tmp_path_factory.mktemp("resume")
    run = out / "r"
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=r", *ZERO3_OFFLOAD_RUN,
            "train.checkpoint_every=100")
    gate = _wrapper(out / "train_with_stop_gate.py", STOP_GATE_WRAPPER, gate=GATE_STEP)
    launch = launch_train("configs/e2v_tiny_lora.yaml", *sets, "train.gradient_checkpointing=true", num_gpus=2, script=gate)
    signalled, deadline = set(), time.time() + 600
    while launch.proc.poll() is None and time.time() < deadline:
        if (run / "scalars.jsonl").exists() and max(read_scalars(run), default=0) >= SIGNAL_AFTER:
            for rank, procs in launch.ranks().items():  # not the launcher's processes
                for p in procs:  # the rank and its data workers (which inherit the handler and ignore it)
                    p.send_signal(signal.SIGTERM)
                signalled.add(rank)
            break
        time.sleep(0.02)
    proc = launch.wait(check=False)
    assert signalled == {0, 1}, signalled
    return run, proc, sets


def test_sigterm_saves_a_checkpoint_and_exits(interrupted):
    run, proc, _ = interrupted
    log = proc.stdout + proc.stderr
    assert "checkpoint saved at step" in log, log[-3000:]
    stopped = int(log.split("checkpoint saved at step ")[1].split(";")[0])
    assert SIGNAL_AFTER <= stopped <= GATE_STEP, "the signal stops the run after the step it followed"
    assert proc.returncode == 0, "every rank must exit cleanly (code 0) after the save"
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == [f"step_{stopped:06d}"], \
        "the signal's save must be the only checkpoint"
    assert (run / "checkpoints/latest").read_text() == f"step_{stopped:06d}"
    assert checkpoint_problem(run / f"checkpoints/step_{stopped:06d}") is None
    assert json.loads((run / f"checkpoints/step_{stopped:06d}" / MANIFEST).read_text())["step"] == stopped
    assert "lora" not in os.listdir(run)  # a stop exports nothing; its line names the command that does
    assert f"python tools/export_lora.py {run}/checkpoints/latest --out {run}/lora" in log
    assert max(read_scalars(run)) == stopped


def test_resume_continues_from_the_signalled_step_with_uninterrupted_losses(interrupted, zero3_offload_run):
    run, _, sets = interrupted
    stopped = max(read_scalars(run))
    signalled = run / f"checkpoints/step_{stopped:06d}"
    stale = run / "checkpoints/step_000005.partial"  # a save killed mid-write, never completed
    (stale / "global_step5").mkdir(parents=True)
    (stale / "global_step5/mp_rank_00_model_states.pt").write_bytes(b"x" * 100)

    torch.save(_probe(), run / "probe.pt")
    wrapper = _wrapper(run / "train_with_probe.py", ENGINE_PROBE_WRAPPER, probe=str(run / "probe.pt"),
                       out=str(run / "engine_probe_out.pt"))
    proc = launch_train("configs/e2v_tiny_lora.yaml", *sets, num_gpus=2, extra=("--resume", "latest"),
                        script=wrapper).wait(check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert f"resumed from {signalled} at step {stopped}" in proc.stdout
    reference = read_scalars(zero3_offload_run)
    resumed = read_scalars(run)  # steps 1..stopped: the interrupted run (with checkpointing); then the resumed one
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step]["train/loss"] == reference[step]["train/loss"], step
        assert resumed[step]["train/lr"] == reference[step]["train/lr"], step
    assert not stale.exists(), "the final save must remove the stale .partial folder"
    assert checkpoint_problem(signalled) is None, "completed checkpoints are kept"

    # Oracle: the live engine at the end of training (not a reload of its checkpoint).
    engine_out = torch.load(run / "engine_probe_out.pt")
    parts = build_tiny_parts(seed=0)
    pipe = WanImageToVideoPipeline(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae,
                                   image_encoder=parts.image_encoder, image_processor=parts.image_processor,
                                   transformer=parts.transformer, scheduler=UniPCMultistepScheduler())
    pipe.load_lora_weights(str(run / "lora"))
    assert load_extra_modules(pipe.transformer, run / "lora")
    with torch.no_grad():
        exported = pipe.transformer(**_probe(), return_dict=False)[0]
    torch.testing.assert_close(exported, engine_out, atol=1e-5, rtol=0)

    final = run / "checkpoints/step_000008"
    assert (run / "checkpoints/latest").read_text() == final.name
    victim = max((p for p in final.rglob("*.pt")), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a copy cut short by a full disk
    assert "truncated" in checkpoint_problem(final)
    assert find_resume("latest", run) == signalled, "a truncated `latest` falls back to the previous checkpoint"


def test_error_mid_run_saves_the_last_finished_step_and_resumes(tmp_path):
    """One process, a clip that indexes (its header is fine) but fails to load at step 4
    (on_bad_sample: error): the run stops naming the file, after saving step 3 although no
    periodic checkpoint was due; once the file is fixed, `--resume latest` finishes from step 3
    with the losses of a run that never failed."""
    from helpers_t2v import make_npz_manifest

    def corrupt(path):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)  # inside the frame data: the zip CRC fails on load
        path.write_bytes(bytes(raw))

    data = tmp_path / "data"
    make_npz_manifest(data, num_clips=5, num_frames=9, height=32, width=32)
    victim = data / "clips/clip_0003.npz"
    good = victim.read_bytes()
    corrupt(victim)
    sets = ["model.preset=tiny", "model.pretrained=null", f"data.datasets.0.data_root={data}", "data.num_frames=9",
            "data.resolution=[32,32]", "data.shuffle=false", "train.mixed_precision=no",
            "train.gradient_checkpointing=false", "train.gradient_accumulation_steps=1", "train.micro_batch_size=1",
            "train.max_steps=5", "train.checkpoint_every=100", f"output_dir={tmp_path}"]
    proc = run_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=crash", check=False)
    assert proc.returncode != 0
    assert "clip_0003.npz" in proc.stdout + proc.stderr and "saving step 3 first" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "crash"
    assert find_resume("latest", run) == run / "checkpoints/step_000003"
    assert max(read_scalars(run)) == 3

    victim.write_bytes(good)
    resume = launch_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=crash", extra=("--resume", "latest"))
    clean = launch_train(str(ROOT / "configs/t2v_lora.yaml"), *sets, "run_id=clean")  # side by side: same data
    wait_all(resume, clean)
    resumed, clean = read_scalars(run), read_scalars(tmp_path / "clean")
    assert sorted(resumed) == sorted(clean) == [1, 2, 3, 4, 5]
    for step in clean:
        assert resumed[step]["train/loss"] == clean[step]["train/loss"], step
