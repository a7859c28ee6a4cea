"""What a fifth first day met before training started, each checked where it is decided: every
command answers --help and a config error (and the dry run its first line) without importing
torch, DeepSpeed, diffusers or transformers; a file's unknown keys are named in one run; SLURM's
task variables make one run (e2v/runtime/slurm.py), or one line; every command that reads weights
stops in e2v/models/weights.py's one line; the dry run plans a multi-GPU config from one process;
and the smaller items (checkpoint_every 0, the report's folder, a repeated problem said once, a
T2V run's encoders, the partitioned load's host figure)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, train_main

HEAVY = ("torch", "deepspeed", "diffusers", "transformers")
TOOLS = sorted(p.name for p in (ROOT / "tools").glob("*.py") if not p.stem.startswith("_"))
TWO_UNKNOWN = "typo_key: 1\ntrain:\n  lr_typo: 1.0e-4\n"  # two unknown keys, in two sections

# Run in a fresh interpreter in which importing any of HEAVY raises: each command started as
# `python tools/<command>.py ARGS` would be (runpy, as __main__), its exit and what it printed recorded.
PROBE = r"""
import contextlib, importlib.abc, io, json, runpy, sys
HEAVY = {heavy!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError("blocked: " + name)

sys.meta_path.insert(0, Block())
sys.path.insert(0, {tools!r})  # as for a command started as a file: tools/ first
from e2v.config.load import load_config
for config in {configs!r}:  # every check of a shipped config loads without them too
    load_config(config, check_paths=False)
out = []
for script, argv in {runs!r}:
    buf, code = io.StringIO(), 0
    sys.argv = [script, *argv]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except Exception as e:
            code = "raised " + repr(e)
    out.append([script, argv, code if isinstance(code, (int, type(None))) else str(code), buf.getvalue()])
print(json.dumps(out))
"""


def _probe(runs: list, configs: list[str], hub) -> list:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, tools=str(ROOT / "tools"), configs=configs,
                                                              runs=runs)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_commands_answer_before_the_heavy_imports(tmp_path, demo_data):
    """--help of train_e2v.py and every tool, a config error of each that reads a config (both
    unknown keys named, exit non-zero), the missing-weights line of training and precompute, and the
    dry run's first line, with torch, DeepSpeed, diffusers and transformers blocked from import:
    what answers here answers in about a second (bench/RESULTS.md, section 9)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(TWO_UNKNOWN)
    (tmp_path / "prep.yaml").write_text("clips_typo: 1\nshots:\n  detector_typo: x\n")
    data = f"data.datasets.0.data_root={demo_data}"
    config_error = {"train_e2v.py": ["--config", str(bad)],
                    "precompute.py": ["--config", str(bad)], "check_dataset.py": ["--config", str(bad)],
                    "estimate_memory.py": ["--config", str(bad)], "dump_visualizations.py": ["--config", str(bad), "x"],
                    "sample.py": ["--config", str(bad), "--prompt", "p", "--out", str(tmp_path / "v.mp4")],
                    "import_opens2v.py": ["--config", str(bad), "--metadata", "m.json", "--media-root", ".",
                                          "--output", str(tmp_path / "o")],
                    "prepare_data.py": ["--config", str(tmp_path / "prep.yaml"), "--input", str(tmp_path),
                                        "--output", str(tmp_path / "p")]}
    scripts = {"train_e2v.py": str(ROOT / "train_e2v.py"), **{t: str(ROOT / "tools" / t) for t in TOOLS}}
    runs = [(scripts[s], ["--help"]) for s in scripts] + [(scripts[s], a) for s, a in config_error.items()]
    runs += [(scripts["train_e2v.py"], ["--config", "configs/e2v.yaml", "--set", data]),  # offline, not downloaded
             (scripts["precompute.py"], ["--config", "configs/e2v.yaml", "--set", data]),
             (scripts["train_e2v.py"], ["--config", "configs/e2v_tiny_lora.yaml", "--dry_run", "--set", data])]
    out = _probe(runs, [str(ROOT / "configs" / c) for c in ("e2v.yaml", "e2v_wan22_i2v_a14b.yaml", "r2v_tiny.yaml")],
                 hub=tmp_path / "hub")  # an empty hub cache: nothing downloaded
    helps, errors, weights = out[:len(scripts)], out[len(scripts):-3], out[-3:-1]
    for script, _, code, text in helps:
        assert code == 0 and "usage:" in text, (script, code, text[-500:])
    for script, _, code, text in errors:
        assert code not in (0, None) and "blocked" not in str(code) + text, (script, code, text[-800:])
        if script.endswith("prepare_data.py"):
            assert "clips_typo" in text and "shots.detector_typo" in text, text
        else:
            assert "2 problems in" in str(code) + text and "'typo_key'" in str(code) + text \
                and "'train.lr_typo'" in str(code) + text, (script, code, text)
    for script, _, code, text in weights:
        assert str(code).startswith("weights: model.pretrained: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers is not "
                                    "downloaded") and "hf download" in str(code), (script, code, text[-800:])
    script, _, code, text = out[-1]  # the dry run: its first line, then the stages' import (blocked here)
    assert text.startswith("[e2v dry run] configs/e2v_tiny_lora.yaml: read and checked; planning for 1 rank "
                           "(--gpus N plans for N)"), text[:500]
    assert "blocked: torch" in str(code), code


def test_every_problem_of_a_file_in_one_run(tmp_path):
    """Unknown keys in three sections and a list item, a wrong type and a missing key: one error
    naming each (its own line, the file and the count first); one problem reads as it always did."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("typo_key: 1\ntrain:\n  lr_typo: 1.0e-4\n  max_steps: abc\ndata:\n  elements:\n"
                   "    - name: person\n      sufixes: [_p.png]\n    - name: obj\n      suffixes: [_o.png]\n"
                   "      vae: {repaet: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad, ["lora.rnk=4"])
    lines = str(e.value).splitlines()
    assert lines[0] == f"6 problems in {bad} and --set:", lines
    assert [line.split(";")[0] for line in lines[1:]] == [  # one line each, in the file's order (--set last)
        "  unknown key 'typo_key'", "  unknown key 'train.lr_typo'", "  train.max_steps: expected an integer, got 'abc'",
        "  unknown key 'data.elements[0].sufixes'", "  unknown key 'data.elements[1].vae.repaet'",
        "  unknown key 'lora.rnk'"], lines
    assert lines[4].endswith("did you mean 'suffixes'?") and lines[5].endswith("did you mean 'repeat'?")
    assert "missing required" not in str(e.value)  # a misspelt key is not also a missing one
    seed = tmp_path / "seed.json"  # a seed JSON dataset config: its unknown keys together too
    seed.write_text(json.dumps({"datasets": [{"data_root": str(tmp_path), "target_resolutoin": [64, 64]},
                                             {"data_root": str(tmp_path), "bogus": 1}]}))
    with pytest.raises(ConfigError) as e:
        load_config(seed)
    assert str(e.value).splitlines()[0] == f"2 problems in {seed}:" and "datasets[0].target_resolutoin'; did you " \
        "mean 'target_resolution'?" in str(e.value) and "datasets[1].bogus'" in str(e.value), str(e.value)
    one = tmp_path / "one.yaml"
    one.write_text("train:\n  learning_rat: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(one)
    assert str(e.value) == "unknown key 'train.learning_rat'; did you mean 'lr'?"


# --- SLURM -----------------------------------------------------------------------------------------


def test_slurm_hostlists_and_task_counts():
    from e2v.runtime.slurm import first_host, tasks_on_node

    assert first_host("gpu[003-004,007],login1") == "gpu003"
    assert first_host("rack[1-2]-n[01-02]") == "rack1-n01"
    assert first_host("node7") == "node7" and first_host("a,b") == "a" and first_host("n[5]") == "n5"
    assert [tasks_on_node("4(x2),2", n) for n in range(3)] == [4, 4, 2]
    assert tasks_on_node("8", 0) == 8


SRUN = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
        "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu[011-012]",
        "SLURM_JOB_ID": "4242917"}


def test_an_srun_task_is_a_rank_of_one_run():
    """SLURM's variables -> torch's: rank, world, local rank and count, the step's first node, and a
    port every task computes alike from the job id; a launcher's own variables are not touched."""
    from e2v.runtime.slurm import PORT_BASE, launch_env, launch_ranks, split_runs

    env = launch_env(SRUN)
    assert env == {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu011", "MASTER_PORT": str(PORT_BASE + 2917)}
    assert launch_env({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29611"})["MASTER_PORT"] == "29611"
    assert launch_env({**SRUN, "SLURM_STEP_NUM_TASKS": "1"}) is None  # one task: the one-process start
    assert launch_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) is None  # a batch script: not a step's task
    assert split_runs(16, SRUN) is None
    given = dict(SRUN)
    assert launch_ranks(given) == (3, 16, 3) and given["MASTER_ADDR"] == "gpu011"  # set for a later group
    torchrun = {**SRUN, "RANK": "9", "WORLD_SIZE": "32", "LOCAL_RANK": "1"}
    assert launch_ranks(torchrun) == (9, 32, 1) and "MASTER_ADDR" not in torchrun


@pytest.mark.parametrize("env, fix", [
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, "start the ranks with srun"),  # `python train_e2v.py` in sbatch
    ({**SRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "one launcher per node"),  # srun -n 16 torchrun
])
def test_slurm_tasks_that_would_train_copies_stop_in_one_line(env, fix, monkeypatch):
    from e2v.runtime.distributed import resolve_launch

    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as stop:
        resolve_launch()
    text = str(stop.value)
    assert text.startswith("distributed: SLURM started ") and "would train unsynchronised" in text and fix in text
    assert "\n" not in text


# --- weights ---------------------------------------------------------------------------------------


def test_precompute_without_the_weights_says_the_one_line(demo_data, tmp_path, monkeypatch):
    """The first command of the 24 GB recipes, offline with an empty hub cache: missing_weights' line
    (the repo, where it looked, the download), not the traceback of diffusers' loader."""
    from e2v.config.bases import resolve_pretrained
    from e2v.config.load import load_config
    from e2v.models.weights import missing_weights
    from tools.precompute import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_pretrained.cache_clear()

    argv = ["--config", "configs/e2v_24gb.yaml", "--set", f"data.datasets.0.data_root={demo_data}"]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    error, _ = missing_weights(load_config("configs/e2v_24gb.yaml", argv[2:][1::2]))
    assert error and str(stop.value) == f"weights: {error}"
    assert "hf download Wan-AI/Wan2.1-I2V-14B-480P-Diffusers" in error and "HF_HUB_OFFLINE is set" in error
    resolve_pretrained.cache_clear()


# --- the dry run -----------------------------------------------------------------------------------


def test_dry_run_plans_a_multi_gpu_config_from_one_process(demo_data, capsys):
    """A config whose context-parallel group is 2 ranks, dry-run in one process: planned for its own
    count, or --gpus N, said first; a count that holds no whole group is one line; the real start,
    one process, still refuses."""
    sets = ["--set", f"data.datasets.0.data_root={demo_data}", "--set", "parallel.ulysses_degree=2"]
    assert train_main("--config", "configs/e2v_tiny_lora.yaml", "--dry_run", *sets) is None
    out = capsys.readouterr().out
    assert "planning for 2 ranks (one context-parallel group, parallel.ulysses_degree 2 x ring_degree 1" in out
    assert "over 2 context-parallel ranks (ulysses 2 x ring 1)" in out and "memory on each of 2 24 GiB GPUs" in out
    assert train_main("--config", "configs/e2v_tiny_lora.yaml", "--dry_run", "--gpus", "4", *sets) is None
    out = capsys.readouterr().out
    assert "planning for 4 ranks (--gpus)" in out and "memory on each of 4 24 GiB GPUs" in out
    code = train_main("--config", "configs/e2v_tiny_lora.yaml", "--dry_run", "--gpus", "3", *sets)
    assert str(code).startswith("dry run: parallel: ulysses_degree 2 x ring_degree 1 = 2 ranks per "), code
    code = train_main("--config", "configs/e2v_tiny_lora.yaml", *sets, "--set", "output_dir=/nonexistent/x")
    assert str(code).startswith("config error: parallel: ulysses_degree 2 x ring_degree 1 = 2 ranks per "
                                "context-parallel group, but 1 processes were launched"), code


# --- the smaller items -----------------------------------------------------------------------------


def test_checkpoint_every_zero_is_a_setting(demo_data):
    """0 turns periodic saves off (the run that saves only at its end:
    tests/launch/test_t2v_lora_runs.py); below 0 is refused naming the key."""
    from e2v.config.load import load_config
    from e2v.config.schema import ConfigError

    data = f"data.datasets.0.data_root={demo_data}"
    assert load_config("configs/e2v_tiny_lora.yaml", [data, "train.checkpoint_every=0"]).train.checkpoint_every == 0
    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        load_config("configs/e2v_tiny_lora.yaml", [data, "train.checkpoint_every=-1"])


def test_check_report_lands_beside_the_data(demo_data, tmp_path, monkeypatch, capsys):
    """Without --report, in the dataset's folder (not the working directory), and not counted as an
    orphan file by the next check; --report PATH puts it there."""
    from tools.check_dataset import main

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/e2v_tiny_lora.yaml"), "--set", f"data.datasets.0.data_root={data}",
            "--workers", "1"]
    assert main(args) == 0
    assert (data / "check_dataset_report.json").is_file() and not (tmp_path / "check_dataset_report.json").exists()
    assert main([*args, "--report", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'r.json'}" in out and "orphan" not in out
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["samples"] == 8


def test_a_problem_met_often_is_said_once_with_a_count(demo_data, tmp_path, monkeypatch):
    """8 clips too short for data.num_frames: one line with the count and the first three files,
    not eight lines."""
    from e2v.config.load import load_config
    from e2v.data.dataset import BadSampleError, index_samples

    monkeypatch.setenv("E2V_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config("configs/e2v_tiny_lora.yaml", [f"data.datasets.0.data_root={demo_data}", "data.num_frames=33",
                                                     "data.frame_buckets=[33]"])
    with pytest.raises(BadSampleError) as e:
        index_samples(cfg, verbose=False)
    text = str(e.value)
    assert "8 sample(s) unusable" in text and "too_short          8 samples, e.g. " in text, text
    assert text.count("too short:") == 3 and "007.mp4" not in text, text


def test_a_t2v_run_loads_no_image_encoder():
    """e2v_type none reads no reference: the tiny preset builds no CLIP for it, as a pretrained
    base's load takes none, so the run's start-up line names what it loaded."""
    from helpers_t2v import tiny_sets

    from e2v.config.load import load_config
    from e2v.models.load import load_parts

    cfg = load_config("configs/t2v_lora.yaml", tiny_sets(ROOT), check_paths=False)
    parts = load_parts(cfg, with_transformer=False)
    assert parts.image_encoder is None and parts.vae is not None and parts.text_encoder is not None


def test_the_partitioned_load_host_figure():
    """Host RAM per node at start-up, against the rule written out: a whole load is e P per rank;
    ZeRO-3's partitioned load keeps the partitions on the GPUs (one gathered layer per rank left on
    the host), or in host RAM under parameter offload (the node's share, e P / nodes); on one GPU
    with offload the two are the same, and the tool says why."""
    from e2v.config.load import load_config
    from e2v.train.memory import GB, ModelCounts, partitioned_load_bytes
    from tools.estimate_memory import load_line

    c = ModelCounts(trainable=10**8, frozen=16 * 10**9, largest_layer=10**8, width=5120, ffn=13824, layers=40)
    p, e = c.trainable + c.frozen, 2
    assert partitioned_load_bytes(c, e, "zero3.json", 8, 2) == 8 * e * c.largest_layer
    assert partitioned_load_bytes(c, e, "zero3_offload.json", 8, 2) == 8 * e * c.largest_layer + e * p / 2
    cfg = load_config("configs/e2v_tiny_lora.yaml", ["train.mixed_precision=bf16"], check_paths=False)
    one = {"load_cpu_per_node_gb": e * p / GB, "load_partitioned_gb": {
        name: partitioned_load_bytes(c, e, name, 1, 1) / GB for name in ("zero3.json", "zero3_offload.json")}}
    line = load_line(cfg, one, 1)
    assert f"~{e * p / GB:.1f} GB CPU RAM per node" in line and f"zero3 ~{e * c.largest_layer / GB:.1f} GB" in line
    assert "the same figure" in line  # zero3_offload on one GPU: the whole model either way
    eight = {"load_cpu_per_node_gb": 8 * e * p / GB, "load_partitioned_gb": {
        name: partitioned_load_bytes(c, e, name, 8, 1) / GB for name in ("zero3.json", "zero3_offload.json")}}
    assert "the same figure" not in load_line(cfg, eight, 8)


def test_a_run_from_a_cache_never_computed_stops_before_any_weight_loads(demo_data, tmp_path, monkeypatch):
    """cache.enabled without tools/precompute.py: the missing entries named in one message with the
    command that makes them, before the model is built (minutes at real sizes), not a traceback."""
    import train_e2v

    train_e2v.import_stages()
    built = []
    monkeypatch.setattr(train_e2v, "build_model", lambda *a, **k: built.append(1))
    code = train_main("--config", str(ROOT / "configs/e2v_tiny.yaml"), "--set", f"data.datasets.0.data_root={demo_data}",
                      "--set", f"cache.dir={tmp_path / 'cache'}", "--set", f"output_dir={tmp_path}")
    assert isinstance(code, str) and code.startswith("cache error: ") and not built, code
    assert "no cache entry" in code and code.endswith("python tools/precompute.py --config <this config> (it recomputes "
                                                      "only these)")
