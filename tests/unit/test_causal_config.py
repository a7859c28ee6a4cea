"""The causal task's config (docs/causal.md, docs/formats.md): the seed's CausVid keys mapped in the
one alias place (e2v/config/seed_formats.py) with a note each, a listed timestep 0 allowed, and every
refusal one line that names the key and the fix: at load (e2v/config/checks.py) or at start, before
any weight loads (e2v.models.causal.causal_refusal, asked by train_e2v.py)."""

import subprocess
import sys

import pytest

from e2v.config.load import load_config
from e2v.config.schema import ConfigError

SEED = """dataset_base_path: data
metadata_path: data/metadata.csv
num_frames: 81
height: 480
width: 832
time_division_factor: 4
batch_size: 1
lr: 2.0e-6
max_steps: 100
save_interval: 50
generator_task: causal_video
num_frame_per_block: 3
independent_first_frame: false
warp_denoising_step: true
generator_ckpt: ode_init.pt
denoising_step_list: [1000, 750, 500, 250]
model: {preset: tiny, base: t2v}
"""


@pytest.fixture
def seed_dir(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "ode_init.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path, text):
    path.write_text(text)
    return path


def test_the_seeds_causal_keys_map_with_a_note_each(seed_dir, capsys):
    cfg = load_config(write(seed_dir / "seed.yaml", SEED))
    assert cfg.task == "causal" and cfg.causal.frames_per_block == 3 and not cfg.causal.independent_first_frame
    assert cfg.flow.warp_denoising_step and cfg.flow.denoising_step_list == [1000, 750, 500, 250]
    assert (cfg.flow.shift, cfg.flow.objective) == (8.0, "x0")  # CausVid's grid; its regression loss
    assert (cfg.model.generator_ckpt, cfg.model.generator_ckpt_dict) == ("ode_init.pt", "generator")
    assert cfg.model.training_type == "full" and cfg.e2v_type == "none"
    out = capsys.readouterr().out
    for note in ("seed key 'generator_task' -> task = 'causal'",
                 "seed key 'num_frame_per_block' -> causal.frames_per_block = 3",
                 "seed key 'independent_first_frame' -> causal.independent_first_frame = False",
                 "seed key 'warp_denoising_step' -> flow.warp_denoising_step = True",
                 "seed key 'generator_ckpt' -> model.generator_ckpt = 'ode_init.pt'",
                 "flow.shift = 8 (CausVid's training grid",
                 "model.training_type = full (the seed trains the whole transformer"):
        assert out.count(note) == 1, note
    # a clip of the seed's time_division_factor trains at its largest count of whole blocks
    from e2v.config.shapes import frame_bucket_list

    assert frame_bucket_list(cfg) == [9, 21, 33, 45, 57, 69, 81]

    bidirectional = load_config(write(seed_dir / "bi.yaml", SEED.replace("causal_video", "bidirectional_video")
                                      + "flow: {shift: 5.0}\n"))
    assert bidirectional.task == "bidirectional" and bidirectional.flow.shift == 5.0  # the file's own shift wins
    assert "flow.shift = 8" not in capsys.readouterr().out


def test_a_listed_zero_is_a_clean_frame_and_zeros_alone_are_refused(seed_dir):
    seed = write(seed_dir / "seed.yaml", SEED.replace("[1000, 750, 500, 250]", "[1000, 757, 522, 0]")
                 .replace("warp_denoising_step: true", "warp_denoising_step: false"))
    assert load_config(seed).flow.denoising_step_list == [1000, 757, 522, 0]
    lora = load_config(seed, ["model.training_type=lora"])  # the seed's full fine-tune is a default, said so
    assert lora.model.training_type == "lora"


REFUSALS = [  # (--set, the line's start, a phrase of the fix)
    (["flow.denoising_step_list=[0, 0]"], "flow.denoising_step_list: [0.0, 0.0] has no timestep above 0",
     "add the noisy timesteps"),
    (["data.num_frames=77"], "data.num_frames: 77 frames make 20 latent frames, which do not split into whole "
     "blocks of causal.frames_per_block=3", "use 69 or 81 frames"),
    (["causal.independent_first_frame=true"], "data.num_frames: 81 frames make 21 latent frames",
     "after frame 0's own block: use 73 or 85 frames"),
    (["data.time_division_factor=null", "data.auto_frame_buckets=true", "data.frame_buckets=[33, 41]"],
     "data.frame_buckets: 41 frames make 11 latent frames", "use 33 or 45 frames"),
    (["flow.objective=flow"], "task: causal trains CausVid's regression", "set flow.objective: x0"),
    (["flow.weighting=cosmap"], "task: causal averages its loss over the noisy frames unweighted",
     "set flow.weighting: none"),
    (["flow.denoising_step_list=[]", "flow.warp_denoising_step=false"],
     "task: causal draws each block's timestep from flow.denoising_step_list", "set it"),
    (["flow.denoising_step_list=[1000, 757.5]"], "flow.warp_denoising_step: flow.denoising_step_list entries "
     "[757.5] are not whole timesteps", "give whole numbers 0..1000"),
    (["model.generator_ckpt=missing.pt"], "model.generator_ckpt: missing.pt is not a file", "remove the key"),
    (["model.preset=null", "model.pretrained=/nowhere", "deepspeed.config=ds_configs/zero3.json"],
     "model.generator_ckpt loads into whole weights, but ds_configs/zero3.json (ZeRO-3)",
     "set model.zero3_init: false"),
    (["task=bidirectional", "flow.warp_denoising_step=true", "flow.denoising_step_list=[]"],
     "flow.warp_denoising_step maps flow.denoising_step_list through the training grid", "give the list"),
]


@pytest.mark.parametrize("sets,line,fix", REFUSALS, ids=[r[1][:40] for r in REFUSALS])
def test_every_refusal_is_one_line_naming_the_key_and_the_fix(seed_dir, sets, line, fix):
    seed = write(seed_dir / "seed.yaml", SEED)
    with pytest.raises(ConfigError) as e:
        load_config(seed, sets)
    message = str(e.value)
    assert message.startswith(line) and fix in message and "\n" not in message, message


@pytest.mark.parametrize("sets,line", [
    (["parallel.ring_degree=2"], "task: causal with parallel.ring_degree: 2: diffusers' ring attention takes no mask"),
    (["parallel.ulysses_degree=2", "parallel.ring_degree=2"], "task: causal with parallel.ring_degree: 2"),
    (["e2v_type=vae", "conditioning.target_layout=sequence", "data.elements=[{name: person, suffixes: [_p.png]}]"],
     "task: causal with conditioning.target_layout: sequence"),
])
def test_what_the_model_cannot_serve_is_one_line(seed_dir, sets, line):
    """The model's own refusals (e2v.models.causal.causal_refusal): train_e2v.py asks them right after
    the config loads, before any weight (tests/launch/test_causal_runs.py runs that start)."""
    from e2v.models.causal import causal_refusal

    refusal = causal_refusal(load_config(write(seed_dir / "seed.yaml", SEED), sets))
    assert refusal.startswith(line) and "\n" not in refusal, refusal
    if "ring_degree" in line:  # the fix named: Ulysses instead
        assert "set parallel.ring_degree: 1 and split with parallel.ulysses_degree instead" in refusal, refusal


def test_ulysses_context_parallelism_is_served(seed_dir):
    """Ulysses gives attention the whole sequence (a head shard of it), so the block rule applies there:
    no refusal (the spawned check: tests/unit/test_context_parallel.py)."""
    from e2v.models.causal import causal_refusal

    assert causal_refusal(load_config(write(seed_dir / "seed.yaml", SEED), ["parallel.ulysses_degree=2"])) is None


def test_the_causal_config_loads_without_torch(seed_dir):
    """The config stage imports no torch (tests/unit/test_firstday_start.py's rule), a causal seed file
    and its refusals included."""
    write(seed_dir / "seed.yaml", SEED)
    code = ("import sys\nfor m in ('torch', 'deepspeed', 'diffusers', 'transformers'): sys.modules[m] = None\n"
            "from e2v.config.load import load_config\nfrom e2v.config.schema import ConfigError\n"
            "assert load_config('seed.yaml').task == 'causal'\n"
            "try:\n    load_config('seed.yaml', ['data.num_frames=77'])\nexcept ConfigError as e:\n    print(e)\n")
    from helpers import ROOT

    out = subprocess.run([sys.executable, "-c", code], cwd=seed_dir, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "do not split into whole blocks" in out.stdout


def test_shipped_causal_configs_load(monkeypatch, tmp_path):
    from helpers import ROOT

    cfg = load_config(ROOT / "configs/causal_regression.yaml", check_paths=False)
    assert (cfg.task, cfg.causal.frames_per_block, cfg.flow.denoising_step_list) == ("causal", 3, [1000, 757, 522, 0])
    assert (cfg.model.training_type, cfg.train.lr, cfg.train.grad_clip, cfg.flow.shift) == ("full", 2e-6, 10.0, 8.0)


def test_a_seed_key_in_our_yaml_says_where_it_belongs(tmp_path):
    """Without dataset_base_path the file is ours: a CausVid key there names our key and the seed rule."""
    ours = write(tmp_path / "ours.yaml", "generator_task: causal_video\nmodel: {preset: tiny, base: t2v}\n")
    with pytest.raises(ConfigError) as e:
        load_config(ours)
    assert str(e.value) == ("unknown key 'generator_task'; did you mean 'task'? ('generator_task' is a video-regression "
                            "seed key: a seed file is recognised by its top-level dataset_base_path, docs/formats.md)")
    with pytest.raises(ConfigError, match="generator_task: 'image' is not one e2v trains; use causal_video or "
                                          "bidirectional_video"):
        load_config(write(tmp_path / "seed.yaml", SEED.replace("causal_video", "image")))
