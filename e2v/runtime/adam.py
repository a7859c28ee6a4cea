"""Which Adam steps the weights, and the preflight of DeepSpeed's compiled ones (docs/gpu_runs.md).

torch's AdamW is the default on every device: under ZeRO the optimizer sees one flat fp32
partition, so `AdamW(fused=True)` (one kernel, on the GPU, or on the CPU under optimizer offload)
does the work of DeepSpeed's FusedAdam / CPU Adam, ships in the torch wheel (nothing to build) and
resumes bit-exactly. DeepSpeed's own Adam is a C++ op (CPU Adam, optimizer offload) or a CUDA op
(FusedAdam), prebuilt into the deepspeed install (DS_BUILD_CPU_ADAM=1 / DS_BUILD_FUSED_ADAM=1) or
JIT-built at its first use, which on real machines fails for reasons outside this code. When it is
named, `preflight_deepspeed_adam` builds it before any weight is read, so a failure costs seconds,
and names the cause and the fix.

bitsandbytes' AdamW8bit (`adamw_8bit`) keeps both moments in 8 bits (blockwise, 256 values per fp32
absmax): 2 bytes of optimizer state per trained weight instead of 8, beside the fp32 master copy
ZeRO keeps. Its CPU and CUDA kernels ship in the wheel (nothing compiled), its state is plain
tensors (uint8 moments, fp32 absmax and code books) that a checkpoint restores bit-exactly. Built
here and handed to DeepSpeed as the client optimizer (DeepSpeed's own config has no such type).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

TORCH_ADAMW = "torch_adamw"
DEEPSPEED_ADAM = "deepspeed_adam"
ADAMW_8BIT = "adamw_8bit"
CHOICES = (TORCH_ADAMW, DEEPSPEED_ADAM, ADAMW_8BIT)

# An arch entry DeepSpeed 0.19's op builder parses: it reads "major.minor[+PTX]" with int(), so
# torch's family suffixes ("9.0a", "10.0f") stop the build with "invalid literal for int()".
_ARCH_ENTRY = re.compile(r"\d+\.\d+(\+PTX)?")
# Many times a JIT build of either Adam op (bench/RESULTS.md, section 7: `adam_jit_build`): a build
# lock older than this outlived its build.
STALE_LOCK_S = 600


def arch_list_problem(arch_list: str | None) -> str | None:
    """Why DeepSpeed's op builder cannot parse TORCH_CUDA_ARCH_LIST, or None."""
    if not arch_list:
        return None
    bad = [cc for cc in arch_list.replace(" ", ";").split(";") if cc.strip() and not _ARCH_ENTRY.fullmatch(cc.strip())]
    if not bad:
        return None
    fixed = ";".join(re.sub(r"[a-z]+$", "", cc.strip()) for cc in arch_list.replace(" ", ";").split(";") if cc.strip())
    return (f"TORCH_CUDA_ARCH_LIST={arch_list}: DeepSpeed's op builder reads each entry as major.minor with int() "
            f"and cannot parse {', '.join(bad)}; set TORCH_CUDA_ARCH_LIST={fixed} for this run")


def nvcc_problem(cuda_home: str | None, torch_cuda: str | None) -> str | None:
    """Why FusedAdam cannot be compiled with this CUDA toolkit, or None: no toolkit, a runtime-only
    image without nvcc, or an nvcc whose major version differs from the CUDA torch was built with
    (DeepSpeed refuses that combination)."""
    if cuda_home is None:
        return "no CUDA toolkit found (CUDA_HOME unset and no nvcc on PATH): FusedAdam needs nvcc to compile"
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} does not run ({e}): a runtime-only CUDA image has no compiler; install the CUDA toolkit"
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m is None:
        return f"{nvcc} --version did not print a release number"
    if torch_cuda and m.group(1) != torch_cuda.split(".")[0]:
        return (f"{nvcc} is CUDA {m.group(1)}.{m.group(2)}, torch was built with CUDA {torch_cuda}: install the "
                f"matching toolkit (or point CUDA_HOME at it)")
    return None


def lock_problem(lock: Path, now: float | None = None) -> str | None:
    """A build lock torch's extension loader would wait on forever: a build killed mid-way never
    removes it."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:
        return None
    if age < STALE_LOCK_S:
        return None
    return (f"{lock} is {age / 60:.0f} min old: a build that was killed left it, and every later build waits on "
            f"it forever; delete it (no build of this op is running)")


def _builder(offload: bool):
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

    return CPUAdamBuilder() if offload else FusedAdamBuilder()


def deepspeed_adam_problem(offload: bool, cuda: bool) -> str | None:
    """What stops DeepSpeed's Adam from being built here, found without building it, or None."""
    try:
        from deepspeed.git_version_info import installed_ops
        builder = _builder(offload)
    except Exception as e:  # an install without op builders
        return f"deepspeed's op builders are not importable ({e})"
    if installed_ops.get(builder.NAME, False):
        return None  # prebuilt into the install: nothing to compile
    if not offload and not cuda:
        return "FusedAdam is a CUDA op and this machine has no CUDA"
    missing = [tool for tool in ("ninja", "c++") if shutil.which(tool) is None]
    if missing:
        return f"{builder.NAME} is not prebuilt and JIT-building it needs {', '.join(missing)}"
    if not offload:
        from torch.utils.cpp_extension import CUDA_HOME

        problem = arch_list_problem(os.environ.get("TORCH_CUDA_ARCH_LIST")) or nvcc_problem(CUDA_HOME, torch.version.cuda)
        if problem:
            return problem
    from torch.utils.cpp_extension import _get_build_directory

    return lock_problem(Path(_get_build_directory(builder.NAME, verbose=False)) / "lock")


def build_deepspeed_adam(offload: bool, cuda: bool) -> str | None:
    """Build (or load the cached build of) DeepSpeed's Adam op; None when it loaded, else why not."""
    problem = deepspeed_adam_problem(offload, cuda)
    if problem:
        return problem
    try:
        _builder(offload).load(verbose=False)
    except Exception as e:  # the compiler's own failure: its message says what
        return f"building DeepSpeed's {'CPU Adam' if offload else 'FusedAdam'} failed: {type(e).__name__}: {e}"
    return None


def preflight_deepspeed_adam(offload: bool, cuda: bool, local_rank: int, gather) -> None:
    """Build DeepSpeed's Adam on every rank before any weight loads, the node's first rank first (it
    compiles into the node's shared cache; the others then load the result), and stop every rank
    with the first rank's cause if any rank cannot have it. `gather(x)` is a collective returning
    every rank's `x` (distributed.gather_all); each rank calls this once."""
    what = "CPU Adam" if offload else "FusedAdam"
    first = build_deepspeed_adam(offload, cuda) if local_rank == 0 else None
    problems = gather(first)
    if not any(problems):
        problems = gather(build_deepspeed_adam(offload, cuda) if local_rank != 0 else None)
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if bad:
        rank, problem = bad[0]
        raise SystemExit(f"optimizer preflight (deepspeed.optimizer: {DEEPSPEED_ADAM}, DeepSpeed's {what}), rank "
                         f"{rank}: {problem}. Nothing was loaded. Fix that, or use torch's AdamW "
                         f"(deepspeed.optimizer: {TORCH_ADAMW}, the default: no build, exact resume)")


def optimizer_bytes(optimizer: str) -> float:
    """Bytes per trained parameter of what the optimizer keeps: ZeRO's fp32 master copy (4) and
    AdamW's two fp32 moments (8), or AdamW8bit's two 8-bit moments with an fp32 absmax per 256
    values (2 + 8/256)."""
    return 4 + (2 + 8 / 256 if optimizer == ADAMW_8BIT else 8)


def adamw_8bit(params, lr: float, betas, eps: float, weight_decay: float):
    """bitsandbytes' AdamW8bit over `params` (module docstring). Every tensor of at least 4096 values
    gets 8-bit moments (bitsandbytes' own threshold); under ZeRO that is the flat partition."""
    import logging

    # bitsandbytes warns at import that its optional 4-bit CPU matmul kernel is absent; 4-bit is not used.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
