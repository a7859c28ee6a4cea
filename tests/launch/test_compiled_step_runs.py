"""Compiled and eager training in this process (the compiled half of tests/unit/test_speed.py, here
because a cold inductor compile of the tiny block costs ~1-2 min on 2 cores, too much for `make
test-fast`; the inductor cache makes a later session's a few seconds): the same losses (LoRA and
full, checkpointing on), the same checkpoint and export keys, resume into each other, and two
buckets make the graphs docs/speed.md states. They share one module-scoped set of runs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, read_scalars, train_main

from e2v.models import speed

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = str(ROOT / "configs" / "e2v_tiny_lora.yaml")


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


# Two buckets: the session's 17-frame demo data and 9-frame clips of the same kind (frame buckets 9
# and 17: latents of 3 and 5 frames). Checkpoints at 2 and 4 (the resumes start at 2).
RUN = ("data.auto_frame_buckets=true", "data.frame_buckets=[9,17]", "train.max_steps=4", "train.checkpoint_every=2",
       "train.micro_batch_size=2", "train.gradient_checkpointing=true", "validation.every_n_steps=0",
       "visualization.enabled=false", "data.num_workers=0")


def _run(root, run_id: str, *sets: str, resume: str | None = None) -> tuple[dict, int]:
    """One in-process run: its losses by step and the graphs torch.compile made during it."""
    before = speed.compiled_graphs()
    code = train_main("--config", TINY, *_sets(*RUN, f"output_dir={root}", f"run_id={run_id}", *sets),
                      *(["--resume", resume] if resume else []))
    assert code is None, code
    return {s: r["train/loss"] for s, r in read_scalars(root / run_id).items() if "train/loss" in r}, \
        speed.compiled_graphs() - before


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data):
    from e2v.data.demo import main as make_demo

    torch._dynamo.reset()  # no graph of another test's model: each run compiles what it needs
    root = tmp_path_factory.mktemp("speed")
    make_demo([str(root / "clips9"), "--num-samples", "8", "--frames", "9"])
    data = f"data.datasets=[{{data_root: {demo_data}}}, {{data_root: {root / 'clips9'}}}]"
    out = {"root": root}
    out["eager"] = _run(root, "eager", data)
    out["compiled"] = _run(root, "compiled", data, "speed.compile=true")
    out["eager_to_compiled"] = _run(root, "e2c", data, "speed.compile=true",
                                    resume=str(root / "eager" / "checkpoints" / "step_000002"))
    out["compiled_to_eager"] = _run(root, "c2e", data, resume=str(root / "compiled" / "checkpoints" / "step_000002"))
    one_bucket = (f"data.datasets.0.data_root={demo_data}", "model.training_type=full", "train.max_steps=2",
                  "train.trainable=[]")
    out["full_eager"] = _run(root, "full_eager", *one_bucket)
    # aot_eager: dynamo's graph and AOT autograd's backward without inductor's codegen, which the LoRA
    # run covers (a second cold inductor compile would double this fixture's ~1-2 min)
    out["full_compiled"] = _run(root, "full_compiled", *one_bucket, "speed.compile=true", "speed.compile_backend=aot_eager")
    fp8 = (f"data.datasets.0.data_root={demo_data}", "model.base_dtype=fp8", "train.max_steps=2")
    out["fp8_eager"] = _run(root, "fp8_eager", *fp8)
    out["fp8_compiled"] = _run(root, "fp8_compiled", *fp8, "speed.compile=true", "speed.compile_backend=aot_eager")
    return out


def _close(a: dict, b: dict, steps) -> None:
    """fp32 losses of the compiled and the eager step: inductor reorders sums (measured ~1e-7)."""
    assert set(steps) <= set(a) and set(steps) <= set(b), (a, b)
    for s in steps:
        assert a[s] == pytest.approx(b[s], rel=1e-5), (s, a[s], b[s])


def test_compiled_training_gives_eager_losses(runs):
    """LoRA with inductor, over two buckets; a full fine-tune and an fp8 base through dynamo and AOT
    autograd (aot_eager), each against its eager run; checkpointing on in all."""
    _close(runs["compiled"][0], runs["eager"][0], [1, 2, 3, 4])
    _close(runs["full_compiled"][0], runs["full_eager"][0], [1, 2])
    _close(runs["fp8_compiled"][0], runs["fp8_eager"][0], [1, 2])  # the fp8 Linear's autograd Function, traced
    assert runs["eager"][1] == 0  # nothing compiled unless asked


def test_two_buckets_make_the_graphs_the_docs_state(runs):
    """docs/speed.md: with compile_shapes auto, at most 2 graphs per kind of block input whatever the
    buckets (the first shape static, the second one dynamic graph for all); e2v_tiny_lora trains the
    patch embedding, so every block's input requires grad: one kind. Exactly 2: the second bucket was met."""
    assert runs["compiled"][1] == 2
    doc = " ".join((ROOT / "docs" / "speed.md").read_text().replace("**", "").split())
    assert "at most 2 graphs per kind of block input" in doc


def test_resume_across_compilation_continues_the_losses(runs):
    eager, compiled = runs["eager"][0], runs["compiled"][0]
    _close(runs["eager_to_compiled"][0], eager, [3, 4])
    _close(runs["compiled_to_eager"][0], compiled, [3, 4])


def _keys(run) -> dict:
    """Every name a run wrote: the checkpoint's module and parameter shapes, each safetensors file's
    keys, the export's JSON."""
    from safetensors import safe_open

    out = {}
    step = run / "checkpoints" / "step_000004"
    states = torch.load(step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    out["module"] = sorted(states["module"])
    out["param_shapes"] = [sorted(g) for g in states["param_shapes"]]
    for f in sorted([*run.glob("lora/*.safetensors"), *step.glob("*.safetensors"), *run.glob("*.safetensors")]):
        if not f.name.startswith("rng_"):
            with safe_open(str(f), "pt") as st:
                out[str(f.relative_to(run))] = sorted(st.keys())
    out["export"] = json.loads((step / "e2v_export.json").read_text())
    return out


def test_checkpoint_and_export_names_do_not_change(runs):
    eager, compiled = _keys(runs["root"] / "eager"), _keys(runs["root"] / "compiled")
    assert compiled == eager
    assert "_orig_mod" not in json.dumps(compiled)
    assert len(eager) >= 6  # module, shapes, the LoRA and its ComfyUI copy, the modules trained in full, base
