// Rows of x quantized as llama.cpp quantizes activations for its integer dot products, shared by the int8-input
// kernels (gemm_group_quant_q8.cpp: row-major weights; gemm_group_quant_x16.cpp: tiled ones): each run of 32 inputs
// of a row gets d = max |x| / 127 and q = round-to-nearest-even(x / d) (q = 0 where d = 0), x' = d * q.
//
// For row-major U4 / U5 weights, q is stored in the weights' paired order: q of run 2p codes 0-15, run 2p + 1 codes
// 0-15, run 2p codes 16-31, run 2p + 1 codes 16-31 (natural order for an odd last run); otherwise in natural order.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "skinny_gemm.h"

namespace hf_spec {

constexpr int RUN_Q8 = 32;  // inputs per scale d of x

// the rows of x quantized: q [M, K] (int8: paired order for row-major U4 / U5 weights, natural order otherwise),
// d [M, K / 32] (fp32), half_sum [M, K / 16] (int32: the sum of each 16 inputs' q) and, where the kernel adds w's
// mins in float, gsum [M, K / group]: sum over each group of x' (fp32, runs in order)
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dpair;  // packed weights: [M, K / 64, 8], lanes 0-3 d of run 2p, lanes 4-7 d of run 2p + 1
  std::vector<float> gsum;
  std::vector<int32_t> half_group;  // [K / 16]: the group of inputs 16h..16h + 15 (no division in the tiles)
  std::vector<int32_t> half_sum;    // [M, K / 16]: each row's sum of the codes of inputs 16h..16h + 15
  int64_t K = 0, runs = 0, groups = 0, group = 0;  // group: the group size `half_group` was made for
};

// run r of a row of x: its scale d (returned), codes 0-15 at q[0..15] and codes 16-31 at q[hi..hi + 15] (hi = 16:
// natural order; 32: paired with the neighbouring run), and the integer sums of codes 0-15 and 16-31 in halves[0..1]
inline float quantize_run(const float* x, int8_t* q, int hi, int32_t* halves) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < RUN_Q8; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  if (!finite) {  // a NaN or infinite input: the run's scale is NaN, so every output it reaches is NaN, as in float
    for (int i = 0; i < 16; ++i) q[i] = q[hi + i] = 0;
    halves[0] = halves[1] = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  halves[0] = halves[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const auto c = static_cast<int8_t>(std::nearbyint(x[i] * id));
    q[i < 16 ? i : hi + i - 16] = c;
    halves[i / 16] += c;
  }
  return d;
}

// the same with AVX2: the same products x * id, rounded to nearest even, so the same codes
HF_AVX2 inline float quantize_run_avx2(const float* x, int8_t* q, int hi, int32_t* halves) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for NaN and +-inf
    amax = _mm256_max_ps(amax, a);
  }
  if (finite != 0xFF) return quantize_run(x, q, hi, halves);  // the scalar path's NaN handling
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i s0 = _mm256_add_epi32(c[0], c[1]), s1 = _mm256_add_epi32(c[2], c[3]);
  __m128i h0 = _mm_add_epi32(_mm256_castsi256_si128(s0), _mm256_extracti128_si256(s0, 1));
  __m128i h1 = _mm_add_epi32(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1));
  h0 = _mm_hadd_epi32(h0, h1);  // [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
  h0 = _mm_hadd_epi32(h0, h0);
  halves[0] = _mm_cvtsi128_si32(h0);
  halves[1] = _mm_extract_epi32(h0, 1);
  // int32 -> int8 in order: packs interleave the 128-bit lanes, the permute puts them back
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(ordered));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + hi), _mm256_extracti128_si256(ordered, 1));
  return d;
}

// rows [0, M) of x [M, K] for products with w (its layout sets the order of q; a tiled layout folds a zero point
// into its integer sums, so only stored mins need gsum)
inline void quantize_rows(const float* x, const GroupQuantWeight& w, int64_t M, int64_t K, QuantizedRows& out,
                          bool simd) {
  const bool paired = w.layout == kCodesU4 || w.layout == kCodesU5;
  out.K = K;
  out.runs = K / RUN_Q8;
  out.groups = K / w.group;
  out.q.resize(M * K);
  out.d.resize(M * out.runs);
  out.dpair.resize(paired ? M * (out.runs / 2) * 8 : 0);
  const bool mins = w.min || (w.zero_point && !is_tiled_layout(w.layout));
  out.gsum.assign(mins ? M * out.groups : 0, 0.f);
  if (static_cast<int64_t>(out.half_group.size()) != K / 16 || out.group != w.group) {  // else the last call's
    out.half_group.resize(K / 16);
    for (int64_t h = 0; h < K / 16; ++h) out.half_group[h] = static_cast<int32_t>(h * 16 / w.group);
    out.group = w.group;
  }
  out.half_sum.resize(M * (K / 16));
  for (int64_t m = 0; m < M; ++m) {
    int32_t* halves = out.half_sum.data() + m * (K / 16);
    const float* xm = x + m * K;
    int8_t* qm = out.q.data() + m * K;
    float* dm = out.d.data() + m * out.runs;
    for (int64_t r = 0; r < out.runs; ++r) {
      int8_t* base = qm + r * RUN_Q8;
      int hi = 16;
      if (paired && (r | 1) < out.runs) {  // a run of a pair: codes 0-15 at +0 / +16, codes 16-31 at +32 / +48
        base = qm + (r & ~int64_t{1}) * RUN_Q8 + (r & 1) * 16;
        hi = 32;
      }
      dm[r] = (simd ? quantize_run_avx2 : quantize_run)(xm + r * RUN_Q8, base, hi, halves + 2 * r);
    }
    if (paired) {  // the scales of a pair of runs as one vector's halves, read by the tiles with their products
      float* pm = out.dpair.data() + m * (out.runs / 2) * 8;
      for (int64_t p = 0; p < out.runs / 2; ++p)
        for (int l = 0; l < 8; ++l) pm[8 * p + l] = dm[2 * p + l / 4];
    }
    if (mins) {  // sum of x' over each group, half runs in the order of the inputs (a group of 16 is half a run)
      float* gm = out.gsum.data() + m * out.groups;
      for (int64_t h = 0; h < K / 16; ++h) gm[out.half_group[h]] += dm[h / 2] * static_cast<float>(halves[h]);
    }
  }
}

}  // namespace hf_spec
