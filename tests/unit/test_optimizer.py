"""Which Adam steps the weights (e2v/runtime/adam.py, e2v/train/ds_config.py): torch's AdamW by
default on every device, fused wherever CUDA is, with nothing built; DeepSpeed's compiled Adam only
by name, built in a preflight that stops the run before any weight is read, naming the cause (an
arch list DeepSpeed cannot parse, no nvcc, an nvcc of another CUDA, a stale build lock, a build that
throws); the optimizer's class recorded in each checkpoint, a resume with another class refused;
and the CUDA RNG state of the rank's own device only, so a resume on fewer GPUs works."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch
from helpers import ROOT

from e2v.config.load import load_config
from e2v.config.schema import ConfigError

SHIPPED = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json"))


def tiny_cfg(*sets):
    return load_config(ROOT / "configs/e2v_tiny_lora.yaml", list(sets), check_paths=False)


@pytest.fixture
def no_builds(monkeypatch):
    """Any attempt to build or probe DeepSpeed's Adam fails the test."""
    import e2v.runtime.adam as adam

    def refuse(*a, **kw):
        raise AssertionError("DeepSpeed's Adam op builder was touched")

    monkeypatch.setattr(adam, "_builder", refuse)
    monkeypatch.setattr(adam, "deepspeed_adam_problem", refuse)


@pytest.mark.parametrize("name", SHIPPED)
def test_torch_adamw_is_the_default_everywhere_and_fused_wherever_cuda_is(name, no_builds):
    from e2v.train.ds_config import optimizer_preflight, resolve_deepspeed_config

    cfg = load_config(ROOT / "configs/e2v.yaml", [f"deepspeed.config=ds_configs/{name}"], check_paths=False)
    assert cfg.deepspeed.optimizer == "torch_adamw"
    offload = "offload" in name
    gpu, cpu = resolve_deepspeed_config(cfg, 1, cuda=True), resolve_deepspeed_config(cfg, 1, cuda=False)
    assert gpu["optimizer"]["params"]["torch_adam"] is True and gpu["optimizer"]["params"]["fused"] is True
    # DeepSpeed refuses a torch optimizer under offload unless this key says it is meant
    assert gpu.get("zero_force_ds_cpu_optimizer", True) is (not offload)
    assert cpu["optimizer"]["params"]["torch_adam"] is True and "fused" not in cpu["optimizer"]["params"]
    optimizer_preflight(cfg, gpu, cuda=True)  # nothing to build: no_builds would raise


def test_the_removed_torch_adam_key_names_its_replacement():
    for value in ("true", "false"):
        with pytest.raises(ConfigError, match=r"deepspeed.torch_adam.*deepspeed.optimizer: torch_adamw"):
            tiny_cfg(f"deepspeed.torch_adam={value}")
    assert tiny_cfg("deepspeed.optimizer=deepspeed_adam").deepspeed.optimizer == "deepspeed_adam"
    with pytest.raises(ConfigError, match="deepspeed.optimizer"):
        tiny_cfg("deepspeed.optimizer=fused_adam")


@pytest.fixture
def gpu_machine(tmp_path, monkeypatch):
    """A CUDA machine as DeepSpeed's op builders see it, with nothing prebuilt: ninja and c++ on the
    PATH, a toolkit whose nvcc reports CUDA 13.0 (torch's own), an empty extension cache."""
    import deepspeed.git_version_info as info
    import torch.utils.cpp_extension as cpp

    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(info, "installed_ops", {})
    monkeypatch.setattr("shutil.which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(cpp, "CUDA_HOME", str(home))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    return home


class WeightsRead(Exception):
    pass


def build_until_the_weights(cfg, tmp_path, monkeypatch):
    """train_e2v.build_model on a 'CUDA' device up to the weight load, which raises WeightsRead."""
    import train_e2v

    def load_parts(*a, **kw):
        raise WeightsRead

    monkeypatch.setattr(train_e2v, "load_parts", load_parts)
    train_e2v.build_model(cfg, tmp_path, 0, 1, torch.device("cuda", 0))


def _arch(home, mp, tmp):
    mp.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")


def _no_nvcc(home, mp, tmp):
    (home / "bin" / "nvcc").unlink()  # a runtime-only image


def _other_cuda(home, mp, tmp):
    mp.setattr(torch.version, "cuda", "12.8")


def _stale_lock(home, mp, tmp):
    lock = tmp / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600,) * 2)


def _build_throws(home, mp, tmp):
    from deepspeed.ops.op_builder import FusedAdamBuilder

    def load(self, verbose=True):
        raise RuntimeError("Error building extension 'fused_adam': nvcc fatal: Unsupported gpu architecture")

    mp.setattr(type(FusedAdamBuilder()), "load", load)


@pytest.mark.parametrize("break_it,cause", [
    (_arch, r"cannot parse 9\.0a; set TORCH_CUDA_ARCH_LIST=8\.0;9\.0 for this run"),
    (_no_nvcc, r"nvcc does not run .*install the CUDA toolkit"),
    (_other_cuda, r"nvcc is CUDA 13\.0, torch was built with CUDA 12\.8"),
    (_stale_lock, r"fused_adam/lock is 60 min old: a build that was killed left it.*delete it"),
    (_build_throws, r"building DeepSpeed's FusedAdam failed: RuntimeError: .*Unsupported gpu architecture"),
], ids=["arch_9.0a", "no_nvcc", "nvcc_of_another_cuda", "stale_lock", "build_throws"])
def test_a_named_deepspeed_adam_that_cannot_be_built_stops_before_the_weights(break_it, cause, gpu_machine,
                                                                              tmp_path, monkeypatch):
    break_it(gpu_machine, monkeypatch, tmp_path)
    cfg = tiny_cfg("deepspeed.optimizer=deepspeed_adam")
    with pytest.raises(SystemExit, match=r"optimizer preflight .*rank 0: .*" + cause + r".*Nothing was loaded"):
        build_until_the_weights(cfg, tmp_path, monkeypatch)
    # the default on the same broken machine never builds, and goes on to the weights
    _arch(gpu_machine, monkeypatch, tmp_path)
    with pytest.raises(WeightsRead):
        build_until_the_weights(tiny_cfg(), tmp_path, monkeypatch)


def test_a_buildable_deepspeed_adam_is_built_before_the_weights(gpu_machine, tmp_path, monkeypatch):
    from deepspeed.ops.op_builder import FusedAdamBuilder

    built = []
    monkeypatch.setattr(type(FusedAdamBuilder()), "load", lambda self, verbose=True: built.append(self.NAME))
    with pytest.raises(WeightsRead):
        build_until_the_weights(tiny_cfg("deepspeed.optimizer=deepspeed_adam"), tmp_path, monkeypatch)
    assert built == ["fused_adam"]


# --- the optimizer's class in the checkpoint -------------------------------------------------------


class Engine:
    """What checkpoint.load_checkpoint reads of a DeepSpeed engine before it loads any state."""

    def __init__(self, optimizer):
        self.basic_optimizer = optimizer

    def load_checkpoint(self, *a, **kw):
        raise AssertionError("the engine loaded the checkpoint's states")


def test_a_resume_with_another_optimizer_class_stops_before_loading(tmp_path):
    from e2v.train import checkpoint as ckpt

    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    folder = tmp_path / "step_000004"
    folder.mkdir()
    (folder / ckpt.OPTIMIZER_FILE).write_text(json.dumps({"class": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"}))
    with pytest.raises(SystemExit, match=r"saved with the optimizer deepspeed\.ops\.adam\.cpu_adam\.DeepSpeedCPUAdam "
                                         r"\(deepspeed\.optimizer: deepspeed_adam\), this run builds "
                                         r"torch\.optim\.adamw\.AdamW .*--set deepspeed\.optimizer=deepspeed_adam"):
        ckpt.load_checkpoint(Engine(adamw), folder)
    (folder / ckpt.OPTIMIZER_FILE).write_text(json.dumps({"class": ckpt.optimizer_class(Engine(adamw))}))
    ckpt.check_optimizer_class(Engine(adamw), folder)  # the same class resumes


# --- the CUDA RNG state of the rank's own device ---------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda with `visible` devices, this rank on `current`; each device's state distinct."""
    calls = {"set": [], "visible": 8, "current": 3}

    def get_rng_state(device="cuda"):
        index = calls["current"] if device == "cuda" else torch.device(device).index
        return torch.full((16,), index, dtype=torch.uint8)

    def set_rng_state(state, device="cuda"):
        index = calls["current"] if device == "cuda" else torch.device(device).index
        if index >= calls["visible"]:
            raise RuntimeError(f"invalid device ordinal {index}")
        calls["set"].append((index, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls["current"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls["visible"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [get_rng_state(f"cuda:{i}")
                                                                  for i in range(calls["visible"])])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [set_rng_state(s, f"cuda:{i}")
                                                                         for i, s in enumerate(states)])
    return calls


def test_cuda_rng_of_the_ranks_own_device_is_saved_and_restored_on_fewer_devices(fake_cuda, tmp_path):
    """Saved by the rank on cuda:3 of 8; resumed with CUDA_VISIBLE_DEVICES naming 1 GPU, where the
    rank is on cuda:0: its own state goes to its own device, and no other device is touched."""
    from e2v.runtime.integrity import load_rng, save_rng
    from e2v.train import checkpoint as ckpt

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    save_rng(ckpt.rng_state(rng, gen), tmp_path / "rng.safetensors")
    state = load_rng(tmp_path / "rng.safetensors")
    assert torch.equal(state["cuda"], torch.full((16,), 3, dtype=torch.uint8))  # one device's state
    fake_cuda.update(visible=1, current=0)
    ckpt.set_rng_state(state, rng, gen)
    assert fake_cuda["set"] == [(0, 3)]


def test_an_older_checkpoints_every_device_rng_restores_the_ranks_own(fake_cuda, tmp_path):
    """A file written before (cuda_0 .. cuda_7, every visible device) restores the entry of the
    rank's own device only, also when fewer devices are visible now."""
    from safetensors.torch import load_file, save_file

    from e2v.runtime.integrity import load_rng, save_rng
    from e2v.train import checkpoint as ckpt

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    save_rng(ckpt.rng_state(rng, gen), tmp_path / "rng.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "rng.safetensors"), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(tmp_path / "rng.safetensors")
    del tensors["cuda"]
    tensors.update({f"cuda_{i}": torch.full((16,), i, dtype=torch.uint8) for i in range(8)})
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    fake_cuda.update(visible=2, current=1)
    ckpt.set_rng_state(load_rng(tmp_path / "old.safetensors"), rng, gen)
    assert fake_cuda["set"] == [(1, 1)]
