"""What a quantized CPU engine decodes over (`model.decode_cache`): a bf16 or an int8 copy of the
prompt's cache, each close to decoding over the prefill's own fp32 cache, which it leaves untouched."""

import pytest
import torch

from blend_engine.attention import attend, attend_int8, attend_last_int8, fold_int8_queries, last_meta
from blend_engine.decode_cache import Int8KVCache, Int8Layer, quantize_rows, resolve_decode_cache, write_rows
from blend_engine.kv import KVCache
from blend_engine.layer import rotate, rotate_into
from blend_engine.runner import apply_rope, signed_sin
from blend_engine.types import PrefillMode
from configs.enums import DecodeCache, WeightFormat
from configs.settings import load_settings
from engine_models import cpu_exact, random_ids
from test_engine_blend import rag_prompt
from test_engine_weights import _quantized_engine

pytestmark = cpu_exact  # the int8 kernel is torch's CPU one


def test_auto_is_int8_for_quantized_cpu_engines_only():
    assert load_settings().model.decode_cache == DecodeCache.AUTO
    assert _quantized_engine(WeightFormat.INT4).decode_cache == DecodeCache.INT8
    assert _quantized_engine(WeightFormat.INT8).decode_cache == DecodeCache.INT8
    assert _quantized_engine(WeightFormat.FP32).decode_cache == DecodeCache.MODEL
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_cache(DecodeCache.AUTO, cpu, True, head_dim=72) == DecodeCache.BF16  # the kernel's unit is 16
    assert resolve_decode_cache(DecodeCache.AUTO, cuda, True, head_dim=64) == DecodeCache.MODEL
    with pytest.raises(ValueError, match="CPU only"):
        resolve_decode_cache(DecodeCache.INT8, cuda, True, head_dim=64)
    with pytest.raises(ValueError, match="divisible by 16"):
        resolve_decode_cache(DecodeCache.INT8, cpu, True, head_dim=72)
    with pytest.raises(Exception, match="int8"):
        load_settings(model={"decode_cache": "int4"})


@pytest.mark.parametrize("fmt", [DecodeCache.BF16, DecodeCache.INT8])
def test_decode_over_a_converted_cache_stays_close_and_leaves_the_prefill_cache(fmt):
    """Logits within bf16's resolution of decoding over the fp32 cache, same argmax; the copy grows
    past the prefill's capacity; the prefill's cache is not touched."""
    engine = _quantized_engine(WeightFormat.INT4)
    result = engine.prefill(rag_prompt(engine), PrefillMode.BLEND, max_new_tokens=2)
    n = len(result.token_ids)
    keys_before = result.cache.keys[:, :, :n].clone()
    tokens = random_ids(6, 77)  # more than max_new_tokens: the converted cache must grow
    decoder = engine.decoder(result, cache_format=fmt)
    steps = torch.stack([decoder.step(t) for t in tokens])
    assert decoder.cache.length == n + 6 and decoder.cache.capacity >= n + 6
    assert decoder.cache.keys.dtype == {DecodeCache.BF16: torch.bfloat16, DecodeCache.INT8: torch.int8}[fmt]
    assert result.cache.length == n and torch.equal(result.cache.keys[:, :, :n], keys_before)
    exact = engine.decoder(result, cache_format=DecodeCache.MODEL)
    reference = torch.stack([exact.step(t) for t in tokens])
    torch.testing.assert_close(steps, reference, atol=float(reference.abs().max()) * 2e-2, rtol=0)
    assert torch.equal(steps.argmax(-1), reference.argmax(-1))


def test_int8_rows_round_trip_within_half_a_step():
    torch.manual_seed(3)
    x = torch.randn(3, 50, 64) * torch.logspace(-2, 1, 50)[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: a tiny scale, no division by zero
    q, scales = quantize_rows(x)
    assert q.dtype == torch.int8 and scales.shape == (3, 50) and int(q.abs().max()) <= 127
    error = (q.float() * scales.float()[..., None] - x).abs()
    assert torch.all(error <= scales.float()[..., None] / 2 + 1e-7)
    assert torch.equal(q[0, 0], torch.zeros(64, dtype=torch.int8))


def _dequantized(kv: Int8Layer) -> tuple[torch.Tensor, torch.Tensor]:
    keys = kv.keys.float() * kv.key_scales.float()[..., None]  # [H_kv, N, D]
    values = kv.values_t[..., : kv.num_keys].transpose(1, 2).float() * kv.value_scales.float()[..., None]
    return keys, values


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,num_keys", [(9, 3, 64, 70), (4, 2, 16, 33), (4, 4, 48, 1)])
def test_attention_over_int8_equals_attention_over_the_dequantized_cache(num_heads, num_kv_heads, head_dim, num_keys):
    """The int8 kernel computes what the dequantized keys and values give (to bf16's resolution),
    for any number of keys; the slots past the length (uninitialised) get no weight."""
    torch.manual_seed(5)
    q = torch.randn(num_heads, 1, head_dim)
    cache = Int8KVCache(1, num_kv_heads, head_dim, num_keys + 10, torch.device("cpu"))
    assert cache.capacity % 32 == 0
    cache.values_t.fill_(100)  # garbage past the length must not leak in
    cache.extend(num_keys)
    kv = cache.update(0, slice(0, num_keys), torch.randn(num_kv_heads, num_keys, head_dim),
                      torch.randn(num_kv_heads, num_keys, head_dim))
    assert kv.num_keys == num_keys and kv.values_t.shape == (num_kv_heads, head_dim, cache.capacity)
    ref = attend(q, *_dequantized(kv), last_meta(num_keys), 0.125)  # [1, H*D]
    out = attend_last_int8(q, kv, 0.125)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=0)


def test_a_batch_over_int8_caches_is_each_sequence_alone_bit_for_bit(decode_kernel):
    """`batch_step`'s int8 path (`Int8KVCache.step`, `write_rows`, `attend_int8`) on B tokens,
    each over its own cache (different lengths, one growing, one with a column bias), writes and
    attends exactly as `Int8Slots.write` + `attend_last_int8` (the B = 1 decoder's) on each alone."""
    num_heads, num_kv_heads, head_dim, num_layers, scale = 6, 2, 32, 2, 0.2
    lengths = [5, 40, 32]  # the last fills its capacity: the step grows it

    def caches() -> list[Int8KVCache]:
        torch.manual_seed(8)
        out = []
        for length in lengths:
            cache = Int8KVCache(num_layers, num_kv_heads, head_dim, length, torch.device("cpu"))
            cache.extend(length)
            for layer in range(num_layers):
                cache.update(layer, slice(0, length), torch.randn(num_kv_heads, length, head_dim),
                             torch.randn(num_kv_heads, length, head_dim))
            out.append(cache)
        return out

    torch.manual_seed(9)
    q = torch.randn(num_layers, num_heads, len(lengths), head_dim)  # [L, H, B, D] per layer's tokens
    k, v = torch.randn(2, num_layers, num_kv_heads, len(lengths), head_dim)  # [L, H_kv, B, D] each
    biases = [None, torch.randn(41), None]  # sequence 1's column bias [N]

    alone = caches()
    positions = [cache.extend(1) for cache in alone]
    expected = [[attend_last_int8(q[layer, :, b : b + 1], cache.slots(layer).write(
                 slice(pos, pos + 1), k[layer, :, b : b + 1], v[layer, :, b : b + 1], pos + 1), scale, biases[b])
                 for layer in range(num_layers)] for b, (cache, pos) in enumerate(zip(alone, positions))]

    batched = caches()
    steps = [cache.step(cache.extend(1), num_heads // num_kv_heads) for cache in batched]
    assert batched[2].capacity > lengths[2]
    for layer in range(num_layers):
        write_rows(steps, layer, k[layer], v[layer])
        folded = fold_int8_queries(q[layer], scale, num_kv_heads)  # [B * H_kv, G, D]
        for b, step in enumerate(steps):
            out = attend_int8(folded[b * num_kv_heads : (b + 1) * num_kv_heads], step.layers[layer], biases[b],
                              step.heads[layer] if step.heads else None)
            assert torch.equal(out.reshape(1, -1).float(), expected[b][layer])
    for got, want in zip(batched, alone):
        n = want.length
        assert got.length == n
        for name in ("keys", "key_scales", "value_scales"):
            assert torch.equal(getattr(got, name)[:, :, :n], getattr(want, name)[:, :, :n])
        assert torch.equal(got.values_t[..., :n], want.values_t[..., :n])


def test_rotate_equals_apply_rope_bit_for_bit():
    torch.manual_seed(2)
    x, cos, sin = torch.randn(12, 3, 64), torch.randn(3, 64), torch.randn(3, 64)
    assert torch.equal(rotate(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_into_equals_apply_rope_bit_for_bit(dtype):
    """Laying out reused keys rotates them into a span of the cache (a strided view) in place."""
    torch.manual_seed(3)
    x = torch.randn(4, 3, 50, 64).to(dtype)  # [L, H_kv, n, D]
    cos, sin = torch.randn(50, 64).to(dtype), torch.randn(50, 64).to(dtype)
    cache = torch.zeros(4, 3, 80, 64, dtype=dtype)
    rotate_into(cache[..., 20:70, :], x, cos, signed_sin(sin))
    assert torch.equal(cache[..., 20:70, :], apply_rope(x, cos, sin))
    assert not cache[..., :20, :].any() and not cache[..., 70:, :].any()


def test_conversion_and_growth_keep_every_slot():
    cache = KVCache(2, 3, 16, 10, torch.device("cpu"), torch.float32)
    cache.extend(7)
    cache.keys.normal_(), cache.values.normal_()
    int8 = Int8KVCache.from_cache(cache)
    assert int8.length == 7 and int8.capacity == 32
    before = [_dequantized(int8.update(layer, slice(0, 0), cache.keys[layer, :, :0], cache.values[layer, :, :0]))
              for layer in range(2)]
    for layer in range(2):
        for got, want in zip(before[layer], cache.layer(layer)):
            torch.testing.assert_close(got, want, atol=float(want.abs().max()) / 127, rtol=0)
    int8.extend(40)  # past the capacity: grows, keeping the first 7 slots
    assert int8.capacity >= 47 and int8.capacity % 32 == 0
    for layer in range(2):
        kv = int8.update(layer, slice(7, 7), cache.keys[layer, :, :0], cache.values[layer, :, :0])
        after = _dequantized(Int8Layer(kv.keys[:, :7], kv.key_scales[:, :7], kv.values_t, kv.value_scales[:, :7], kv.unit_scales))
        assert all(torch.equal(a, b) for a, b in zip(after, before[layer]))
