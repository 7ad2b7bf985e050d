"""Row-wise joins of weight buffers that need no copy where the parts already lie one after another.

A fused layer (q/k/v, gate/up) holds its parts' rows in one buffer. The GGUF loader joins them before
it keeps the packed weights (blend_engine/gguf_loader.py), so a warm start maps the kept file and its
parts arrive as consecutive views of one storage: joining them again is then a view, and the weights stay
pages of the mapped file (shared with every process that maps it) instead of a fresh copy per start.
"""

from __future__ import annotations

import math

import torch


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` (along dim 0), as a view of their storage where the parts are contiguous and lie
    there back to back in order, else a copy."""
    first = parts[0]
    rest_shape = first.shape[1:]
    offset = first.storage_offset()
    for part in parts:
        is_next = (part.is_contiguous() and part.dtype == first.dtype and part.shape[1:] == rest_shape
                   and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   and part.storage_offset() == offset)
        if not is_next:
            return torch.cat(parts)
        offset += part.numel()
    num_rows = sum(part.shape[0] for part in parts)
    row_stride = math.prod(rest_shape)
    strides = tuple(math.prod(rest_shape[i + 1:]) for i in range(len(rest_shape)))
    return first.as_strided((num_rows, *rest_shape), (row_stride, *strides), first.storage_offset())
