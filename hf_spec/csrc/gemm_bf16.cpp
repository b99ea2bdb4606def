// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for bfloat16 x and w, fp32 y: on AVX512-BF16 `vdpbf16ps` multiplies 32
// bf16 pairs into 16 fp32 sums per instruction (products exact in fp32, fp32 sums), with no conversion of w or x;
// each row of w is read from memory once (half an fp32 weight's bytes). The plain C++ tiles compute the same sums
// for tests and for CPUs without AVX512-BF16.
#include <cstring>

#include "skinny_gemm.h"

namespace hf_spec {
namespace {

#define HF_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))
using TileBf16Fn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*, const float*,
                            const uint16_t*, int);

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int NRT, int MR>
void tile_bf16_scalar(const uint16_t* __restrict w, const uint16_t* __restrict x, int64_t K, int64_t N,
                      float* __restrict y, const float* __restrict bias, const uint16_t*, int) {
  float acc[NRT][MR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < NRT; ++i) {
      const float wv = bf16_to_float(w[i * K + k]);
      for (int j = 0; j < MR; ++j) acc[i][j] += wv * bf16_to_float(x[j * K + k]);
    }
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < NRT; ++i) y[j * N + i] = acc[i][j] + (bias ? bias[i] : 0.0f);
}

template <int NRT, int MR>
HF_BF16 void tile_bf16_dp(const uint16_t* __restrict w, const uint16_t* __restrict x, int64_t K, int64_t N,
                          float* __restrict y, const float* __restrict bias, const uint16_t* next, int npf) {
  __m512 acc[NRT][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NRT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) wv[i] = _mm512_loadu_si512(w + i * K + k);
    for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512i xv = _mm512_loadu_si512(x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
    }
  }
  if (k < K) {  // zero pairs past K add nothing
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1u);
    __m512i wv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) wv[i] = _mm512_maskz_loadu_epi16(mask, w + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[i], (__m512bh)xv);
    }
  }
  if constexpr (NRT == 4) {
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      __m128 s = _mm_hadd_ps(_mm_hadd_ps(hsum128_avx512(acc[0][j]), hsum128_avx512(acc[1][j])),
                             _mm_hadd_ps(hsum128_avx512(acc[2][j]), hsum128_avx512(acc[3][j])));
      if (bias) s = _mm_add_ps(s, _mm_loadu_ps(bias));
      _mm_storeu_ps(y + j * N, s);
    }
  } else {
    for (int j = 0; j < MR; ++j)
      for (int i = 0; i < NRT; ++i) y[j * N + i] = hsum_avx512(acc[i][j]) + (bias ? bias[i] : 0.0f);
  }
}

static const TileBf16Fn kBf16Scalar[4][6] = HF_TABLE(tile_bf16_scalar);
static const TileBf16Fn kBf16Dp[4][6] = HF_TABLE(tile_bf16_dp);

bool detect_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace

bool has_bf16() {
  static const bool bf16 = detect_bf16();
  return bf16;
}

// isa kIsaAvx512 (or above): the AVX512-BF16 tiles, anything else the plain C++ ones (tests)
void skinny_gemm_bf16(const uint16_t* x, const uint16_t* w, const float* bias, float* y, int64_t M, int64_t N,
                      int64_t K, int isa) {
  const bool dp = isa >= kIsaAvx512 && has_bf16();
  const TileBf16Fn(*table)[6] = dp ? kBf16Dp : kBf16Scalar;
  const int mr_max = dp ? MR_AVX512 : MR_SCALAR;
  over_q_tiles(M, N, NR, mr_max, NR * K * std::max<int64_t>(M, 4) / 2,
               [&](int64_t n, int64_t nr, int64_t m, int64_t mr, int npf) {
                 table[nr - 1][mr - 1](w + n * K, x + m * K, K, N, y + m * N + n, bias ? bias + n : nullptr,
                                       w + (n + NR) * K, npf);
               });
}

}  // namespace hf_spec
