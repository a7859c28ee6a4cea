"""The README's sampling command, as printed there, works on a run of each demo config:
`make demo-quick`'s (configs/e2v_tiny_lora.yaml: the session's shared viz run) and `make demo`'s
(configs/e2v_tiny.yaml: a 2-step run here). `--run` reads the run's own config, so the model built
for sampling is the one trained."""

from __future__ import annotations

import contextlib
import re
import shlex

import imageio.v3 as iio
import pytest
from helpers import ROOT
from helpers_launch import run_train

pytestmark = pytest.mark.xdist_group("viz_run")  # with the other users of `viz_run` (tests/conftest.py)


def readme_sample_command() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^    (python tools/sample.py --run .*?)(?=\n\n)", text, re.S | re.M)
    assert m, "README has no `python tools/sample.py --run` command"
    return m.group(1).replace("\\\n", " ")


def _sample(run, demo_data, out, capsys):
    """The command's argv through tools/sample.py's main in this process (what `python
    tools/sample.py ARGS` runs, without a second interpreter start-up)."""
    from tools.sample import main

    cmd = readme_sample_command().replace("runs/<run>", str(run)).replace("demo_data/", f"{demo_data}/")
    cmd = cmd.replace("--out video.mp4", f"--out {out} --steps 3")  # the README's command, fewer steps
    argv = shlex.split(cmd)
    assert argv[:2] == ["python", "tools/sample.py"] and "--config" not in argv
    capsys.readouterr()
    with contextlib.chdir(ROOT):
        assert main(argv[2:]) in (None, 0)
    assert f"[e2v sample] config: {run / 'config.yaml'}" in capsys.readouterr().out
    return iio.imread(out)


def test_readme_sample_command_after_demo_quick_and_demo(viz_run, demo_data, tmp_path, capsys):
    video = _sample(viz_run, demo_data, tmp_path / "quick.mp4", capsys)
    assert video.shape == (17, 64, 64, 3)
    out = tmp_path / "runs"
    run_train("configs/e2v_tiny.yaml", f"data.datasets.0.data_root={demo_data}", f"output_dir={out}", "run_id=demo",
              "train.max_steps=2", "cache.enabled=false", "validation.every_n_steps=0", "visualization.enabled=false",
              "train.checkpoint_every=100")
    video = _sample(out / "demo", demo_data, tmp_path / "demo.mp4", capsys)
    assert video.shape[0] >= 1 and video.shape[-1] == 3
