"""Low-bit KV at rest: keys quantized per channel over groups of tokens, values per token
(KIVI's split: keys have outlier channels, values do not), codes kept one per byte and entropy-coded
bit-packed (any width 1..8) and entropy-coded by zstd
(the `zstandard` package), optionally as token-wise deltas (CacheGen's idea). One layer is one
self-contained payload, so a reader decodes layer by layer as it streams.

Payload of a layer, before zstd: key codes [H, n, D] | value codes [H, n, D] (packed) | then the
scales (G = ceil(n / group)):
- `scale_bits` 16: key min, key step [H, G, D] fp16 | value min, value step [H, n, 1] fp16;
- `scale_bits` 8 (two levels): key min codes, key step codes [H, G, D] u8 | key ranges [4, H, D] fp16 |
  value min codes, value step codes [H, n] u8 | value ranges [4, H] fp16. Each key channel's (each
  value head's) group minimums are 8-bit codes over that channel's range of minimums, its steps 8-bit
  codes of log(step) over its range of log steps: the fp16 scales cost 1 bit per key element at
  32-token groups and 0.5 per value element (a fifth of the int4 format's bytes), these half that.
  The minimum is rounded down and the step up, so a group's codes still span its values: the error
  stays within half a (slightly wider) step, as with fp16 scales.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard


@dataclass(frozen=True)
class LowBitSpec:
    key_bits: int = 4
    value_bits: int = 4
    group_tokens: int = 64  # keys: one (min, step) per channel per this many tokens
    zstd_level: int = 3  # 0: no zstd (codes stored raw, one per byte)
    is_delta: bool = False  # codes stored as differences from the previous token's (mod 2^bits)
    scale_bits: int = 16  # 16: each group's min and step in fp16; 8: two-level (see the module's doc)

    def __post_init__(self) -> None:
        if self.scale_bits not in (8, 16):
            raise ValueError(f"scale_bits must be 8 or 16, got {self.scale_bits}")
        for bits in (self.key_bits, self.value_bits):
            if not 1 <= bits <= 8:
                raise ValueError(f"bit widths must be 1..8, got {bits}")
        if self.group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1, got {self.group_tokens}")

    @property
    def tag(self) -> str:
        delta = "d" if self.is_delta else ""
        scales = "s8" if self.scale_bits == 8 else ""
        return f"k{self.key_bits}v{self.value_bits}g{self.group_tokens}{delta}z{self.zstd_level}{scales}"


_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _quantize(x: np.ndarray, axis: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantization along `axis`: codes u8, min and step fp16 (keepdims).

    numpy, not torch: on small per-layer arrays torch's thread pool costs ~100x the arithmetic
    (measured on this 2-core CPU: round_ 4 ms vs np.rint 0.014 ms for 32k values)."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    lo16 = lo.astype(np.float16)
    step16 = np.maximum((hi - lo) / (2**bits - 1), 1e-6).astype(np.float16)  # fp16: what the decoder sees
    codes = np.clip(np.rint((x - lo16.astype(np.float32)) / step16.astype(np.float32)), 0, 2**bits - 1)
    return codes.astype(np.uint8), lo16, step16


def _f16_rounded(x: np.ndarray, is_down: bool) -> np.ndarray:
    """x (fp32) to fp16, rounded down (or up) so the fp16 value is <= x (>= x)."""
    h = x.astype(np.float16)
    toward = np.float16(-np.inf if is_down else np.inf)
    is_wrong = h.astype(np.float32) > x if is_down else h.astype(np.float32) < x
    return np.where(is_wrong, np.nextafter(h, toward), h)


_MIN_STEP = 1e-6  # a constant group's step (its codes are all 0)
_MIN_DELTA = np.float16(1e-4)  # a range's code step when all its values are equal


@dataclass(frozen=True)
class _Ranges:
    """A second level: per slice, the minimums' range and the log steps' range, 8-bit codes over each.
    Decoded alike by the encoder (which quantizes against what the decoder will see) and the decoder."""

    lo_min: np.ndarray  # fp16, the slice's smallest group minimum (rounded down)
    lo_delta: np.ndarray  # fp16, one minimum code's width (rounded up)
    log_step_min: np.ndarray  # fp16
    log_step_delta: np.ndarray  # fp16

    def lo(self, codes: np.ndarray) -> np.ndarray:
        return _decoded_min(self.lo_min, self.lo_delta, codes)

    def step(self, codes: np.ndarray) -> np.ndarray:
        exponent = self.log_step_min.astype(np.float32) + codes.astype(np.float32) * self.log_step_delta.astype(np.float32)
        return np.exp(exponent)

    def tobytes(self) -> bytes:
        return np.stack([self.lo_min, self.lo_delta, self.log_step_min, self.log_step_delta]).tobytes()

    @classmethod
    def frombuffer(cls, buf: np.ndarray, shape: tuple[int, ...]) -> _Ranges:
        parts = buf.view(np.float16).reshape(4, *shape)
        return cls(*parts)


def _decoded_min(lo_min: np.ndarray, lo_delta: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return lo_min.astype(np.float32) + codes.astype(np.float32) * lo_delta.astype(np.float32)


def _quantize_two_level(x: np.ndarray, axis: int, bits: int, slice_axis: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Ranges]:
    """As `_quantize`, with each group's min and step as 8-bit codes over a `_Ranges` shared along
    `slice_axis` (the groups of one key channel, the tokens of one value head).
    Returns codes u8 (x's shape), min codes and step codes u8 (keepdims along `axis`), the ranges."""
    levels = 2**bits - 1
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    lo_min = _f16_rounded(lo.min(axis=slice_axis, keepdims=True), is_down=True)
    lo_delta = np.maximum(_f16_rounded((lo.max(axis=slice_axis, keepdims=True) - lo_min.astype(np.float32)) / 255,
                                       is_down=False), _MIN_DELTA)
    lo_codes = np.clip(np.floor((lo - lo_min.astype(np.float32)) / lo_delta.astype(np.float32)), 0, 255)
    lo_codes -= _decoded_min(lo_min, lo_delta, lo_codes) > lo  # float rounding: never above the true min
    lo_codes = np.maximum(lo_codes, 0).astype(np.uint8)
    log_need = np.log(np.maximum((hi - _decoded_min(lo_min, lo_delta, lo_codes)) / levels, _MIN_STEP)).astype(np.float32)
    log_min = _f16_rounded(log_need.min(axis=slice_axis, keepdims=True), is_down=True)
    log_delta = np.maximum(_f16_rounded((log_need.max(axis=slice_axis, keepdims=True) - log_min.astype(np.float32)) / 255,
                                        is_down=False), _MIN_DELTA)
    ranges = _Ranges(lo_min, lo_delta, log_min, log_delta)
    step_codes = np.clip(np.ceil((log_need - log_min.astype(np.float32)) / log_delta.astype(np.float32)), 0, 255)
    step_codes = np.minimum(step_codes + (ranges.step(step_codes) < np.exp(log_need)), 255).astype(np.uint8)
    codes = np.clip(np.rint((x - ranges.lo(lo_codes)) / ranges.step(step_codes)), 0, levels)
    return codes.astype(np.uint8), lo_codes, step_codes, ranges


def _delta(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [H, n, D] -> first token's codes, then differences mod 2^bits along the token axis."""
    out = codes.clone()
    out[:, 1:] = (codes[:, 1:].to(torch.int16) - codes[:, :-1].to(torch.int16)).remainder_(2**bits).to(torch.uint8)
    return out


def _undelta(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return codes.to(torch.int32).cumsum_(1).remainder_(2**bits).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes u8 < 2^bits (any shape) -> their low `bits` bits, packed: [ceil(numel * bits / 8)] u8."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    if bits == 4:  # the common case, without numpy's bit arrays: two codes a byte, the first low
        a = flat.numpy()
        if a.size % 2:
            a = np.concatenate([a, np.zeros(1, np.uint8)])
        pairs = a.reshape(-1, 2)
        return torch.from_numpy(pairs[:, 0] | (pairs[:, 1] << 4))
    # any width: 8 codes -> one little-endian uint64 -> its low `bits` bytes (vectorized, no bit arrays)
    a = flat.numpy()
    pad = -a.size % 8
    if pad:
        a = np.concatenate([a, np.zeros(pad, np.uint8)])
    groups = a.reshape(-1, 8).astype(np.uint64)  # [numel / 8, 8]
    word = np.zeros(groups.shape[0], np.uint64)
    for i in range(8):
        word |= groups[:, i] << np.uint64(bits * i)
    packed = word.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits]  # [numel / 8, bits]
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1)[: _packed_len(flat.numel(), bits)])


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 8:
        return packed
    if bits == 4:
        p = packed.numpy()
        return torch.from_numpy(np.stack([p & 15, p >> 4], 1).reshape(-1)[:numel])
    p = packed.numpy()
    num_words = -(-numel // 8)
    padded = np.zeros(num_words * bits, np.uint8)
    padded[: p.size] = p
    buf = np.zeros((num_words, 8), np.uint8)
    buf[:, :bits] = padded.reshape(num_words, bits)
    word = buf.view("<u8").reshape(-1)  # [numel / 8]
    shifts = np.arange(0, 8 * bits, bits, dtype=np.uint64)  # [8]: one broadcast op, not 8 + a stack
    codes = ((word[:, None] >> shifts) & np.uint64((1 << bits) - 1)).astype(np.uint8)  # [numel / 8, 8]
    return torch.from_numpy(codes.reshape(-1)[:numel])


def _packed_len(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


def encode_layer(kv: torch.Tensor, spec: LowBitSpec) -> bytes:
    """kv [2, H, n, D] (any float dtype, CPU) -> one compressed payload."""
    x = kv.detach().float().numpy()
    keys, values = x[0], x[1]  # [H, n, D]
    num_heads, num_tokens, head_dim = keys.shape
    g = spec.group_tokens
    num_groups = -(-num_tokens // g)
    pad = num_groups * g - num_tokens
    # groups of g tokens: pad by repeating the last token (it does not widen the group's range)
    padded = np.concatenate([keys, np.repeat(keys[:, -1:], pad, axis=1)], 1) if pad else keys
    grouped = padded.reshape(num_heads, num_groups, g, head_dim)
    if spec.scale_bits == 8:  # second level per key channel (over its groups), per value head (over tokens)
        k_codes, k_lo, k_step, k_ranges = _quantize_two_level(grouped, 2, spec.key_bits, slice_axis=1)
        v_codes, v_lo, v_step, v_ranges = _quantize_two_level(values, 2, spec.value_bits, slice_axis=1)
        scales = [k_lo, k_step, v_lo, v_step]  # u8 [H, G, 1, D] x2, [H, n, 1] x2
        tails = [k_ranges.tobytes(), v_ranges.tobytes()]  # fp16 [4, H, 1, 1, D], [4, H, 1, 1]
    else:
        k_codes, k_lo, k_step = _quantize(grouped, 2, spec.key_bits)
        v_codes, v_lo, v_step = _quantize(values, 2, spec.value_bits)  # [H, n, D], [H, n, 1]
        scales, tails = [k_lo, k_step, v_lo, v_step], []
    k_codes = torch.from_numpy(k_codes.reshape(num_heads, num_groups * g, head_dim)[:, :num_tokens])
    v_codes = torch.from_numpy(v_codes)
    if spec.is_delta:
        k_codes, v_codes = _delta(k_codes, spec.key_bits), _delta(v_codes, spec.value_bits)
    raw = b"".join([
        _pack(k_codes.contiguous(), spec.key_bits).numpy().tobytes(),
        _pack(v_codes.contiguous(), spec.value_bits).numpy().tobytes(),
        *(np.ascontiguousarray(a).tobytes() for a in scales),
        *tails,
    ])
    return _compressor(spec.zstd_level).compress(raw) if spec.zstd_level > 0 else raw


def _scale_sizes(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> list[int]:
    """Bytes of each scale part, in payload order (see the module's doc)."""
    num_groups = -(-num_tokens // spec.group_tokens)
    num_k, num_v = num_heads * num_groups * head_dim, num_heads * num_tokens
    if spec.scale_bits == 8:
        return [num_k, num_k, num_v, num_v, 2 * 4 * num_heads * head_dim, 2 * 4 * num_heads]
    return [2 * num_k, 2 * num_k, 2 * num_v, 2 * num_v]


def raw_size(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> int:
    codes = num_heads * num_tokens * head_dim
    return (_packed_len(codes, spec.key_bits) + _packed_len(codes, spec.value_bits)
            + sum(_scale_sizes(num_heads, num_tokens, head_dim, spec)))


def packed_size(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> int:
    """Bytes of a layer before zstd (what zstd's output stays near or below, plus its frame header)."""
    return raw_size(num_heads, num_tokens, head_dim, spec) + 64


def decode_layer(payload, num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec,
                 dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """One payload -> kv [2, H, n, D] in `dtype` (CPU). Raises ValueError on a malformed payload."""
    size = raw_size(num_heads, num_tokens, head_dim, spec)
    if spec.zstd_level > 0:
        try:
            raw = _decompressor().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from exc
    else:
        raw = payload
    buf = np.frombuffer(raw, dtype=np.uint8)
    if buf.size != size:
        raise ValueError(f"payload decodes to {buf.size} bytes, expected {size}")
    t = torch.from_numpy(buf.copy()) if not buf.flags.writeable else torch.from_numpy(buf)
    n_codes = num_heads * num_tokens * head_dim
    num_groups = -(-num_tokens // spec.group_tokens)
    n_k, n_v = _packed_len(n_codes, spec.key_bits), _packed_len(n_codes, spec.value_bits)
    parts = torch.split(t, [n_k, n_v, *_scale_sizes(num_heads, num_tokens, head_dim, spec)])
    k_codes = _unpack(parts[0], spec.key_bits, n_codes).view(num_heads, num_tokens, head_dim)
    v_codes = _unpack(parts[1], spec.value_bits, n_codes).view(num_heads, num_tokens, head_dim)
    if spec.is_delta:
        k_codes, v_codes = _undelta(k_codes, spec.key_bits), _undelta(v_codes, spec.value_bits)
    k_shape, v_shape = (num_heads, num_groups, 1, head_dim), (num_heads, num_tokens, 1)
    if spec.scale_bits == 8:
        k_ranges = _Ranges.frombuffer(parts[6].numpy(), (num_heads, 1, 1, head_dim))
        v_ranges = _Ranges.frombuffer(parts[7].numpy(), (num_heads, 1, 1))
        k_lo, k_step = k_ranges.lo(parts[2].numpy().reshape(k_shape)), k_ranges.step(parts[3].numpy().reshape(k_shape))
        v_lo, v_step = v_ranges.lo(parts[4].numpy().reshape(v_shape)), v_ranges.step(parts[5].numpy().reshape(v_shape))
    else:
        k_lo, k_step = (p.numpy().view(np.float16).astype(np.float32).reshape(k_shape) for p in parts[2:4])
        v_lo, v_step = (p.numpy().view(np.float16).astype(np.float32).reshape(v_shape) for p in parts[4:6])
    g = spec.group_tokens
    pad = num_groups * g - num_tokens
    k = k_codes.numpy()
    if pad:
        k = np.concatenate([k, np.zeros((num_heads, pad, head_dim), np.uint8)], 1)
    # code * step + min, in fp32 (numpy: see _quantize), per key group / value token
    k = (k.reshape(num_heads, num_groups, g, head_dim) * k_step + k_lo).reshape(num_heads, num_groups * g, head_dim)
    v = v_codes.numpy() * v_step + v_lo
    out = np.empty((2, num_heads, num_tokens, head_dim), dtype=np.float32)  # [2, H, n, D]
    out[0] = k[:, :num_tokens]
    out[1] = v
    return _cast(torch.from_numpy(out), dtype)


_CAST_SLICE = 32_768  # elements: below torch's grain size, so a cast runs on the calling thread alone


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (fp32, contiguous) in `dtype`. torch casts with the CPU's conversion instructions (numpy's fp16
    cast is ~10x slower here), but a cast over its grain size starts an OpenMP team on this (loader)
    thread beside the engine's, which on 2 cores cost more than the cast (measured 12 ms against 4 ms
    a layer): slices below the grain size stay on this thread."""
    if dtype == torch.float32:
        return x
    out = torch.empty(x.shape, dtype=dtype)
    for dst, src in zip(out.view(-1).split(_CAST_SLICE), x.view(-1).split(_CAST_SLICE)):
        dst.copy_(src)
    return out
