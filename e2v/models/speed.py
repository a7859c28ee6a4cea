"""How the transformer runs (`speed:`; docs/speed.md): the attention kernel diffusers dispatches to,
regional compilation of the repeated block, and TF32 / cuDNN. None of it renames a parameter, so
checkpoints, resume and every export read the same with it on or off.

What each attention backend needs lives in one table, BACKENDS: the package, the GPU generation
(compute capability), the dtypes and head sizes its kernel takes, whether it has a backward (what
training needs) and whether it runs on a CPU. The rules that need no torch (a backend without a
backward named for training, the causal mask, ring attention, fp32 with a half-precision kernel)
are config checks (e2v/config/checks.py's `_validate_speed`); those that need the machine (the
package importable, the GPU, the head size of the model) are `preflight`, which every rank runs
before any weight loads, each failing in one line that names the pip package or the key to change.

Compilation is `Module.compile` on every WanTransformerBlock (diffusers' `compile_repeated_blocks`):
the block's call is compiled in place, so `state_dict`, `named_parameters` and DeepSpeed's
checkpoints keep their names (torch.compile(model) would wrap the model and prefix every name with
`_orig_mod.`). All blocks share one code object, so torch's recompile limit
(torch._dynamo.config.recompile_limit, 8 by default) counts every block's graphs together; how many
graphs a run makes is docs/speed.md's "Recompilations", and `watch_compiles` logs each new one.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import weakref
from dataclasses import dataclass

import torch

from e2v.config.schema import Config, ConfigError
from e2v.runtime.log import get_logger

log = get_logger("e2v.speed")


@dataclass(frozen=True)
class Backend:
    """What one diffusers attention backend needs (from diffusers' attention_dispatch.py: its
    registered constraints and the kernels it calls)."""

    what: str  # the kernel, for messages and docs/speed.md
    module: str | None = None  # the import that must succeed (None: in torch)
    pip: str | None = None  # what to install when it does not
    capability: tuple[int, int] | None = None  # the lowest CUDA compute capability its kernel runs on
    only_capability: tuple[int, int] | None = None  # the one generation it is built for (FA3: Hopper)
    half: bool = False  # bf16 / fp16 only
    max_head_dim: int | None = None
    head_dims: tuple[int, ...] = ()  # exactly these head sizes
    backward: bool = True  # False: inference only (validation videos, tools/sample.py)
    cpu: bool = False  # runs on a CPU (what the tests can exercise)
    cpu_backward: bool = False  # and trains there


BACKENDS = {
    "native": Backend("torch's scaled_dot_product_attention (it picks flash / efficient / cuDNN / math)", cpu=True,
                      cpu_backward=True),
    # eager flex materialises the scores (as math); fused kernels come with speed.compile. On a CPU
    # torch's FlexAttention has a forward only ("does not support backward on CPU").
    "flex": Backend("torch's FlexAttention (fused only when compiled: speed.compile)", cpu=True),
    "_native_flash": Backend("torch's flash-attention SDPA kernel", capability=(8, 0), half=True, max_head_dim=256),
    "_native_cudnn": Backend("torch's cuDNN SDPA kernel (cuDNN 9+)", capability=(8, 0), half=True, max_head_dim=128),
    "flash": Backend("FlashAttention-2", module="flash_attn", pip="flash-attn>=2.6.3", capability=(8, 0),
                     half=True, max_head_dim=256),
    # diffusers calls FA3's forward through a custom op that registers no backward
    "_flash_3": Backend("FlashAttention-3", module="flash_attn_interface",
                        pip="FlashAttention-3 (built from flash-attention's hopper/ folder)",
                        only_capability=(9, 0), half=True, max_head_dim=256, backward=False),
    "_flash_varlen_3": Backend("FlashAttention-3, variable length", module="flash_attn_interface",
                               pip="FlashAttention-3 (built from flash-attention's hopper/ folder)",
                               only_capability=(9, 0), half=True, max_head_dim=256),
    # SageAttention's quantised kernels have no backward (diffusers raises NotImplementedError in it)
    "sage": Backend("SageAttention (int8 QK)", module="sageattention", pip="sageattention>=2.1.1",
                    capability=(8, 0), half=True, head_dims=(64, 128), backward=False),
    "xformers": Backend("xformers' memory_efficient_attention", module="xformers", pip="xformers>=0.0.29",
                        capability=(7, 0)),
}


def backend_problem(name: str, cuda: bool, capability: tuple[int, int] | None = None, head_dim: int | None = None,
                    cudnn_version: int | None = None, key: str = "speed.attention_backend",
                    training: bool = True) -> str | None:
    """Why `name` cannot run on this machine (one line naming the package or the key to change), or
    None. `capability`: the GPU's (major, minor); `head_dim`: the model's, when known; `training`:
    it needs a backward."""
    b = BACKENDS[name]
    fix = f"or set {key}: native"
    if not cuda and not b.cpu:
        return (f"{key}: {name} ({b.what}) runs on CUDA GPUs only and this machine has none; set {key}: native "
                "(torch's SDPA, which takes the CPU's flash op here)")
    if not cuda and training and not b.cpu_backward:
        return (f"{key}: {name} ({b.what}) has no backward on a CPU, so it cannot train here (it can sample: "
                f"speed.sampling_attention_backend: {name}); set {key}: native")
    if b.module is not None and importlib.util.find_spec(b.module) is None:
        return f"{key}: {name} needs {b.pip}, which is not importable here: pip install '{b.pip}', {fix}"
    if cuda and capability is not None:
        cc = ".".join(map(str, capability))
        if b.only_capability is not None and tuple(capability) != b.only_capability:
            return (f"{key}: {name} ({b.what}) is built for compute capability "
                    f"{'.'.join(map(str, b.only_capability))} (Hopper) only; this GPU is {cc}: use flash "
                    f"(FlashAttention-2), {fix}")
        if b.capability is not None and tuple(capability) < b.capability:
            return (f"{key}: {name} ({b.what}) needs compute capability >= {'.'.join(map(str, b.capability))} "
                    f"(Ampere or newer); this GPU is {cc}: {fix}")
    if name == "_native_cudnn" and cuda and cudnn_version is not None and cudnn_version < 90000:
        return f"{key}: _native_cudnn needs cuDNN 9 or newer; this torch has cuDNN {cudnn_version}: {fix}"
    if head_dim is not None and ((b.max_head_dim and head_dim > b.max_head_dim)
                                 or (b.head_dims and head_dim not in b.head_dims)):
        allowed = " or ".join(map(str, b.head_dims)) if b.head_dims else f"at most {b.max_head_dim}"
        return f"{key}: {name} takes head sizes {allowed}; this model's is {head_dim}: {fix}"
    return None


def compiler_problem(cfg: Config, cuda: bool) -> str | None:
    """Why speed.compile cannot build here, or None: inductor writes C++ for the CPU (a compiler
    on PATH) and Triton kernels for CUDA (the triton package)."""
    if not cfg.speed.compile or cfg.speed.compile_backend != "inductor":
        return None
    if cuda and importlib.util.find_spec("triton") is None:
        return ("speed.compile: inductor generates Triton kernels on CUDA and triton is not importable here: "
                "pip install triton (torch's CUDA wheels bring it), or set speed.compile: false")
    if not cuda and not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c):
        return ("speed.compile: inductor builds C++ for the CPU and no compiler is on PATH (g++, c++, clang++ or "
                "$CXX): install one (apt-get install g++), or set speed.compile: false")
    return None


def preflight(cfg: Config, head_dim: int | None = None) -> None:
    """Every rank, before any weight loads: the attention backends named for training and sampling
    can run here, and the compiler can build. Raises ConfigError with one line."""
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    cudnn = torch.backends.cudnn.version() if cuda else None
    s = cfg.speed
    for key, name in (("speed.attention_backend", s.attention_backend),
                      ("speed.sampling_attention_backend", s.sampling_attention_backend)):
        problem = name and backend_problem(name, cuda, capability, head_dim, cudnn, key,
                                           training=key == "speed.attention_backend")
        if problem:
            raise ConfigError(problem)
    problem = compiler_problem(cfg, cuda)
    if problem:
        raise ConfigError(problem)


def sampling_problem(cfg: Config, cuda: bool) -> str | None:
    """Why the backend generated videos use (speed.sampling_attention_backend, else the training
    one) cannot run here, or None: tools/sample.py asks before any weight loads, generate() again."""
    s = cfg.speed
    key = "speed.sampling_attention_backend" if s.sampling_attention_backend else "speed.attention_backend"
    return backend_problem(s.sampling_attention_backend or s.attention_backend, cuda, key=key, training=False)


# --- applying it --------------------------------------------------------------------------------

def _processors(model) -> list:
    """The attention processors of every Wan transformer in `model` (a module, a TwoExperts, an
    engine): the objects diffusers' dispatch reads `_attention_backend` from."""
    module = getattr(model, "module", model)
    return [m.processor for m in module.modules()
            if hasattr(m, "processor") and hasattr(m.processor, "_attention_backend")]


# The transformers whose processors set_backend changed, so that sampling can switch them too
# (a run's trained expert reaches generate() inside a closure: e2v/models/experts.py's switch).
_WITH_BACKEND = weakref.WeakSet()


def set_backend(model, name: str) -> None:
    """Every attention processor of `model` dispatches to backend `name`. `native` leaves them as
    diffusers builds them (no backend of their own: the process's active one, torch's SDPA), so
    a default run is exactly what it was. diffusers' own set_attention_backend also changes the
    process-wide active backend; this touches the model only."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = None if name == "native" else AttentionBackendName(name)
    for processor in _processors(model):
        processor._attention_backend = backend
    if backend is not None:
        _WITH_BACKEND.add(getattr(model, "module", model))


@contextlib.contextmanager
def sampling_backend(model, cfg: Config):
    """Generation (e2v/eval/sampling.py's generate) with speed.sampling_attention_backend (null: the
    training backend): the process's active backend, which the models loaded for sampling follow
    (their processors name none: tools/sample.py, the other Wan2.2 expert), and, when it is not the
    training backend, the processors of `model` and of every transformer set_backend changed, put
    back after. A run with native throughout changes nothing."""
    s = cfg.speed
    name = s.sampling_attention_backend or s.attention_backend
    if name == "native" and s.attention_backend == "native":
        yield
        return
    from diffusers import attention_backend

    problem = sampling_problem(cfg, torch.cuda.is_available())
    if problem:
        raise ConfigError(problem)
    trained = [] if name == s.attention_backend else [model, *_WITH_BACKEND]
    processors = {id(p): p for m in trained if isinstance(getattr(m, "module", m), torch.nn.Module)
                  for p in _processors(m)}
    before = {k: p._attention_backend for k, p in processors.items()}
    try:
        with attention_backend(name):
            for p in processors.values():
                p._attention_backend = None  # the active backend
            yield
    finally:
        for k, p in processors.items():
            p._attention_backend = before[k]


def set_precision(cfg: Config) -> None:
    """TF32 and cuDNN for this process (speed.matmul_tf32, cudnn_tf32, cudnn_benchmark). The VAE
    sets its own TF32 around each encode (model.vae_tf32) and puts these back after. No effect
    without CUDA."""
    s = cfg.speed
    torch.backends.cuda.matmul.allow_tf32 = s.matmul_tf32
    torch.backends.cudnn.allow_tf32 = s.cudnn_tf32
    torch.backends.cudnn.benchmark = s.cudnn_benchmark


def bucket_shapes(cfg: Config) -> int:
    """How many input shapes training meets: frame buckets x resolution buckets (the config's rule,
    e2v/config/shapes.py's frame_bucket_list)."""
    from e2v.config.shapes import frame_bucket_list

    d = cfg.data
    frames = len(frame_bucket_list(cfg)) if d.auto_frame_buckets else 1
    return frames * max(1, len(d.resolution_buckets))


DYNAMIC = {"auto": None, "dynamic": True, "static": False}  # speed.compile_shapes -> torch.compile's dynamic


def compile_blocks(model, cfg: Config, shapes: int = 1) -> int:
    """torch.compile every repeated block of `model` in place (the model's `_repeated_blocks`, what
    diffusers' compile_repeated_blocks compiles: WanTransformerBlock), names unchanged. Under
    compile_shapes: static each of the run's `shapes` (bucket shapes) is a graph, in two kinds of
    block input (docs/speed.md): the recompile limit is raised to hold them, and said.
    Returns the number of blocks compiled."""
    s = cfg.speed
    module = getattr(model, "module", model)
    repeated = {name for m in module.modules() for name in getattr(m, "_repeated_blocks", ())}  # diffusers' list
    blocks = [m for m in module.modules() if type(m).__name__ in repeated]
    if s.compile_shapes == "static":
        need = 2 * shapes + 2  # two kinds of block input per shape, and validation's no-grad pair
        if need > torch._dynamo.config.recompile_limit:
            log.info(f"speed.compile_shapes: static with {shapes} bucket shapes: up to {need} graphs of the block; "
                     f"torch._dynamo.config.recompile_limit raised from {torch._dynamo.config.recompile_limit}")
            torch._dynamo.config.recompile_limit = need
    for block in blocks:
        block.compile(backend=s.compile_backend, dynamic=DYNAMIC[s.compile_shapes],
                      **({"mode": s.compile_mode} if s.compile_backend == "inductor" else {}))
    return len(blocks)


def compiled_graphs(attempts: bool = False) -> int:
    """Graphs torch.compile has made in this process (dynamo's frame counter); with `attempts`,
    also the compiles it started and gave up (a shape past the recompile limit)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total" if attempts else "ok"]


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process (each splits a compiled call in two)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class CompileWatch:
    """After each forward of the transformer: a line for each graph of the block compiled since
    `apply` (a new shape or kind of input; the first SAID of them, then one line that more follow),
    and, once, the line that says torch's recompile limit is reached and what runs eager from then on.
    Reading dynamo's counters costs a dict lookup per forward."""

    SAID = 4

    def __init__(self):
        self.start, self.start_breaks = compiled_graphs(), graph_breaks()
        self.seen, self.attempts = 0, compiled_graphs(attempts=True)
        self.warned = False

    @property
    def graphs(self) -> int:
        return compiled_graphs() - self.start

    @property
    def breaks(self) -> int:
        return graph_breaks() - self.start_breaks

    @staticmethod
    def entries() -> int:
        """Graphs cached for the block's own call (WanTransformerBlock.forward, every block's code):
        the count torch's recompile limit applies to (resumed frames after a break have their own)."""
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(WanTransformerBlock.forward.__code__))

    def __call__(self, module, args, output):
        attempts = compiled_graphs(attempts=True)
        if attempts == self.attempts:  # nothing compiled or tried since the last forward
            return
        self.attempts = attempts
        n, first, self.seen = self.graphs, self.seen, self.graphs
        limit = torch._dynamo.config.recompile_limit
        if first < self.SAID and n > first:
            more = f"; {self.breaks} graph break(s)" if self.breaks else ""
            log.info(f"speed.compile: {n} graph(s) of the block compiled (each new input shape or kind of input "
                     f"makes one; torch's recompile limit per code: {limit}{more})")
        if self.entries() >= limit and not self.warned:
            self.warned = True
            log.warning(f"WARNING: speed.compile: the block's call has {limit} graphs, torch._dynamo.config."
                        f"recompile_limit: a new shape or kind of input "
                        "runs the block eager from now on (slower, the same numbers). Use speed.compile_shapes: auto or "
                        "dynamic, or fewer buckets (data.frame_buckets / resolution_buckets)")


def apply(model, cfg: Config, shapes: int = 1, zero_stage: int = 0) -> CompileWatch | None:
    """The speed: keys on a transformer built for training (after context parallelism put in its
    processors; e2v/train/engine.py's initialize_engine): the attention backend, TF32 / cuDNN,
    and with speed.compile its blocks compiled (lazily: the first forward traces) and watched.
    Returns the watch (None without compilation)."""
    set_backend(model, cfg.speed.attention_backend)
    set_precision(cfg)
    if not cfg.speed.compile:
        return None
    compile_blocks(model, cfg, shapes)
    if zero_stage == 3:  # docs/speed.md, "Regional compilation": measured on the tiny preset
        log.info("note: speed.compile under ZeRO-3: DeepSpeed gathers each layer's parameters in hooks inside the "
                 "block, which break the compiled block into many small graphs (the same losses, little to gain); "
                 "ZeRO-2 (ds_configs/zero2_offload.json) keeps it whole")
    watch = CompileWatch()
    module = getattr(model, "module", model)
    module.register_forward_hook(watch)
    setattr(module, WATCH_ATTR, watch)  # what the run's last line reads (compile_summary)
    return watch


WATCH_ATTR = "e2v_compile_watch"


def compile_summary(model) -> str | None:
    """The run's compile line: graphs of the block compiled and torch's limit; None without compilation."""
    watch = getattr(getattr(model, "module", model), WATCH_ATTR, None)
    if watch is None:
        return None
    return (f"speed.compile: {watch.graphs} graph(s) of the block compiled in this run, {watch.breaks} graph "
            f"break(s) (recompile limit {torch._dynamo.config.recompile_limit})")
