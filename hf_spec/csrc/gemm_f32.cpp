// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32, all contiguous: plain C++, AVX2 + FMA and AVX-512 tiles.
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

// tile(w, x, K, N, y, bias, next, npf): y[j * N + i] = <w row i, x row j> (+ bias[i]) for the tile's rows i of w
// and rows j of x; meanwhile prefetch `npf` rows of w starting at `next`.
using TileFn = void (*)(const float*, const float*, int64_t, int64_t, float*, const float*, const float*, int);

// ------------------------------------------------------------------------------------------------ plain C++
template <int NRT, int MR>
void tile_scalar(const float* __restrict w, const float* __restrict x, int64_t K, int64_t N,
                 float* __restrict y, const float* __restrict bias, const float*, int) {
  float acc[NRT][MR] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < NRT; ++i) {
      const float wv = w[i * K + k];
      for (int j = 0; j < MR; ++j) acc[i][j] += wv * x[j * K + k];
    }
  }
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < NRT; ++i) y[j * N + i] = acc[i][j] + (bias ? bias[i] : 0.0f);
}

// ------------------------------------------------------------------------------------------------ AVX2 + FMA
alignas(32) static const int32_t kMask8[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

template <int NRT, int MR>
HF_AVX2 void tile_avx2(const float* __restrict w, const float* __restrict x, int64_t K, int64_t N,
                       float* __restrict y, const float* __restrict bias, const float* next, int npf) {
  // x's MR rows stay in registers while w's NRT rows stream through one register: 4 x 3 accumulators + 3 x +
  // 1 w = 16 ymm; 12 independent FMA chains cover the FMA latency (4-5 cycles) times its throughput (2 a cycle)
  __m256 acc[NRT][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NRT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) xv[j] = _mm256_loadu_ps(x + j * K + k);
    for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) {
      const __m256 wv = _mm256_loadu_ps(w + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask8 + 8 - (K - k)));
    __m256 xv[MR];
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) xv[j] = _mm256_maskload_ps(x + j * K + k, mask);
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) {
      const __m256 wv = _mm256_maskload_ps(w + i * K + k, mask);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  if constexpr (NRT == 4) {
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      __m128 s = _mm_hadd_ps(_mm_hadd_ps(hsum128_avx2(acc[0][j]), hsum128_avx2(acc[1][j])),
                             _mm_hadd_ps(hsum128_avx2(acc[2][j]), hsum128_avx2(acc[3][j])));
      if (bias) s = _mm_add_ps(s, _mm_loadu_ps(bias));
      _mm_storeu_ps(y + j * N, s);
    }
  } else {
    for (int j = 0; j < MR; ++j)
      for (int i = 0; i < NRT; ++i) y[j * N + i] = hsum_avx2(acc[i][j]) + (bias ? bias[i] : 0.0f);
  }
}

// ------------------------------------------------------------------------------------------------ AVX-512
template <int NRT, int MR>
HF_AVX512 void tile_avx512(const float* __restrict w, const float* __restrict x, int64_t K, int64_t N,
                           float* __restrict y, const float* __restrict bias, const float* next, int npf) {
  __m512 acc[NRT][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NRT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) wv[i] = _mm512_loadu_ps(w + i * K + k);
    // pull `npf` rows of the next tile of w into L2 while this one computes, so DRAM and the FMAs overlap
    for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) wv[i] = _mm512_maskz_loadu_ps(mask, w + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
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

// ------------------------------------------------------------------------------------------------ dispatch
// table[nr - 1][mr - 1]
static const TileFn kScalar[4][6] = HF_TABLE(tile_scalar);
static const TileFn kAvx2[4][6] = HF_TABLE(tile_avx2);
static const TileFn kAvx512[4][6] = HF_TABLE(tile_avx512);

int detect_isa() {
  __builtin_cpu_init();  // libgcc's checks include the OS saving the AVX / AVX-512 registers (XGETBV)
  if (__builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kIsaAvx2;
  return kIsaScalar;
}

// Rows [n0, n1) of y^T: tiles of NR rows of w, each against all of x in chunks of at most mr_max rows (split evenly).
void run_rows(const TileFn (*table)[6], int mr_max, const float* x, const float* w, const float* bias, float* y,
              int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t chunks = (M + mr_max - 1) / mr_max;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    int64_t m = 0;
    // the next tile's rows are prefetched spread over this tile's chunks
    const int64_t pf_rows = std::max<int64_t>(0, std::min<int64_t>(NR, n1 - (n + NR)));
    int64_t pf_done = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t mr = (M - m) / (chunks - c);
      const int64_t npf = (pf_rows - pf_done) / (chunks - c);
      table[nr - 1][mr - 1](w + n * K, x + m * K, K, N, y + m * N + n, bias ? bias + n : nullptr,
                            w + (n + NR + pf_done) * K, static_cast<int>(npf));
      m += mr;
      pf_done += npf;
    }
  }
}

}  // namespace

int best_isa() {
  static const int isa = detect_isa();
  return isa;
}

void skinny_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                 int isa) {
  const TileFn(*table)[6] = kScalar;
  int mr_max = MR_SCALAR;
  if (isa == kIsaAvx512) {
    table = kAvx512;
    mr_max = MR_AVX512;
  } else if (isa == kIsaAvx2) {
    table = kAvx2;
    mr_max = MR_AVX2;
  }
  const int64_t tiles = (N + NR - 1) / NR;
  // At least ~256K multiply-adds per thread (a few microseconds) before splitting; beyond that the OpenMP backend
  // hands each thread an equal contiguous share of the tiles.
  const int64_t per_tile = NR * K * std::max<int64_t>(M, 4);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(per_tile, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    run_rows(table, mr_max, x, w, bias, y, M, N, K, t0 * NR, std::min(N, t1 * NR));
  });
}

}  // namespace hf_spec
