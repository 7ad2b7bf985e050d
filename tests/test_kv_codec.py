"""Keys and the entry codec: content addressing, layout, fidelity per storage dtype, validation."""

import pytest
import safetensors.torch
import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import codec
from kv_store.errors import CorruptEntryError
from kv_store.keys import StorageFormat, chunk_key, is_valid_key

FP16 = StorageFormat(StorageDtype.FLOAT16)
FP32 = StorageFormat(StorageDtype.FLOAT32)


def random_kv(num_tokens=40, num_layers=3, num_kv_heads=2, head_dim=16, seed=0, context_ids=(1,)) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_kv_heads, num_tokens, head_dim)
    tokens = tuple(torch.randint(0, 1000, (num_tokens,), generator=g).tolist())
    return ChunkKV(tokens, context_ids, torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def roundtrip(kv: ChunkKV, fmt: StorageFormat) -> ChunkKV:
    key = chunk_key("fp", fmt, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", fmt))
    header = codec.read_header(blob, key, "fp", fmt, kv.shape)
    return codec.decode(header, lambda b, e: memoryview(blob)[b:e])


def test_key_depends_on_tokens_context_fingerprint_and_format():
    base = chunk_key("model-a", FP16, (1, 2, 3), (0,))
    assert is_valid_key(base) and base == chunk_key("model-a", FP16, [1, 2, 3], [0])
    variants = [
        chunk_key("model-b", FP16, (1, 2, 3), (0,)),
        chunk_key("model-a", FP32, (1, 2, 3), (0,)),
        chunk_key("model-a", StorageFormat(StorageDtype.FLOAT16, KVQuantization.INT8), (1, 2, 3), (0,)),
        chunk_key("model-a", FP16, (1, 2, 4), (0,)),
        chunk_key("model-a", FP16, (1, 2, 3), ()),
        chunk_key("model-a", FP16, (0, 1, 2, 3), ()),  # same concatenation, different split
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_key_requires_fingerprint_and_rejects_foreign_keys():
    with pytest.raises(ValueError, match="fingerprint"):
        chunk_key("", FP16, (1,), ())
    assert not is_valid_key("../../etc/passwd")
    assert not is_valid_key("A" * 64)


def test_fp32_roundtrip_is_bit_exact():
    kv = random_kv()
    out = roundtrip(kv, FP32)
    assert out.token_ids == kv.token_ids and out.context_ids == kv.context_ids
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)


@pytest.mark.parametrize("dtype,torch_dtype", [(StorageDtype.FLOAT16, torch.float16), (StorageDtype.BFLOAT16, torch.bfloat16)])
def test_half_roundtrip_equals_rounding(dtype, torch_dtype):
    kv = random_kv()
    out = roundtrip(kv, StorageFormat(dtype))
    assert out.keys.dtype == torch_dtype
    assert torch.equal(out.keys, kv.keys.to(torch_dtype)) and torch.equal(out.values, kv.values.to(torch_dtype))


def test_int8_per_channel_error_is_bounded():
    kv = random_kv(num_tokens=200)
    kv = ChunkKV(kv.token_ids, kv.context_ids, kv.keys * torch.linspace(0.1, 10, 16), kv.values)  # outlier channels
    out = roundtrip(kv, StorageFormat(StorageDtype.FLOAT32, KVQuantization.INT8))
    # per-channel absmax: error <= half a step of each channel's scale
    step = kv.keys.abs().amax(dim=2, keepdim=True) / 127
    assert ((out.keys - kv.keys).abs() <= step / 2 + 1e-6).all()
    rel = (out.values - kv.values).norm() / kv.values.norm()
    assert rel < 0.02


def test_blob_is_a_valid_safetensors_file():
    kv = random_kv()
    key = chunk_key("fp", FP16, kv.token_ids, kv.context_ids)
    tensors = safetensors.torch.load(codec.encode(kv, key, "fp", FP16))
    assert set(tensors) == {f"kv.{i}" for i in range(3)}
    assert torch.equal(tensors["kv.1"][1], kv.values[1].half())


def test_layer_ranges_allow_single_layer_decode():
    kv = random_kv()
    key = chunk_key("fp", FP32, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", FP32))
    header = codec.read_header(blob, key, "fp", FP32, kv.shape)
    k, v = codec.decode_layer(header, 2, [bytearray(blob[b:e]) for b, e in header.layer_ranges[2]])
    assert torch.equal(k, kv.keys[2]) and torch.equal(v, kv.values[2])
    assert header.layer_nbytes(2) == codec.storage_bytes_per_layer(2, 40, 16, FP32)


def _header_error(blob: bytearray, key, fingerprint="fp", fmt=FP16, total=None, shape=random_kv().shape):
    with pytest.raises(CorruptEntryError) as info:
        codec.parse_header(blob[: codec.header_size(blob, len(blob))], total or len(blob), key, fingerprint, fmt, shape)
    return str(info.value)


def test_header_rejects_mismatches():
    kv = random_kv()
    key = chunk_key("fp", FP16, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", FP16))
    assert "another model" in _header_error(blob, key, fingerprint="other")
    # another format is not an error: the entry's own tag says how to read it (an entry written
    # before the default format changed stays readable under its key)
    assert codec.read_header(blob, key, "fp", FP32, kv.shape).fmt == FP16
    assert "expected" in _header_error(blob, "0" * 64)
    assert "the model's is (3, 4, 16)" in _header_error(blob, key, shape=KVShape(3, 4, 16))  # another model's shape
    assert "byte range" in _header_error(blob, key, total=len(blob) - 1)  # truncated
    with pytest.raises(CorruptEntryError, match="truncated"):
        codec.header_size(b"\x01\x02", 2)
    with pytest.raises(CorruptEntryError, match="implausible"):
        codec.header_size((1 << 40).to_bytes(8, "little"), 1 << 50)
    with pytest.raises(CorruptEntryError, match="truncated"):  # a header longer than its entry: refused unread
        codec.header_size(blob[:8], codec.header_size(blob, len(blob)) - 1)


def test_checksum_catches_a_flipped_byte():
    kv = random_kv()
    key = chunk_key("fp", FP16, kv.token_ids, kv.context_ids)
    blob = bytearray(codec.encode(kv, key, "fp", FP16))
    header = codec.read_header(blob, key, "fp", FP16, kv.shape)
    begin, end = header.layer_ranges[1][0]
    blob[begin + 7] ^= 0x01
    with pytest.raises(CorruptEntryError, match="checksum"):
        codec.decode_layer(header, 1, [bytearray(blob[begin:end])])


def test_a_salted_entry_records_its_salt_and_reads_back_only_under_its_own_key():
    """A collection's salt is part of its chunks' keys (kv_store/keys.py): the empty salt hashes as keys
    did before salts; a salted entry records its salt, so a reader can still check that its token ids
    hash to its key, and the same chunk filed under another salt's key reads as damaged."""
    kv = random_kv()
    unsalted = chunk_key("fp", FP16, kv.token_ids, kv.context_ids)
    assert chunk_key("fp", FP16, kv.token_ids, kv.context_ids, "") == unsalted
    salted = chunk_key("fp", FP16, kv.token_ids, kv.context_ids, "team-a")
    assert len({unsalted, salted, chunk_key("fp", FP16, kv.token_ids, kv.context_ids, "team-b")}) == 3
    blob = bytearray(codec.encode(ChunkKV(kv.token_ids, kv.context_ids, kv.keys, kv.values, "team-a"), salted, "fp", FP16))
    header = codec.read_header(blob, salted, "fp", FP16, kv.shape)
    back = codec.decode(header, lambda b, e: memoryview(blob)[b:e])
    assert header.salt == back.salt == "team-a" and torch.allclose(back.keys.float(), kv.keys, atol=1e-2)
    plain = bytes(codec.encode(kv, unsalted, "fp", FP16))
    assert b'"salt"' not in plain  # unsalted entries are written as before
    misfiled = bytearray(codec.encode(kv, salted, "fp", FP16))  # the salt left out: its key cannot be checked
    with pytest.raises(CorruptEntryError, match="token ids and context are not those of key"):
        codec.read_header(misfiled, salted, "fp", FP16, kv.shape)
