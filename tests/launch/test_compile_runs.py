"""speed.compile through the launcher, on two ranks (`make test-slow`: each rank compiles the block,
~1-3 min on 2 cores from an empty inductor cache): ZeRO-2 with inductor and ZeRO-3 with offload
(dynamo only: `compile_backend: eager`, which keeps DeepSpeed's hooks and graph breaks without the
code generation) train with their eager runs' losses and say what they compiled.

The in-process tests: one rank, the names, resume, buckets in tests/launch/test_compiled_step_runs.py, the
refusals in tests/unit/test_speed.py."""

from __future__ import annotations

import pytest
from helpers import ROOT, read_scalars
from helpers_launch import run_train

TINY = str(ROOT / "configs" / "e2v_tiny_lora.yaml")
RUN = ("train.max_steps=3", "train.micro_batch_size=2", "train.gradient_checkpointing=true", "train.checkpoint_every=0",
       "validation.every_n_steps=0", "visualization.enabled=false", "data.num_workers=0")
CASES = {"zero2": ("deepspeed.config=ds_configs/zero2.json",),
         "zero3_offload": ("deepspeed.config=ds_configs/zero3_offload.json", "speed.compile_backend=eager")}


def _losses(run) -> dict:
    return {s: r["train/loss"] for s, r in read_scalars(run).items() if "train/loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_compiled_train_with_eager_losses(demo_data, tmp_path, case):
    sets = (f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}", *RUN, *CASES[case])
    run_train(TINY, *sets, "run_id=eager", num_gpus=2)
    proc = run_train(TINY, *sets, "run_id=compiled", "speed.compile=true", num_gpus=2)
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), (step, compiled, eager)
    assert "speed.compile: " in proc.stdout and "graph(s) of the block compiled in this run" in proc.stdout, \
        proc.stdout[-2000:]
    if case == "zero3_offload":
        assert "note: speed.compile under ZeRO-3" in proc.stdout
