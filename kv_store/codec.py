"""Entry serialization: one safetensors blob per chunk, laid out for layer-by-layer reads.

Tensors: `kv.{l}` = stack(keys[l], values[l]) [2, num_kv_heads, num_tokens, head_dim] in the storage
dtype (int8 when quantized, with `scale.{l}` [2, num_kv_heads, 1, head_dim] fp32 per-channel scales;
a low-bit format's `kv.{l}` is one zstd-coded payload, a u8 vector: see lowbit.py).
The safetensors header (read alone, cheaply) carries shapes and per-tensor byte offsets; its
`__metadata__["ragblend"]` JSON carries the fingerprint, key, token/context ids and one crc32 per
layer, so a reader can fetch and verify any single layer. The blob is a valid safetensors file.
The header's format tag says how to decode it: an entry written under an older default (float16,
int8) stays readable under its own key after the default changes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Annotated, Callable

import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import lowbit
from kv_store.errors import CorruptEntryError
from kv_store.keys import StorageFormat, chunk_key

TORCH_DTYPES = {
    StorageDtype.FLOAT16: torch.float16,
    StorageDtype.BFLOAT16: torch.bfloat16,
    StorageDtype.FLOAT32: torch.float32,
}
_ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8, "U8": torch.uint8}
# low-bit formats (a compressed payload per layer) and the parameters new entries are written with;
# measured: docs/decisions/0014. An entry's header names its parameters (`lowbit`), so entries written
# with earlier ones stay readable (an int4 entry without the field: the first int4 parameters, fp16 scales).
LOWBIT_SPECS = {KVQuantization.INT4: lowbit.LowBitSpec(key_bits=3.5, value_bits=3.5, group_tokens=32, zstd_level=3,
                                                       scale_bits=8, key_widths=lowbit.BitWidths.BY_RANGE,
                                                       value_widths=lowbit.BitWidths.BY_RANGE)}
_FIRST_LOWBIT_SPECS = {KVQuantization.INT4: lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=3)}
_EARLIER_LOWBIT_SPECS = (  # written by earlier versions, under the header's `lowbit` tag
    lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=3, scale_bits=8),  # one key width
)
_READABLE_LOWBIT_SPECS = {spec.tag: spec for spec in (*LOWBIT_SPECS.values(), *_FIRST_LOWBIT_SPECS.values(),
                                                      *_EARLIER_LOWBIT_SPECS)}
_MAX_HEADER_BYTES = 64 << 20  # safetensors' own limit is 100 MB; ours are a few KB per 1k tokens
_MAX_ENTRY_BYTES = 1 << 40  # any size or offset a header states is below this (entries are megabytes)
META_KEY = "ragblend"


@dataclass(frozen=True)
class EntryHeader:
    """Everything about an entry except its tensor bytes."""

    key: str
    fingerprint: str
    fmt: StorageFormat
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_ranges: tuple[tuple[tuple[int, int], ...], ...]  # per layer: absolute (begin, end) byte ranges
    checksums: tuple[int, ...]  # crc32 per layer over its ranges' bytes, in order
    total_bytes: int
    lowbit_spec: lowbit.LowBitSpec | None = None  # a low-bit format's parameters, as written
    salt: str = ""  # the collection's KV salt the key was made with

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def layer_nbytes(self, layer_idx: int) -> int:
        return sum(end - begin for begin, end in self.layer_ranges[layer_idx])


def storage_bytes_per_layer(num_kv_heads: int, num_tokens: int, head_dim: int, fmt: StorageFormat) -> int:
    """Stored bytes of one layer (a low-bit format's: its size before zstd, an upper bound)."""
    spec = LOWBIT_SPECS.get(fmt.quantization)
    if spec is not None:
        return lowbit.packed_size(num_kv_heads, num_tokens, head_dim, spec)
    if fmt.quantization is KVQuantization.INT8:
        return 2 * num_kv_heads * (num_tokens + 4) * head_dim  # int8 values + fp32 scales
    return 2 * num_kv_heads * num_tokens * head_dim * TORCH_DTYPES[fmt.dtype].itemsize


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel absmax int8 over the token axis: x [2, H, n, D] -> q int8 [2, H, n, D], scale [2, H, 1, D]."""
    x = x.float()
    scale = x.abs().amax(dim=2, keepdim=True).clamp_min(1e-8) / 127.0
    return (x / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def _layer_tensors(kv: ChunkKV, layer_idx: int, fmt: StorageFormat) -> list[tuple[str, torch.Tensor]]:
    stacked = torch.stack([kv.keys[layer_idx], kv.values[layer_idx]]).cpu()  # [2, H, n, D]
    spec = LOWBIT_SPECS.get(fmt.quantization)
    if spec is not None:
        payload = lowbit.encode_layer(stacked, spec)
        return [(f"kv.{layer_idx}", torch.frombuffer(bytearray(payload), dtype=torch.uint8))]  # [num bytes]
    if fmt.quantization is KVQuantization.INT8:
        q, scale = _quantize(stacked)
        return [(f"kv.{layer_idx}", q), (f"scale.{layer_idx}", scale.contiguous())]
    return [(f"kv.{layer_idx}", stacked.to(TORCH_DTYPES[fmt.dtype]).contiguous())]


def _crc(buffers: list) -> int:
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf.numpy() if isinstance(buf, torch.Tensor) else buf, crc)
    return crc


def _bytes_view(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()  # zero-copy, works for bf16 too


def encode(kv: ChunkKV, key: str, fingerprint: str, fmt: StorageFormat) -> bytes:
    """Serialize a chunk's KV into one self-describing blob."""
    tensors: dict[str, torch.Tensor] = {}
    checksums = []
    for layer_idx in range(kv.num_layers):
        named = _layer_tensors(kv, layer_idx, fmt)
        tensors.update(named)
        checksums.append(_crc([_bytes_view(t) for _, t in named]))
    meta = {
        "key": key,
        "fingerprint": fingerprint,
        "format": [fmt.version, fmt.dtype.value, fmt.quantization.value],
        "token_ids": list(kv.token_ids),
        "context_ids": list(kv.context_ids),
        **({"salt": kv.salt} if kv.salt else {}),  # absent when unsalted: such entries stay as they were
        "shape": [kv.num_layers, kv.keys.shape[1], kv.keys.shape[3]],
        "checksums": checksums,
    }
    spec = LOWBIT_SPECS.get(fmt.quantization)
    if spec is not None:
        meta["lowbit"] = spec.tag
    return safetensors.torch.save(tensors, metadata={META_KEY: json.dumps(meta, separators=(",", ":"))})


MAX_REASON_CHARS = 200  # of a damaged entry's reason: enough to say what is wrong, never its content


def header_size(prefix: bytes, total_bytes: int) -> int:
    """Bytes of the whole header (8-byte length + JSON), from the blob's first 8 bytes; `total_bytes`
    is the whole entry's size: a header claiming more is a truncated or crafted entry, refused before
    anything that size is read."""
    if len(prefix) < 8:
        raise CorruptEntryError(f"truncated: {len(prefix)} bytes")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > _MAX_HEADER_BYTES:
        raise CorruptEntryError(f"header length {n} is implausible")
    if 8 + n > total_bytes:
        raise CorruptEntryError(f"truncated: a header of {8 + n} bytes in an entry of {total_bytes}")
    return 8 + n


# The header's schema, validated by pydantic (strict: no float or string passes for an int) before
# any value is used. Its JSON parser bounds nesting (a deeply nested header is a validation error, not
# a RecursionError) and the bounds below keep every number a plain int that fits what reads it.
_Size = Annotated[int, Field(ge=0, le=_MAX_ENTRY_BYTES)]
_Id = Annotated[int, Field(ge=0, lt=1 << 63)]  # token ids are hashed as int64 (keys.py)
_Crc = Annotated[int, Field(ge=0, lt=1 << 32)]


class _TensorInfo(BaseModel):
    """One tensor of the safetensors table."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    dtype: str
    shape: Annotated[list[_Size], Field(max_length=4)]
    data_offsets: tuple[_Size, _Size]  # [begin, end) from the start of the data, after the header


class _Table(BaseModel):
    """The safetensors header: our metadata plus one `_TensorInfo` per tensor name."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")
    __pydantic_extra__: dict[str, _TensorInfo] = Field(init=False)
    metadata: dict[str, str] = Field(alias="__metadata__")


class _Meta(BaseModel):
    """Our metadata (`encode`). Unknown fields are ignored: a later version may add some."""

    model_config = ConfigDict(strict=True, frozen=True)
    key: str
    fingerprint: str
    format: tuple[int, StorageDtype, KVQuantization]  # version, dtype, quantization
    token_ids: Annotated[list[_Id], Field(min_length=1)]
    context_ids: list[_Id]
    salt: Annotated[str, Field(max_length=128)] = ""  # the collection's KV salt (keys.py), part of the key
    shape: tuple[_Size, _Size, _Size]  # num_layers, num_kv_heads, head_dim
    checksums: list[_Crc]
    lowbit: str | None = None


def _invalid(what: str, exc: ValidationError) -> CorruptEntryError:
    """Where and why a header fails its schema; never its values (kilobytes of a document's token ids)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])[:60]
    return CorruptEntryError(f"unreadable {what}: {where or 'JSON'}: {first['msg'][:MAX_REASON_CHARS]}")


def read_header(blob, expected_key: str, fingerprint: str, fmt: StorageFormat, shape: KVShape) -> EntryHeader:
    """`parse_header` of a whole entry held in memory."""
    return parse_header(blob[: header_size(blob[:8], len(blob))], len(blob), expected_key, fingerprint, fmt, shape)


def parse_header(head: bytes, total_bytes: int, expected_key: str, fingerprint: str, fmt: StorageFormat,
                 shape: KVShape) -> EntryHeader:
    """Parse and validate a header (`head` = the blob's first `header_size` bytes). Anything wrong with
    it raises CorruptEntryError, checked before anything is allocated for the entry's layers: its
    schema, then that it is this model's entry for this key (fingerprint, key, token and context ids
    hashing to that key), of the model's `shape` (layers, KV heads, head dim), with one checksum per
    layer and each layer's tensors inside the entry at their exact sizes.

    `fmt` is the tier's current format; an entry in another format this version reads (float16,
    int8, int4 ...: the tag in its header) is accepted: its key, made with its own format, was
    looked up by a chunk stored before the default changed."""
    try:
        table = _Table.model_validate_json(bytes(head[8:]))
    except ValidationError as exc:
        raise _invalid("header", exc) from exc
    if META_KEY not in table.metadata:
        raise CorruptEntryError(f"header has no {META_KEY!r} metadata")
    try:
        meta = _Meta.model_validate_json(table.metadata[META_KEY])
    except ValidationError as exc:
        raise _invalid("metadata", exc) from exc
    version, dtype, quantization = meta.format
    stored_fmt = StorageFormat(dtype, quantization, version)
    if meta.fingerprint != fingerprint or version != fmt.version:
        raise CorruptEntryError(f"entry is for another model/format: {meta.fingerprint[:40]!r}, {stored_fmt.tag}")
    if meta.key != expected_key:
        raise CorruptEntryError(f"entry holds key {meta.key[:16]!r}, expected {expected_key[:16]}")
    token_ids, context_ids = tuple(meta.token_ids), tuple(meta.context_ids)
    if chunk_key(fingerprint, stored_fmt, token_ids, context_ids, meta.salt) != expected_key:  # content-addressed
        raise CorruptEntryError(f"entry's {len(token_ids)} token ids and context are not those of key "
                                f"{expected_key[:16]}")
    stored_shape = tuple(meta.shape)
    if stored_shape != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise CorruptEntryError(f"entry of shape {stored_shape} (layers, KV heads, head dim), the model's is "
                                f"{(shape.num_layers, shape.num_kv_heads, shape.head_dim)}")
    if len(meta.checksums) != shape.num_layers:
        raise CorruptEntryError(f"{len(meta.checksums)} checksums for {shape.num_layers} layers")
    try:
        lowbit_spec = _lowbit_spec(quantization, meta.lowbit)
    except ValueError as exc:
        raise CorruptEntryError(str(exc)) from exc
    tensors = table.__pydantic_extra__
    expected = _tensor_shapes(stored_fmt, lowbit_spec is not None, shape, len(token_ids))
    if set(tensors) != {name for layer in expected for name, _, _ in layer}:
        raise CorruptEntryError(f"entry's tensors are not one set per layer of {shape.num_layers}: "
                                f"{sorted(tensors)[:6]}"[:MAX_REASON_CHARS])
    data_start = len(head)
    ranges = tuple(tuple(_tensor_range(name, tensors[name], dtype_name, dims, data_start, total_bytes)
                         for name, dtype_name, dims in layer) for layer in expected)
    return EntryHeader(
        expected_key, fingerprint, stored_fmt, token_ids, context_ids, shape.num_layers, shape.num_kv_heads,
        shape.head_dim, ranges, tuple(meta.checksums), total_bytes, lowbit_spec, meta.salt,
    )


_ST_NAMES = {StorageDtype.FLOAT16: "F16", StorageDtype.BFLOAT16: "BF16", StorageDtype.FLOAT32: "F32"}


def _tensor_shapes(fmt: StorageFormat, is_lowbit: bool, shape: KVShape, num_tokens: int
                   ) -> list[list[tuple[str, str, list[int] | None]]]:
    """Per layer: each tensor's name, safetensors dtype and shape (None: a low-bit payload, u8 of any length)."""
    kv_shape = [2, shape.num_kv_heads, num_tokens, shape.head_dim]
    layers = []
    for layer_idx in range(shape.num_layers):
        if is_lowbit:
            layers.append([(f"kv.{layer_idx}", "U8", None)])
        elif fmt.quantization is KVQuantization.INT8:
            layers.append([(f"kv.{layer_idx}", "I8", kv_shape),
                           (f"scale.{layer_idx}", "F32", [2, shape.num_kv_heads, 1, shape.head_dim])])
        else:
            layers.append([(f"kv.{layer_idx}", _ST_NAMES[fmt.dtype], kv_shape)])
    return layers


def _tensor_range(name: str, info: _TensorInfo, dtype_name: str, shape: list[int] | None, data_start: int,
                  total_bytes: int) -> tuple[int, int]:
    """The tensor's absolute byte range, checked against its dtype, its shape and the entry's size."""
    if info.dtype != dtype_name:
        raise CorruptEntryError(f"tensor {name}: dtype {info.dtype[:10]!r}, expected {dtype_name}")
    if shape is None:  # a low-bit payload: its length is its own
        if len(info.shape) != 1:
            raise CorruptEntryError(f"tensor {name}: expected a u8 payload, got shape {info.shape}")
        shape = info.shape
    elif info.shape != shape:
        raise CorruptEntryError(f"tensor {name}: expected shape {shape}, got {info.shape}")
    begin, end = (data_start + offset for offset in info.data_offsets)
    if end - begin != _ST_DTYPES[dtype_name].itemsize * _numel(shape) or end > total_bytes:
        raise CorruptEntryError(f"tensor {name}: bad byte range (entry of {total_bytes} bytes)")
    return begin, end


def _lowbit_spec(quantization: KVQuantization, tag: str | None) -> lowbit.LowBitSpec | None:
    """The parameters a low-bit entry was written with (None: not a low-bit format)."""
    if quantization not in LOWBIT_SPECS:
        return None
    if tag is None:  # written before headers named them
        return _FIRST_LOWBIT_SPECS[quantization]
    if tag not in _READABLE_LOWBIT_SPECS:
        raise ValueError(f"low-bit parameters {str(tag)[:40]!r} are not known to this version")
    return _READABLE_LOWBIT_SPECS[tag]


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class StackedLayer:
    """One layer's keys and values as stored, in one block: moving it to the GPU is one copy."""

    kv: torch.Tensor  # [2, H, n, D] storage dtype (a low-bit layer decoded on the CPU: fp32)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StackedLayer:
        return StackedLayer(self.kv.to(device, non_blocking=non_blocking))

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [H, n, D] (views)."""
        return self.kv[0], self.kv[1]


@dataclass(frozen=True)
class QuantizedLayer:
    """One int8 layer as stored, dequantized where it is used: moved to the GPU first, half the bytes
    of fp16 cross PCIe, and the multiply runs there."""

    q: torch.Tensor  # [2, H, n, D] int8
    scale: torch.Tensor  # [2, H, 1, D] fp32, per channel
    dtype: torch.dtype  # the storage dtype it dequantizes to

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedLayer:
        return QuantizedLayer(self.q.to(device, non_blocking=non_blocking),
                              self.scale.to(device, non_blocking=non_blocking), self.dtype)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys, values [H, n, D] in the storage dtype, on the tensors' device."""
        kv = (self.q.float() * self.scale).to(self.dtype)
        return kv[0], kv[1]


# A layer as a reader hands it over: keys, values [H, n, D], or packed as stored (`unpack()` after a move)
EncodedLayer = tuple[torch.Tensor, torch.Tensor] | StackedLayer | QuantizedLayer


def unpacked(layer: EncodedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer if isinstance(layer, tuple) else layer.unpack()


def decode_layer(header: EntryHeader, layer_idx: int, buffers: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify and decode one layer from its ranges' bytes -> keys, values [H, n, D] (CPU, storage dtype)."""
    k, v = unpacked(decode_layer_encoded(header, layer_idx, buffers))
    dtype = TORCH_DTYPES[header.fmt.dtype]
    return k.to(dtype), v.to(dtype)  # a low-bit layer comes in fp32 (see decode_layer_encoded)


_LOWBIT_READ_DTYPE = torch.float32  # a low-bit layer read on the CPU: the decoder's own precision


def read_layer_nbytes(header: EntryHeader) -> int | None:
    """Host bytes of one layer once read, where they are not its stored bytes: a low-bit layer's
    decoded tensors (`decode_layer_encoded`), 4-8x its payload."""
    if header.lowbit_spec is None:
        return None
    return 2 * header.num_kv_heads * header.num_tokens * header.head_dim * _LOWBIT_READ_DTYPE.itemsize


def decode_layer_encoded(header: EntryHeader, layer_idx: int, buffers: list) -> EncodedLayer:
    """Verify one layer and view it as stored: keys and values in one block, or int8 with its scales.

    The tensors share memory with `buffers` (writable bytearray / numpy / uint8 tensors). Pass a pinned
    buffer as the tensor itself: views of it keep the pinned allocator's block, so an async copy from
    them is tracked and the block is not reused before the copy completes.
    """
    if _crc(buffers) != header.checksums[layer_idx]:
        raise CorruptEntryError(f"layer {layer_idx} of {header.key[:16]} fails its checksum")
    shape = (2, header.num_kv_heads, header.num_tokens, header.head_dim)
    dtype = TORCH_DTYPES[header.fmt.dtype]
    spec = header.lowbit_spec
    if spec is not None:  # decoded here, on the host (the reader thread when pipelined)
        # in fp32, the decoder's own precision, where the layer stays on the CPU: a cast to fp16 here and
        # back to the engine's fp32 was a third of the decode (measured). Pinned (bound for a GPU), in
        # the storage dtype: half the bytes cross PCIe.
        is_pinned = _is_pinned(buffers[0])
        try:
            kv = lowbit.decode_layer(_as_bytes(buffers[0]), *shape[1:], spec, dtype if is_pinned else _LOWBIT_READ_DTYPE)
        except ValueError as exc:  # checksum passed yet undecodable: written by a broken encoder
            raise CorruptEntryError(f"layer {layer_idx} of {header.key[:16]}: {exc}") from exc
        if not is_pinned and dtype != kv.dtype:
            # rounded to the storage dtype, in place: the same values a promoted copy of this layer holds in
            # the memory tier (stored in `dtype`), so an answer does not change with the tier its KV came
            # from (tests/test_server_batching.py). ~0.6 ms a layer of 3k tokens (SmolLM2), on the reader.
            kv.copy_(kv.to(dtype))
        return StackedLayer(kv.pin_memory() if is_pinned else kv)
    if header.fmt.quantization is KVQuantization.INT8:
        q = _as_tensor(buffers[0], torch.int8).view(shape)
        scale = _as_tensor(buffers[1], torch.float32).view(2, header.num_kv_heads, 1, header.head_dim)
        return QuantizedLayer(q, scale, dtype)
    return StackedLayer(_as_tensor(buffers[0], dtype).view(shape))


def _as_bytes(buf):
    return buf.numpy() if isinstance(buf, torch.Tensor) else buf


def _is_pinned(buf) -> bool:
    return isinstance(buf, torch.Tensor) and buf.is_pinned()


def _as_tensor(buf, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        return buf.view(dtype)
    return torch.frombuffer(buf, dtype=dtype)


def decode(header: EntryHeader, read: Callable[[int, int], object]) -> ChunkKV:
    """Whole entry: `read(begin, end)` returns a writable buffer of those bytes."""
    keys, values = [], []
    for layer_idx in range(header.num_layers):
        k, v = decode_layer(header, layer_idx, [read(b, e) for b, e in header.layer_ranges[layer_idx]])
        keys.append(k)
        values.append(v)
    # [L, H, n, D] each
    return ChunkKV(header.token_ids, header.context_ids, torch.stack(keys), torch.stack(values), header.salt)
