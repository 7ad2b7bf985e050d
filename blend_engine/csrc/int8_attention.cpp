// One decoded token's attention over one layer of the int8 decode cache (blend_engine/decode_cache.py), in one
// call, on x86-64 CPUs with AVX2 (blend_engine/native.py).
//
// The torch path (blend_engine/attention.py, `attend_int8_heads`) runs the two thin matmuls per KV head through
// `_weight_int8pack_mm` and ~15 small ops around them; at 3 019 keys a layer of the 1.5B took 0.54 ms, ~0.16 ms of
// it in the small ops (a 2-core AVX2 VM). This computes the same thing, and bit for bit where torch runs its AVX2
// kernel, because every rounding is the torch path's, in its order:
//   scores[h, g, n] = bf16(sum_k q[h, g, k] * (K[h, n, k] * key_scale[h, n]))   (torch's AVX2 int8 kernel: 8 fp32
//                     lanes over k in steps of 8, an FMA each, then its horizontal sum; q is bf16)
//   scores += bias                                                         (ATen's own add, into bf16)
//   p = softmax(scores, fp32)                                              (ATen's own softmax)
//   w[h, g, n] = bf16(p * value_scale[h, n])                               (fp32 product, rounded once)
//   out[h, g, d] = bf16(sum_n w[h, g, n] * V_t[h, d, n])                   (the same kernel's sums, scale 1)
// torch's p @ V runs over the whole capacity with zero weights past N; fma(0, v, acc) == acc, so stopping at N
// rounded up to 8 gives the same sums. The query heads of a KV head (at most 8) share each key's and value's
// widening to fp32, which torch repeats per block of 4 query rows.

#include "gemv.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ragblend {
namespace {

constexpr int64_t kMaxGroup = 8;     // query heads per KV head (GQA group) the kernel takes
constexpr int64_t kValueBlock = 256;  // keys per block of p @ V (attend_head)

// 8 int8 -> 8 fp32 (exact)
inline __m256 widen_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 widen_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 finite fp32 -> their nearest bf16 (ties to even), as fp32: c10::BFloat16(float)'s rounding
inline __m256 round_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// 8 finite fp32 -> 8 bf16 at dst (count < 8: the first count)
inline void store_bf16(at::BFloat16* dst, __m256 v, int64_t count) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);  // each < 2^16: packus keeps it
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  if (count == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
    return;
  }
  alignas(16) uint16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
  std::memcpy(dst, lanes, count * sizeof(uint16_t));
}

// x[0..7], 8 vectors of partial sums -> lane i the total of x[i], each added as torch's AVX2 `_mm256_reduce_add_ps`
// (int8mm_kernel.cpp) adds one vector: s_j = l_j + l_(j+4), then (s_0 + s_2) + (s_1 + s_3). Eight at once: the
// same additions (float addition commutes exactly), ~3 instructions a total instead of ~7
inline __m256 reduce8(const __m256* x) {
  __m256 s[4];  // s[p]: [s_0..3 of x[2p] | s_0..3 of x[2p+1]]
  for (int p = 0; p < 4; ++p) {
    s[p] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x31));
  }
  __m256 t[2];  // t[h], low half: [e(x[4h]), e(x[4h+2]), o(x[4h]), o(x[4h+2])], high: the same of x[4h+1], x[4h+3]
  for (int h = 0; h < 2; ++h) {  //   where e = s_0 + s_2, o = s_1 + s_3
    const __m256 even = _mm256_shuffle_ps(s[2 * h], s[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 odd = _mm256_shuffle_ps(s[2 * h], s[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1));
    t[h] = _mm256_hadd_ps(even, odd);
  }
  // low half: [e, o of x0 | e, o of x4] and [x2 | x6]; high half the same of x1, x5 and x3, x7
  const __m256 first = _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 second = _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1));
  const __m256 totals = _mm256_hadd_ps(first, second);  // [x0, x4, x2, x6 | x1, x5, x3, x7]
  return _mm256_permutevar8x32_ps(totals, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7));
}

// state[r * G + g] += sum over k0 <= k < k1 (multiples of 8) of a[g * lda + k] * (rows[r][k] * scales[r]), lane k % 8,
// for g < G, r < R (zeros first where `fresh`): the 8 lanes of torch's kernel, each one chain of FMAs in its order.
// A chain waits on the one before, so G x R independent chains (R = 2 rows) keep both FMA units busy where one row's
// G chains would wait on the FMA latency (by count, not measured apart); a row's widening serves G chains (torch's
// kernel widens it once per 4 rows of a)
template <int G, int R, bool kScaled>
inline void chains(const float* a, int64_t lda, const int8_t* const* rows, const float* scales, int64_t k0, int64_t k1,
                   __m256* state, bool fresh) {
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = fresh ? _mm256_setzero_ps() : state[r * G + g];
  for (int64_t k = k0; k < k1; k += 8) {
    __m256 b[R];
    for (int r = 0; r < R; ++r) {
      b[r] = widen_int8(rows[r] + k);
      // torch multiplies by the scale; p @ V's is 1 (exact either way), so it is skipped there
      if constexpr (kScaled) b[r] = _mm256_mul_ps(b[r], _mm256_broadcast_ss(scales + r));
    }
    // g outer: one load of a's vector for the R rows, 2 G accumulators + R rows + 1 in AVX2's 16 registers
    for (int g = 0; g < G; ++g) {
      const __m256 x = _mm256_loadu_ps(a + g * lda + k);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm256_fmadd_ps(x, b[r], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) state[r * G + g] = acc[r][g];
}

using Chains = void (*)(const float*, int64_t, const int8_t* const*, const float*, int64_t, int64_t, __m256*, bool);

// 2 rows at a time, or 1 where 2 G accumulators would not fit the registers (G of 7 and 8)
template <bool kScaled>
Chains chains_for(int64_t group) {
  switch (group) {
    case 1: return &chains<1, 2, kScaled>;
    case 2: return &chains<2, 2, kScaled>;
    case 3: return &chains<3, 2, kScaled>;
    case 4: return &chains<4, 2, kScaled>;
    case 5: return &chains<5, 2, kScaled>;
    case 6: return &chains<6, 2, kScaled>;
    case 7: return &chains<7, 1, kScaled>;
    default: return &chains<8, 1, kScaled>;
  }
}

inline int64_t rows_per_call(int64_t group) { return group <= 6 ? 2 : 1; }

// the chains' totals for 8 rows x G -> out[g * out_stride + i] for row i < count: state is [8 rows][G]
inline void store_totals(const __m256* state, int64_t group, at::BFloat16* out, int64_t out_stride, int64_t count) {
  __m256 x[8];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < 8; ++i) x[i] = state[i * group + g];
    store_bf16(out + g * out_stride, reduce8(x), count);
  }
}

struct Head {
  const float* q;  // [G, D] fp32
  const int8_t* keys;  // [N, D], row stride keys_stride
  int64_t keys_stride;
  const uint16_t* key_scales;  // [N] bf16 bits
  const int8_t* values_t;  // [D, >= padded], row stride values_stride
  int64_t values_stride;
  const uint16_t* value_scales;  // [N] bf16 bits
  at::BFloat16* out;  // [G, D]
};

// one KV head's attention on the calling thread: scores, bias, softmax (ATen's own: its exp), weights, p @ V
void attend_head(const Head& head, int64_t group, int64_t head_dim, int64_t num_keys, const at::Tensor& bias) {
  const int64_t padded = (num_keys + 7) / 8 * 8, step = rows_per_call(group);
  std::vector<__m256> state(std::max<int64_t>(8, head_dim) * group);

  // scores [G, N] bf16, 8 keys at a time
  auto scores = at::empty({group, num_keys}, at::kBFloat16);
  at::BFloat16* scores_p = scores.data_ptr<at::BFloat16>();
  const Chains key_chains = chains_for<true>(group);
  for (int64_t n0 = 0; n0 < num_keys; n0 += 8) {
    const int64_t count = std::min<int64_t>(8, num_keys - n0);
    for (int64_t i = 0; i < 8; i += step) {
      const int8_t* rows[2];
      float scales[2];
      for (int64_t r = 0; r < step; ++r) {  // keys past N: the last key again (finite; their totals are not stored)
        const int64_t n = std::min(n0 + i + r, num_keys - 1);
        rows[r] = head.keys + n * head.keys_stride;
        scales[r] = c10::detail::f32_from_bits(head.key_scales[n]);
      }
      key_chains(head.q, head_dim, rows, scales, 0, head_dim, state.data() + i * group, true);
    }
    store_totals(state.data(), group, scores_p + n0, num_keys, count);
  }
  if (bias.defined()) scores.add_(bias);  // ATen's add into bf16, as the torch path's `scores += bias`
  const auto probs = at::softmax(scores, -1, at::kFloat);  // [G, N] fp32
  const float* probs_p = probs.data_ptr<float>();

  // weights [G, padded]: bf16(p * value_scale) as fp32, zero past N
  std::vector<float> weights(group * padded, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    const float* p = probs_p + g * num_keys;
    float* w = weights.data() + g * padded;
    int64_t n = 0;
    for (; n + 8 <= num_keys; n += 8) {
      _mm256_storeu_ps(w + n, round_bf16(_mm256_mul_ps(_mm256_loadu_ps(p + n), widen_bf16(head.value_scales + n))));
    }
    for (; n < num_keys; ++n) w[n] = static_cast<float>(at::BFloat16(p[n] * c10::detail::f32_from_bits(head.value_scales[n])));
  }

  // p @ V a block of kValueBlock keys at a time for every row of V: the block's weights (6 x 256 fp32, 6 KB) stay
  // in L1 while V's rows go by, where whole rows of weights (72 KB at 3 019 keys) came from L2 for every pair of
  // V's rows; the chains wait in `state` ([D][G]) between blocks
  const Chains value_chains = chains_for<false>(group);
  for (int64_t k0 = 0; k0 < padded; k0 += kValueBlock) {
    const int64_t k1 = std::min(padded, k0 + kValueBlock);
    for (int64_t d = 0; d < head_dim; d += step) {
      const int8_t* rows[2] = {head.values_t + d * head.values_stride, head.values_t + (d + 1) * head.values_stride};
      value_chains(weights.data(), padded, rows, nullptr, k0, k1, state.data() + d * group, k0 == 0);
    }
  }
  for (int64_t d0 = 0; d0 < head_dim; d0 += 8) store_totals(state.data() + d0 * group, group, head.out + d0, head_dim, 8);
}

}  // namespace

// q [H_kv, G, D] bf16 contiguous (scaled; G <= 8, D % 8 == 0); keys [H_kv, N, D] int8, key_scales [H_kv, N] bf16,
// values_t [H_kv, D, C] int8 (C >= N rounded up to 8), value_scales [H_kv, N] bf16 (each with its last dimension
// contiguous); bias [N] or None -> out [H_kv, G, D] bf16. Each KV head runs on one thread, start to end (one
// parallel region a layer; on 2 threads the catalogue's 2 and 3 KV heads keep both busy, 3 unevenly).
at::Tensor int8_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& key_scales,
                          const at::Tensor& values_t, const at::Tensor& value_scales,
                          const c10::optional<at::Tensor>& bias) {
  for (const at::Tensor* t : {&q, &keys, &key_scales, &values_t, &value_scales}) TORCH_CHECK(t->is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q: [H_kv, G, D] bf16 contiguous");
  const int64_t num_kv_heads = q.size(0), group = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(group >= 1 && group <= kMaxGroup && head_dim % 8 == 0, "q: at most 8 query heads per KV head, D % 8 == 0");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kChar && keys.stride(2) == 1 && keys.size(0) == num_kv_heads &&
                  keys.size(2) == head_dim, "keys: [H_kv, N, D] int8, rows contiguous");
  const int64_t num_keys = keys.size(1);
  TORCH_CHECK(num_keys >= 1, "keys: at least one");
  const int64_t padded = (num_keys + 7) / 8 * 8;
  TORCH_CHECK(key_scales.dim() == 2 && key_scales.scalar_type() == at::kBFloat16 && key_scales.stride(1) == 1 &&
                  key_scales.size(0) == num_kv_heads && key_scales.size(1) == num_keys, "key_scales: [H_kv, N] bf16");
  TORCH_CHECK(values_t.dim() == 3 && values_t.scalar_type() == at::kChar && values_t.stride(2) == 1 &&
                  values_t.size(0) == num_kv_heads && values_t.size(1) == head_dim && values_t.size(2) >= padded,
              "values_t: [H_kv, D, C] int8 with C >= N rounded up to 8, rows contiguous");
  TORCH_CHECK(value_scales.dim() == 2 && value_scales.scalar_type() == at::kBFloat16 && value_scales.stride(1) == 1 &&
                  value_scales.size(0) == num_kv_heads && value_scales.size(1) == num_keys, "value_scales: [H_kv, N] bf16");
  const at::Tensor no_bias;
  const at::Tensor& column_bias = bias.has_value() ? *bias : no_bias;
  TORCH_CHECK(!column_bias.defined() || (column_bias.dim() == 1 && column_bias.size(0) == num_keys), "bias: [N]");

  const auto q32 = q.to(at::kFloat);  // [H_kv, G, D] fp32, widened once
  auto out = at::empty({num_kv_heads, group, head_dim}, q.options());  // [H_kv, G, D] bf16
  const auto* key_scales_p = reinterpret_cast<const uint16_t*>(key_scales.data_ptr<at::BFloat16>());
  const auto* value_scales_p = reinterpret_cast<const uint16_t*>(value_scales.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const Head head{q32.data_ptr<float>() + h * group * head_dim,
                      keys.data_ptr<int8_t>() + h * keys.stride(0), keys.stride(1),
                      key_scales_p + h * key_scales.stride(0),
                      values_t.data_ptr<int8_t>() + h * values_t.stride(0), values_t.stride(1),
                      value_scales_p + h * value_scales.stride(0),
                      out.data_ptr<at::BFloat16>() + h * group * head_dim};
      attend_head(head, group, head_dim, num_keys, column_bias);
    }
  });
  return out;
}

// k, v [H_kv, n, D] fp32 (rows contiguous) -> the int8 cache's slots start .. start + n: keys [H_kv, C, D] int8,
// key_scales [H_kv, C] bf16, values_t [H_kv, D, C] int8, value_scales [H_kv, C] bf16. Each row as
// `quantize_rows` (blend_engine/decode_cache.py) makes it, bit for bit: scale = bf16(max(max|x| / 127, 1e-8)),
// level = clamp(round_half_even(x / scale), -127, 127); one call where the torch path made ~12 small ones.
void int8_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys, const at::Tensor& key_scales,
                const at::Tensor& values_t, const at::Tensor& value_scales, int64_t start) {
  for (const at::Tensor* t : {&k, &v, &keys, &key_scales, &values_t, &value_scales}) TORCH_CHECK(t->is_cpu(), "CPU tensors only");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.stride(2) == 1 && v.sizes() == k.sizes() &&
                  v.scalar_type() == at::kFloat && v.stride(2) == 1, "k, v: [H_kv, n, D] fp32, rows contiguous");
  const int64_t num_kv_heads = k.size(0), count = k.size(1), head_dim = k.size(2);
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kChar && keys.stride(2) == 1 && keys.size(0) == num_kv_heads &&
                  keys.size(2) == head_dim, "keys: [H_kv, C, D] int8, rows contiguous");
  const int64_t capacity = keys.size(1);
  TORCH_CHECK(start >= 0 && start + count <= capacity, "slots start .. start + n must lie in the capacity");
  TORCH_CHECK(values_t.dim() == 3 && values_t.scalar_type() == at::kChar && values_t.size(0) == num_kv_heads &&
                  values_t.size(1) == head_dim && values_t.size(2) == capacity, "values_t: [H_kv, D, C] int8");
  for (const at::Tensor* scales : {&key_scales, &value_scales}) {
    TORCH_CHECK(scales->dim() == 2 && scales->scalar_type() == at::kBFloat16 && scales->size(0) == num_kv_heads &&
                    scales->size(1) == capacity, "key_scales, value_scales: [H_kv, C] bf16");
  }
  const float* k_p = k.data_ptr<float>();
  const float* v_p = v.data_ptr<float>();
  int8_t* keys_p = keys.data_ptr<int8_t>();
  int8_t* values_p = values_t.data_ptr<int8_t>();
  at::BFloat16* key_scales_p = key_scales.data_ptr<at::BFloat16>();
  at::BFloat16* value_scales_p = value_scales.data_ptr<at::BFloat16>();
  std::vector<int8_t> levels(head_dim);
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    for (int64_t t = 0; t < count; ++t) {
      for (int is_value = 0; is_value < 2; ++is_value) {
        const float* x = (is_value ? v_p + h * v.stride(0) + t * v.stride(1) : k_p + h * k.stride(0) + t * k.stride(1));
        float amax = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
        const at::BFloat16 scale(std::max(amax / 127.f, 1e-8f));
        const float divisor = static_cast<float>(scale);
        for (int64_t d = 0; d < head_dim; ++d) {
          levels[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / divisor))));
        }
        const int64_t slot = start + t;
        if (is_value) {
          for (int64_t d = 0; d < head_dim; ++d) {
            values_p[h * values_t.stride(0) + d * values_t.stride(1) + slot * values_t.stride(2)] = levels[d];
          }
          value_scales_p[h * value_scales.stride(0) + slot * value_scales.stride(1)] = scale;
        } else {
          std::memcpy(keys_p + h * keys.stride(0) + slot * keys.stride(1), levels.data(), head_dim);
          key_scales_p[h * key_scales.stride(0) + slot * key_scales.stride(1)] = scale;
        }
      }
    }
  }
}

}  // namespace ragblend
