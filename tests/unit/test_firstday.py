"""What a new user meets on a second first day, each checked at the point it is decided:
`--resume latest|auto` passes over a run folder a failed start left (e2v/train/resume.py), a
hold-out that leaves nothing to train stops in one line (e2v/eval/validation.py)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from helpers import ROOT, train_main

HOLD_ALL = ("validation.num_samples: 8 samples held out for validation, but the dataset has 8 usable, so none "
            "is left to train on; hold out fewer (--set validation.num_samples=1), or none (--set "
            "validation.every_n_steps=0: no validation)")


def _run(root, name: str, steps: list[int], saved_at: float) -> None:
    """A run folder as training leaves it: config.yaml, and a checkpoint folder per step whose
    COMPLETE manifest records one file's size (checkpoint.checkpoint_problem's size check)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run_id: null\n")
    for step in steps:
        folder = run / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "state.bin").write_bytes(b"x" * 8)
        (folder / "COMPLETE").write_text(json.dumps({"step": step, "files": {"state.bin": {"bytes": 8}}}))
        os.utime(folder, (saved_at, saved_at))


def test_resume_passes_over_folders_without_a_checkpoint(tmp_path):
    from e2v.train.resume import run_to_resume

    now = time.time()
    _run(tmp_path, "e2v_tiny_lora-20260101-000000", [40, 80], now - 300)  # the 80-step run
    _run(tmp_path, "e2v_tiny_lora-20260102-000000", [], now)  # a failed start: config.yaml only
    _run(tmp_path, "other-20260103-000000", [5], now)  # another config's run
    run, why = run_to_resume(tmp_path, "e2v_tiny_lora")
    assert run == tmp_path / "e2v_tiny_lora-20260101-000000"
    assert "saved last (step_000080)" in why and "passed over 1 folder(s) without a checkpoint" in why
    assert "e2v_tiny_lora-20260102-000000" in why  # named, so the user can delete it

    # of two runs with checkpoints, the one that saved last, whatever the names say
    _run(tmp_path, "e2v_tiny_lora-20251231-000000", [3], now - 10)
    assert run_to_resume(tmp_path, "e2v_tiny_lora")[0] == tmp_path / "e2v_tiny_lora-20251231-000000"

    # an interrupted save (no manifest) is no checkpoint
    (tmp_path / "lone-1/checkpoints/step_000001").mkdir(parents=True)
    run, why = run_to_resume(tmp_path, "lone")
    assert run is None and "no run of lone" in why and "passed over 1 folder(s)" in why


def test_hold_out_rule_is_split_held_out_s(tmp_path):
    """hold_out_problem says no exactly when split_held_out would leave nothing to train (the
    same rule, asked before indexing ends by the dry run and the dataset check)."""
    from types import SimpleNamespace

    from e2v.config.schema import ConfigError
    from e2v.data.sample import Sample
    from e2v.eval.validation import hold_out_problem, split_held_out

    samples = [Sample(f"{i:02d}", None, "p", dataset=0) for i in range(6)] * 2  # 6 ids, each twice (repeat)
    for every, held in [(10, 5), (10, 6), (10, 9), (0, 9), (10, 0)]:
        cfg = SimpleNamespace(validation=SimpleNamespace(every_n_steps=every, num_samples=held, seed=1))
        problem = hold_out_problem(cfg, 6)
        try:
            train, _ = split_held_out(samples, cfg)
        except ConfigError as e:
            assert problem is not None and str(e) == "; ".join(problem), (every, held)
            continue
        assert problem is None and train, (every, held)
    cfg = SimpleNamespace(validation=SimpleNamespace(every_n_steps=10, num_samples=6, seed=1))
    assert hold_out_problem(cfg, 6)[1].startswith("hold out fewer (--set validation.num_samples=1)")
    assert "validation.num_samples=0" in hold_out_problem(cfg, 1)[1]  # one sample: it must train


def test_dry_run_refuses_a_hold_out_of_every_sample(demo_data, monkeypatch, capsys):
    """`--dry_run` with validation.num_samples = the dataset's 8 samples: one line naming the key
    and the fix, exit non-zero, before the model is planned; 7 held out leaves one to train."""
    import sys

    import train_e2v

    argv = ["train_e2v.py", "--config", "configs/e2v_tiny_lora.yaml", "--dry_run", "--set",
            f"data.datasets.0.data_root={demo_data}", "--set", "validation.every_n_steps=2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--set", "validation.num_samples=8"])
    with pytest.raises(SystemExit) as stop:
        train_e2v.main()
    assert str(stop.value) == f"config error: {HOLD_ALL}"
    assert "config OK" not in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv, "--set", "validation.num_samples=7"])
    train_e2v.main()
    assert "config OK; 8 usable samples" in capsys.readouterr().out


def test_check_dataset_says_every_sample_is_held_out(demo_data, tmp_path, capsys):
    from tools.check_dataset import main

    args = ["--config", "configs/e2v_tiny_lora.yaml", "--set", f"data.datasets.0.data_root={demo_data}",
            "--set", "validation.every_n_steps=2", "--workers", "1", "--json", str(tmp_path / "r.json")]
    assert main([*args, "--set", "validation.num_samples=8"]) == 1
    out = capsys.readouterr().out
    assert f"ERROR   held_out_all       config: {HOLD_ALL.replace('; hold out', ' -> hold out')}" in out, out
    assert "errors           1" in out
    assert main([*args, "--set", "validation.num_samples=7"]) == 0
    assert "held out         7 of the samples_ok" in capsys.readouterr().out


def _band_text(text: str, width: int) -> np.ndarray:
    """A label band holding only `text` at x=1 (Pillow's built-in font): what one label looks like."""
    from PIL import Image, ImageDraw

    from e2v.eval.viz import LABEL_BAND

    band = Image.new("RGB", (width, LABEL_BAND), "white")
    ImageDraw.Draw(band).text((1, 1), text, fill="black")
    return np.asarray(band)


def test_validation_sheet_names_each_row_and_tile():
    """Validator.generated_sheet: the body is the unlabelled sheet (references | frames, spacer,
    the partner's references | the swapped frames), and above each row its two label lines; a
    sample without an object gets its own tile names, not the first row's."""
    from types import SimpleNamespace

    from e2v.eval.validation import Validator
    from e2v.eval.viz import GAP, LABEL_BAND, frame_strip, hstack

    rng = np.random.default_rng(0)
    tile = lambda: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)  # noqa: E731
    refs = [{"vae": {"subject": tile(), "object": tile(), "background": tile()}},
            {"vae": {"subject": tile(), "background": tile()}}]  # no object
    videos, swapped = rng.integers(0, 256, (2, 2, 9, 64, 64, 3), dtype=np.uint8)
    fake = SimpleNamespace(element_inputs=lambda: refs, samples=[SimpleNamespace(id="007"), SimpleNamespace(id="012")],
                           partner=lambda k: (k + 1) % 2)
    sheet = Validator.generated_sheet(fake, videos, swapped)

    top = 0
    for k in (0, 1):
        own, other = list(refs[k]["vae"].values()), list(refs[1 - k]["vae"].values())
        spacer = np.full((64, 3 * GAP, 3), 255, np.uint8)
        body = hstack([frame_strip(own, videos[k]), spacer, frame_strip(other, swapped[k])])
        band, row = sheet[top:top + 2 * LABEL_BAND], sheet[top + 2 * LABEL_BAND:top + 2 * LABEL_BAND + 64]
        assert np.array_equal(row[:, :body.shape[1]], body), k
        # line 2: each tile's name, over that tile (frames 0, 4, 8 of 9)
        names = [*refs[k]["vae"], "gen f0", "gen f4", "gen f8", *refs[1 - k]["vae"], "swap f0", "swap f4", "swap f8"]
        x = 0
        for i, name in enumerate(names):
            if i == len(refs[k]["vae"]) + 3:
                x += 3 * GAP + GAP  # the spacer between the halves
            assert np.array_equal(band[LABEL_BAND:, x:x + 64], _band_text(name, 64 + 2 * GAP)[:, :64]), (k, name)
            x += 64 + GAP
        # line 1: whose references each half shows
        first = f"{fake.samples[k].id}: its references -> generated"
        assert np.array_equal(band[:LABEL_BAND, :120], _band_text(first, 400)[:, :120]), k
        top += 2 * LABEL_BAND + 64 + GAP
    assert sheet.shape[0] == top - GAP


def test_readme_commands_run_in_the_venv():
    """The README activates the venv before its first command, and every program its commands
    call (python, deepspeed, hf, tensorboard) is one the venv has: what `source .venv/bin/activate`
    puts on PATH."""
    import sys
    from pathlib import Path

    from helpers import ROOT

    code = [line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("    ")]
    programs = {"python", "deepspeed", "hf", "tensorboard"}
    calls = [i for i, line in enumerate(code) if line.split(" ")[0] in programs]
    assert calls and code.index("source .venv/bin/activate") < calls[0]
    used = {code[i].split(" ")[0] for i in calls}
    assert used >= {"python", "deepspeed", "tensorboard"}
    venv_bin = Path(sys.executable).parent
    assert all((venv_bin / p).is_file() for p in used), used


def test_training_refuses_a_hold_out_of_every_sample_in_one_line(demo_data, tmp_path, capsys):
    """The real entry point (one process, no launcher): the same line, no traceback (a SystemExit
    with the message), and nothing built: the optimizer and model lines come after the check and
    are never printed."""
    code = train_main("--config", str(ROOT / "configs/e2v_tiny_lora.yaml"),
                      *[a for s in (f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}",
                                    "validation.every_n_steps=2", "validation.num_samples=8") for a in ("--set", s)])
    assert code == f"config error: {HOLD_ALL}"
    out = capsys.readouterr().out
    assert "[e2v] optimizer" not in out and "frozen encoders loaded" not in out
