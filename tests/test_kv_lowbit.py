"""The low-bit entry format (int4 + zstd): fidelity bound, size, per-layer checksums, and entries
written in the older formats (float16, int8) staying readable after the default changes."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, codec, lowbit
from kv_store.disk import DiskBackend
from kv_store.errors import CorruptEntryError
from kv_store.keys import StorageFormat, chunk_key

INT4 = StorageFormat(StorageDtype.FLOAT16, KVQuantization.INT4)
FP16 = StorageFormat(StorageDtype.FLOAT16)
INT8 = StorageFormat(StorageDtype.FLOAT16, KVQuantization.INT8)


SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=64)  # smooth_kv's


def smooth_kv(num_tokens=100, num_layers=3, num_kv_heads=2, head_dim=64, seed=0) -> ChunkKV:
    """KV with per-channel offsets and scales (outlier channels) like a model's, plus noise."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_kv_heads, num_tokens, head_dim)
    offset = 4 * torch.randn(num_layers, num_kv_heads, 1, head_dim, generator=g)
    keys = offset + torch.randn(shape, generator=g) * torch.rand(num_layers, num_kv_heads, 1, head_dim, generator=g)
    values = torch.randn(shape, generator=g)
    tokens = tuple(torch.randint(0, 1000, (num_tokens,), generator=g).tolist())
    return ChunkKV(tokens, (1,), keys, values)


def test_int4_round_trip_is_within_half_a_step_and_small():
    kv = smooth_kv()
    key = chunk_key("fp", INT4, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", INT4))
    header = codec.read_header(blob, key, "fp", INT4, kv.shape)
    out = codec.decode(header, lambda b, e: bytearray(blob[b:e]))
    assert out.keys.dtype == torch.float16 and out.keys.shape == kv.keys.shape
    # keys: per channel over groups of tokens; values: per token; error <= half a step (+ fp16 rounding)
    spec = codec.LOWBIT_SPECS[KVQuantization.INT4]
    g = spec.group_tokens
    for layer in range(kv.num_layers):
        k, v = kv.keys[layer], kv.values[layer]  # [H, n, D]
        (begin, end), = header.layer_ranges[layer]
        key_widths, value_widths = (torch.from_numpy(w.astype("int64")) for w in  # [H, D], [H, n]
                                    lowbit.layer_widths(bytes(blob[begin:end]), 2, 100, 64, spec))
        assert key_widths.float().mean() == spec.key_bits and value_widths.float().mean() == spec.value_bits
        k_step = (k[:, :g].amax(1) - k[:, :g].amin(1)) / (2**key_widths - 1)  # [H, D], first group
        assert ((out.keys[layer, :, :g].float() - k[:, :g]).abs() <= k_step[:, None] / 2 * 1.01 + 5e-3).all()
        v_step = (v.amax(2) - v.amin(2)) / (2**value_widths - 1)  # [H, n]
        assert ((out.values[layer].float() - v).abs() <= v_step[..., None] / 2 * 1.01 + 5e-3).all()
    fp16_layer = codec.storage_bytes_per_layer(2, 100, 64, FP16)
    assert header.layer_nbytes(0) <= codec.storage_bytes_per_layer(2, 100, 64, INT4) < fp16_layer / 3


def test_a_streamed_int4_layer_is_fp32_and_rounds_to_the_whole_entry_decode():
    """The stream hands the decoder's fp32 to the engine (no cast to fp16 and back); whole-entry reads
    stay in the storage dtype, the same values rounded."""
    kv = smooth_kv(num_tokens=70)  # a last, shorter key group
    key = chunk_key("fp", INT4, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", INT4))
    header = codec.read_header(blob, key, "fp", INT4, kv.shape)
    whole = codec.decode(header, lambda b, e: bytearray(blob[b:e]))
    for layer in range(kv.num_layers):
        buffers = [bytearray(blob[b:e]) for b, e in header.layer_ranges[layer]]
        k, v = codec.decode_layer_encoded(header, layer, buffers).unpack()
        assert k.dtype == v.dtype == torch.float32
        assert torch.equal(k.half(), whole.keys[layer]) and torch.equal(v.half(), whole.values[layer])


def test_token_wise_deltas_decode_to_the_same_values():
    x = torch.stack([smooth_kv().keys[0], smooth_kv(seed=1).values[0]])  # [2, H, n, D]
    plain, delta = lowbit.LowBitSpec(), lowbit.LowBitSpec(is_delta=True)
    a = lowbit.decode_layer(lowbit.encode_layer(x, plain), 2, 100, 64, plain)
    b = lowbit.decode_layer(lowbit.encode_layer(x, delta), 2, 100, 64, delta)
    assert torch.equal(a, b)


def test_a_damaged_int4_layer_fails_its_checksum(tmp_path):
    store = KVStore("fp", StoreConfig(max_memory_bytes=0, disk_dir=tmp_path, quantization=KVQuantization.INT4),
                    shape=SHAPE)
    kv = smooth_kv()
    key = store.key_for(kv.token_ids, kv.context_ids)
    store.put(key, kv)
    path = store.backend(store.tiers[0]).path(key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40  # inside the last layer's payload
    path.write_bytes(bytes(data))
    assert store.get(key) is None  # a miss, the entry deleted and counted
    assert not path.exists() and store.stats().tiers["disk"].corrupt == 1
    with pytest.raises(ValueError):
        lowbit.decode_layer(b"not zstd", 2, 100, 64, lowbit.LowBitSpec())


def test_an_open_int4_entry_counts_the_bytes_its_read_layers_hold(tmp_path):
    """Keeping streamed layers for promotion, and the prefetch's bound, count what a read layer holds:
    int4 decodes to fp32, several times its payload."""
    store = KVStore("fp", StoreConfig(max_memory_bytes=0, disk_dir=tmp_path, quantization=KVQuantization.INT4),
                    shape=SHAPE)
    kv = smooth_kv()  # [3 layers, 2 heads, 100 tokens, 64]
    key = store.key_for(kv.token_ids, kv.context_ids)
    store.put(key, kv)
    handle = store.handle(key)
    assert handle.entry.num_bytes == 3 * 2 * 2 * 100 * 64 * 4  # layers x (K, V) x heads x tokens x dim x fp32
    assert handle.entry.num_bytes > 4 * handle.layer_nbytes * handle.num_layers  # not the payload
    handle.entry.release()
    store.close()


@pytest.mark.parametrize("old", [FP16, INT8], ids=["float16", "int8"])
def test_entries_in_an_older_format_stay_readable_after_the_default_changes(tmp_path, old):
    kv = smooth_kv()
    old_key = chunk_key("fp", old, kv.token_ids, kv.context_ids)
    DiskBackend(tmp_path, 1 << 30, "fp", old, SHAPE).put(old_key, kv)  # written under the old default
    store = KVStore("fp", StoreConfig(max_memory_bytes=0, disk_dir=tmp_path, quantization=KVQuantization.INT4),
                    shape=SHAPE)
    assert store.key_for(kv.token_ids, kv.context_ids) != old_key  # new chunks get int4 entries
    found = store.get(old_key)
    assert found is not None and found.token_ids == kv.token_ids
    tolerance = 1e-2 if old == FP16 else 0.1
    assert torch.allclose(found.keys.float(), kv.keys, atol=tolerance * kv.keys.abs().max())
    handle = store.handle(old_key)  # streamed too
    assert handle is not None and handle.num_tokens == kv.num_tokens


@pytest.mark.parametrize("bits", range(1, 9))
def test_codes_of_every_width_pack_and_unpack_exactly(bits):
    for numel in (1, 7, 8, 9, 1000):
        codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8)
        packed = lowbit._pack(codes, bits)
        assert packed.numel() == -(-numel * bits // 8)  # bits per code, nothing more
        assert torch.equal(torch.from_numpy(lowbit._unpack_codes(packed.numpy(), bits, numel)), codes)


def _with_meta(blob: bytes, edit) -> bytearray:
    """`blob` with its header's ragblend metadata passed through `edit` (the tensors' bytes unchanged)."""
    import json
    import struct

    (n,) = struct.unpack("<Q", blob[:8])
    table = json.loads(blob[8: 8 + n])
    meta = json.loads(table["__metadata__"][codec.META_KEY])
    edit(meta)
    table["__metadata__"][codec.META_KEY] = json.dumps(meta)
    head = json.dumps(table).encode()
    head += b" " * (-len(head) % 8)
    return bytearray(struct.pack("<Q", len(head)) + head + blob[8 + n:])


def test_two_level_scales_store_under_a_quarter_of_float16_at_the_same_error():
    x = torch.stack([smooth_kv(num_tokens=512).keys[0], smooth_kv(num_tokens=512, seed=1).values[0]])  # [2, H, n, D]
    fp16_scales = lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=0)
    two_level = lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=0, scale_bits=8)
    sizes, errors = [], []
    for spec in (fp16_scales, two_level):
        payload = lowbit.encode_layer(x, spec)
        sizes.append(len(payload))
        errors.append((lowbit.decode_layer(payload, 2, 512, 64, spec, torch.float32) - x).abs().mean().item())
    assert sizes[0] > x.numel() * 2 / 4 >= sizes[1]  # float16 is 2 bytes an element; bit-packed, no zstd
    assert errors[1] <= errors[0] * 1.05


def test_a_constant_layer_round_trips_with_two_level_scales():
    spec = lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, scale_bits=8)
    x = torch.full((2, 2, 40, 8), 0.75)
    assert torch.equal(lowbit.decode_layer(lowbit.encode_layer(x, spec), 2, 40, 8, spec, torch.float32), x)


def test_int4_entries_written_before_headers_named_their_parameters_stay_readable(tmp_path, monkeypatch):
    kv = smooth_kv()
    key = chunk_key("fp", INT4, kv.token_ids, kv.context_ids)
    first = codec._FIRST_LOWBIT_SPECS[KVQuantization.INT4]
    monkeypatch.setitem(codec.LOWBIT_SPECS, KVQuantization.INT4, first)  # the encoder of the earlier version
    blob = _with_meta(codec.encode(kv, key, "fp", INT4), lambda meta: meta.pop("lowbit"))
    monkeypatch.undo()
    assert codec.LOWBIT_SPECS[KVQuantization.INT4] != first
    header = codec.read_header(blob, key, "fp", INT4, kv.shape)
    assert header.lowbit_spec == first
    out = codec.decode(header, lambda b, e: bytearray(blob[b:e]))
    assert torch.allclose(out.keys.float(), kv.keys, atol=0.05 * kv.keys.abs().max())
    (begin, end), = header.layer_ranges[0]
    with pytest.raises(ValueError):  # the new parameters cannot read it: the header's choice made it readable
        lowbit.decode_layer(bytes(blob[begin:end]), 2, 100, 64, codec.LOWBIT_SPECS[KVQuantization.INT4])


def test_an_entry_naming_unknown_low_bit_parameters_is_damaged():
    kv = smooth_kv()
    key = chunk_key("fp", INT4, kv.token_ids, kv.context_ids)
    blob = _with_meta(codec.encode(kv, key, "fp", INT4), lambda meta: meta.update(lowbit="k9v9"))
    with pytest.raises(CorruptEntryError, match="not known"):
        codec.read_header(blob, key, "fp", INT4, kv.shape)


def test_widths_by_range_sum_to_the_bits_and_follow_the_ranges():
    importance = torch.tensor([[1.0, 4.0, 16.0, 1e4], [0.0, 0.0, 0.0, 0.0]]).numpy()  # [H, m]
    widths = lowbit._widths_by_range(importance, total_bits=16)
    assert widths.sum(1).tolist() == [16, 16]  # each head's slices get its bits, 4 on average
    assert widths.min() >= lowbit.MIN_BITS and widths.max() <= lowbit.MAX_BITS
    assert (widths[0, :-1] <= widths[0, 1:]).all() and widths[0, 3] == 8  # a wider range, more bits
    # a step b -> b+1 removes importance * 4^-b: slice 1 (4x slice 0's) earns one bit more
    assert widths[0, 1] == widths[0, 0] + 1
    assert lowbit._widths_by_range(importance, total_bits=14).sum(1).tolist() == [14, 14]  # 3.5 on average


def _uneven_kv(num_tokens=512) -> torch.Tensor:
    """[2, H, n, D]: keys with outlier channels, values whose tokens' ranges differ by up to 10x."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2, num_tokens, 64, generator=g) * (0.3 + 3 * torch.rand(2, num_tokens, 1, generator=g) ** 4)
    return torch.stack([smooth_kv(num_tokens=num_tokens).keys[0], values])


@pytest.mark.parametrize("scale_bits", [8, 16])
def test_widths_by_range_cut_the_error_at_the_same_bytes(scale_bits):
    x = _uneven_kv()  # [2, H, n, D]
    uniform = lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=0, scale_bits=scale_bits)
    by_range = replace(uniform, key_widths=lowbit.BitWidths.BY_RANGE, value_widths=lowbit.BitWidths.BY_RANGE)
    assert by_range.tag != uniform.tag
    outs, sizes = [], []
    for spec in (uniform, by_range):
        payload = lowbit.encode_layer(x, spec)
        sizes.append(len(payload))
        outs.append(lowbit.decode_layer(payload, 2, 512, 64, spec, torch.float32))  # [2, H, n, D]
    num_widths = 2 * 64 + 2 * 512  # one per key channel and value token, 3 bits each
    assert sizes[1] <= sizes[0] + num_widths * 3 // 8 + 2 * lowbit.MAX_BITS  # and each width's padding
    assert sizes[1] <= lowbit.raw_size(2, 512, 64, by_range)
    for i in (0, 1):  # keys, values: measured ~2x lower squared error on these (a model's: kv-codec.md)
        errors = [((out[i] - x[i]) ** 2).mean().item() for out in outs]
        assert errors[1] < errors[0] / 1.3


def test_half_bits_by_range_round_trip_and_one_width_needs_whole_bits():
    spec = lowbit.LowBitSpec(key_bits=3.5, value_bits=3.5, group_tokens=32, key_widths=lowbit.BitWidths.BY_RANGE,
                             value_widths=lowbit.BitWidths.BY_RANGE, scale_bits=8)
    assert spec.tag == "k3.5rv3.5rg32z3s8"
    for num_tokens in (1, 33, 100):
        x = _uneven_kv(num_tokens)
        out = lowbit.decode_layer(lowbit.encode_layer(x, spec), 2, num_tokens, 64, spec, torch.float32)
        assert out.shape == x.shape and ((out - x).abs() < 0.5 * x.abs().amax()).all()
    with pytest.raises(ValueError, match="width"):
        lowbit.LowBitSpec(key_bits=3.5)
    with pytest.raises(ValueError, match="1/2"):
        replace(spec, value_bits=3.25)


def test_the_decode_is_the_layout_read_step_by_step():
    """decode_layer against the format's layout read one part and one width at a time here: each
    width's codes unpacked apart (`_unpack_codes`, exact at every width), put back in slice order by row
    number, code * step + min in numpy."""
    spec = lowbit.LowBitSpec(key_bits=3.5, value_bits=3.5, group_tokens=32, zstd_level=0, scale_bits=16,
                             key_widths=lowbit.BitWidths.BY_RANGE, value_widths=lowbit.BitWidths.BY_RANGE)
    num_heads, num_tokens, head_dim, g = 2, 70, 64, 32  # a last, shorter key group
    x = _uneven_kv(num_tokens)
    payload = lowbit.encode_layer(x, spec)
    buf, offset = np.frombuffer(payload, dtype=np.uint8), 0

    def take(size: int) -> np.ndarray:
        nonlocal offset
        offset += size
        return buf[offset - size : offset]

    def codes_of(widths: np.ndarray, slice_len: int) -> np.ndarray:  # -> [H, m, slice_len] in slice order
        take(-(-widths.size * 3 // 8))  # the widths themselves, 3 bits each (read by layer_widths)
        flat = widths.reshape(-1)
        codes = np.zeros((flat.size, slice_len), dtype=np.uint8)
        for bits in range(1, 9):  # each width's codes, padded to whole bytes
            rows = np.flatnonzero(flat == bits)
            size = -(-rows.size * slice_len * bits // 8)
            codes[rows] = lowbit._unpack_codes(take(size), bits, rows.size * slice_len).reshape(-1, slice_len)
        return codes.reshape(*widths.shape, slice_len)

    key_widths, value_widths = lowbit.layer_widths(payload, num_heads, num_tokens, head_dim, spec)
    assert len(np.unique(key_widths)) > 2 and len(np.unique(value_widths)) > 2  # several widths each
    keys = codes_of(key_widths, num_tokens).transpose(0, 2, 1)  # [H, n, D]
    values = codes_of(value_widths, head_dim)  # [H, n, D]
    num_groups = -(-num_tokens // g)
    k_lo, k_step = (take(2 * num_heads * num_groups * head_dim).view(np.float16).astype(np.float32)
                    .reshape(num_heads, num_groups, head_dim).repeat(g, axis=1)[:, :num_tokens] for _ in range(2))
    v_lo, v_step = (take(2 * num_heads * num_tokens).view(np.float16).astype(np.float32)
                    .reshape(num_heads, num_tokens, 1) for _ in range(2))
    assert offset == buf.size
    expected = np.stack([keys * k_step + k_lo, values * v_step + v_lo])  # [2, H, n, D]
    out = lowbit.decode_layer(payload, num_heads, num_tokens, head_dim, spec, torch.float32)
    assert torch.equal(out, torch.from_numpy(expected.astype(np.float32)))


def test_damaged_bit_widths_are_a_malformed_payload():
    spec = lowbit.LowBitSpec(key_bits=4, value_bits=3, group_tokens=32, zstd_level=0,
                             key_widths=lowbit.BitWidths.BY_RANGE)
    x = torch.stack([smooth_kv().keys[0], smooth_kv().values[0]])
    payload = bytearray(lowbit.encode_layer(x, spec))
    payload[0] ^= 0x07  # the first key channel's width changes: its head's no longer sum to its bits
    with pytest.raises(ValueError, match="widths"):
        lowbit.decode_layer(bytes(payload), 2, 100, 64, spec)
    with pytest.raises(ValueError, match="deltas"):
        replace(spec, is_delta=True)


@pytest.mark.parametrize("earlier", codec._EARLIER_LOWBIT_SPECS, ids=lambda spec: spec.tag)
def test_int4_entries_written_with_earlier_parameters_stay_readable(earlier, monkeypatch):
    kv = smooth_kv()
    key = chunk_key("fp", INT4, kv.token_ids, kv.context_ids)
    monkeypatch.setitem(codec.LOWBIT_SPECS, KVQuantization.INT4, earlier)  # the earlier version's encoder
    blob = bytearray(codec.encode(kv, key, "fp", INT4))
    monkeypatch.undo()
    assert codec.LOWBIT_SPECS[KVQuantization.INT4] != earlier
    header = codec.read_header(blob, key, "fp", INT4, kv.shape)
    assert header.lowbit_spec == earlier  # by the header's tag, under the same key
    out = codec.decode(header, lambda b, e: bytearray(blob[b:e]))
    assert torch.allclose(out.keys.float(), kv.keys, atol=0.05 * kv.keys.abs().max())
