// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for fp32 x and group-quantized weights, de-quantized in registers:
// w[n, k] = scale[n, g] * code[n, k] (+ min[n, g]) with g = k / G. The codes are stored as
//   kCodesI8: one int8 per weight (K bytes a row; G a multiple of 16);
//   kCodesU4: unsigned 4-bit codes, two a byte (K / 2 bytes a row; G a multiple of 32): in each run of 32 codes,
//             byte i holds code i in its low nibble and code i + 16 in its high nibble;
//   kCodesU5: kCodesU4 plus one uint32 a run of 32 codes (K / 32 a row) whose bit i is bit 4 of code i.
// Where a layout has mins, scale * code is exact in fp32 (the packers see to it), so the fused multiply-add here
// and an unfused `scale * code + min` give the same weight bits. Sums are fp32; each output is accumulated lane by
// lane over k in the same order whatever M and the tiling, so a row of x gets the same bits alone (decoding) as
// among 64 (verification). AVX-512 CPUs take the AVX2 path.
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

constexpr int NR_GQ = 4;  // rows of w per tile
constexpr int MR_GQ = 4;  // rows of x per tile

// the weight of code `k` in row `n` (plain C++)
inline float gq_weight(const GroupQuantWeight& w, int64_t n, int64_t k, int64_t K) {
  const int64_t g = k / w.group, groups = K / w.group;
  float code;
  if (w.layout == kCodesI8) {
    code = static_cast<float>(static_cast<const int8_t*>(w.codes)[n * K + k]);
  } else {
    const uint8_t* row = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
    const int64_t run = k / 32, i = k % 32;
    const uint8_t byte = row[run * 16 + (i & 15)];
    int c = i < 16 ? (byte & 15) : (byte >> 4);
    if (w.layout == kCodesU5) c |= ((w.high[n * (K / 32) + run] >> i) & 1u) << 4;
    code = static_cast<float>(c);
  }
  const float s = w.scale[n * groups + g];
  return w.min ? __builtin_fmaf(s, code, w.min[n * groups + g]) : s * code;
}

void rows_scalar(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t n0, int64_t nr,
                 int64_t m0, int64_t mr, int64_t N, int64_t K) {
  for (int64_t n = n0; n < n0 + nr; ++n)
    for (int64_t m = m0; m < m0 + mr; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += gq_weight(w, n, k, K) * x[m * K + k];
      y[m * N + n] = acc + (bias ? bias[n] : 0.f);
    }
}

// 8 int8 codes as floats
HF_AVX2 inline __m256 codes_i8x8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// a run of 32 4-bit codes (16 bytes at `q`) as 4 x 8 floats, codes 0-7, 8-15, 16-23, 24-31; with `U5` bit 4 of
// code i from bit i of `high`
template <bool U5>
HF_AVX2 inline void codes_u4x32(const uint8_t* q, uint32_t high, __m256 (&c)[4]) {
  const __m256i low4 = _mm256_set1_epi32(15);
  __m256i v[4];
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
    v[h] = _mm256_and_si256(b, low4);
    v[h + 2] = _mm256_srli_epi32(b, 4);
  }
  if (U5) {
    const __m256i hb = _mm256_set1_epi32(static_cast<int>(high)), one = _mm256_set1_epi32(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < 4; ++r) {
      const __m256i shift = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * r));
      const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(hb, shift), one);
      v[r] = _mm256_or_si256(v[r], _mm256_slli_epi32(bit, 4));
    }
  }
  for (int r = 0; r < 4; ++r) c[r] = _mm256_cvtepi32_ps(v[r]);
}

// rows [n, n + NRT) of w against rows [m, m + MR) of x; a "run" is 16 int8 codes or 32 packed ones
template <int LAYOUT, bool MIN, int NRT, int MR>
HF_AVX2 void tile_gq_avx2(const float* __restrict x, const GroupQuantWeight& w, const float* bias,
                          float* __restrict y, int64_t n, int64_t m, int64_t N, int64_t K, int npf) {
  constexpr int RUN = LAYOUT == kCodesI8 ? 16 : 32, VECS = RUN / 8;
  const int64_t groups = K / w.group, row_bytes = LAYOUT == kCodesI8 ? K : K / 2;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n * row_bytes;
  const float* scale = w.scale + n * groups;
  const float* mins = MIN ? w.min + n * groups : nullptr;
  const uint32_t* high = LAYOUT == kCodesU5 ? w.high + n * (K / 32) : nullptr;
  const float* xm = x + m * K;
  __m256 acc[NRT][MR];
  for (int i = 0; i < NRT; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NRT], mn[NRT];
    for (int i = 0; i < NRT; ++i) {
      s[i] = _mm256_set1_ps(scale[i * groups + g]);
      if (MIN) mn[i] = _mm256_set1_ps(mins[i * groups + g]);
    }
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += RUN) {
      const int64_t off = LAYOUT == kCodesI8 ? k : k / 2;
      if ((off & 63) == 0)
        for (int i = 0; i < npf; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(codes + (NRT + i) * row_bytes + off), _MM_HINT_T1);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) {
        __m256 c[4];
        if (LAYOUT == kCodesI8) {
          for (int r = 0; r < VECS; ++r) c[r] = codes_i8x8(reinterpret_cast<const int8_t*>(codes) + i * K + k + 8 * r);
        } else {
          codes_u4x32<LAYOUT == kCodesU5>(codes + i * row_bytes + off, LAYOUT == kCodesU5 ? high[i * (K / 32) + k / 32] : 0u,
                                          c);
        }
#pragma GCC unroll 4
        for (int r = 0; r < VECS; ++r) {
          const __m256 wv = MIN ? _mm256_fmadd_ps(s[i], c[r], mn[i]) : _mm256_mul_ps(s[i], c[r]);
#pragma GCC unroll 4
          for (int j = 0; j < MR; ++j)
            acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xm + j * K + k + 8 * r), acc[i][j]);
        }
      }
    }
  }
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < NRT; ++i) y[(m + j) * N + n + i] = hsum_avx2(acc[i][j]) + (bias ? bias[n + i] : 0.f);
}

using TileGqFn = void (*)(const float*, const GroupQuantWeight&, const float*, float*, int64_t, int64_t, int64_t,
                          int64_t, int);

#define HF_GQ_ROW(L, MN, NRT) {tile_gq_avx2<L, MN, NRT, 1>, tile_gq_avx2<L, MN, NRT, 2>, tile_gq_avx2<L, MN, NRT, 3>, \
                              tile_gq_avx2<L, MN, NRT, 4>}
#define HF_GQ_TABLE(L, MN) {HF_GQ_ROW(L, MN, 1), HF_GQ_ROW(L, MN, 2), HF_GQ_ROW(L, MN, 3), HF_GQ_ROW(L, MN, 4)}

static const TileGqFn kGq[3][2][NR_GQ][MR_GQ] = {
    {HF_GQ_TABLE(kCodesI8, false), HF_GQ_TABLE(kCodesI8, true)},
    {HF_GQ_TABLE(kCodesU4, false), HF_GQ_TABLE(kCodesU4, true)},
    {HF_GQ_TABLE(kCodesU5, false), HF_GQ_TABLE(kCodesU5, true)},
};

}  // namespace

bool group_quant_valid(const GroupQuantWeight& w, int64_t K) {
  if (w.layout < kCodesI8 || w.layout > kCodesU5x16 || w.group < 1 || K % w.group) return false;
  const int rows = row_layout(w.layout);  // a tiled layout's rules are its row-major layout's
  if (!w.codes || !(w.scale || w.scale16) || (w.scale && w.scale16) || (rows == kCodesU5 && !w.high)) return false;
  if (w.scale16 && (w.group != 32 || w.min)) return false;
  if (w.zero_point < 0 || (w.zero_point & (w.zero_point - 1)) || (w.zero_point && w.min)) return false;
  return rows == kCodesI8 ? w.group % 16 == 0 : w.group % 32 == 0;
}

void skinny_gemm_gq(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
                    int64_t K, int isa) {
  // (a zero point and tiled layouts are the int8-input kernel's: the caller gives this one stored mins and row-major
  // codes, `run_gemm_gq` checks)
  const bool simd = isa >= kIsaAvx2;
  const TileGqFn(*table)[MR_GQ] = kGq[w.layout][w.min ? 1 : 0];
  over_q_tiles(M, N, NR_GQ, MR_GQ, NR_GQ * K * std::max<int64_t>(M, 4),
               [&](int64_t n, int64_t nr, int64_t m, int64_t mr, int npf) {
                 if (simd)
                   table[nr - 1][mr - 1](x, w, bias, y, n, m, N, K, npf);
                 else
                   rows_scalar(x, w, bias, y, n, nr, m, mr, N, K);
               });
}

}  // namespace hf_spec
