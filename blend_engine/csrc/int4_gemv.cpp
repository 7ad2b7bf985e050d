// int4 weights x int8 activations for decode's few rows, on x86-64 CPUs with AVX2 (blend_engine/native.py).
//
// Decode multiplies one row (or a batch's few) by every weight matrix: it is bound by reading the weights.
// torch's `_weight_int4pack_mm_for_cpu` dequantizes each weight to fp32 and multiplies in fp32, ~5 vector ops
// per 8 weights; on a 2-core AVX2 VM it reads Qwen2.5-1.5B's gate/up [17 920 x 1 536] at ~9 GB/s. Here the
// activations are quantized to int8 per group of 32 (as the weights' groups), and a group's dot product is
// two integer instructions over 32 weights (maddubs: u8 x s8 pairs -> i16, madd: -> i32), the scales
// applied once per group; ~0.3 ops per weight, so memory bound.
//
// Layouts (blend_engine/int4.py, Int4Linear):
//   nibbles      [N / 8, K * 4] uint8: blocks of 8 rows. A group's 32 levels of a row are 16 bytes, byte j
//                holding q[n, g*32 + j] in its low nibble and q[n, g*32 + j + 16] in its high one (q in
//                0..15). A block holds its groups by pairs (g, g + 1), each pair as 8 rows of 32 bytes (the
//                row's group g, then g + 1), and where K / 32 is odd, its last group as 8 rows of 16 bytes.
//                A block is read front to back: one stream the hardware prefetcher follows (rows apart were
//                8 short streams, ~10% slower from DRAM); a pair is one 32-byte load a row, its two groups'
//                sums split by the reduction for free (~2x fewer instructions than a group at a time)
//   block_scales [N / 8, K / 32, 8, 2] bf16 (scale, zero): a block's pairs one after another, group by group (any
//                stride between blocks: a fused part's are a slice of the fused blocks). Held by group instead
//                ([K / 32, N, 2]), a block's 8 pairs of each group were a line apart from the next group's, as
//                many streams as groups, and the 1.5B's gate/up read at 19 GB/s from DRAM where this reads 27
//   W[n, k] = (q[n, k] - 8) * scale[k / 32, n] + zero[k / 32, n]
// Result: out[m, n] = sum_k W[n, k] * xq[m, k] * dx[m, k / 32], exactly (to fp32 rounding) the product of
// the dequantized weights by x rounded to int8 per group: xq = round(x / dx), dx = max|x| / 127.

#include "gemv.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace ragblend {
namespace {

// a group's 16 bytes -> its 32 levels in order, as u8
inline __m256i unpack_group(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// 32 u8 levels . 32 s8 activations -> 8 partial i32 sums (no saturation: 2 * 15 * 127 < 2^15)
inline __m256i dot_group(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// x [M, K] fp32 -> xq [M, K] int8, dx [M, K/32] (each group's scale), sx [M, K/32] (dx * sum of the group's xq).
// xq is in the weights' pair order: per pair of groups (g, g + 1), g's first 16, g + 1's first 16, g's last
// 16, g + 1's last 16 (a lone last group as it is), so that one pair's low nibbles meet one 32-byte load.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t groups = K / kGroup;
  const int64_t paired = groups / 2 * 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      int8_t* dst = xq + m * K + g * kGroup;
      if (g < paired) dst = xq + m * K + (g / 2) * 2 * kGroup + (g % 2) * (kGroup / 2);
      int32_t sum = 0;
      // paired: the first 16 at [0, 16) (+16 for g + 1), the last 16 at [32, 48) (+16 for g + 1)
      const float amax = quantize_group(x + m * K + g * kGroup, dst, dst + (g < paired ? kGroup : kGroup / 2), &sum);
      const float d = amax / 127.f;
      dx[m * groups + g] = d;
      sx[m * groups + g] = d * static_cast<float>(sum);
    }
  }
}

// one pair of groups (g, g + 1) of a block's 8 rows (8 x 32 bytes) . one activation row's 64 levels in pair
// order (xlo: the 32 that meet the low nibbles, xhi: the high ones) -> the 8 rows' integer dot products of g
// (*dot0) and of g + 1 (*dot1), as fp32. Each row is reduced as soon as it is read, so that at most a few
// rows' vectors are live: holding all 8 rows' unpacked levels (16 registers) spilled to the stack, ~20%
// slower from DRAM
inline void pair_dots(const uint8_t* pair, __m256i xlo, __m256i xhi, __m256* dot0, __m256* dot1) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  auto row = [&](int64_t r) {  // 4 partial sums of group g, then 4 of g + 1
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + r * kGroup));
    const __m256i lo = _mm256_and_si256(v, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    // each i16 at most 2 * 15 * 127 = 3810, so the sum of the two fits too
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
  };
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(row(0), row(1)), _mm256_hadd_epi32(row(2), row(3)));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(row(4), row(5)), _mm256_hadd_epi32(row(6), row(7)));
  // h0123: [rows 0-3 of g | rows 0-3 of g + 1], h4567 the same for rows 4-7
  *dot0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(h0123, h4567, 0x20));
  *dot1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// 8 rows' (scale, zero) bf16 pairs of one group -> fp32 scale and (zero - 8 * scale)
inline void group_scales(const uint16_t* p, __m256* scale, __m256* offset) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));  // a bf16 is the top half of its fp32
  const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  *offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *scale, zero);
}

// what one call multiplies: the quantized activations and the weights' blocks
struct Operands {
  const int8_t* xq;      // [M, K] in pair order
  const float* dx;       // [M, K/32]
  const float* sx;       // [M, K/32]
  const uint8_t* nib;    // [N/8, K*4]
  int64_t block_stride;  // nibbles.stride(0)
  const uint16_t* sz;    // block_scales as bf16 bits
  int64_t scale_stride;  // block_scales.stride(0)
  int64_t K, N;
  float* out;            // [M, N]
};

// rows m0 .. m0 + chunk of the result at one block's 8 outputs. kChunk is the most rows it takes: 1 makes
// decode's usual single row a separate body whose accumulator stays in a register (a runtime-sized array of
// them lives on the stack, ~5-10% slower)
template <int64_t kChunk>
void block_rows(const Operands& op, int64_t block, int64_t m0, int64_t chunk) {
  const int64_t rows = kChunk == 1 ? 1 : chunk;
  const int64_t K = op.K, groups = K / kGroup, paired = groups / 2 * 2, n0 = block * kRows;
  const uint8_t* base = op.nib + block * op.block_stride;
  const uint16_t* scales = op.sz + block * op.scale_stride;  // [K/32, 8, 2]
  __m256 acc[kChunk];
  for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < paired; g += 2) {
    const uint8_t* pair = base + (g / 2) * (kRows * kGroup);
    __m256 scale0, offset0, scale1, offset1;
    group_scales(scales + g * kRows * 2, &scale0, &offset0);
    group_scales(scales + (g + 1) * kRows * 2, &scale1, &offset1);
    for (int64_t i = 0; i < rows; ++i) {  // a second row reads the pair again, from L1
      const int64_t m = m0 + i;
      const int8_t* xp = op.xq + m * K + g * kGroup;
      __m256 dot0, dot1;
      pair_dots(pair, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + kGroup)), &dot0, &dot1);
      const float* dxm = op.dx + m * groups;
      const float* sxm = op.sx + m * groups;
      acc[i] = _mm256_fmadd_ps(dot0, _mm256_mul_ps(scale0, _mm256_set1_ps(dxm[g])), acc[i]);
      acc[i] = _mm256_fmadd_ps(offset0, _mm256_set1_ps(sxm[g]), acc[i]);
      acc[i] = _mm256_fmadd_ps(dot1, _mm256_mul_ps(scale1, _mm256_set1_ps(dxm[g + 1])), acc[i]);
      acc[i] = _mm256_fmadd_ps(offset1, _mm256_set1_ps(sxm[g + 1]), acc[i]);
    }
  }
  if (paired < groups) {  // a lone last group: 8 rows x 16 bytes
    const int64_t g = paired;
    __m256i w[kRows];
    const uint8_t* lone = base + (g / 2) * (kRows * kGroup);
    for (int64_t r = 0; r < kRows; ++r) w[r] = unpack_group(lone + r * (kGroup / 2));
    __m256 scale, offset;
    group_scales(scales + g * kRows * 2, &scale, &offset);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t m = m0 + i;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.xq + m * K + g * kGroup));
      __m256i partial[kRows];
      for (int64_t r = 0; r < kRows; ++r) partial[r] = dot_group(w[r], xv);
      acc[i] = _mm256_fmadd_ps(totals(partial), _mm256_mul_ps(scale, _mm256_set1_ps(op.dx[m * groups + g])), acc[i]);
      acc[i] = _mm256_fmadd_ps(offset, _mm256_set1_ps(op.sx[m * groups + g]), acc[i]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) _mm256_storeu_ps(op.out + (m0 + i) * op.N + n0, acc[i]);
}

}  // namespace

// x [M, K] fp32 contiguous; nibbles [N/8, K*4] uint8 with contiguous blocks; block_scales [N/8, K/32, 8, 2] bf16 with
// stride(1) == 2 and stride(2) == 1 -> [M, N] fp32
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& block_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32 contiguous");
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.stride(1) == 1,
              "nibbles: [N/8, K*4] uint8, blocks contiguous");
  TORCH_CHECK(block_scales.dim() == 4 && block_scales.scalar_type() == at::kBFloat16 && block_scales.size(2) == kRows &&
                  block_scales.size(3) == 2 && block_scales.stride(3) == 1 && block_scales.stride(2) == 2 &&
                  block_scales.stride(1) == 2 * kRows,
              "block_scales: [N/8, K/32, 8, 2] bf16, each block's contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = nibbles.size(0) * kRows;
  TORCH_CHECK(K % kGroup == 0 && nibbles.size(1) == K * kRows / 2, "shapes: K % 32, K*4 bytes a block of 8 rows");
  TORCH_CHECK(block_scales.size(0) == N / kRows && block_scales.size(1) == K / kGroup, "block_scales: [N/8, K/32, 8, 2]");
  const int64_t groups = K / kGroup;

  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * groups), sx(M * groups);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx.data(), sx.data());

  auto out = at::empty({M, N}, x.options());
  const Operands op{xq.data(), dx.data(), sx.data(), nibbles.data_ptr<uint8_t>(), nibbles.stride(0),
                    reinterpret_cast<const uint16_t*>(block_scales.data_ptr<at::BFloat16>()), block_scales.stride(0),
                    K, N, out.data_ptr<float>()};
  // row blocks of 8 over the threads; ~16 blocks a grain keeps each thread's reads sequential
  at::parallel_for(0, N / kRows, 16, [&](int64_t begin, int64_t end) {
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
  return out;
}

}  // namespace ragblend
