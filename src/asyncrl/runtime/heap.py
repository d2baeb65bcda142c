"""Keep freed memory in the process for reuse instead of handing it back to the kernel.

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and returns it with ``munmap`` when freed, and it trims the top of the heap once
more than a few tens of MB lie free there. A CPU train step allocates and frees gigabytes
of activations, LM-head chunks and gradients, so each step gets its memory back from the
kernel as new pages, which the kernel must zero on first touch. On 2 cores (SmolLM2-135M,
32 sequences of prompt + 64 tokens in one micro-batch) that was about a million page
faults and 3-5 s of kernel CPU a step; served from a heap that is never trimmed, the same
step faults almost never and runs 1.15x (fp32) to 1.4x (bf16) faster (``bench/trainer.py
--compare-malloc`` prints both, per step). Micro-batches of 2k tokens mostly stay under
the threshold, which glibc raises as it sees large blocks freed, and gain little.

The cost: the process keeps its peak footprint until it exits, which a trainer or a
generation engine reaches on its first steps anyway. ``ASYNCRL_RETAIN_HEAP=0`` keeps the
C library's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

RETAIN_HEAP_ENV = "ASYNCRL_RETAIN_HEAP"
"""``0`` leaves malloc as the C library configures it."""

# mallopt(3) parameters of glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def retain_heap() -> bool:
    """Configures glibc's malloc in this process to reuse what it frees: blocks of every
    size come from heaps (no per-block ``mmap``), which are never trimmed. Call it early,
    before the large allocations. Returns whether malloc was configured: not where the C
    library is not glibc or ``ASYNCRL_RETAIN_HEAP=0``.

    Threads keep their own arenas (capping them at one, as ``MALLOC_ARENA_MAX=1`` does,
    made bf16 steps 1.5x slower here: oneDNN's worker threads allocate too). A block too
    large for a thread's heap (64 MB) is still mapped afresh."""
    if os.environ.get(RETAIN_HEAP_ENV, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; -1 as the trim threshold turns trimming off (mallopt(3))
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    return all(mallopt(param, value) == 1 for param, value in settings)
