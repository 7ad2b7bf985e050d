"""Low-bit KV at rest: keys quantized per channel over groups of tokens, values per token
(KIVI's split: keys have outlier channels, values do not), codes bit-packed (any width 1..8) and
entropy-coded by zstd (the `zstandard` package), optionally as token-wise deltas (CacheGen's idea).
One layer is one self-contained payload, so a reader decodes layer by layer as it streams.

Widths by range (`BitWidths.BY_RANGE`): a head's key channels differ in range by 100x and more, its
value tokens by 10x; at one width for all, the widest few carry most of the error (measured:
docs/benchmarks/kv-codec.md). So each head's bits (`key_bits` x D for its key channels, `value_bits`
x n for its value tokens: averages, halves allowed) are spread by transform coding's greedy rule
(`_widths_by_range`): a slice's squared error shrinks 4x per bit, each bit goes where it removes the
most. A width (1..8) per key channel and per value token is stored with the layer.

Payload of a layer, before zstd: key part | value part | the scales. A part at one width: its codes
[H, n, D] packed. A part with widths by range: the widths minus 1, 3 bits each ([H, D] for keys,
[H, n] for values), then the codes of each width's slices, width 1 first ([channels, n] for keys,
[tokens, D] for values), each packed at its width. The scales (G = ceil(n / group)):
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
from enum import Enum

import numpy as np
import torch
import zstandard

MIN_BITS, MAX_BITS = 1, 8  # the widths a code can have


class BitWidths(str, Enum):
    """How a layer's bits are spread over its slices (a key channel, a value token)."""

    UNIFORM = "uniform"  # every slice at the spec's bits
    BY_RANGE = "by_range"  # the spec's bits on average over each head's slices, by their ranges


@dataclass(frozen=True)
class LowBitSpec:
    key_bits: float = 4  # BY_RANGE: the average over each head's channels (a multiple of 1/2), else a width
    value_bits: float = 4  # BY_RANGE: the average over each head's tokens, as keys
    group_tokens: int = 64  # keys: one (min, step) per channel per this many tokens
    zstd_level: int = 3  # 0: no zstd (codes stored raw, one per byte)
    is_delta: bool = False  # codes stored as differences from the previous token's (mod 2^bits)
    scale_bits: int = 16  # 16: each group's min and step in fp16; 8: two-level (see the module's doc)
    key_widths: BitWidths = BitWidths.UNIFORM
    value_widths: BitWidths = BitWidths.UNIFORM

    def __post_init__(self) -> None:
        if self.scale_bits not in (8, 16):
            raise ValueError(f"scale_bits must be 8 or 16, got {self.scale_bits}")
        for bits, widths in ((self.key_bits, self.key_widths), (self.value_bits, self.value_widths)):
            if not MIN_BITS <= bits <= MAX_BITS:
                raise ValueError(f"bit widths must be {MIN_BITS}..{MAX_BITS}, got {bits}")
            step = 0.5 if widths is BitWidths.BY_RANGE else 1
            if bits % step:
                raise ValueError(f"{bits} bits: a {'width' if step == 1 else 'multiple of 1/2'} is needed")
        if self.group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1, got {self.group_tokens}")
        if self.is_delta and BitWidths.BY_RANGE in (self.key_widths, self.value_widths):
            raise ValueError("token-wise deltas take one width per tensor: not with widths by range")

    @property
    def tag(self) -> str:
        def part(bits: float, widths: BitWidths) -> str:
            return f"{bits:g}{'r' if widths is BitWidths.BY_RANGE else ''}"

        delta = "d" if self.is_delta else ""
        scales = "s8" if self.scale_bits == 8 else ""
        return (f"k{part(self.key_bits, self.key_widths)}v{part(self.value_bits, self.value_widths)}"
                f"g{self.group_tokens}{delta}z{self.zstd_level}{scales}")


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


def _levels(bits: int | np.ndarray) -> int | np.ndarray:
    """The largest code of each width (bits: a width, or widths broadcastable against the scales)."""
    return (1 << np.asarray(bits, dtype=np.int32)) - 1


def _quantize(x: np.ndarray, axis: int, bits: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantization along `axis`: codes u8, min and step fp16 (keepdims).

    numpy, not torch: on small per-layer arrays torch's thread pool costs ~100x the arithmetic
    (measured on this 2-core CPU: round_ 4 ms vs np.rint 0.014 ms for 32k values)."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    levels = _levels(bits)
    lo16 = lo.astype(np.float16)
    step16 = np.maximum((hi - lo) / levels, 1e-6).astype(np.float16)  # fp16: what the decoder sees
    codes = np.clip(np.rint((x - lo16.astype(np.float32)) / step16.astype(np.float32)), 0, levels)
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


def _quantize_two_level(x: np.ndarray, axis: int, bits: int | np.ndarray, slice_axis: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Ranges]:
    """As `_quantize`, with each group's min and step as 8-bit codes over a `_Ranges` shared along
    `slice_axis` (the groups of one key channel, the tokens of one value head).
    Returns codes u8 (x's shape), min codes and step codes u8 (keepdims along `axis`), the ranges."""
    levels = _levels(bits)
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


def _unpack_codes(p: np.ndarray, bits: int, numel: int) -> np.ndarray:
    """`_pack`'s output -> its first `numel` codes, u8 (numpy throughout: a decode makes a dozen calls
    a layer, where torch's per-op cost would show)."""
    if bits == 8:
        return p[:numel]
    if bits == 1:
        return np.unpackbits(p, bitorder="little")[:numel]
    if bits in (2, 4):  # 4 or 2 codes a byte, the first lowest: one op per code, then one interleave
        mask = (1 << bits) - 1
        return np.stack([(p >> shift) & mask for shift in range(0, 8, bits)], 1).reshape(-1)[:numel]
    # 3, 5, 6, 7: 8 codes fill `bits` bytes. Code i is byte (i * bits) // 8 shifted, ORed with the next
    # byte where it straddles: a few byte-wide ops per code over all groups of 8 at once (2x the
    # bit-array and uint64 unpacks it replaced, measured at 20k-60k codes)
    num_words = -(-numel // 8)
    if p.size < num_words * bits:
        p = np.concatenate([p, np.zeros(num_words * bits - p.size, np.uint8)])
    words = p[: num_words * bits].reshape(num_words, bits)  # [numel / 8, bits]
    columns = [np.ascontiguousarray(words[:, j]) for j in range(bits)]  # byte j of every group
    mask = np.uint8((1 << bits) - 1)
    codes = np.empty((num_words, 8), np.uint8)  # [numel / 8, 8]
    for i in range(8):
        byte, shift = divmod(i * bits, 8)
        code = columns[byte] >> shift
        if shift + bits > 8:
            code |= columns[byte + 1] << (8 - shift)
        if shift + bits != 8:
            code &= mask
        codes[:, i] = code
    return codes.reshape(-1)[:numel]


def _packed_len(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


def _widths_by_range(importance: np.ndarray, total_bits: int) -> np.ndarray:
    """Widths u8 [H, m] summing to `total_bits` over each head's m slices, from each slice's
    `importance` [H, m] (its squared quantization range).

    Transform coding's greedy rule: a slice at b bits has squared error ~ importance * 4^-b, so the
    bit b -> b + 1 removes importance * 4^-b * 3/4. The bits above MIN_BITS go to the largest such
    gains over all slices and widths; a slice's gains shrink 4x per bit, so the ones taken are a
    prefix of each slice's: its width is MIN_BITS plus how many it got."""
    num_heads, num_slices = importance.shape
    steps = np.arange(MIN_BITS, MAX_BITS, dtype=np.float64)  # [W]: the b of each step b -> b + 1
    gains = importance.astype(np.float64)[:, :, None] * 4.0 ** -steps  # [H, m, W]
    num_extra = total_bits - MIN_BITS * num_slices
    taken = np.argsort(-gains.reshape(num_heads, -1), axis=1, kind="stable")[:, :num_extra]  # [H, extra]
    is_taken = np.zeros((num_heads, num_slices * len(steps)), dtype=bool)
    np.put_along_axis(is_taken, taken, True, axis=1)
    return (MIN_BITS + is_taken.reshape(num_heads, num_slices, -1).sum(-1)).astype(np.uint8)


def _total_bits(avg_bits: float, num_slices: int) -> int:
    """A head's bits over its slices at `avg_bits` on average."""
    return int(np.floor(avg_bits * num_slices + 0.5))


_WIDTH_CODE_BITS = 3  # a stored width: width - MIN_BITS in 0..7


def _pack_by_width(codes: np.ndarray, widths: np.ndarray) -> bytes:
    """codes u8 [H, m, len] of slices with `widths` [H, m] -> the widths, then each width's slices
    [slices, len] packed at that width, in order (the part's layout: the module's doc)."""
    stored = _pack(torch.from_numpy(np.ascontiguousarray(widths - MIN_BITS)), _WIDTH_CODE_BITS)
    return stored.numpy().tobytes() + b"".join(
        _pack(torch.from_numpy(np.ascontiguousarray(codes[widths == bits])), bits).numpy().tobytes()
        for bits in range(MIN_BITS, MAX_BITS + 1))


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
    key_bits: float | np.ndarray = spec.key_bits
    value_bits: float | np.ndarray = spec.value_bits
    key_widths = value_widths = None
    if spec.key_widths is BitWidths.BY_RANGE:  # a channel's importance: its groups' mean squared range
        spans = (grouped.max(axis=2) - grouped.min(axis=2)).astype(np.float64)  # [H, G, D]
        key_widths = _widths_by_range((spans**2).mean(axis=1), _total_bits(spec.key_bits, head_dim))  # [H, D]
        key_bits = key_widths[:, None, None, :]  # [H, 1, 1, D], as the group scales
    if spec.value_widths is BitWidths.BY_RANGE:  # a token's importance: its squared range
        spans = (values.max(axis=2) - values.min(axis=2)).astype(np.float64)  # [H, n]
        value_widths = _widths_by_range(spans**2, _total_bits(spec.value_bits, num_tokens))  # [H, n]
        value_bits = value_widths[:, :, None]  # [H, n, 1], as the token scales
    if spec.scale_bits == 8:  # second level per key channel (over its groups), per value head (over tokens)
        k_codes, k_lo, k_step, k_ranges = _quantize_two_level(grouped, 2, key_bits, slice_axis=1)
        v_codes, v_lo, v_step, v_ranges = _quantize_two_level(values, 2, value_bits, slice_axis=1)
        scales = [k_lo, k_step, v_lo, v_step]  # u8 [H, G, 1, D] x2, [H, n, 1] x2
        tails = [k_ranges.tobytes(), v_ranges.tobytes()]  # fp16 [4, H, 1, 1, D], [4, H, 1, 1]
    else:
        k_codes, k_lo, k_step = _quantize(grouped, 2, key_bits)
        v_codes, v_lo, v_step = _quantize(values, 2, value_bits)  # [H, n, D], [H, n, 1]
        scales, tails = [k_lo, k_step, v_lo, v_step], []
    k_codes = k_codes.reshape(num_heads, num_groups * g, head_dim)[:, :num_tokens]  # [H, n, D]
    raw = b"".join([
        _pack_by_width(k_codes.transpose(0, 2, 1), key_widths) if key_widths is not None  # [H, D, n]: by channel
        else _uniform_part(k_codes, spec.key_bits, spec.is_delta),
        _pack_by_width(v_codes, value_widths) if value_widths is not None  # [H, n, D]: by token
        else _uniform_part(v_codes, spec.value_bits, spec.is_delta),
        *(np.ascontiguousarray(a).tobytes() for a in scales),
        *tails,
    ])
    return _compressor(spec.zstd_level).compress(raw) if spec.zstd_level > 0 else raw


def _uniform_part(codes: np.ndarray, bits: float, is_delta: bool) -> bytes:
    """codes u8 [H, n, D] at one width, packed (as token-wise deltas where asked)."""
    tensor = torch.from_numpy(np.ascontiguousarray(codes))
    return _pack(_delta(tensor, int(bits)) if is_delta else tensor, int(bits)).numpy().tobytes()


def _scale_sizes(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> list[int]:
    """Bytes of each scale part, in payload order (see the module's doc)."""
    num_groups = -(-num_tokens // spec.group_tokens)
    num_k, num_v = num_heads * num_groups * head_dim, num_heads * num_tokens
    if spec.scale_bits == 8:
        return [num_k, num_k, num_v, num_v, 2 * 4 * num_heads * head_dim, 2 * 4 * num_heads]
    return [2 * num_k, 2 * num_k, 2 * num_v, 2 * num_v]


def _max_part_size(num_heads: int, num_slices: int, slice_len: int, bits: float, widths: BitWidths) -> int:
    """Bytes of a part at most (exactly, at one width; by range, each width's codes padded to whole bytes
    apart: at most one byte more per width)."""
    if widths is BitWidths.UNIFORM:
        return _packed_len(num_heads * num_slices * slice_len, int(bits))
    return (_packed_len(num_heads * num_slices, _WIDTH_CODE_BITS)
            + _packed_len(num_heads * _total_bits(bits, num_slices) * slice_len, 1) + (MAX_BITS - MIN_BITS + 1))


def raw_size(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> int:
    """Bytes of a layer before zstd (at most this, with widths by range: `_max_part_size`)."""
    return (_max_part_size(num_heads, head_dim, num_tokens, spec.key_bits, spec.key_widths)
            + _max_part_size(num_heads, num_tokens, head_dim, spec.value_bits, spec.value_widths)
            + sum(_scale_sizes(num_heads, num_tokens, head_dim, spec)))


def packed_size(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> int:
    """Bytes of a layer before zstd (what zstd's output stays near or below, plus its frame header)."""
    return raw_size(num_heads, num_tokens, head_dim, spec) + 64


class _Reader:
    """Takes a raw payload's parts in order, checking each fits."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.offset = buf, 0  # u8 [bytes]

    def take(self, size: int) -> np.ndarray:
        if self.offset + size > self.buf.size:
            raise ValueError(f"payload of {self.buf.size} bytes ends before its parts")
        self.offset += size
        return self.buf[self.offset - size : self.offset]


def _take_part(reader: _Reader, num_heads: int, num_slices: int, slice_len: int, bits: float,
               widths: BitWidths) -> tuple[np.ndarray | None, np.ndarray]:
    """One code part of m slices of `slice_len` codes each: its stored widths [H, m] (None at one width)
    and its packed codes (by range: every width's, one after the other, width 1 first)."""
    if widths is BitWidths.UNIFORM:
        return None, reader.take(_packed_len(num_heads * num_slices * slice_len, int(bits)))
    num_widths = num_heads * num_slices
    stored = reader.take(_packed_len(num_widths, _WIDTH_CODE_BITS))
    slice_widths = _unpack_codes(stored, _WIDTH_CODE_BITS, num_widths).reshape(num_heads, num_slices) + MIN_BITS
    if (slice_widths.sum(axis=1, dtype=np.int64) != _total_bits(bits, num_slices)).any():
        raise ValueError("damaged bit widths: a head's do not sum to its bits")
    counts = np.bincount(slice_widths.reshape(-1), minlength=MAX_BITS + 1)  # slices of each width
    size = sum(_packed_len(int(counts[b]) * slice_len, b) for b in range(MIN_BITS, MAX_BITS + 1))
    return slice_widths, reader.take(size)


def _codes_by_width(packed: np.ndarray, widths: np.ndarray, slice_len: int) -> np.ndarray:
    """A part with widths by range -> its codes u8 [H, m, slice_len], each slice back in its place
    (`packed`: each width's slices in order, width 1 first, each width's codes padded to whole bytes).
    Each width's codes are unpacked into the slices sorted by width, then put back in one scatter."""
    flat = widths.reshape(-1)  # [H * m]
    order = np.argsort(flat, kind="stable")  # slice numbers, by width, in order within a width
    counts = np.bincount(flat, minlength=MAX_BITS + 1)
    by_width = np.empty((flat.size, slice_len), dtype=np.uint8)  # [H * m, len], slices in `order`
    start = row = 0
    for bits in range(MIN_BITS, MAX_BITS + 1):
        num_slices = int(counts[bits])
        if num_slices == 0:
            continue
        size = _packed_len(num_slices * slice_len, bits)
        by_width[row : row + num_slices] = _unpack_codes(packed[start : start + size], bits,
                                                         num_slices * slice_len).reshape(num_slices, slice_len)
        start, row = start + size, row + num_slices
    codes = np.empty_like(by_width)
    codes[order] = by_width
    return codes.reshape(*widths.shape, slice_len)


def _uniform_codes(packed: np.ndarray, bits: float, shape: tuple[int, int, int], is_delta: bool) -> np.ndarray:
    """A part at one width -> its codes u8 [H, n, D], as stored (deltas along n undone)."""
    codes = _unpack_codes(packed, int(bits), shape[0] * shape[1] * shape[2]).reshape(shape)
    if is_delta:
        return _undelta(torch.from_numpy(codes.copy()), int(bits)).numpy()
    return codes if codes.flags.writeable else codes.copy()  # 8 bits: a view of the payload, read-only for torch


def _raw_reader(payload, num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> _Reader:
    if spec.zstd_level > 0:
        try:
            raw = _decompressor().decompress(payload, max_output_size=raw_size(num_heads, num_tokens, head_dim, spec))
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from exc
    else:
        raw = payload
    return _Reader(np.frombuffer(raw, dtype=np.uint8))


def layer_widths(payload, num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The widths a payload's codes have: per key channel [H, D] and per value token [H, n] (u8; at one
    width, that width everywhere)."""
    reader = _raw_reader(payload, num_heads, num_tokens, head_dim, spec)
    out = []
    for bits, widths, num_slices, slice_len in ((spec.key_bits, spec.key_widths, head_dim, num_tokens),
                                                (spec.value_bits, spec.value_widths, num_tokens, head_dim)):
        slice_widths, _ = _take_part(reader, num_heads, num_slices, slice_len, bits, widths)
        out.append(np.full((num_heads, num_slices), int(bits), dtype=np.uint8) if slice_widths is None
                   else slice_widths)
    return out[0], out[1]


def decode_layer(payload, num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec,
                 dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """One payload -> kv [2, H, n, D] in `dtype` (CPU). Raises ValueError on a malformed payload."""
    reader = _raw_reader(payload, num_heads, num_tokens, head_dim, spec)
    if spec.key_widths is BitWidths.BY_RANGE:  # by channel: m = D slices of n codes
        k_widths, k_packed = _take_part(reader, num_heads, head_dim, num_tokens, spec.key_bits, spec.key_widths)
    else:
        k_widths, k_packed = _take_part(reader, num_heads, num_tokens, head_dim, spec.key_bits, spec.key_widths)
    v_widths, v_packed = _take_part(reader, num_heads, num_tokens, head_dim, spec.value_bits, spec.value_widths)
    scale_parts = [reader.take(size) for size in _scale_sizes(num_heads, num_tokens, head_dim, spec)]
    if reader.offset != reader.buf.size:
        raise ValueError(f"payload decodes to {reader.buf.size} bytes, expected {reader.offset}")
    num_groups = -(-num_tokens // spec.group_tokens)
    k_shape, v_shape = (num_heads, num_groups, head_dim), (num_heads, num_tokens)
    if spec.scale_bits == 8:
        k_ranges = _Ranges.frombuffer(scale_parts[4], (num_heads, 1, head_dim))
        v_ranges = _Ranges.frombuffer(scale_parts[5], (num_heads, 1))
        k_lo, k_step = k_ranges.lo(scale_parts[0].reshape(k_shape)), k_ranges.step(scale_parts[1].reshape(k_shape))
        v_lo, v_step = v_ranges.lo(scale_parts[2].reshape(v_shape)), v_ranges.step(scale_parts[3].reshape(v_shape))
    else:
        k_lo, k_step = (p.view(np.float16).astype(np.float32).reshape(k_shape) for p in scale_parts[0:2])
        v_lo, v_step = (p.view(np.float16).astype(np.float32).reshape(v_shape) for p in scale_parts[2:4])
    # code * step + min in fp32: k_* [H, G, D] per key group, v_* [H, n] per token
    out = np.empty((2, num_heads, num_tokens, head_dim), dtype=np.float32)  # [2, H, n, D]
    if k_widths is not None:  # by channel: codes [H, D, n], seen as [H, n, D]
        k = _codes_by_width(k_packed, k_widths, num_tokens).transpose(0, 2, 1)
    else:
        k = _uniform_codes(k_packed, spec.key_bits, (num_heads, num_tokens, head_dim), spec.is_delta)
    _dequantize_keys(k, k_step, k_lo, spec.group_tokens, torch.from_numpy(out[0]))
    if v_widths is not None:  # by token: codes [H, n, D]
        v = _codes_by_width(v_packed, v_widths, head_dim)
    else:
        v = _uniform_codes(v_packed, spec.value_bits, (num_heads, num_tokens, head_dim), spec.is_delta)
    torch.from_numpy(out[1]).copy_(torch.from_numpy(v)).mul_(torch.from_numpy(v_step[..., None])).add_(
        torch.from_numpy(v_lo[..., None]))
    return _cast(torch.from_numpy(out), dtype)


def _dequantize_keys(codes: np.ndarray, step: np.ndarray, lo: np.ndarray, group_tokens: int,
                     out: torch.Tensor) -> None:
    """codes u8 [H, n, D] -> out [H, n, D] fp32 = code * step + min, per group of tokens (step, lo
    [H, G, D]). torch's in-place cast, multiply and add: 1.4-2x numpy's mixed u8 x fp32 ufuncs here."""
    num_heads, num_tokens, head_dim = codes.shape
    out.copy_(torch.from_numpy(codes))
    num_full = num_tokens // group_tokens  # whole groups; a last, shorter group apart (no padded copy)
    full = out[:, : num_full * group_tokens].unflatten(1, (num_full, group_tokens))  # [H, G_full, g, D], a view
    full.mul_(torch.from_numpy(step[:, :num_full, None])).add_(torch.from_numpy(lo[:, :num_full, None]))
    if num_full * group_tokens < num_tokens:
        tail = out[:, num_full * group_tokens :]  # [H, n - num_full * g, D]
        tail.mul_(torch.from_numpy(step[:, num_full, None])).add_(torch.from_numpy(lo[:, num_full, None]))


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
