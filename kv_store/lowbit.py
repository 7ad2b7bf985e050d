"""Low-bit KV at rest: keys quantized per channel over groups of tokens, values per token
(KIVI's split: keys have outlier channels, values do not), codes kept one per byte and entropy-coded
bit-packed where the width divides a byte (1, 2, 4 bits; else one per byte) and entropy-coded by zstd
(the `zstandard` package), optionally as token-wise deltas (CacheGen's idea). One layer is one
self-contained payload, so a reader decodes layer by layer as it streams.

Payload of a layer, before zstd: key codes [H, n, D] | value codes [H, n, D] (packed) |
key min, key step [H, G, D] fp16 | value min, value step [H, n, 1] fp16   (G = ceil(n / group)).
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

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if not 1 <= bits <= 8:
                raise ValueError(f"bit widths must be 1..8, got {bits}")
        if self.group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1, got {self.group_tokens}")

    @property
    def tag(self) -> str:
        delta = "d" if self.is_delta else ""
        return f"k{self.key_bits}v{self.value_bits}g{self.group_tokens}{delta}z{self.zstd_level}"


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


def _quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization along `dim`: codes u8, min and step fp16 (keepdim)."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo16 = lo.half()
    step16 = ((hi - lo) / (2**bits - 1)).clamp_min(1e-6).half()  # fp16: what the decoder sees
    codes = ((x - lo16.float()) / step16.float()).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, lo16, step16


def _delta(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [H, n, D] -> first token's codes, then differences mod 2^bits along the token axis."""
    out = codes.clone()
    out[:, 1:] = (codes[:, 1:].to(torch.int16) - codes[:, :-1].to(torch.int16)).remainder_(2**bits).to(torch.uint8)
    return out


def _undelta(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return codes.to(torch.int32).cumsum_(1).remainder_(2**bits).to(torch.uint8)


def _per_byte(bits: int) -> int:
    return 8 // bits if bits in (1, 2, 4) else 1


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes u8 (any shape) -> bytes [ceil(numel / per byte)], the first code in the low bits."""
    per = _per_byte(bits)
    flat = codes.reshape(-1)
    if per == 1:
        return flat
    pad = -flat.numel() % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, per).to(torch.int32)
    out = torch.zeros(groups.shape[0], dtype=torch.int32)
    for i in range(per):
        out |= groups[:, i] << (i * bits)
    return out.to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = _per_byte(bits)
    if per == 1:
        return packed
    p = packed.to(torch.int32)
    mask = (1 << bits) - 1
    out = torch.stack([(p >> (i * bits)) & mask for i in range(per)], 1).reshape(-1)
    return out[:numel].to(torch.uint8)


def _packed_len(numel: int, bits: int) -> int:
    return -(-numel // _per_byte(bits))


def encode_layer(kv: torch.Tensor, spec: LowBitSpec) -> bytes:
    """kv [2, H, n, D] (any float dtype, CPU) -> one compressed payload."""
    keys, values = kv[0].float(), kv[1].float()  # [H, n, D]
    num_heads, num_tokens, head_dim = keys.shape
    g = spec.group_tokens
    num_groups = -(-num_tokens // g)
    pad = num_groups * g - num_tokens
    # groups of g tokens: pad by repeating the last token (it does not widen the group's range)
    padded = torch.cat([keys, keys[:, -1:].expand(num_heads, pad, head_dim)], 1) if pad else keys
    k_codes, k_lo, k_step = _quantize(padded.view(num_heads, num_groups, g, head_dim), 2, spec.key_bits)
    k_codes = k_codes.view(num_heads, num_groups * g, head_dim)[:, :num_tokens]
    v_codes, v_lo, v_step = _quantize(values, 2, spec.value_bits)  # [H, n, D], [H, n, 1]
    if spec.is_delta:
        k_codes, v_codes = _delta(k_codes, spec.key_bits), _delta(v_codes, spec.value_bits)
    raw = b"".join(t.contiguous().numpy().tobytes() for t in (
        _pack(k_codes, spec.key_bits), _pack(v_codes, spec.value_bits), k_lo.view(torch.int16), k_step.view(torch.int16), v_lo.view(torch.int16),
        v_step.view(torch.int16),
    ))
    return _compressor(spec.zstd_level).compress(raw) if spec.zstd_level > 0 else raw


def raw_size(num_heads: int, num_tokens: int, head_dim: int, spec: LowBitSpec) -> int:
    num_groups = -(-num_tokens // spec.group_tokens)
    codes = num_heads * num_tokens * head_dim
    return (_packed_len(codes, spec.key_bits) + _packed_len(codes, spec.value_bits)
            + 4 * num_heads * num_groups * head_dim + 4 * num_heads * num_tokens)


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
    n_kscale = num_heads * num_groups * head_dim
    n_k, n_v = _packed_len(n_codes, spec.key_bits), _packed_len(n_codes, spec.value_bits)
    parts = torch.split(t, [n_k, n_v, 2 * n_kscale, 2 * n_kscale, 2 * num_heads * num_tokens,
                            2 * num_heads * num_tokens])
    k_codes = _unpack(parts[0], spec.key_bits, n_codes).view(num_heads, num_tokens, head_dim)
    v_codes = _unpack(parts[1], spec.value_bits, n_codes).view(num_heads, num_tokens, head_dim)
    if spec.is_delta:
        k_codes, v_codes = _undelta(k_codes, spec.key_bits), _undelta(v_codes, spec.value_bits)
    k_lo, k_step = (p.view(torch.float16).view(num_heads, num_groups, 1, head_dim) for p in parts[2:4])
    v_lo, v_step = (p.view(torch.float16).view(num_heads, num_tokens, 1) for p in parts[4:6])
    out = torch.empty((2, num_heads, num_tokens, head_dim), dtype=dtype)  # [2, H, n, D]
    g = spec.group_tokens
    pad = num_groups * g - num_tokens
    k = k_codes.to(torch.float16)
    if pad:
        k = torch.cat([k, k.new_zeros(num_heads, pad, head_dim)], 1)
    # per group: code * step + min, in fp16 (the codes are exact in fp16; the product rounds once)
    k = torch.addcmul(k_lo, k.view(num_heads, num_groups, g, head_dim), k_step)
    out[0] = k.view(num_heads, num_groups * g, head_dim)[:, :num_tokens]
    out[1] = torch.addcmul(v_lo, v_codes.to(torch.float16), v_step)
    return out
