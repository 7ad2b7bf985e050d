"""ragblend's decode kernels (blend_engine/csrc/: int4_gemv.cpp, int8_gemv.cpp, int8_attention.cpp,
rms_norm.cpp): built here, exact against their reference, and torch's kernels where they are off or cannot be
built."""

import fcntl
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from blend_engine import native
from blend_engine.attention import attend_int8_heads
from blend_engine.config import ModelConfig
from blend_engine.decode_cache import Int8KVCache, quantize_rows
from blend_engine.int4 import GROUP_SIZE, Int4Linear, _blocked, _nibbles
from blend_engine.weights import Int8Linear, quantize_int8

IS_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512")


def _built(monkeypatch, kernel):
    """`kernel()` (one of native's getters) with the kernels on, or the test skipped where they cannot be built."""
    monkeypatch.setattr(native, "_enabled", [True])
    op = kernel()
    if op is None:
        pytest.skip(f"not built here: {native.unavailable_reason()}")
    return op


@pytest.fixture
def int8_kernel(monkeypatch):
    return _built(monkeypatch, native.int8_mm)


@pytest.fixture
def kernel(monkeypatch):
    return _built(monkeypatch, native.int4_mm)


@pytest.mark.skipif(not IS_AVX2 or shutil.which("c++") is None, reason="needs x86-64 with AVX2 and a C++ compiler")
def test_the_kernels_build_on_an_avx2_machine_with_a_compiler(monkeypatch):
    monkeypatch.setattr(native, "_enabled", [True])
    assert native.int4_mm() is not None and native.int8_mm() is not None, native.unavailable_reason()
    assert native.int8_attention() is not None and native.int8_write() is not None
    assert Int4Linear.from_weight(torch.randn(16, 32)).is_native
    assert Int8Linear.from_weight(torch.randn(16, 32)).is_native
    assert not Int8Linear.from_weight(torch.randn(16, 24)).is_native  # rows not whole groups: torch's kernel


def test_a_dead_builders_lock_file_is_not_waited_on(monkeypatch):
    """torch's `lock` file, left by a builder killed mid-build, made every later process wait forever (a CI run
    hung so): a process holding ragblend's flock deletes it and builds or loads."""
    _built(monkeypatch, native.int4_mm)
    lock = native.build_directory() / "lock"
    lock.touch()
    code = "from blend_engine import native; assert native.int4_mm() is not None, native.unavailable_reason()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()


def test_each_ninja_on_path_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """Two ninja versions (Debian's, the venv's) cannot read each other's build logs and rebuild everything
    when they take turns in one folder (~75 s each time): the folder follows the ninja that PATH finds."""
    for version in ("1.11", "1.13"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "ninja").touch()
    monkeypatch.setattr(native.shutil, "which", lambda command: str(tmp_path / "1.11" / "ninja"))
    first = native.build_directory()
    assert native.build_directory() == first
    monkeypatch.setattr(native.shutil, "which", lambda command: str(tmp_path / "1.13" / "ninja"))
    assert native.build_directory() != first


def test_a_build_held_past_the_wait_falls_back_to_torch_with_its_reason(monkeypatch):
    _built(monkeypatch, native.int4_mm)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "BUILD_WAIT_S", 0.5)
    with open(native.build_directory().with_suffix(".flock"), "a") as other_builder:
        fcntl.flock(other_builder.fileno(), fcntl.LOCK_EX)  # another open file: the flocks conflict
        assert native.int4_mm() is None
    assert "another process has held the build" in native.unavailable_reason()
    monkeypatch.setattr(native, "_state", {})
    assert native.int4_mm() is not None  # the turn let go of: built (loaded) again


def _layer(num_out: int, num_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels [out, in] 0..15, scales_zeros [in / 32, out, 2] bf16, the dequantized weight [out, in] fp32)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (num_out, num_in), generator=g)
    scales_zeros = (torch.randn(num_in // GROUP_SIZE, num_out, 2, generator=g) * 0.02).bfloat16()
    scale, zero = (scales_zeros[..., i].t().float()[..., None] for i in (0, 1))  # [out, in / 32, 1]
    weight = ((levels.float().reshape(num_out, -1, GROUP_SIZE) - 8) * scale + zero).reshape(num_out, num_in)
    return levels, scales_zeros, weight


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: int8 levels per group of 32, scale max|x| / 127."""
    groups = x.reshape(x.shape[0], -1, GROUP_SIZE)
    step = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / torch.where(step > 0, step, 1)) * step).reshape(x.shape)


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 32])
@pytest.mark.parametrize("shape", [(8, 32), (264, 96), (16, 128), (1536, 8960 // 4)])  # lone last groups, pairs
def test_the_kernel_is_the_dequantized_weight_times_x_rounded_to_int8(kernel, num_rows, shape):
    levels, scales_zeros, weight = _layer(*shape, seed=num_rows)
    x = torch.randn(num_rows, shape[1]) * torch.logspace(-2, 1, shape[1])  # groups of very different scales
    x[0, :GROUP_SIZE] = 0  # a group of zeros: scale 0, contributes nothing
    out = kernel(x, _nibbles(levels), _blocked(scales_zeros))
    ref = _int8_rows(x).double() @ weight.double().t()
    assert out.shape == (num_rows, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=float(ref.abs().max()) * 1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_rows", [2, 9, 17])  # rows 9 and 17 are a chunk of one: the single row's own body
def test_each_row_of_a_batch_is_that_row_alone_bit_for_bit(kernel, int8_kernel, num_rows):
    """Decode's single row and a batch's rows go through different bodies of each kernel (csrc's block_rows<1>
    and <8>); a batched step's rows must equal each sequence's step alone."""
    levels, scales_zeros, _ = _layer(264, 96, seed=num_rows)
    q, scales = quantize_int8(torch.randn(264, 96))
    x = torch.randn(num_rows, 96) * torch.logspace(-2, 1, 96)
    nibbles, block_scales = _nibbles(levels), _blocked(scales_zeros)
    for multiply in (lambda rows: kernel(rows, nibbles, block_scales), lambda rows: int8_kernel(rows, q, scales)):
        out = multiply(x)
        for m in range(num_rows):
            assert torch.equal(out[m:m + 1], multiply(x[m:m + 1].contiguous())), m


def test_the_kernel_reads_a_fused_parts_blocks(kernel):
    """A fused q/k/v's part views its blocks of the fused nibbles and block scales."""
    levels, scales_zeros, weight = _layer(64, 128, seed=5)
    part = slice(16, 40)  # blocks 2-4 of 8 rows
    x = torch.randn(2, 128)
    out = kernel(x, _nibbles(levels)[2:5], _blocked(scales_zeros)[2:5])
    torch.testing.assert_close(out, _int8_rows(x) @ weight[part].t(), atol=1e-4, rtol=1e-5)


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    levels, scales_zeros, _ = _layer(16, 64, seed=6)
    nibbles, block_scales = _nibbles(levels), _blocked(scales_zeros)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(torch.randn(1, 64).bfloat16(), nibbles, block_scales)
    with pytest.raises(RuntimeError, match=r"block_scales: \[N/8, K/32, 8, 2\]"):
        kernel(torch.randn(1, 96), _nibbles(_layer(16, 96, 6)[0]), block_scales)  # scales of another width
    with pytest.raises(RuntimeError, match="each block's contiguous"):
        kernel(torch.randn(1, 64), nibbles, block_scales.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="each block's contiguous"):
        kernel(torch.randn(1, 64), nibbles, scales_zeros)  # the pairs by group, as from_q takes them


def test_decode_kernel_torch_uses_torchs_kernels(monkeypatch):
    """`model.decode_kernel: torch` (the loader's `native.enable(False)`): layers made then multiply by torch's
    kernels, int4 over its own layout, made at the first decode call."""
    monkeypatch.setattr(native, "_enabled", [True])
    native.enable(ModelConfig(decode_kernel="torch").decode_kernel == "auto")
    assert native.int4_mm() is None and native.int8_mm() is None and native.unavailable_reason() is None
    assert native.int8_attention() is None and native.int8_write() is None
    assert not Int8Linear.from_weight(torch.randn(16, 32)).is_native
    levels, scales_zeros, weight = _layer(32, 64, seed=7)
    linear = Int4Linear.from_q(levels, scales_zeros, None)
    assert not linear.is_native and linear._torch_layout is None
    x = torch.randn(1, 64)
    torch.testing.assert_close(linear(x), x.bfloat16().float() @ weight.t(), atol=1e-2, rtol=2**-7)
    assert linear._torch_layout is not None


def test_a_machine_without_avx2_falls_back_with_its_reason(monkeypatch):
    monkeypatch.setattr(native, "_enabled", [True])
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert native.int4_mm() is None and native.int8_mm() is None and native.int8_attention() is None
    assert "need AVX2" in native.unavailable_reason()
    assert not Int4Linear.from_weight(torch.randn(16, 32)).is_native
    assert not Int8Linear.from_weight(torch.randn(16, 32)).is_native


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 32])
@pytest.mark.parametrize("shape", [(8, 32), (13, 64), (264, 96), (1536, 8960 // 4)])  # 13: a last block of 5 rows
def test_the_int8_kernel_is_the_dequantized_weight_times_x_rounded_to_int8(int8_kernel, num_rows, shape):
    g = torch.Generator().manual_seed(num_rows)
    q, scales = quantize_int8(torch.randn(*shape, generator=g) * torch.logspace(-2, 0, shape[0])[:, None])
    q[0, :3] = torch.tensor([-128, 127, -127], dtype=torch.int8)  # the extremes: -128 is a valid int8 level too
    x = torch.randn(num_rows, shape[1], generator=g) * torch.logspace(-2, 1, shape[1])
    x[0, :GROUP_SIZE] = 0  # a group of zeros: scale 0, contributes nothing
    out = int8_kernel(x, q, scales)
    ref = _int8_rows(x).double() @ (q.double() * scales.double()[:, None]).t()
    assert out.shape == (num_rows, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=float(ref.abs().max()) * 1e-5, rtol=1e-5)


def test_the_int8_kernel_reads_a_fused_parts_rows(int8_kernel):
    """A fused q/k/v's part is a view of its rows of the fused levels and scales."""
    q, scales = quantize_int8(torch.randn(64, 128))
    part = slice(16, 40)
    x = torch.randn(2, 128)
    ref = _int8_rows(x) @ (q[part].float() * scales[part].float()[:, None]).t()
    torch.testing.assert_close(int8_kernel(x, q[part], scales[part]), ref, atol=1e-4, rtol=1e-5)
    wide = torch.zeros(64, 160, dtype=torch.int8)
    wide[:, :128] = q  # rows further apart than their length
    torch.testing.assert_close(int8_kernel(x, wide[part, :128], scales[part]), ref, atol=1e-4, rtol=1e-5)


def test_the_int8_kernel_refuses_what_it_cannot_read(int8_kernel):
    q, scales = quantize_int8(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="fp32"):
        int8_kernel(torch.randn(1, 64).bfloat16(), q, scales)
    with pytest.raises(RuntimeError, match="K % 32"):
        int8_kernel(torch.randn(1, 48), quantize_int8(torch.randn(16, 48))[0], scales)
    with pytest.raises(RuntimeError, match="one a row"):
        int8_kernel(torch.randn(1, 64), q, scales[:8])
    with pytest.raises(RuntimeError, match="rows contiguous"):
        int8_kernel(torch.randn(1, 64), q.t().contiguous().t(), scales)


@pytest.fixture
def attention_kernel(monkeypatch):
    return _built(monkeypatch, native.int8_attention)


def _int8_layer(num_kv_heads: int, head_dim: int, num_keys: int, seed: int):
    """One layer of an int8 decode cache holding num_keys random keys and values; the slots past them garbage."""
    torch.manual_seed(seed)
    cache = Int8KVCache(1, num_kv_heads, head_dim, num_keys, torch.device("cpu"))
    cache.values_t.fill_(-100)  # garbage past the length: must get no weight
    cache.extend(num_keys)
    keys = torch.randn(num_kv_heads, num_keys, head_dim) * torch.logspace(-1, 1, num_keys)[:, None]
    return cache.update(0, slice(0, num_keys), keys, torch.randn(num_kv_heads, num_keys, head_dim))


@pytest.mark.parametrize("num_kv_heads,group,head_dim,num_keys", [
    (2, 6, 128, 3019), (3, 3, 64, 37), (2, 7, 64, 8), (1, 8, 128, 1), (4, 1, 32, 100), (2, 5, 16, 9), (2, 2, 64, 300)])
@pytest.mark.parametrize("biased", [False, True])
def test_the_attention_kernel_is_the_torch_paths_attention(attention_kernel, num_kv_heads, group, head_dim, num_keys,
                                                           biased):
    """csrc/int8_attention.cpp rounds where the torch path (`attend_int8_heads`) rounds, in its order: bit for bit
    where torch runs its AVX2 int8 kernel (its AVX512 one adds in another order: within a bf16 step there)."""
    kv = _int8_layer(num_kv_heads, head_dim, num_keys, seed=num_keys + group)
    q = (torch.randn(num_kv_heads, group, head_dim) * 0.3).bfloat16()
    bias = torch.randn(num_keys) if biased else None
    out = attention_kernel(q, kv.keys, kv.key_scales, kv.values_t, kv.value_scales, bias)
    ref = torch.stack(attend_int8_heads(q.unbind(0), kv.heads(group), bias))
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=2**-7)


def test_the_attention_kernel_refuses_what_it_cannot_read(attention_kernel):
    kv = _int8_layer(2, 64, 20, seed=1)
    parts = kv.keys, kv.key_scales, kv.values_t, kv.value_scales
    with pytest.raises(RuntimeError, match="at most 8 query heads"):
        attention_kernel(torch.randn(2, 9, 64).bfloat16(), *parts)
    with pytest.raises(RuntimeError, match="bf16 contiguous"):
        attention_kernel(torch.randn(2, 6, 64), *parts)
    with pytest.raises(RuntimeError, match="C >= N rounded up to 8"):
        attention_kernel(torch.randn(2, 6, 64).bfloat16(), kv.keys, kv.key_scales, kv.values_t[..., :16],
                         kv.value_scales)
    with pytest.raises(RuntimeError, match=r"bias: \[N\]"):
        attention_kernel(torch.randn(2, 6, 64).bfloat16(), *parts, torch.zeros(19))
    with pytest.raises(RuntimeError, match="CPU tensors only"):  # another device's memory: refused, never read
        attention_kernel(torch.empty(2, 6, 64, dtype=torch.bfloat16, device="meta"), *parts)


@pytest.mark.parametrize("num_kv_heads,head_dim,num_rows,start", [(2, 128, 1, 17), (3, 64, 5, 0), (2, 128, 32, 64)])
def test_the_write_kernel_is_quantize_rows_bit_for_bit(monkeypatch, num_kv_heads, head_dim, num_rows, start):
    """A decode step's new K/V through csrc's write: the levels and scales `quantize_rows` gives, at their slots,
    the others untouched: rows of zeros, halves (ties to even) and wide ranges included."""
    write = _built(monkeypatch, native.int8_write)
    torch.manual_seed(num_rows)
    k = torch.randn(num_kv_heads, num_rows, head_dim) * torch.rand(num_kv_heads, num_rows, 1) * 10
    v = torch.randn(num_kv_heads, num_rows, head_dim)
    k[0, 0] = 0
    v[-1, -1, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, 127.5])
    cache = Int8KVCache(1, num_kv_heads, head_dim, start + num_rows + 8, torch.device("cpu"))
    for buffer in cache._buffers():
        buffer.zero_()
    write(k, v, cache.keys[0], cache.key_scales[0], cache.values_t[0], cache.value_scales[0], start)
    levels, scales = quantize_rows(torch.cat([k, v]))  # [2 H_kv, n, D], [2 H_kv, n]
    slots = slice(start, start + num_rows)
    assert torch.equal(cache.keys[0, :, slots], levels[:num_kv_heads])
    assert torch.equal(cache.key_scales[0, :, slots], scales[:num_kv_heads])
    assert torch.equal(cache.values_t[0, :, :, slots], levels[num_kv_heads:].transpose(1, 2))
    assert torch.equal(cache.value_scales[0, :, slots], scales[num_kv_heads:])
    untouched = torch.ones(cache.capacity, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.keys[0, :, untouched].any() and not cache.values_t[0, :, :, untouched].any()


@pytest.fixture
def rms_norm_kernel(monkeypatch):
    return _built(monkeypatch, native.rms_norm)


@pytest.mark.parametrize("width", [8, 24, 100, 576, 896, 1000, 1536, 8960, 8 * 4 * 16 * 17 + 8])  # tails, cascades
@pytest.mark.parametrize("num_rows", [1, 3, 70, 700])  # 70 and 700: torch's sums over its threads
def test_the_rms_norm_kernel_is_torchs_rms_norm_bit_for_bit(rms_norm_kernel, width, num_rows):
    g = torch.Generator().manual_seed(width + num_rows)
    weight = torch.randn(width, generator=g)
    for magnitude in (1e-3, 1.0, 1e3):  # rows of very different scales: the order of additions shows
        x = torch.randn(num_rows, width, generator=g) * torch.logspace(-3, 3, width)[torch.randperm(width, generator=g)]
        x *= magnitude
        assert torch.equal(rms_norm_kernel(x, weight, 1e-6), F.rms_norm(x, (width,), weight=weight, eps=1e-6))


def test_the_rms_norm_kernel_refuses_what_it_cannot_read(rms_norm_kernel):
    with pytest.raises(RuntimeError, match="fp32"):
        rms_norm_kernel(torch.randn(1, 64).bfloat16(), torch.randn(64), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm_kernel(torch.randn(1, 64), torch.randn(32), 1e-6)
    with pytest.raises(RuntimeError, match="rows of 8"):
        rms_norm_kernel(torch.randn(1, 4), torch.randn(4), 1e-6)


def test_a_models_rms_norms_go_through_the_kernel_with_torchs_bits(rms_norm_kernel):
    """layer.norm_call: a known plain RMSNorm on fp32 rows is the kernel where it is built; inputs it does not
    take (3-D, bf16) go to torch's."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from blend_engine.layer import norm_call

    norm = Qwen2RMSNorm(96, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    call = norm_call(norm, torch.float32)
    assert call is not norm and getattr(call, "__name__", "") == "rms_norm"
    for x in (torch.randn(5, 96), torch.randn(2, 5, 96)):
        with torch.inference_mode():
            assert torch.equal(call(x), F.rms_norm(x, (96,), weight=norm.weight, eps=1e-6))
