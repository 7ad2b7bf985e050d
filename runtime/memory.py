"""Handing the allocator's free memory back to the system when the engine goes idle.

glibc's malloc keeps memory that was freed: the top of each arena above its trim threshold is
returned, the free holes below it never are. A prefill frees tens of MB of activations in chunks
of a few MB (below malloc's mmap threshold, which grows to 32 MB as large blocks are freed), other
threads (HTTP, embedding, KV loaders) leave holes in their own arenas, and the resident set stays at
its high-water mark. `malloc_trim(0)` gives every whole free page of every arena back. Run when
the engine has been idle a while (`EngineLoop`), not between steps: the next request touches those
pages again, as fresh zeroed ones, and pays for that (measured in docs/benchmarks/memory.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from blend_engine.int4 import release_scratch

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    """libc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Give the allocator's free pages back to the system; returns whether the C library can."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_idle_memory() -> bool:
    """What an idle engine thread gives back: its prefill fp32 GEMM scratch (the largest layer's, 110 MB for
    the 1.5B; made again by the next prefill), then the allocator's free pages. Returns whether the C library
    could trim."""
    release_scratch()
    return release_free_memory()
