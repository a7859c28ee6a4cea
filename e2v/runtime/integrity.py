"""What a checkpoint may contain, and proof that its files are the ones saved.

A pickle (`torch.load(..., weights_only=False)`) runs whatever code its author put in it, so a
checkpoint copied from elsewhere, or edited on a shared disk, could run code on every rank at
`--resume` or in tools/export_lora.py. So:

- our own state is plain data: the RNG states in safetensors (torch's states are uint8 tensors)
  with Python's and numpy's states as JSON numbers in the file's metadata;
- DeepSpeed's files are read with torch's weights-only unpickler, which builds tensors, numbers,
  strings and containers and, beyond those, only the classes in `DEEPSPEED_CLASSES` (found by
  loading the checkpoints of every ZeRO stage this project trains with). DeepSpeed itself loads
  with weights_only=False, at the engine (its checkpoint engine: replaced here by a weights-only
  one) and in zero_to_fp32 (its `torch.load`, replaced for the duration of one call);
- every file's size and SHA-256 is recorded in the checkpoint's manifest and checked before a
  resume. The record is the writer's own: each rank counts and hashes the bytes as it writes them
  (`record_write`; DeepSpeed's files through the checkpoint engine below), and the ranks' records
  are gathered, never read back from stat() or listings of files other nodes just wrote (on NFS
  those can show a good file short, or not yet at all).

A refused file raises `UnsafeCheckpoint` naming the file and the class it asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import torch


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file asks to run code, or to build a class outside the allow-list."""


def _deepspeed_classes() -> list:
    """What DeepSpeed's checkpoint files pickle besides tensors and plain containers: the loss
    scaler object and the ZeRO stage enum (optimizer states), the tensor fragment addresses
    (ZeRO-1/2 optimizer states). The LR scheduler and our client state are plain numbers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


# Only for reading an RNG file written before the RNG states were stored as safetensors: numpy's
# state is an array of uint32 (these rebuild arrays of numbers; an object array would need more).
_LEGACY_NUMPY = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def weights_only_load(path, map_location=None, mmap: bool | None = None, allow: list | None = None):
    """`torch.load` that builds data only: tensors, numbers, strings, containers and the classes
    in `allow` (DeepSpeed's by default). Anything else raises UnsafeCheckpoint naming the file."""
    allow = _deepspeed_classes() if allow is None else allow
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message wraps the one line that names the class in advice to set weights_only=False
        m = re.search(r"(?:unsupported|Unsupported global:) GLOBAL [\w.]+", str(e))
        why = f"it asks for {m.group(0).split()[-1]}" if m else str(e).strip().splitlines()[-1][:200]
        raise UnsafeCheckpoint(
            f"refusing to load {path}: it is not plain tensors and numbers ({why}). A checkpoint "
            "written by this trainer never asks for that, so the file was replaced or edited: "
            "resume from a checkpoint you trust (or delete this one)") from None


def weights_only_checkpoint_engine(engine):
    """DeepSpeed's checkpoint engine of `engine`, loading weights-only and recording what it saves.
    DeepSpeed reads every model and optimizer file of a checkpoint through
    `engine.checkpoint_engine.load`, which for its torch engine is `torch.load(weights_only=False)`,
    and writes them through `.save`: the same torch.save, its bytes counted and hashed on the way
    into `.written` (path -> record_write's record)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    current = engine.checkpoint_engine
    if getattr(current, "weights_only", False):  # already replaced
        return current
    if type(current) is not TorchCheckpointEngine:  # e.g. an async engine from the DeepSpeed config
        raise UnsafeCheckpoint(f"DeepSpeed checkpoint engine {type(current).__name__}: only the default torch "
                               "engine can be made to load weights-only; remove checkpoint.* engine settings "
                               "from the DeepSpeed config")

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        weights_only = True

        def load(self, path: str, map_location=None):
            return weights_only_load(path, map_location=map_location)

        def save(self, state_dict, path: str):
            zipfile = self.zipfile_serialization
            self.written[str(path)] = record_write(
                path, lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile))

    safe = WeightsOnlyCheckpointEngine.__new__(WeightsOnlyCheckpointEngine)
    safe.__dict__.update(current.__dict__)  # the same settings (serialization format, name)
    safe.written = {}
    return safe


@contextlib.contextmanager
def weights_only_zero_to_fp32():
    """DeepSpeed's zero_to_fp32 reads each shard with `torch.load(weights_only=False)` through the
    `torch` name of its own module; for the duration of the block that name resolves to torch with
    a weights-only `load`. Nothing else sees the change."""
    from deepspeed.utils import zero_to_fp32

    class _WeightsOnlyTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def load(f, map_location=None, mmap=None, **_ignored):  # weights_only=False is what it passes
            return weights_only_load(f, map_location=map_location, mmap=mmap)

    real = zero_to_fp32.torch
    zero_to_fp32.torch = _WeightsOnlyTorch()
    try:
        yield
    finally:
        zero_to_fp32.torch = real


# --- RNG state as data ---------------------------------------------------------------------------


def save_rng(state: dict, path: Path) -> dict:
    """`checkpoint.rng_state(...)` as safetensors: torch's CPU, generator and CUDA states are
    uint8 tensors; Python's Mersenne Twister (625 ints and the cached gauss) and numpy's (624
    uint32, position, cached gaussian) go into the metadata as JSON numbers, which round-trip
    floats exactly. Returns the file's record (record_write)."""
    from safetensors.torch import save

    tensors = {"torch": state["torch"], "generator": state["generator"]}
    if state.get("cuda") is not None:  # the rank's own device's state (checkpoint.rng_state)
        tensors["cuda"] = state["cuda"]
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    meta = {"python": json.dumps([version, list(internal), gauss]),
            "numpy": json.dumps([name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)])}
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    record = record_write(path, lambda f: f.write(data))
    usual_permissions(path)
    return record


def load_rng(path: Path) -> dict:
    """The state `save_rng` wrote (or, for a `.pt` file of an older checkpoint, the same dict read
    weights-only)."""
    path = Path(path)
    if path.suffix == ".pt":
        return weights_only_load(path, allow=_LEGACY_NUMPY)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    version, internal, gauss = json.loads(meta["python"])
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    # one device's state; an older file holds every visible device's as cuda_0, cuda_1, ...
    legacy = [tensors[f"cuda_{i}"] for i in range(sum(k.startswith("cuda_") for k in tensors))]
    cuda = tensors["cuda"] if "cuda" in tensors else legacy or None
    return {"python": (version, tuple(internal), gauss), "torch": tensors["torch"],
            "numpy": (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
            "generator": tensors["generator"], "cuda": cuda}


# --- checksums -----------------------------------------------------------------------------------

HASH = "sha256"  # its cost per GB of one core: bench/RESULTS.md, section 7: `sha256_per_gb`


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()


class _Recorded(io.RawIOBase):
    """A file opened for writing that counts and hashes every byte on its way to the disk."""

    def __init__(self, f):
        super().__init__()
        self.f, self.hash, self.bytes = f, hashlib.new(HASH), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        self.f.write(b)
        self.hash.update(b)
        self.bytes += n
        return n


def record_write(path: Path, write) -> dict:
    """`write(f)` into a new file at `path`; the writer's own record of it: {"bytes", HASH} of
    exactly the bytes written (no stat, no read-back)."""
    with open(path, "wb") as f:
        rec = _Recorded(f)
        write(rec)
    return {"bytes": rec.bytes, HASH: rec.hash.hexdigest()}


def record_file(path: Path) -> dict:
    """The record of a file this process wrote by other means (a copy, a hard link): its bytes
    read and hashed once."""
    h, n = hashlib.new(HASH), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, HASH: h.hexdigest()}


# --- permissions ---------------------------------------------------------------------------------


def _umask() -> int:
    """The process umask, read without changing it where Linux exposes it (changing it, even for a
    moment, would apply to files other threads create meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_permissions(*paths: Path) -> None:
    """Give files the mode `open()` gives the run's other files (0666 less the umask): safetensors
    creates its files 0600, so an exported LoRA would otherwise be unreadable to the group that
    reads the rest of the run."""
    mode = 0o666 & ~_umask()
    for p in paths:
        if Path(p).is_file():
            os.chmod(p, mode)
