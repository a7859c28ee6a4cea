"""A safetensors file written one tensor at a time, so a save never holds more than one tensor.

`safetensors.torch.save_file` takes the whole dict: rank 0 of a ZeRO run would gather every
trained module in fp32 first (24 GiB for the 6.4 B trained parameters of configs/e2v.yaml) and
only then write. The format allows streaming, since its header needs only names, dtypes and
shapes, all known before any value is gathered: the header goes first, then each tensor's bytes
as it arrives, in header order (the format's one rule: the data offsets tile the byte buffer in
order). The file reads back with safetensors' own `load_file` / `safe_open`; tests check that.
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

import torch

# safetensors' dtype names (the format's spec); the byte sizes come from torch.
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this dtype and shape in the file."""
    return prod(shape) * torch.empty((), dtype=dtype).element_size()


class StreamedSafetensors:
    """`layout` (name -> (dtype, shape)) fixes the header and the order; `write(name, tensor)`
    appends each tensor in that order, `close()` checks every one came. Use as a context manager."""

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path, self.layout = Path(path), dict(layout)
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name, (dtype, shape) in self.layout.items():
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{path}: {name} has dtype {dtype}, which safetensors cannot store")
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.order, self.next = list(self.layout), 0
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.next] if self.next < len(self.order) else None
        dtype, shape = self.layout.get(name, (None, None))
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: got {name} {tensor.dtype} {tuple(tensor.shape)}, expected {expected} "
                             f"{dtype} {shape} (tensors come in the layout's order)")
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.file.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self.next} tensors never written, first "
                             f"{self.order[self.next]}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.file.close()
