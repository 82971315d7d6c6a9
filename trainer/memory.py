"""Host memory policy for the trainer process: glibc's malloc told to give freed tensor-sized buffers back.

Two settings, both measured with bench/scale (marginal peak RSS per parameter between model sizes):

- fewer arenas: glibc gives each thread that allocates under contention an arena of its own (up to 8 per core)
  and keeps what is freed there for reuse. The trainer allocates tensor-sized buffers on several threads at once
  (the training step, verification, writing and diffing versions), so each arena grew to its own high-water mark:
  3M -> 30M parameters, 26.6 bytes per parameter with the default arenas, 23.6 with two.
- a fixed mmap threshold: blocks of ``TRAINER_MMAP_THRESHOLD`` or more are mapped on their own and unmapped when
  freed. By default glibc raises that threshold to the size of any mapped block freed (up to 32 MiB), after which
  gradients, activations and the publisher's 1 MiB reads come from the heap, and a freed heap block below a
  long-lived small one is never returned. That kept the trainer's peak rising after its first step (30M -> 300M:
  20.4 bytes per parameter through the first step, 22.2 over the run).

Linux/glibc only; elsewhere a no-op. Set before any thread allocates (node/cli.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
M_ARENA_MAX = -8
TRAINER_ARENAS = 2
TRAINER_MMAP_THRESHOLD = 256 << 10


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def limit_malloc_arenas(n: int = TRAINER_ARENAS) -> bool:
    """Cap this process's malloc arenas at ``n`` (arenas made before stay); True when glibc took it."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, n) == 1


def map_large_blocks(threshold: int = TRAINER_MMAP_THRESHOLD) -> bool:
    """Blocks of ``threshold`` bytes or more are mapped on their own and returned to the system when freed (a
    fixed threshold also stops glibc from raising it); True when glibc took it."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


def apply_trainer_malloc_policy() -> bool:
    """Both settings above (each tried even if the other was refused); True when glibc took both."""
    arenas = limit_malloc_arenas()
    mapped = map_large_blocks()
    return arenas and mapped
