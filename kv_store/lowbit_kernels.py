"""Compiled loops of the low-bit decoder (numba): a part with widths by range, unpacked, put back in
slice order and dequantized in one pass, without the GIL.

Why compiled: in numpy the same decode was ~60 calls a layer (one per width and step), each a pass
over the codes, with Python holding the GIL between them, in a reader thread beside the engine's own
Python thread. Here a part is two calls that release the GIL, and a 600-token SmolLM2 chunk decodes
in 18 ms against 25 ms (one thread; docs/benchmarks/kv-store.md).

The layout is lowbit's (see its module doc): after a part's widths, each width's slices (width 1
first, slices in their order), packed at that width, each width's codes padded to whole bytes.
"""

from __future__ import annotations

import numba
import numpy as np


def _jit(fn):
    """Compiled without the GIL, cached on disk: once per machine into __pycache__ (or numba's user
    cache), not at every process start (~1 s cold). Where neither is writable (a read-only install
    without a home), numba refuses to cache: then it compiles once per process instead."""
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(fn)


@_jit
def _refill(buf: np.ndarray, pos: int, acc: np.uint64, num_acc: int) -> tuple[int, np.uint64, int]:
    """Top up the bit accumulator: 7 bytes at once where 8 are left to read, else one at a time.
    Bits above `num_acc` may be set by the lookahead byte; they are the stream's own next bits."""
    if pos + 8 <= buf.size:
        word = np.uint64(0)
        for i in range(8):
            word |= np.uint64(buf[pos + i]) << np.uint64(8 * i)
        acc |= word << np.uint64(num_acc)
        taken = (63 - num_acc) >> 3
        return pos + taken, acc, num_acc + 8 * taken
    acc |= np.uint64(buf[pos]) << np.uint64(num_acc)
    return pos + 1, acc, num_acc + 8


@_jit
def _take_code(buf: np.ndarray, pos: int, acc: np.uint64, num_acc: int, bits: int) -> tuple[int, int, np.uint64, int]:
    """The next `bits`-wide code of the stream (least significant bits first) -> (code, and the reader's
    state after it: pos, acc, num_acc). A stream starts at pos with acc = num_acc = 0."""
    while num_acc < bits:
        pos, acc, num_acc = _refill(buf, pos, acc, num_acc)
    code = np.int32(acc & np.uint64((1 << bits) - 1))
    return code, pos, acc >> np.uint64(bits), num_acc - bits


@_jit
def take_widths(buf: np.ndarray, offset: int, num_heads: int, num_slices: int, slice_len: int,
                total_bits: int, min_bits: int, code_bits: int) -> tuple[np.ndarray, int, int]:
    """A part with widths by range, from byte `offset` of `buf`: its widths u8 [H, m] (stored as
    width - `min_bits` in `code_bits` bits each, checked: each head's sum to `total_bits`), and the
    bytes [start, end) of its codes (each width's, width 1 first, each padded to whole bytes)."""
    num_widths = num_heads * num_slices
    start = offset + (num_widths * code_bits + 7) // 8
    if start > buf.size:
        raise ValueError("payload ends before its parts")
    widths = np.empty((num_heads, num_slices), dtype=np.uint8)
    counts = np.zeros(9, dtype=np.int64)  # slices of each width
    stored = buf[:start]  # the widths' bytes
    acc, num_acc, pos = np.uint64(0), 0, offset
    for h in range(num_heads):
        head_bits = 0
        for i in range(num_slices):
            code, pos, acc, num_acc = _take_code(stored, pos, acc, num_acc, code_bits)
            width = code + min_bits
            widths[h, i] = width
            counts[width] += 1
            head_bits += width
        if head_bits != total_bits:
            raise ValueError("damaged bit widths: a head's do not sum to its bits")
    end = start
    for bits in range(1, 9):
        end += (counts[bits] * slice_len * bits + 7) // 8
    if end > buf.size:
        raise ValueError("payload ends before its parts")
    return widths, start, end


@_jit
def decode_keys(buf: np.ndarray, widths: np.ndarray, group_tokens: int, step: np.ndarray, lo: np.ndarray,
                out: np.ndarray) -> None:
    """Keys by channel: `buf` (u8, the codes after the widths), `widths` u8 [H, D] ->
    out [H, n, D] fp32 = code * step + min, `step` and `lo` fp32 [H, G, D] per group of `group_tokens`."""
    num_heads, num_tokens, head_dim = out.shape
    start = 0  # byte where the current width's codes begin
    for bits in range(1, 9):
        pos, num_codes = start, 0  # pos: the next byte to take (read ahead of the codes used)
        acc, num_acc = np.uint64(0), 0  # bits taken from buf, not yet used (a width's codes start on a byte)
        for h in range(num_heads):
            for d in range(head_dim):
                if widths[h, d] != bits:
                    continue
                for t0 in range(0, num_tokens, group_tokens):
                    g = t0 // group_tokens
                    s, m = step[h, g, d], lo[h, g, d]
                    for t in range(t0, min(t0 + group_tokens, num_tokens)):
                        code, pos, acc, num_acc = _take_code(buf, pos, acc, num_acc, bits)
                        out[h, t, d] = np.float32(code) * s + m
                    num_codes += min(group_tokens, num_tokens - t0)
        start += (num_codes * bits + 7) >> 3


@_jit
def decode_values(buf: np.ndarray, widths: np.ndarray, step: np.ndarray, lo: np.ndarray, out: np.ndarray) -> None:
    """Values by token: `widths` u8 [H, n] -> out [H, n, D] fp32 = code * step + min, `step` and `lo`
    fp32 [H, n] per token."""
    num_heads, num_tokens, head_dim = out.shape
    start = 0
    for bits in range(1, 9):
        pos, num_codes = start, 0
        acc, num_acc = np.uint64(0), 0
        for h in range(num_heads):
            for t in range(num_tokens):
                if widths[h, t] != bits:
                    continue
                s, m = step[h, t], lo[h, t]
                for d in range(head_dim):
                    code, pos, acc, num_acc = _take_code(buf, pos, acc, num_acc, bits)
                    out[h, t, d] = np.float32(code) * s + m
                num_codes += head_dim
        start += (num_codes * bits + 7) >> 3


def warm_up() -> None:
    """Compile the kernels, or load them from numba's cache, now (~1 s cold, ~0.3 s cached): at a store's
    start-up rather than in the first request that reads a low-bit entry. The arguments have the types
    the decoder passes (a payload's bytes are read-only), so the same compiled versions are the ones made."""
    payload = np.frombuffer(bytes(8), dtype=np.uint8)
    widths = np.ones((1, 1), dtype=np.uint8)
    scales = np.zeros((1, 1, 1), dtype=np.float32)
    out = np.empty((1, 1, 1), dtype=np.float32)
    take_widths(payload, 0, 1, 1, 1, 1, 1, 3)
    decode_keys(payload, widths, 1, scales, scales, out)
    decode_values(payload, widths, scales[0], scales[0], out)
