"""GGUF's block quantization types decoded into levels and per-block scales, in torch.

Every type this module decodes stores a value as `level * scale + offset`, with the integer level per
value and the scale (and, for the asymmetric types, the offset) per block of `block` values along a
row. Kept apart, they let the loader hand 4-bit types to the int4 kernel level for level (no
re-quantization), hold an embedding in int8 blocks exactly, and dequantize anything else in one
vectorized pass. The arithmetic is gguf-py's own (`gguf.quants`, llama.cpp's reference), in the same
fp32 order, so `dequantize` here is bit for bit gguf's (tests/test_gguf_loader.py checks each type on
random blocks). It is re-done in torch for speed: gguf's numpy dequantizes Qwen2.5-1.5B's Q4_K
tensors in 10 s on one core, this on the torch pool in a fraction of it. Types not decoded here
(Q5_1, Q2_K, Q3_K, Q5_K) are dequantized by gguf itself, slower but exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize

FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16})
# levels and scales decoded here, in torch
BLOCK_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K})
# dequantized by gguf-py (numpy) only
GGUF_ONLY_TYPES = frozenset({QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q5_K})
SUPPORTED_TYPES = FLOAT_TYPES | BLOCK_TYPES | GGUF_ONLY_TYPES
# 16 levels in blocks of 32 along a row: what the int4 kernel holds level for level
INT4_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})


@dataclass(frozen=True)
class Blocks:
    """A matrix as `levels * scale + offset`, per block of `block` values along each row."""

    levels: torch.Tensor  # [rows, cols] int8
    scales: torch.Tensor  # [rows, cols / block] fp32
    offsets: torch.Tensor | None  # [rows, cols / block] fp32; None: symmetric (offset 0)
    block: int

    def dequantized(self) -> torch.Tensor:
        """[rows, cols] fp32, computed as gguf-py computes it."""
        rows, cols = self.levels.shape
        values = self.levels.reshape(rows, -1, self.block).float() * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        return values.reshape(rows, cols)


def type_name(qtype: int) -> str:
    try:
        return QT(qtype).name
    except ValueError:
        return f"type {qtype}"


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes one row of `cols` values takes in `qtype`."""
    block, size = GGML_QUANT_SIZES[QT(qtype)]
    if cols % block:
        raise ValueError(f"a {type_name(qtype)} row of {cols} values is not a whole number of {block}-value blocks")
    return cols // block * size


def decode_blocks(raw: np.ndarray, qtype: int, cols: int) -> Blocks:
    """raw [rows, row_bytes] uint8 of a BLOCK_TYPES tensor -> its levels and scales."""
    qtype = QT(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, type_size)  # [rows * blocks, type_size] uint8
    n = data.shape[0]

    def fp16(col: int) -> torch.Tensor:  # [n] fp32 from the fp16 at byte `col` of each block
        return data[:, col:col + 2].contiguous().view(torch.float16).float().reshape(n)

    def nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, k] uint8 -> [n, 2, k]: low nibbles, then high
        return torch.stack([qs & 0x0F, qs >> 4], dim=1)

    offsets = None
    if qtype in (QT.Q4_0, QT.Q4_1):
        head = 2 if qtype == QT.Q4_0 else 4
        levels = nibbles(data[:, head:]).reshape(n, 32).to(torch.int8)  # element j: low nibble of byte j, j+16: high
        scales = fp16(0)
        if qtype == QT.Q4_0:
            levels = levels - 8
        else:
            offsets = fp16(2)
    elif qtype == QT.Q5_0:
        high = data[:, 2:6].contiguous().view(torch.int32).reshape(n, 1)  # bit j: element j's fifth bit
        high = (high >> torch.arange(32, dtype=torch.int32)) & 1  # [n, 32]
        low = nibbles(data[:, 6:]).reshape(n, 32)
        levels = (low.to(torch.int32) | (high << 4)).to(torch.int8) - 16
        scales = fp16(0)
    elif qtype == QT.Q8_0:
        levels = data[:, 2:].contiguous().view(torch.int8)
        scales = fp16(0)
    elif qtype == QT.Q4_K:
        # d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles:
        # byte chunk c (32 bytes) holds sub-block 2c in its low nibbles and 2c + 1 in its high ones
        sc, mn = (torch.from_numpy(np.asarray(x)) for x in Q4_K.get_scale_min(data[:, 4:16].numpy()))  # [n, 8]
        qs = data[:, 16:].reshape(n, 4, 32)
        levels = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n * 8, 32).to(torch.int8)
        scales = (fp16(0)[:, None] * sc.float()).reshape(n * 8)
        offsets = -(fp16(2)[:, None] * mn.float()).reshape(n * 8)
        block_size = 32
    elif qtype == QT.Q6_K:
        # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 values), d (fp16)
        ql = data[:, :128].reshape(n, 2, 64)
        ql = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 2, 2, 32)  # [n, half, nibble, 2, 32]
        qh = data[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(n, 2, 2, 2, 32)  # [n, half, shift pair, 2, 32]: 4 shifts per half
        levels = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n * 16, 16)
        scales = (fp16(208)[:, None] * data[:, 192:208].contiguous().view(torch.int8).float()).reshape(n * 16)
        block_size = 16
    else:
        raise ValueError(f"{qtype.name} is not decoded into blocks here")
    levels = levels.reshape(rows, cols)
    scales = scales.reshape(rows, cols // block_size)
    offsets = None if offsets is None else offsets.reshape(rows, cols // block_size)
    return Blocks(levels, scales, offsets, block_size)


def dequantize(raw: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    """raw [rows, row_bytes] uint8 of any SUPPORTED_TYPES tensor -> [rows, cols] fp32."""
    qtype = QT(qtype)
    if qtype in BLOCK_TYPES:
        return decode_blocks(raw, qtype, cols).dequantized()
    if qtype == QT.F32:
        return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.float32).reshape(-1, cols).clone()
    if qtype in (QT.F16, QT.BF16):
        dtype = torch.float16 if qtype == QT.F16 else torch.bfloat16
        return torch.from_numpy(np.ascontiguousarray(raw)).view(dtype).reshape(-1, cols).float()
    if qtype in GGUF_ONLY_TYPES:
        return torch.from_numpy(gguf_dequantize(np.ascontiguousarray(raw), qtype)).reshape(-1, cols)
    raise ValueError(f"GGUF type {qtype.name} is not supported")
