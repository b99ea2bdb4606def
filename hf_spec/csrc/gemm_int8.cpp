// y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] for fp32 x and int8 weights q: the weights are converted to fp32 in
// registers (exactly: |q| <= 127), products and sums are fp32; each row of q is read from memory once (a quarter of
// an fp32 weight's bytes).
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

using TileI8Fn = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, float*, const int8_t*, int);

template <int NRT, int MR>
void tile_i8_scalar(const int8_t* __restrict q, const float* __restrict scale, const float* __restrict x, int64_t K,
                    int64_t N, float* __restrict y, const int8_t*, int) {
  float acc[NRT][MR] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < NRT; ++i) {
      const float wv = static_cast<float>(q[i * K + k]);
      for (int j = 0; j < MR; ++j) acc[i][j] += wv * x[j * K + k];
    }
  }
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < NRT; ++i) y[j * N + i] = acc[i][j] * scale[i];
}

// 8 int8 weights as 8 floats (exact: |q| <= 127)
HF_AVX2 inline __m256 load_i8x8_avx2(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// the last K % 8 products in plain C++, then y[j * N + i] = (sum of acc[i][j] + tail) * scale[i]
template <int NRT, int MR>
HF_AVX2 inline void store_i8_avx2(const __m256 (&acc)[NRT][MR], const int8_t* __restrict q,
                                  const float* __restrict scale, const float* __restrict x, int64_t k, int64_t K,
                                  int64_t N, float* __restrict y) {
  float tail[NRT][MR] = {};
  for (; k < K; ++k)
    for (int i = 0; i < NRT; ++i)
      for (int j = 0; j < MR; ++j) tail[i][j] += static_cast<float>(q[i * K + k]) * x[j * K + k];
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < NRT; ++i) y[j * N + i] = (hsum_avx2(acc[i][j]) + tail[i][j]) * scale[i];
}

template <int NRT, int MR>
HF_AVX2 void tile_i8_avx2(const int8_t* __restrict q, const float* __restrict scale, const float* __restrict x,
                          int64_t K, int64_t N, float* __restrict y, const int8_t* next, int npf) {
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
    if ((k & 63) == 0)
      for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) {
      const __m256 wv = load_i8x8_avx2(q + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  store_i8_avx2<NRT, MR>(acc, q, scale, x, k, K, N, y);
}

// 4-5 rows of x: 2 rows of q per tile, converted once into registers, against all of x's rows read from L1
// (up to 6 x 2 accumulators + 2 q + 1 x = 15 ymm): the int8 -> fp32 conversions are shared by all rows
template <int NRT, int MR>
HF_AVX2 void tile_i8_avx2_wide(const int8_t* __restrict q, const float* __restrict scale, const float* __restrict x,
                               int64_t K, int64_t N, float* __restrict y, const int8_t* next, int npf) {
  __m256 acc[NRT][MR];
#pragma GCC unroll 2
  for (int i = 0; i < NRT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 63) == 0)
      for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
    __m256 wv[NRT];
#pragma GCC unroll 2
    for (int i = 0; i < NRT; ++i)
      wv[i] = load_i8x8_avx2(q + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
#pragma GCC unroll 2
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  store_i8_avx2<NRT, MR>(acc, q, scale, x, k, K, N, y);
}

static const TileI8Fn kI8Scalar[4][6] = HF_TABLE(tile_i8_scalar);
static const TileI8Fn kI8Avx2[4][6] = HF_TABLE(tile_i8_avx2);
static const TileI8Fn kI8Avx2Wide[2][6] = {HF_ROW(tile_i8_avx2_wide, 1), HF_ROW(tile_i8_avx2_wide, 2)};

}  // namespace

void skinny_gemm_i8(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
                    int isa) {
  // AVX-512 CPUs take the AVX2 paths: tiles of 4 rows of q and 3 of x, except 4-5 rows of x, which run in one
  // chunk against 2 rows of q at a time (each row of q converted once for all rows of x)
  const bool simd = isa >= kIsaAvx2, wide = simd && (M == 4 || M == 5);
  const TileI8Fn(*table)[6] = wide ? kI8Avx2Wide : simd ? kI8Avx2 : kI8Scalar;
  const int mr_max = wide ? 6 : simd ? MR_AVX2 : MR_SCALAR;
  const int64_t nr_tile = wide ? 2 : NR;
  over_q_tiles(M, N, nr_tile, mr_max, nr_tile * K * std::max<int64_t>(M, 4),
               [&](int64_t n, int64_t nr, int64_t m, int64_t mr, int npf) {
                 table[nr - 1][mr - 1](q + n * K, scale + n, x + m * K, K, N, y + m * N + n, q + (n + nr_tile) * K,
                                       npf);
               });
}

}  // namespace hf_spec
