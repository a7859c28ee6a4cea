"""speed: (e2v/models/speed.py, docs/speed.md): every refused attention backend or combination says
so in one line before any weight loads; a compiled block keeps every name; compiled and eager
training give the same losses (LoRA and full, checkpointing on), the same checkpoint and export
keys, resume into each other, and two buckets make the graphs docs/speed.md states: those, which
train in this process with a cold inductor compile (~1-2 min on 2 cores from an empty cache), are in
tests/launch/test_compiled_step_runs.py, out of `make test-fast`."""

from __future__ import annotations

import copy
import importlib.util
import typing

import pytest
import torch
from helpers import ROOT, train_main

from e2v.config import checks
from e2v.config.load import load_config
from e2v.config.schema import AttentionBackend, ConfigError
from e2v.models import speed
from e2v.models.tiny import tiny_transformer_config

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = str(ROOT / "configs" / "e2v_tiny_lora.yaml")


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


# --- what the config refuses: no torch needed, answered by load_config -------------------------

# a causal run the config accepts otherwise: CausVid's list, blocks of one frame (the tiny clips' 5 latent frames)
CAUSAL = ["task=causal", "flow.objective=x0", "flow.weighting=none", "flow.denoising_step_list=[1000,757,522,0]",
          "causal.frames_per_block=1"]
REFUSED = [
    (["speed.attention_backend=sage"], "speed.attention_backend: sage cannot train: SageAttention's quantised "
                                        "kernels have no backward in diffusers; set speed.sampling_attention_backend: sage"),
    (["speed.attention_backend=_flash_3", "train.mixed_precision=bf16"], "speed.attention_backend: _flash_3 cannot train"),
    ([*CAUSAL, "speed.attention_backend=flex"], "speed.attention_backend: flex with task: causal: the causal "
                                                      "mask sets its own attention"),
    ([*CAUSAL, "speed.sampling_attention_backend=sage"], "speed.sampling_attention_backend: sage with task: "
                                                               "causal: the causal mask sets its own attention"),
    (["parallel.ring_degree=2", "speed.attention_backend=flash", "train.mixed_precision=bf16"],
     "speed.attention_backend: flash with parallel.ring_degree 2: ring attention runs its own attention op"),
    (["speed.attention_backend=_native_cudnn"], "speed.attention_backend: _native_cudnn takes bf16 / fp16 only and "
                                                "train.mixed_precision: 'no' runs fp32"),
    (["speed.compile=true", "model.base_dtype=fp8", "model.fp8_blocks_on_host=1"], "speed.compile with "
                                                                                  "model.fp8_blocks_on_host:"),
    (["speed.compile=true", "train.activation_offload=true"], "speed.compile with train.activation_offload:"),
    (["speed.compile=true", "parallel.ulysses_degree=2"], "speed.compile with parallel:"),
]


@pytest.mark.parametrize("sets,line", REFUSED, ids=[" ".join(s) for s, _ in REFUSED])
def test_the_config_refuses_by_name(demo_data, sets, line):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"data.datasets.0.data_root={demo_data}", *sets])
    assert line in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_config_tables_are_the_backend_table():
    """checks.py restates two facts of BACKENDS (it imports no torch); the schema offers its names."""
    assert set(checks.NO_BACKWARD) == {n for n, b in speed.BACKENDS.items() if not b.backward}
    assert set(checks.HALF_ONLY) == {n for n, b in speed.BACKENDS.items() if b.half}
    assert set(typing.get_args(AttentionBackend)) == set(speed.BACKENDS)


# --- what the machine refuses: the preflight's one line ----------------------------------------

@pytest.mark.parametrize("name", [n for n, b in speed.BACKENDS.items() if not b.cpu])
def test_gpu_backends_are_refused_on_a_cpu(name):
    line = speed.backend_problem(name, cuda=False)
    assert line.startswith(f"speed.attention_backend: {name} (") and "runs on CUDA GPUs only" in line
    assert line.endswith("set speed.attention_backend: native (torch's SDPA, which takes the CPU's flash op here)")


def test_flex_samples_on_a_cpu_but_cannot_train_there():
    assert "has no backward on a CPU" in speed.backend_problem("flex", cuda=False)
    assert speed.backend_problem("flex", cuda=False, key="speed.sampling_attention_backend", training=False) is None
    assert speed.backend_problem("native", cuda=False) is None


def test_what_a_gpu_machine_is_told():
    """Missing packages (this machine has none of them), the GPU generation, cuDNN and the head size,
    each with the pip package or the key to change."""
    for name, b in speed.BACKENDS.items():
        if b.module is not None and importlib.util.find_spec(b.module) is None:
            line = speed.backend_problem(name, cuda=True, capability=(9, 0))
            assert line == (f"speed.attention_backend: {name} needs {b.pip}, which is not importable here: "
                            f"pip install '{b.pip}', or set speed.attention_backend: native")
    assert "needs compute capability >= 8.0 (Ampere or newer); this GPU is 7.5" in speed.backend_problem(
        "_native_flash", cuda=True, capability=(7, 5))
    assert speed.backend_problem("_native_flash", cuda=True, capability=(8, 0), head_dim=128) is None
    assert "takes head sizes at most 128; this model's is 256" in speed.backend_problem(
        "_native_cudnn", cuda=True, capability=(9, 0), head_dim=256)
    assert "needs cuDNN 9 or newer" in speed.backend_problem("_native_cudnn", cuda=True, capability=(9, 0),
                                                             cudnn_version=8902)


@pytest.mark.parametrize("sets,line", [
    (["train.mixed_precision=bf16", "speed.attention_backend=flash"], "config error: speed.attention_backend: flash "
                                                                      "(FlashAttention-2) runs on CUDA GPUs only"),
    (["speed.attention_backend=flex"], "config error: speed.attention_backend: flex (torch's FlexAttention"),
    (["speed.sampling_attention_backend=xformers"], "config error: speed.sampling_attention_backend: xformers"),
    (["speed.compile=true"], "config error: speed.compile: inductor builds C++ for the CPU and no compiler is on PATH"),
], ids=["flash", "flex-training", "xformers-sampling", "no-compiler"])
def test_train_e2v_stops_before_any_weight_loads(demo_data, tmp_path, monkeypatch, sets, line):
    import train_e2v

    def load_parts(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(train_e2v, "load_parts", load_parts)
    if "speed.compile=true" in sets:  # a machine without a C++ compiler
        monkeypatch.setenv("PATH", str(tmp_path))
        monkeypatch.delenv("CXX", raising=False)
    code = train_main("--config", TINY, *_sets(f"data.datasets.0.data_root={demo_data}", f"output_dir={tmp_path}",
                                               *sets))
    assert isinstance(code, str) and code.startswith(line) and "\n" not in code, code


# --- the compiled block, in process ---------------------------------------------------------------

def _tiny_call(model, frames: int = 3):
    x = torch.randn(2, 36, frames, 8, 8, generator=torch.Generator().manual_seed(1))
    text = torch.randn(2, 512, 32, generator=torch.Generator().manual_seed(2))
    image = torch.randn(2, 51, 32, generator=torch.Generator().manual_seed(3))
    return model(x, timestep=torch.tensor([500.0, 300.0]), encoder_hidden_states=text,
                 encoder_hidden_states_image=image, return_dict=False)[0]


def test_a_compiled_block_keeps_every_name_and_the_limit_is_said(demo_data, capsys, monkeypatch):
    """Names of parameters, buffers and the state dict unchanged (no `_orig_mod.`); static shapes raise
    torch's recompile limit to the buckets' count; a run past the limit is told what runs eager."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    eager = WanTransformer3DModel(**tiny_transformer_config("i2v"))
    model = copy.deepcopy(eager)
    cfg = load_config(TINY, [f"data.datasets.0.data_root={demo_data}", "speed.compile=true",
                             "speed.compile_backend=eager", "speed.compile_shapes=static"])
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    watch = speed.apply(model, cfg, shapes=5)
    assert torch._dynamo.config.recompile_limit == 12  # 2 kinds of block input x 5 shapes + validation's 2
    assert list(model.state_dict()) == list(eager.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert not any("_orig_mod" in n for n in model.state_dict())
    torch.testing.assert_close(_tiny_call(model), _tiny_call(eager), rtol=0, atol=1e-6)
    assert watch.graphs >= 1 and "graph(s) of the block compiled" in capsys.readouterr().out
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", watch.entries())  # the next shape is past it
    torch.testing.assert_close(_tiny_call(model, frames=2), _tiny_call(eager, frames=2), rtol=0, atol=1e-6)
    out = capsys.readouterr().out
    torch._dynamo.reset()  # dynamo marked the block's code run-only (eager) for this process
    assert "recompile_limit: a new shape or kind of input runs the block eager from now on" in out, out


def test_flex_forward_equals_native_on_a_cpu():
    """The backend reaches every processor (flex: the CPU's forward only), and only the model's."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    native = WanTransformer3DModel(**tiny_transformer_config("i2v")).requires_grad_(False)
    flex = copy.deepcopy(native)
    speed.set_backend(flex, "flex")
    assert {str(p._attention_backend) for p in speed._processors(flex)} == {"AttentionBackendName.FLEX"}
    assert {p._attention_backend for p in speed._processors(native)} == {None}
    with torch.no_grad():
        torch.testing.assert_close(_tiny_call(flex), _tiny_call(native), rtol=0, atol=1e-5)


def test_sampling_switches_the_backend_and_puts_it_back(demo_data):
    """speed.sampling_attention_backend while generate() runs: the process's active backend (models
    loaded for sampling) and the processors of the trained model, each put back after."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    cfg = load_config(TINY, [f"data.datasets.0.data_root={demo_data}", "speed.sampling_attention_backend=flex"])
    torch.manual_seed(0)
    trained = WanTransformer3DModel(**tiny_transformer_config("i2v")).requires_grad_(False)
    speed.set_backend(trained, "native")
    marked = speed._processors(trained)[0]
    marked._attention_backend = AttentionBackendName._NATIVE_MATH  # a backend of its own, to be restored
    before = _AttentionBackendRegistry.get_active_backend()[0]
    with speed.sampling_backend(trained, cfg):
        assert _AttentionBackendRegistry.get_active_backend()[0] == AttentionBackendName.FLEX
        assert {p._attention_backend for p in speed._processors(trained)} == {None}
        with torch.no_grad():
            out = _tiny_call(trained)
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    assert marked._attention_backend == AttentionBackendName._NATIVE_MATH
    marked._attention_backend = None
    with torch.no_grad():
        torch.testing.assert_close(out, _tiny_call(trained), rtol=0, atol=1e-5)


def test_sample_py_stops_before_any_weight_loads(demo_data, tmp_path, monkeypatch):
    """tools/sample.py with a run's GPU-only training backend on a CPU: one line, the key to --set."""
    import e2v.models.load
    from e2v.eval.sample_cli import main

    def load_parts(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(e2v.models.load, "load_parts", load_parts)
    with pytest.raises(SystemExit) as e:
        main(["--config", TINY, "--prompt", "a red ball", "--out", str(tmp_path / "v.mp4"), "--device", "cpu",
              *_sets(f"data.datasets.0.data_root={demo_data}", "train.mixed_precision=bf16",
                     "speed.attention_backend=_native_cudnn")])
    assert str(e.value).startswith("config error: speed.attention_backend: _native_cudnn (torch's cuDNN SDPA kernel "
                                   "(cuDNN 9+)) runs on CUDA GPUs only"), e.value


def test_tf32_and_cudnn_keys_set_torch_flags(demo_data, monkeypatch):
    """The defaults are torch's own (a default run changes nothing); each key reaches its flag."""
    for flag in ("allow_tf32", "benchmark"):
        monkeypatch.setattr(torch.backends.cudnn, flag, getattr(torch.backends.cudnn, flag))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    speed.set_precision(load_config(TINY, [f"data.datasets.0.data_root={demo_data}"]))
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) \
        == (False, True, False)
    speed.set_precision(load_config(TINY, [f"data.datasets.0.data_root={demo_data}", "speed.matmul_tf32=true",
                                           "speed.cudnn_tf32=false", "speed.cudnn_benchmark=true"]))
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) \
        == (True, False, True)
