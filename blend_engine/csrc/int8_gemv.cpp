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
      int8_t* dst = xq + m * K + g * kGroup;
      int32_t unused = 0;
      dx[m * groups + g] = quantize_group(x + m * K + g * kGroup, dst, dst + kGroup / 2, &unused) / 127.f;
    }
  }
}

// one group of a block's 8 rows . one activation row's group -> the 8 rows' integer dot products, as fp32.
// Each row is reduced as soon as it is read (holding the 8 rows' levels and magnitudes, 16 registers, spilled
// to the stack: ~10-20% slower)
inline __m256 group_dots(const int8_t* rows, int64_t row_stride, __m256i xv) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto row = [&](int64_t r) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * row_stride));
    // |q| as u8 times xq * sign(q) (0 where q is 0)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
  };
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(row(0), row(1)), _mm256_hadd_epi32(row(2), row(3)));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(row(4), row(5)), _mm256_hadd_epi32(row(6), row(7)));
  // h0123: [rows 0-3, low lanes' sums | rows 0-3, high lanes' sums], h4567 the same for rows 4-7
  const __m256i low = _mm256_permute2x128_si256(h0123, h4567, 0x20);
  const __m256i high = _mm256_permute2x128_si256(h0123, h4567, 0x31);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
}

// 8 bf16 scales -> fp32 (a bf16 is the top half of its fp32)
inline __m256 widen_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// what one call multiplies
struct Operands {
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, K/32]
  const int8_t* q;    // [N, K] rows at row_stride
  int64_t row_stride;
  const uint16_t* scales;  // [N] as bf16 bits
  int64_t K, N, blocks;
  float* out;         // [M, N]
};

// rows m0 .. m0 + chunk of the result at one block's 8 outputs; kChunk 1 keeps decode's single row's
// accumulator in a register (as csrc/int4_gemv.cpp's block_rows)
template <int64_t kChunk>
void block_rows(const Operands& op, int64_t block, int64_t m0, int64_t chunk) {
  const int64_t rows_m = kChunk == 1 ? 1 : chunk;
  const int64_t K = op.K, groups = K / kGroup, n0 = block * kRows;
  const int8_t* rows = op.q + n0 * op.row_stride;
  const char* ahead = reinterpret_cast<const char*>(rows + kPrefetchBlocks * kRows * op.row_stride);
  __m256 acc[kChunk];
  for (int64_t i = 0; i < rows_m; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 2 == 0 && block + kPrefetchBlocks < op.blocks) {  // the same cache line of each row, blocks ahead
      for (int64_t r = 0; r < kRows; ++r) _mm_prefetch(ahead + r * op.row_stride + g * kGroup, _MM_HINT_T0);
    }
    for (int64_t i = 0; i < rows_m; ++i) {  // a second row reads the group again, from L1
      const int64_t m = m0 + i;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.xq + m * K + g * kGroup));
      acc[i] = _mm256_fmadd_ps(group_dots(rows + g * kGroup, op.row_stride, xv), _mm256_set1_ps(op.dx[m * groups + g]), acc[i]);
    }
  }
  const __m256 scale = widen_bf16(op.scales + n0);
  for (int64_t i = 0; i < rows_m; ++i) _mm256_storeu_ps(op.out + (m0 + i) * op.N + n0, _mm256_mul_ps(acc[i], scale));
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

  const Operands op{xq.data(), dx.data(), q_p, row_stride, scales_p, K, N, blocks, out_p};
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    if (M == 1) {  // decode's usual single row
      for (int64_t block = begin; block < end; ++block) block_rows<1>(op, block, 0, 1);
      return;
    }
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxChunk) {
        const int64_t chunk = std::min(kMaxChunk, M - m0);
        if (chunk == 1) {
          block_rows<1>(op, block, m0, 1);
        } else {
          block_rows<kMaxChunk>(op, block, m0, chunk);
        }
      }
    }
  });
  if (blocks * kRows < N) tail_rows(q_p, row_stride, scales_p, blocks * kRows, N, M, K, xq.data(), dx.data(), out_p);
  return out;
}

}  // namespace ragblend
