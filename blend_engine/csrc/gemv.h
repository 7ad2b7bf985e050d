// What the decode kernels share (blend_engine/native.py): shapes, the 8-row reduction, their entry points.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace ragblend {

constexpr int64_t kGroup = 32;    // activations are quantized to int8 per group of 32, as the int4 weights' groups
constexpr int64_t kRows = 8;      // output rows per step: one fp32 vector of results
constexpr int64_t kMaxChunk = 8;  // activation rows sharing one load of the weights

// eight vectors of 8 partial i32 sums (one vector a row) -> the vector of the eight rows' totals, as fp32
inline __m256 totals(const __m256i* r) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(r[4], r[5]), _mm256_hadd_epi32(r[6], r[7]));
  // h0123: [rows 0-3, low lanes' sums | rows 0-3, high lanes' sums], h4567 the same for rows 4-7
  const __m256i low = _mm256_permute2x128_si256(h0123, h4567, 0x20);
  const __m256i high = _mm256_permute2x128_si256(h0123, h4567, 0x31);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
}

// a group of 32 fp32 activations -> 32 int8 levels round(x * 127 / max|x|) (0 where the group is all 0), the first
// 16 stored at `first`, the last 16 at `last`; returns max|x| and adds the levels' sum to *sum. Bit for bit the
// scalar `std::nearbyint(x * inv)` (rounding to nearest even, the default mode), 8 lanes at a time: a row of
// 8 960 took ~25 us as a scalar loop, before any weight was read
inline float quantize_group(const float* src, int8_t* first, int8_t* last, int32_t* sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float top = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i levels[4];
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    levels[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    total = _mm256_add_epi32(total, levels[i]);
  }
  // |level| <= 127, so the saturating packs are exact; they interleave 128-bit lanes, which the permute undoes
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(levels[0], levels[1]), _mm256_packs_epi32(levels[2], levels[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(ordered));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(last), _mm256_extracti128_si256(ordered, 1));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  *sum += _mm_cvtsi128_si32(t4);
  return top;
}

// csrc/int4_gemv.cpp: x [M, K] fp32, nibbles [N/8, K*4] uint8, block_scales [N/8, K/32, 8, 2] bf16 -> [M, N] fp32
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& block_scales);
// csrc/int8_gemv.cpp: x [M, K] fp32, q [N, K] int8, scales [N] bf16 -> [M, N] fp32
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
// csrc/int8_attention.cpp: one token's attention over one layer of the int8 decode cache -> [H_kv, G, D] bf16
at::Tensor int8_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& key_scales,
                          const at::Tensor& values_t, const at::Tensor& value_scales,
                          const c10::optional<at::Tensor>& bias);
// csrc/int8_attention.cpp: k, v [H_kv, n, D] fp32 quantized into the int8 decode cache's slots start .. start + n
void int8_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys, const at::Tensor& key_scales,
                const at::Tensor& values_t, const at::Tensor& value_scales, int64_t start);

// csrc/rms_norm.cpp: x [M, D] fp32, weight [D] fp32 -> [M, D] fp32, torch's F.rms_norm bit for bit
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace ragblend
