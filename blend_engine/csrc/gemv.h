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

// csrc/int4_gemv.cpp: x [M, K] fp32, nibbles [N/8, K*4] uint8, scales_zeros [K/32, N, 2] bf16 -> [M, N] fp32
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales_zeros);
// csrc/int8_gemv.cpp: x [M, K] fp32, q [N, K] int8, scales [N] bf16 -> [M, N] fp32
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
// csrc/int8_attention.cpp: one token's attention over one layer of the int8 decode cache -> [H_kv, G, D] bf16
at::Tensor int8_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& key_scales,
                          const at::Tensor& values_t, const at::Tensor& value_scales,
                          const c10::optional<at::Tensor>& bias);
// csrc/int8_attention.cpp: k, v [H_kv, n, D] fp32 quantized into the int8 decode cache's slots start .. start + n
void int8_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys, const at::Tensor& key_scales,
                const at::Tensor& values_t, const at::Tensor& value_scales, int64_t start);

}  // namespace ragblend
