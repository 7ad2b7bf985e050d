"""Attention of any subset of queries over a cache, by absolute position, with its metadata built
once per active set (before the layer loop and at each check layer), never per layer.

A query at absolute position p sees keys 0..p, whatever the other queries are. Three layouts:
- CAUSAL: the queries are exactly positions 0..N-1: SDPA's own causal kernel (flash on CUDA);
- LAST: queries at the cache's last positions that see every key (decode, the last prefill
  layer): no mask at all;
- SUBSET: any ascending subset. `AttentionBackend.MASKED` runs one SDPA call with one mask (the
  CUDA path: SDPA falls back to its slow math kernel for a masked GQA call, so query heads are
  folded onto their KV head instead of repeating K/V); `AttentionBackend.GROUPED` cuts the queries
  into up to 8 groups, each over the keys up to its last position only (the CPU path: early
  queries do not pay for keys they cannot see; it needs those cut-offs on the host, read once
  when the active set is built).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from blend_engine import native
from blend_engine.decode_cache import SCALE_DTYPE, Int8Heads, Int8Layer
from blend_engine.int4 import gemm_dtype
from configs.enums import AttentionDtype

MAX_QUERY_GROUPS = 8
MAX_KERNEL_GROUP = 8  # query heads per KV head csrc/int8_attention.cpp takes
# AttentionDtype.AUTO casts a prefill to bf16 from this many keys: below it a new shape's bf16 kernels cost
# their setup (oneDNN JIT, per shape) about what they save. Server, 2-core Xeon with AMX, bf16 at every
# length, blend prefill fp32 / bf16: 1.01x at ~660 tokens, 1.19x at ~1 270, 1.46x at ~3 060 (decision 0023)
BF16_MIN_KEYS = 1024
# GROUPED cuts a subset's queries into groups of whole 64-row blocks, about this many rows each (up to
# MAX_QUERY_GROUPS): torch's CPU flash kernel runs a call's queries in blocks of 32 rows (64 from 192 rows),
# so the groups of 65 rows cut before ran three blocks each, the last of one row. Measured (`ragblend bench
# attention-groups`: 2-core Xeon, bf16, 9 heads over 3, one layer): 521 queries over 3 125 keys 7.2 ms against
# 9.2 ms, 900 over 6 000 19.6 against 21.7, 250 over 1 500 1.74 either way (docs/benchmarks/engine.md, stop 50)
QUERY_GROUP_ROWS = 192
QUERY_BLOCK_ROWS = 64


class AttentionBackend(str, Enum):
    MASKED = "masked"  # one masked call per layer (CUDA default)
    GROUPED = "grouped"  # key cut-offs per query group (CPU default, measured faster there)

    @classmethod
    def for_device(cls, device: torch.device) -> AttentionBackend:
        return cls.MASKED if device.type == "cuda" else cls.GROUPED


class AttentionLayout(str, Enum):
    CAUSAL = "causal"
    LAST = "last"
    SUBSET = "subset"


@dataclass(frozen=True)
class QueryGroup:
    rows: slice  # rows of the query block
    num_keys: int  # keys 0..num_keys-1 (the group's last position + 1)
    mask: torch.Tensor  # [rows, num_keys] bool, or additive (0 / -inf, plus the column bias)


@dataclass(frozen=True)
class AttentionMeta:
    layout: AttentionLayout
    num_keys: int
    # SUBSET + MASKED: [G*A, num_keys] additive (0 / -inf, plus the column bias), query heads folded;
    # LAST: None, or the column bias [1, num_keys] (see `attend`)
    mask: torch.Tensor | None = None
    groups: tuple[QueryGroup, ...] = ()  # SUBSET + GROUPED
    # what SDPA computes in: q, k and v are cast to it per call (ModelConfig.attention_dtype: bf16 attention
    # of an fp32 model on a CPU with AMX), the output cast back to q's; None: q's own dtype
    dtype: torch.dtype | None = None


def avoid_cudnn_attention() -> None:
    """Turn SDPA's cuDNN backend off, for the whole process (a torch setting): on Hopper torch picks
    it first, and it builds a plan for every new shape, while every request's prompt has a length
    of its own. Measured on an H100 at Llama-2-7B shape (docs/benchmarks/gpu.md): a blend prefill
    at a prompt length the process had not run took 263 ms with it, 34 ms at a length it had; with
    flash / memory-efficient kernels, which need no plan, 46 and 43 ms."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def resolve_attention_dtype(choice: AttentionDtype, device: torch.device, model_dtype: torch.dtype,
                            is_quantized: bool) -> torch.dtype:
    """What a prefill's attention computes in (ModelConfig.attention_dtype). AUTO takes bf16 where the
    prefill's GEMMs already run in it (quantized weights multiply a bf16 copy on CPUs with native bf16:
    blend_engine/int4.py `gemm_dtype`); an fp32 model kept in fp32 weights stays exact."""
    if choice == AttentionDtype.BFLOAT16:
        return torch.bfloat16
    if choice == AttentionDtype.AUTO and device.type == "cpu" and model_dtype == torch.float32 and is_quantized \
            and gemm_dtype(device) == torch.bfloat16:
        return torch.bfloat16
    return model_dtype


def causal_mask(query_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[n, num_keys] bool: query at absolute position p sees keys at positions <= p, never later."""
    return query_pos[:, None] >= torch.arange(num_keys, device=query_pos.device)[None, :]


def additive_causal_mask(query_pos: torch.Tensor, num_keys: int, num_repeats: int, dtype: torch.dtype,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """[num_repeats * n, num_keys] of 0 (seen) / -inf (hidden), made once per active set; plus
    `bias` [>= num_keys] on every row where given (a column bias: see `attend`).

    Additive in the attention's dtype, so SDPA does not convert a bool mask at every layer, and
    stored with rows padded to a multiple of 16 elements, the alignment CUDA's memory-efficient
    kernel wants (else SDPA pads a copy of it per call).
    """
    num_padded = -(-num_keys // 16) * 16
    storage = torch.full((num_repeats * query_pos.shape[0], num_padded), float("-inf"), dtype=dtype,
                         device=query_pos.device)
    mask = storage[:, :num_keys]
    mask.masked_fill_(causal_mask(query_pos, num_keys).repeat(num_repeats, 1), 0.0)
    return mask if bias is None else mask.add_(bias[:num_keys].to(dtype))


def causal_meta(num_tokens: int, dtype: torch.dtype | None = None) -> AttentionMeta:
    return AttentionMeta(AttentionLayout.CAUSAL, num_tokens, dtype=dtype)


def last_meta(num_keys: int, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> AttentionMeta:
    """Queries that see every key; `bias` [>= num_keys]: a column bias (see `attend`)."""
    mask = None if bias is None else bias[None, :num_keys]
    return AttentionMeta(AttentionLayout.LAST, num_keys, mask=mask if mask is None or dtype is None else mask.to(dtype),
                         dtype=dtype)


def subset_meta(
    query_pos: torch.Tensor,
    num_keys: int,
    backend: AttentionBackend,
    num_groups_per_kv: int,
    query_pos_host: list[int] | None = None,
    dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> AttentionMeta:
    """Metadata for ascending `query_pos` [A] over keys 0..num_keys-1, with the column `bias`
    [>= num_keys] (see `attend`) if given; the attention computes in `dtype` (its masks are built in it).

    GROUPED needs the positions on the host; pass `query_pos_host` when the caller has them already,
    else they are read back here (once per active set).
    """
    if backend == AttentionBackend.MASKED:
        # fold: the G query heads sharing a KV head become G blocks of rows
        mask_dtype = torch.float32 if dtype is None else dtype
        mask = additive_causal_mask(query_pos, num_keys, num_groups_per_kv, mask_dtype, bias)  # [G*A, N]
        return AttentionMeta(AttentionLayout.SUBSET, num_keys, mask=mask, dtype=dtype)
    host = query_pos_host if query_pos_host is not None else query_pos.tolist()
    return grouped_meta(query_pos, host, query_group_bounds(len(host)), num_keys, dtype, bias)


def grouped_meta(query_pos: torch.Tensor, query_pos_host: Sequence[int], bounds: Sequence[int], num_keys: int,
                 dtype: torch.dtype | None = None, bias: torch.Tensor | None = None) -> AttentionMeta:
    """GROUPED's metadata for ascending `query_pos` [A] (and the same on the host) cut at the row `bounds`
    [0, ..., A], each group over the keys up to its last position (`subset_meta` cuts at
    `query_group_bounds`; `ragblend bench attention-groups` at others, to compare)."""
    mask_dtype = torch.float32 if dtype is None else dtype
    groups = []
    for start, end in itertools.pairwise(bounds):
        num_group_keys = query_pos_host[end - 1] + 1
        mask = causal_mask(query_pos[start:end], num_group_keys)  # [rows, keys] bool
        if bias is not None:
            mask = torch.where(mask, bias[:num_group_keys].to(mask_dtype), float("-inf")).to(mask_dtype)
        groups.append(QueryGroup(slice(start, end), num_group_keys, mask))
    return AttentionMeta(AttentionLayout.SUBSET, num_keys, groups=tuple(groups), dtype=dtype)


def query_group_bounds(num_queries: int) -> list[int]:
    """GROUPED's groups of a subset's `num_queries` queries, as row bounds [0, ..., num_queries]: at most
    MAX_QUERY_GROUPS of about QUERY_GROUP_ROWS rows, each but the last a whole number of QUERY_BLOCK_ROWS."""
    num_groups = max(1, min(MAX_QUERY_GROUPS, -(-num_queries // QUERY_GROUP_ROWS)))
    if num_groups == 1:
        return [0, num_queries]
    rows = -(-num_queries // (num_groups * QUERY_BLOCK_ROWS)) * QUERY_BLOCK_ROWS
    return list(range(0, num_queries, rows)) + [num_queries]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMeta, scale: float) -> torch.Tensor:
    """q [H, A, D] (rotated) over keys/values [H_kv, >=num_keys, D] -> [A, H*D].

    A column bias (in the metadata's masks) is added to every query's logit for that key: log S
    multiplies the key's attention weight by S before the softmax normalizes (reused attention
    scale, BlendConfig.reused_attention_scale)."""
    num_heads, num_queries, head_dim = q.shape
    return attend_heads(q, keys, values, meta, scale).transpose(0, 1).reshape(num_queries, num_heads * head_dim)


def attend_heads(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMeta,
                 scale: float) -> torch.Tensor:
    """`attend` before its heads are laid side by side: q [H, A, D] -> [H, A, D] (a caller that
    copies the output into a buffer of its own does it in one copy: blend_engine/prefill_graph.py)."""
    keys, values = keys[:, : meta.num_keys], values[:, : meta.num_keys]
    if meta.dtype is None or meta.dtype == q.dtype:
        return _attend_heads(q, keys, values, meta, scale)
    out = _attend_heads(q.to(meta.dtype), keys.to(meta.dtype), values.to(meta.dtype), meta, scale)
    return out.to(q.dtype)


def _attend_heads(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMeta,
                  scale: float) -> torch.Tensor:
    if meta.layout == AttentionLayout.SUBSET and meta.mask is not None:
        return _folded(q, keys, values, meta.mask, scale)
    if meta.layout == AttentionLayout.SUBSET:
        outs = [
            F.scaled_dot_product_attention(
                q[None, :, g.rows], keys[None, :, : g.num_keys], values[None, :, : g.num_keys],
                attn_mask=g.mask, scale=scale, enable_gqa=True,
            )[0]
            for g in meta.groups
        ]  # [H, rows, D] each
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [H, A, D]
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=meta.mask,  # LAST: the column bias, if any
        is_causal=meta.layout == AttentionLayout.CAUSAL, scale=scale, enable_gqa=True,
    )[0]


def attend_last(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query token that sees every key, per KV head as two matmuls in the keys' dtype with the
    softmax in fp32: q [H, 1, D] over keys/values [H_kv, N, D] -> [1, H*D] in q's dtype; `bias` [N]:
    a column bias (see `attend`).

    On CPU, over a bf16 cache this reads half of fp32's bytes; SDPA's CPU kernel was measured
    slower on bf16 than on fp32 for a single query, and a batched matmul copies each head's keys
    (the cache's heads are `capacity` rows apart), so the heads go one by one."""
    num_heads, _, head_dim = q.shape
    num_kv_heads, num_keys = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    folded = (q * scale).reshape(num_kv_heads, group, head_dim).to(keys.dtype)  # [H_kv, G, D], scaled
    scores = keys.new_empty(num_kv_heads, group, num_keys)  # [H_kv, G, N]
    for head in range(num_kv_heads):
        torch.mm(folded[head], keys[head].t(), out=scores[head])
    if bias is not None:
        scores += bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)  # [H_kv, G, N]
    out = values.new_empty(num_kv_heads, group, head_dim)  # [H_kv, G, D]
    for head in range(num_kv_heads):
        torch.mm(probs[head], values[head], out=out[head])
    return out.reshape(1, num_heads * head_dim).to(q.dtype)


def attend_last_int8(q: torch.Tensor, kv: Int8Layer, scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`attend_last` over an int8 decode cache (blend_engine/decode_cache.py): q [H, 1, D] -> [1, H*D] in
    q's dtype; `bias` [N] as there."""
    num_heads, _, head_dim = q.shape
    folded = fold_int8_queries(q, scale, kv.values_t.shape[0])  # [H_kv, G, D] bf16
    return attend_int8(folded, kv, bias).reshape(1, num_heads * head_dim).to(q.dtype)


def attend_int8(folded: torch.Tensor, kv: Int8Layer, bias: torch.Tensor | None = None,
                heads: Int8Heads | None = None) -> torch.Tensor:
    """One token over one layer of its int8 cache: folded [H_kv, G, D] (bf16, scaled) -> [H_kv, G, D] bf16;
    `bias` [N] as in `attend`. By ragblend's kernel in one call where it is built (csrc/int8_attention.cpp:
    the torch path's roundings in its order, bit for bit where torch runs its AVX2 kernel; decision 0035),
    else by torch's over `heads` (`kv` cut per KV head; made here where None)."""
    is_native = folded.device.type == "cpu" and folded.shape[1] <= MAX_KERNEL_GROUP and folded.shape[2] % 8 == 0
    kernel = native.int8_attention() if is_native else None
    if kernel is not None:
        return kernel(folded, kv.keys, kv.key_scales, kv.values_t, kv.value_scales, bias)
    return torch.stack(attend_int8_heads(folded.unbind(0), kv.heads(folded.shape[1]) if heads is None else heads, bias))


def fold_int8_queries(q: torch.Tensor, scale: float, num_kv_heads: int) -> torch.Tensor:
    """q [H, B, D] of B tokens (one per sequence) -> [B * H_kv, G, D] in the kernel's dtype, scaled:
    row b * H_kv + h holds token b's queries of KV head h (each row is the kernel's input)."""
    num_heads, num_tokens, head_dim = q.shape
    scaled = (q.transpose(0, 1) * scale).to(SCALE_DTYPE)  # [B, H, D]
    return scaled.reshape(num_tokens * num_kv_heads, num_heads // num_kv_heads, head_dim)


def attend_int8_heads(folded: Sequence[torch.Tensor], kv: Int8Heads,
                      bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One token over one layer of its int8 cache, per KV head: folded [G, D] (bf16, scaled) per KV
    head -> [G, D] bf16 per KV head (`kv.probs` overwritten); `bias` [N] as in `attend`."""
    scores = torch.stack([torch._weight_int8pack_mm(f, k, s)  # [H_kv, G, N]
                          for f, k, s in zip(folded, kv.keys, kv.key_scales)])
    if bias is not None:
        scores += bias
    # the softmax in fp32 times V's per-token scales, rounded once to bf16 into the zero-padded weights
    torch.mul(torch.softmax(scores, dim=-1, dtype=torch.float32), kv.value_scales, out=kv.probs)
    return [torch._weight_int8pack_mm(p, v, kv.unit_scales) for p, v in zip(kv.prob_rows, kv.values_t)]


def _folded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One masked call with the query heads of each KV head stacked as rows: [H, A, D] -> [H, A, D]."""
    num_heads, num_queries, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    folded = q.reshape(num_kv_heads, group * num_queries, head_dim)  # head h -> KV head h // group, as repeat_kv
    out = F.scaled_dot_product_attention(folded[None], keys[None], values[None], attn_mask=mask, scale=scale)[0]
    return out.reshape(num_heads, num_queries, head_dim)
