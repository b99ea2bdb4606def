// u8 x s8 products on AVX512-VNNI: y[M, N] = float((xu[M, K] - 128) @ q[N, K]^T) * (scale[N] * xs[M]) with
// xu = (an int8 x) + 128 as uint8. `vpdpbusd` sums u8 x s8 products exactly in int32 (4 per lane, 64 products per
// instruction against 16 fp32 FMAs), and sum_k (xu - 128) q = sum_k xu q - 128 qsum with qsum[n] = sum_k q[n, k].
#include <cmath>
#include <vector>

#include "skinny_gemm.h"

namespace hf_spec {
namespace {

#define HF_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
using TileU8Fn = void (*)(const int8_t*, const int32_t*, const float*, const uint8_t*, const float*, int64_t,
                          int64_t, float*, const int8_t*, int);

// the four int32 sums of four accumulators' 16 lanes
HF_VNNI inline __m128i hsum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m256i ra = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
  const __m256i rb = _mm256_add_epi32(_mm512_castsi512_si256(b), _mm512_extracti64x4_epi64(b, 1));
  const __m256i rc = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
  const __m256i rd = _mm256_add_epi32(_mm512_castsi512_si256(d), _mm512_extracti64x4_epi64(d, 1));
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(ra, rb), _mm256_hadd_epi32(rc, rd));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

template <int NRT, int MR>
HF_VNNI void tile_u8s8_vnni(const int8_t* __restrict q, const int32_t* __restrict qsum,
                            const float* __restrict scale, const uint8_t* __restrict xu, const float* __restrict xs,
                            int64_t K, int64_t N, float* __restrict y, const int8_t* next, int npf) {
  __m512i acc[NRT][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NRT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512i qv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) qv[i] = _mm512_loadu_si512(q + i * K + k);
    for (int i = 0; i < npf; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512i xv = _mm512_loadu_si512(xu + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, qv[i]);
    }
  }
  if (k < K) {  // zero bytes past K add nothing
    const __mmask64 mask = _cvtu64_mask64((~uint64_t{0}) >> (64 - (K - k)));
    __m512i qv[NRT];
#pragma GCC unroll 4
    for (int i = 0; i < NRT; ++i) qv[i] = _mm512_maskz_loadu_epi8(mask, q + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, xu + j * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < NRT; ++i) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, qv[i]);
    }
  }
  if constexpr (NRT == 4) {
    const __m128i shift = _mm_slli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qsum)), 7);
    const __m128 sc = _mm_loadu_ps(scale);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const __m128i s = _mm_sub_epi32(hsum4_epi32(acc[0][j], acc[1][j], acc[2][j], acc[3][j]), shift);
      _mm_storeu_ps(y + j * N, _mm_mul_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(sc, _mm_set1_ps(xs[j]))));
    }
  } else {
    for (int j = 0; j < MR; ++j)
      for (int i = 0; i < NRT; ++i) {
        const int32_t s = _mm512_reduce_add_epi32(acc[i][j]) - qsum[i] * 128;
        y[j * N + i] = static_cast<float>(s) * (scale[i] * xs[j]);
      }
  }
}

static const TileU8Fn kU8Vnni[4][6] = HF_TABLE(tile_u8s8_vnni);

bool detect_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

}  // namespace

bool has_vnni() {
  static const bool vnni = detect_vnni();
  return vnni;
}

bool has_vnni256() {
  static const bool vnni256 = has_vnni() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("bmi2");
  return vnni256;
}

void skinny_gemm_u8s8(const uint8_t* xu, const float* xs, const int8_t* q, const int32_t* qsum,
                      const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
  // 4 products per lane and instruction
  over_q_tiles(M, N, NR, MR_AVX512, NR * K * std::max<int64_t>(M, 4) / 4,
               [&](int64_t n, int64_t nr, int64_t m, int64_t mr, int npf) {
                 kU8Vnni[nr - 1][mr - 1](q + n * K, qsum + n, scale + n, xu + m * K, xs + m, K, N, y + m * N + n,
                                         q + (n + NR) * K, npf);
               });
}

// y[M, N] = (x[M, K] with each row quantized to int8, a step of amax / 127) @ (q * scale)^T by the VNNI kernel:
// an approximation, for drafts
void skinny_gemm_w8a8(const float* x, const int8_t* q, const int32_t* qsum, const float* scale, float* y, int64_t M,
                      int64_t N, int64_t K) {
  std::vector<uint8_t> xu(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float step = std::max(amax / 127.f, 1e-30f), inv = 1.f / step;
    xs[m] = step;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(row[k] * inv)));  // NaN -> -127
      xu[m * K + k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
  skinny_gemm_u8s8(xu.data(), xs.data(), q, qsum, scale, y, M, N, K);
}

}  // namespace hf_spec
