"""Host memory that a freed tensor gives back to the machine.

glibc's malloc serves a large request with its own mmap only while the request is above the
"mmap threshold", and it raises that threshold (up to 32 MiB) each time such a block is freed. A
training process frees blocks of a layer's size all the time (ZeRO-3's gathered parameters, a
block's activations, the optimizer's temporaries), so after the first few every tensor of up to
32 MiB comes from the heap, and the heap keeps what is freed in the middle of it: the process
holds the memory of tensors that no longer exist, and its resident size follows the worst moment
so far instead of what is alive.

`return_freed_memory` fixes the threshold at 4 MiB (which also stops glibc from moving it) and
the heap's trim threshold with it, once, at the start of a process: a block of a layer's weights
(4.5 MiB and up in Wan2.1-1.3B, more in 14B) is then its own mapping and goes back when freed,
while the many smaller temporaries keep reusing heap memory. On CPU with the real 1.3B shapes
(bench/smoke_real.py's runs) it lowers the peak of the E2V run under ZeRO-3 by a fifth with the
same losses; a lower threshold, 256 KiB, gains little more and makes the CPU steps of the T2V LoRA
run slower, every activation becoming a fresh mapping whose pages the kernel must zero (the
figures: bench/RESULTS.md, section 7: `malloc_threshold`). (On a GPU the host's large blocks are the
offloaded optimizer's and the checkpoints' copies; not measured there.)

It leaves things as they are where the user has chosen: E2V_MALLOC=default, MALLOC_MMAP_THRESHOLD_
/ MALLOC_TRIM_THRESHOLD_ in the environment, or a preloaded allocator (jemalloc, tcmalloc,
mimalloc), and on a C library other than glibc. Nothing here imports torch: it runs before the
first large allocation.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
THRESHOLD_BYTES = 4 << 20  # from this size, a block is its own mapping and goes back to the OS when freed
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
OPT_OUT = "E2V_MALLOC"  # E2V_MALLOC=default: leave glibc as it is


def return_freed_memory(threshold: int = THRESHOLD_BYTES) -> str:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes for this process. Returns what it
    did, one line for a log."""
    if os.environ.get(OPT_OUT) == "default":
        return f"malloc: glibc's default ({OPT_OUT}=default)"
    chosen = [k for k in USER_SETTINGS if k in os.environ]
    if chosen:
        return f"malloc: kept {', '.join(chosen)} from the environment"
    preloaded = [a for a in OTHER_ALLOCATORS if a in os.environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"malloc: {preloaded[0]} is preloaded, left as it is"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: raises AttributeError elsewhere)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc: not glibc, left as it is"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1 or mallopt(M_TRIM_THRESHOLD, threshold) != 1:
        return "malloc: glibc refused the thresholds, left as it is"
    return f"malloc: blocks of {threshold / 2**20:g} MiB and more go back to the OS when freed"
