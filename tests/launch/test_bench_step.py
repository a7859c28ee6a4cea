"""The benchmark measures the step train_e2v.py trains, not a copy of it: from the same config and
seed, the benchmark's step (bench/benchlib/step.py: StepRunner on the engine it builds) and
train_e2v.py's own loop (its main(), run in this process) log the same losses, gradient norms,
learning rates and per-timestep-bucket losses, step for step, in fp32 and in bf16. bf16 is where a
re-stated setup drifts first: deepspeed.initialize casts diffusers' fp32 modules unless
e2v.train.engine puts them back (docs/architecture.md, "Precision and activation memory").

Both run in one process on a one-process gloo group (no deepspeed launcher), the tiny preset, 2
steps of batch 2: the same threads and kernels, so the values must be equal, not close."""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import close_process_group, read_scalars

from bench.benchlib.common import TINY_CONFIG, Phases, config_sets, make_config
from bench.benchlib.step import init_single_rank
from bench.benchlib.steps import setup

# It runs the training loop's engine steps in this process: by its cost a launch test (tests/conftest.py).

STEPS = 2
# The time embedder and the modulation tables frozen (e2v_tiny_lora.yaml trains them in full): modules
# diffusers keeps in fp32, with random weights that a bf16 cast changes. The tiny preset's other
# frozen kept modules (norms at 1 and 0) survive the cast, so a lost restore would go unseen.
SETS = ["train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.log_every=1",
        "train.trainable=[patch_embedding,condition_embedder.text_embedder,condition_embedder.image_embedder,proj_out]"]


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    init_single_rank()
    yield
    close_process_group()


def bench_scalars(data_root, sets, out) -> dict[int, dict]:
    """STEPS steps of the benchmark's online step, as `bench/bench.py --child steps` runs them."""
    cfg = make_config("tiny", data_root, None, sets)
    _, runner, engine, scheduler, batches, _ = setup("tiny", cfg, False, out)
    for _ in range(STEPS):
        runner.train_step(engine, batches, Phases(False), scheduler)
    runner.close()
    return read_scalars(out)


def train_scalars(data_root, sets, out) -> dict[int, dict]:
    """train_e2v.py's main() on the benchmark's config overrides (its --set list), in this process."""
    import train_e2v

    argv = ["--config", str(TINY_CONFIG)]
    for s in config_sets("tiny", data_root, None, sets, cached=False) + [f"output_dir={out}", "run_id=train"]:
        argv += ["--set", s]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    train_e2v.main(argv)
    # main() installs its stop handlers for the run and puts the previous ones back
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    return read_scalars(out / "train")


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_bench_step_is_the_training_step(demo_data, tmp_path, precision):
    sets = SETS + [f"train.mixed_precision={precision}"]
    bench = bench_scalars(demo_data, sets, tmp_path / "bench")
    train = train_scalars(demo_data, sets, tmp_path)

    assert sorted(bench) == sorted(train) == list(range(1, STEPS + 1))
    for step in train:
        numeric = {k for k in train[step] if not k.startswith("perf/")}  # timings differ, nothing else may
        assert {"train/loss", "train/grad_norm", "train/lr"} <= numeric
        assert any(k.startswith("train/loss_at_time_") for k in numeric)
        assert numeric == {k for k in bench[step] if not k.startswith("perf/")}, step
        assert {k: bench[step][k] for k in numeric} == {k: train[step][k] for k in numeric}, (precision, step)
    assert train[1]["train/loss"] != train[2]["train/loss"]  # the optimizer stepped between them
    assert all(torch.isfinite(torch.tensor(train[s]["train/grad_norm"])) for s in train)

