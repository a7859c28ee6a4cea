"""Context parallelism (e2v/models/context_parallel.py, docs/context_parallel.md) in training runs
against runs without it (the in-process checks: tests/unit/test_context_parallel.py).

Training runs (`deepspeed train_e2v.py`), each compared with a shared run of the session that has no
context parallelism (so the baselines cost nothing here; each test is in its baseline's group):
  u2       2 processes, Ulysses 2, the viz run's training settings (its held-out split, checkpoints,
           export; validation losses at steps 0 and 4, no videos or visualizations, which leave the
           training alone)                                          = viz_run, 1 process
  dp2_r2   4 processes, 2 data-parallel groups x ring 2, the ZeRO-3 + offload run's settings, its
           first 3 steps                                            = zero3_offload_run, 2 processes
  resumed  2 processes, Ulysses 2, resumed from u2's step-2 checkpoint (after u2)
                                                                    = u2's and viz_run's steps 3, 4
Ulysses with several data-parallel groups takes the same groups and reduction as ring (the group is
the context-parallel group either way); the in-process tests cover both exchanges.
"""

from __future__ import annotations

import pytest
from helpers import VIZ_RUN, ZERO3_OFFLOAD_RUN, read_scalars
from helpers_context_parallel import TOL
from helpers_launch import launch_train

# The viz run's training, with validation losses at steps 0 and 4 only and no videos or
# visualizations (they cost time and do not touch the training RNGs or weights).
LEAN_VIZ_RUN = (*VIZ_RUN, "validation.every_n_steps=4", "validation.num_videos=0", "validation.subject_colour=null",
                "visualization.enabled=false")


def _cp_launch(out, demo_data, run_id: str, *sets: str, num_gpus: int, extra: tuple = ()):
    # One intra-op thread per rank: 2 and 4 ranks share this machine's 2 cores, and torch's default
    # (a thread per core in every rank) makes the ranks' OpenMP threads spin against each other, about
    # 4x the CPU time of these runs (measured). The numbers compared stay within 2e-7.
    return launch_train("configs/e2v_tiny_lora.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}",
                        f"run_id={run_id}", *sets, num_gpus=num_gpus, env={"OMP_NUM_THREADS": "1"}, extra=extra)


@pytest.fixture(scope="module")
def ulysses_runs(demo_data, tmp_path_factory) -> dict:
    """u2, then the run resumed from its step-2 checkpoint."""
    out = tmp_path_factory.mktemp("cp")
    done = {"u2": _cp_launch(out, demo_data, "u2", *LEAN_VIZ_RUN, "parallel.ulysses_degree=2", num_gpus=2).wait()}
    done["resumed"] = _cp_launch(out, demo_data, "resumed", *LEAN_VIZ_RUN, "parallel.ulysses_degree=2", num_gpus=2,
                                 extra=("--resume", str(out / "u2" / "checkpoints" / "step_000002"))).wait()
    return {"out": out, **done}


@pytest.fixture(scope="module")
def ring_run(demo_data, tmp_path_factory) -> tuple:
    """dp2_r2: (what it printed, its run folder)."""
    out = tmp_path_factory.mktemp("cp")
    dp2_sets = tuple(s for s in ZERO3_OFFLOAD_RUN if not s.startswith("train.max_steps"))
    return _cp_launch(out, demo_data, "dp2_r2", *dp2_sets, "train.max_steps=3", "parallel.ring_degree=2",
                      num_gpus=4).wait(), out / "dp2_r2"


def _close(a: dict, b: dict, steps, keys=("train/loss", "train/grad_norm")) -> None:
    for step in steps:
        for k in keys:
            assert a[step][k] == pytest.approx(b[step][k], abs=TOL), (step, k, a[step][k], b[step][k])


@pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)
def test_context_parallel_ulysses_run_equals_one_process_run(ulysses_runs, viz_run):
    """2 processes at Ulysses 2 train what 1 process trains: the first step's loss and gradient
    norm, the losses and gradient norms of every step, and the validation losses (run under
    context parallelism at steps 0 and 4) within 1e-5; checkpoints at steps 2 and 4, one progress
    bar, and the exported LoRA equal to the 1-process export."""
    from safetensors.torch import load_file

    cp, one = read_scalars(ulysses_runs["out"] / "u2"), read_scalars(viz_run)
    assert sorted(s for s in cp if "train/loss" in cp[s]) == [1, 2, 3, 4]
    _close(cp, one, [1, 2, 3, 4])
    val = [k for k in one[4] if k.startswith("val/loss")]
    assert val and all(k in cp[s] for s in (0, 4) for k in val)
    _close(cp, one, [0, 4], keys=val)
    assert cp[1]["perf/samples_per_s"] * cp[1]["perf/step_time_s"] == pytest.approx(2)  # 1 group x micro batch 2
    run = ulysses_runs["out"] / "u2"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    out = ulysses_runs["u2"].stdout + ulysses_runs["u2"].stderr
    assert "context parallel: 2 processes = 1 data-parallel group(s) x 2 Ulysses x 1 ring" in out
    assert out.count("train:   0%") == 1 and "train: 100%" in out  # one bar (rank 0's), to the end
    for name in ("pytorch_lora_weights.safetensors", "e2v_modules.safetensors"):
        a, b = load_file(run / "lora" / name), load_file(viz_run / "lora" / name)
        assert a.keys() == b.keys() and a
        assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < TOL, name


@pytest.mark.xdist_group("zero3_offload_run")  # with the other users of `zero3_offload_run`
def test_context_parallel_dp_x_cp_run_equals_data_parallel_run(ring_run, zero3_offload_run):
    """4 processes as 2 data-parallel groups of ring attention over 2 ranks (ZeRO-3 + offload over
    all 4 ranks) train what the 2-process data-parallel run trains: the first step's loss and
    gradient norm and those of 3 steps within 1e-5 (ring attention equals the run without it)."""
    (printed, run), dp = ring_run, read_scalars(zero3_offload_run)
    cp = read_scalars(run)
    assert sorted(s for s in cp if "train/loss" in cp[s]) == [1, 2, 3]
    _close(cp, dp, [1, 2, 3])
    assert cp[1]["perf/samples_per_s"] * cp[1]["perf/step_time_s"] == pytest.approx(4)  # 2 groups x micro batch 2
    out = printed.stdout
    assert "context parallel: 4 processes = 2 data-parallel group(s) x 1 Ulysses x 2 ring" in out
    assert (run / "lora" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.xdist_group("viz_run")
def test_context_parallel_resume_continues_with_the_uninterrupted_losses(ulysses_runs, viz_run):
    """A context-parallel run resumed from the Ulysses run's step-2 checkpoint (each rank's ZeRO
    partition and RNG states, the sampler offset of its data-parallel rank) continues with that
    run's losses and gradient norms at steps 3 and 4, and the 1-process run's validation losses."""
    resumed, u2, one = (read_scalars(ulysses_runs["out"] / "resumed"), read_scalars(ulysses_runs["out"] / "u2"),
                        read_scalars(viz_run))
    assert "resumed from" in ulysses_runs["resumed"].stdout
    assert sorted(s for s in resumed if "train/loss" in resumed[s]) == [3, 4]
    _close(resumed, u2, [3, 4])
    _close(resumed, one, [3, 4])
    _close(resumed, one, [4], keys=[k for k in one[4] if k.startswith("val/loss")])
