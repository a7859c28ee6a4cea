"""What the tests share besides fixtures: the repository root, the one-process group's teardown,
`train_e2v.main` in this process,
the folder the pytest-xdist workers share, the tiny preset saved as a user's folders, a model that
ignores its references, the settings of the session's shared runs, and the launch helpers of the
package (e2v/runtime/launch.py: the command, free ports, a run's scalars). Import from here, never
from conftest (tests/conftest.py holds the fixtures and the hooks)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from e2v.runtime.launch import read_scalars, train_command  # noqa: F401  (the tests' names)
from e2v.runtime.ports import free_port as _free_port  # noqa: F401  (the tests' name)

ROOT = Path(__file__).resolve().parent.parent


# What a launcher (or a one-process group made in a test) sets for the process group
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def close_process_group() -> None:
    """Destroy this process's group, its variables (a later launch must not take its rank and
    port) and the copies of it DeepSpeed keeps (its world clone and the groups made from it), so
    that the next test's group is the one DeepSpeed uses."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    dist.destroy_process_group()
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    groups._WORLD_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = groups.mesh_device = None
    for cache in (groups._ALL_TO_ALL_GROUP, groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP,
                  groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        cache.clear()


def train_main(*argv: str):
    """`python train_e2v.py argv` in this process (`train_e2v.main(argv)`, one process, no launcher):
    the code it exits with (a SystemExit's, which the interpreter would print as the one line on
    stderr; None when main returns). For the start-up checks: what they print is the test's
    captured output (capsys), and any process group main made is closed after it."""
    import torch.distributed as dist

    import train_e2v

    try:
        train_e2v.main(list(argv))
        return None
    except SystemExit as e:
        return e.code
    finally:
        if dist.is_initialized():
            close_process_group()


def shared_root(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session sees (the parent of the workers' own
    temporary folders), for what they share (`built_once`). Read-only to tests."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def built_once(tmp_path_factory, name: str, build) -> Path:
    """shared_root/name, filled by `build(folder)` once per session by whichever pytest-xdist worker
    asks first (the others wait on its lock), for what tests of several files read and none
    changes: the demo data, the prepared hard footage. Read-only to tests."""
    root = shared_root(tmp_path_factory)
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (root / f"{name}.done").touch()
    return out


def save_t2v_and_clip_folders(root: Path, clip_layout: str = "pipeline") -> tuple[Path, Path, int]:
    """The tiny preset saved as a user's folders: root/t2v, a diffusers WanPipeline (no image
    encoder), and root/clip, the tiny CLIP vision model with its processor, in an I2V pipeline's
    subfolders (image_encoder/, image_processor/) or, "plain", at the folder's top. Returns both
    folders and the CLIP's width."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from e2v.models.tiny import build_tiny_parts

    t2v, clip = root / "t2v", root / "clip"
    p = build_tiny_parts(seed=0, base="t2v")
    WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
                scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True),
                ).save_pretrained(t2v)
    i2v = build_tiny_parts(seed=0)
    i2v.image_encoder.save_pretrained(clip / "image_encoder" if clip_layout == "pipeline" else clip)
    i2v.image_processor.save_pretrained(clip / "image_processor" if clip_layout == "pipeline" else clip)
    return t2v, clip, i2v.image_encoder.config.hidden_size


def blind(inner):
    """`inner` (an I2V-layout Wan transformer) with its condition channels and image tokens zeroed:
    what it makes cannot depend on the references."""
    import torch

    class _Blind(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, encoder_hidden_states_image=None, **kw):
            hidden_states = torch.cat([hidden_states[:, :16], torch.zeros_like(hidden_states[:, 16:])], 1)
            return self.inner(hidden_states, encoder_hidden_states_image=torch.zeros_like(encoder_hidden_states_image),
                              **kw)

    return _Blind()


VIZ_RUN = ("train.max_steps=4", "train.micro_batch_size=2", "train.checkpoint_every=2", "validation.every_n_steps=2",
           "validation.num_inference_steps=2", "validation.sigmas=[0.3,0.9]", "visualization.frequency=2",
           "validation.subject_colour={subject: person, background: background, distractors: [object]}")


ZERO3_OFFLOAD_RUN = ("train.max_steps=8", "train.micro_batch_size=2", "lora.alpha=4", "train.export_comfyui_checkpoint=true",
                     "deepspeed.config=ds_configs/zero3_offload.json", "validation.every_n_steps=0",
                     "visualization.enabled=false")


def load_checkpoint_module(model, state: dict) -> None:
    """A checkpoint's module state into a model built from the same base: checkpoints hold only what
    trains (e2v/train/checkpoint.py), so every key it lacks must be a frozen parameter of the model,
    which already holds the base's value; nothing in it may be unknown to the model."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not unexpected, f"checkpoint keys the model lacks: {unexpected[:5]}"
    assert not trained & set(missing), f"trained tensors missing from the checkpoint: {sorted(trained & set(missing))[:5]}"


def gpu_report(sections: dict, cuda: bool = True) -> str:
    """bench/gpulib/report.py's report of a recorded GPU check holding `sections` (an H100's, 200 of
    480 s): what the renderer tests read."""
    from bench.gpulib.report import render

    return render({"device": "NVIDIA H100 80GB HBM3", "cuda": cuda, "date_utc": "2026-01-01 00:00 UTC", "argv": "",
                   "budget_s": 480, "elapsed_s": 200.0, "finished": True, "passed": False, "sections": sections})
