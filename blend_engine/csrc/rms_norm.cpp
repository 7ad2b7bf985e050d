// RMSNorm of fp32 rows, bit for bit torch's `F.rms_norm` on this CPU (blend_engine/native.py, layer.norm_call).
//
// A decode step normalizes 57 single rows on Qwen2.5-1.5B (two per layer and the final norm). torch's CPU
// rms_norm is a composite of eight ops (pow, sum, div_, add_, rsqrt, mul, type_as, mul): ~45-50 us a
// row of 1 536 on a 2-core AVX2 VM, ~2.7 ms of a ~85 ms step, nearly all of it dispatch. This is one call.
//
// It rounds where torch rounds, in its order:
//   x * x                           (pow(x, 2) is x * x)
//   the sum of the squares          torch's `cascade_sum` for a contiguous inner reduction on AVX2 (SumKernel.cpp):
//                                   the row as vectors of 8; those as rows of 4 vectors, summed into 4
//                                   accumulators with a cascade of 4 levels of 16 (multi_row_sum), vectors left
//                                   over into the first, the 4 folded in order, then the scalar tail and the 8
//                                   lanes added one by one to a scalar
//   / D, + eps, 1 / sqrt            mean's div_, add_, rsqrt (Vectorized: 1 / sqrt, each rounded)
//   x * r, then * weight            two roundings, as torch's two muls
// The tests compare with `torch.equal` over many rows and widths.

#include "gemv.h"

#include <array>
#include <cmath>

namespace ragblend {
namespace {

constexpr int64_t kLanes = 8;      // Vectorized<float> on AVX2
constexpr int64_t kIlp = 4;        // row_sum's ilp_factor
constexpr int64_t kLevels = 4;     // multi_row_sum's num_levels
constexpr int64_t kLevelPower = 4; // max(4, CeilLog2(size) / 4): 4 below 2^20 vectors

// x * x, kept apart from the add it feeds: with -mfma, g++ contracts a multiply and an add into one fused
// rounding (-ffp-contract=fast), where torch's pow writes the squares out before its sum reads them
inline __m256 square(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  __m256 product = _mm256_mul_ps(v, v);
  asm("" : "+x"(product));  // an empty barrier: the product is a value of its own, rounded once
  return product;
}

// the sum of x[0..D)^2, added in torch's order (above)
float sum_of_squares(const float* x, int64_t D) {
  const int64_t vectors = D / kLanes;
  const int64_t size = vectors / kIlp;  // multi_row_sum's rows of 4 vectors
  constexpr int64_t step = int64_t{1} << kLevelPower;
  constexpr int64_t mask = step - 1;
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc) {
    for (auto& a : level) a = _mm256_setzero_ps();
  }
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * kIlp + k) * kLanes));
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * kLevelPower))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * kIlp + k) * kLanes));
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  }
  __m256 total = acc[0][0];
  for (int64_t v = size * kIlp; v < vectors; ++v) total = _mm256_add_ps(total, square(x + v * kLanes));
  for (int64_t k = 1; k < kIlp; ++k) total = _mm256_add_ps(total, acc[0][k]);
  float sum = 0.f;
  for (int64_t k = vectors * kLanes; k < D; ++k) {
    float product = x[k] * x[k];
    asm("" : "+x"(product));  // as in `square`
    sum += product;
  }
  alignas(32) std::array<float, kLanes> lanes;
  _mm256_store_ps(lanes.data(), total);
  for (const float lane : lanes) sum += lane;
  return sum;
}

}  // namespace

// x [M, D] fp32 contiguous, weight [D] fp32 contiguous, D >= 8 -> [M, D] fp32
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, D] fp32 contiguous");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(0) == D,
              "weight: [D] fp32 contiguous");
  // torch sums rows under 8 without vectors, and splits one row's sum over threads from 32 768 elements
  TORCH_CHECK(D >= kLanes && D < 32768, "rms_norm: rows of 8 to 32 767 (torch adds others in another order)");
  auto out = at::empty({M, D}, x.options());
  const float* x_p = x.data_ptr<float>();
  const float* w_p = weight.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  const float count = static_cast<float>(D);
  // a decode step's one row stays on this thread: waking the others costs more than the row
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x_p + m * D;
      const float mean = sum_of_squares(row, D) / count;
      const float r = 1.f / std::sqrt(mean + eps_f);
      const __m256 rv = _mm256_set1_ps(r);
      float* dst = out_p + m * D;
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(row + d), rv);
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(scaled, _mm256_loadu_ps(w_p + d)));
      }
      for (; d < D; ++d) dst[d] = (row[d] * r) * w_p[d];
    }
  });
  return out;
}

}  // namespace ragblend
