// int8 weights x int8 activations for decode's few rows, on x86-64 CPUs with AVX2 (blend_engine/native.py).
//
// The int8 layers of a GGUF model (its Q5/Q6_K/Q8_0 tensors) and the int8 lm_head are read once per decoded
// token; the lm_head of Qwen2.5's vocabulary [151 936 x 1 536] is the largest matrix a step reads (233 MB).
// torch's `_weight_int8pack_mm` widens each weight and multiplies in fp32 with bf16 activations: on a 2-core
// AVX2 VM it read that lm_head at ~15 GB/s. Here, as in csrc/int4_gemv.cpp, the activations are quantized to
// int8 per group of 32 and a group's dot product is taken in integers. maddubs multiplies unsigned by
// signed bytes, so each weight's sign moves onto its activation (sign) and its magnitude is the unsigned
// side (abs): |q| <= 128 and |xq| <= 127, so a pair's sum, at most 2 * 128 * 127 = 32 512, fits an i16.
//
// Layouts (blend_engine/weights.py, Int8Linear):
//   q      [N, K] int8, rows contiguous (any row stride: a fused part is a view of its rows)
//   scales [N] bf16, W[n, k] = q[n, k] * scales[n]
// Result: out[m, n] = scales[n] * sum_g dx[m, g] * sum_(k in g) q[n, k] * xq[m, k], exactly (to fp32
// rounding) the dequantized weights times x rounded to int8 per group: xq = round(x / dx), dx = max|x| / 127.

#include "gemv.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace ragblend {
namespace {

// A block's 8 rows are read side by side, 8 streams a row's length long: the lm_head's rows are 1 536 bytes, too
// short for the hardware prefetcher to follow (~15 GB/s from DRAM where 8 960-byte rows read at ~22), so each
// row's next line is asked for this many blocks ahead
constexpr int64_t kPrefetchBlocks = 4;

// x [M, K] fp32 -> xq [M, K] int8 and dx [M, K/32]: each group of 32 by its own scale, in order
void quantize_groups(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + m * K + g * kGroup;
      float amax = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = xq + m * K + g * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) dst[j] = static_cast<int8_t>(std::nearbyint(src[j] * inv));
      dx[m * groups + g] = amax / 127.f;
    }
  }
}

// 8 bf16 scales -> fp32 (a bf16 is the top half of its fp32)
inline __m256 widen_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the rows of a last block short of 8, one dot product at a time
void tail_rows(const int8_t* q, int64_t row_stride, const uint16_t* scales, int64_t n0, int64_t N, int64_t M,
               int64_t K, const int8_t* xq, const float* dx, float* out) {
  const int64_t groups = K / kGroup;
  for (int64_t n = n0; n < N; ++n) {
    const float scale = c10::detail::f32_from_bits(scales[n]);
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t j = 0; j < kGroup; ++j) dot += int32_t{q[n * row_stride + g * kGroup + j]} * xq[m * K + g * kGroup + j];
        sum += static_cast<float>(dot) * dx[m * groups + g];
      }
      out[m * N + n] = sum * scale;
    }
  }
}

}  // namespace

// x [M, K] fp32 contiguous; q [N, K] int8 with stride(1) == 1; scales [N] bf16 contiguous -> [M, N] fp32
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32 contiguous");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.stride(1) == 1, "q: [N, K] int8, rows contiguous");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.stride(0) == 1,
              "scales: [N] bf16 contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % kGroup == 0 && q.size(1) == K, "shapes: x [M, K] and q [N, K] with K % 32 == 0");
  TORCH_CHECK(scales.size(0) == N, "scales: one a row of q");
  const int64_t groups = K / kGroup;

  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * groups);
  quantize_groups(x.data_ptr<float>(), M, K, xq.data(), dx.data());

  auto out = at::empty({M, N}, x.options());
  float* out_p = out.data_ptr<float>();
  const int8_t* q_p = q.data_ptr<int8_t>();
  const int64_t row_stride = q.stride(0);
  const uint16_t* scales_p = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t blocks = N / kRows;

  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kRows;
      const int8_t* rows = q_p + n0 * row_stride;
      const char* ahead = reinterpret_cast<const char*>(rows + kPrefetchBlocks * kRows * row_stride);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxChunk) {
        const int64_t chunk = std::min(kMaxChunk, M - m0);
        __m256 acc[kMaxChunk];
        for (int64_t i = 0; i < chunk; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          if (g % 2 == 0 && block + kPrefetchBlocks < blocks) {  // the same cache line of each row, blocks ahead
            for (int64_t r = 0; r < kRows; ++r) _mm_prefetch(ahead + r * row_stride + g * kGroup, _MM_HINT_T0);
          }
          __m256i w[kRows], magnitude[kRows];  // a group of each of the 8 rows: its levels, their |q| as u8
          for (int64_t r = 0; r < kRows; ++r) {
            w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * row_stride + g * kGroup));
            magnitude[r] = _mm256_sign_epi8(w[r], w[r]);
          }
          for (int64_t i = 0; i < chunk; ++i) {
            const int64_t m = m0 + i;
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.data() + m * K + g * kGroup));
            __m256i partial[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
              const __m256i signed_x = _mm256_sign_epi8(xv, w[r]);  // xq * sign(q): 0 where q is 0
              partial[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[r], signed_x), ones);
            }
            acc[i] = _mm256_fmadd_ps(totals(partial), _mm256_set1_ps(dx[m * groups + g]), acc[i]);
          }
        }
        const __m256 scale = widen_bf16(scales_p + n0);
        for (int64_t i = 0; i < chunk; ++i) _mm256_storeu_ps(out_p + (m0 + i) * N + n0, _mm256_mul_ps(acc[i], scale));
      }
    }
  });
  if (blocks * kRows < N) tail_rows(q_p, row_stride, scales_p, blocks * kRows, N, M, K, xq.data(), dx.data(), out_p);
  return out;
}

}  // namespace ragblend
