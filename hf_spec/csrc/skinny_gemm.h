// Shared parts of hf-spec's CPU kernels for skinny products: y[M, N] = x[M, K] @ w[N, K]^T with few rows M of x.
// Every kernel reads each row of w from memory once: a tile of up to NR rows of w meets up to MR rows of x held in
// registers (x stays in L1/L2), vectorised over K, while the next tile of w is prefetched; the tiles are split over
// torch's intra-op threads with `at::parallel_for`. The ISA is chosen at run time through per-function target
// attributes, so one build serves any x86-64 CPU.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace hf_spec {

constexpr int64_t NR = 4;     // rows of w per tile (all ISAs)
constexpr int MR_AVX512 = 6;  // rows of x per tile: 4 x 6 accumulators + 4 w + 1 x = 29 of 32 zmm
constexpr int MR_AVX2 = 3;    // 4 x 3 accumulators + 3 x + 1 w = 16 ymm
constexpr int MR_SCALAR = 4;

enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

// ------------------------------------------------------------------------------------------------ entry points
// All pointers are to contiguous buffers; `isa` is capped by the caller at `best_isa()`.

int best_isa();    // the best of kIsaScalar / kIsaAvx2 (AVX2 + FMA) / kIsaAvx512 this CPU runs
bool has_vnni();   // AVX-512 F, BW and VNNI
bool has_vnni256();  // has_vnni() and AVX-512 VL: VNNI's byte products on 256-bit registers
bool has_bf16();   // AVX-512 F, BW and BF16

// y = x @ w^T (+ bias), fp32 (gemm_f32.cpp)
void skinny_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                 int isa);
// y = (x @ q^T) * scale[N], int8 q widened to fp32 in registers (gemm_int8.cpp)
void skinny_gemm_i8(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
                    int isa);
// y = float((xu - 128) @ q^T) * (scale[N] * xs[M]), exact int32 sums on AVX512-VNNI (gemm_int8.cpp)
void skinny_gemm_u8s8(const uint8_t* xu, const float* xs, const int8_t* q, const int32_t* qsum, const float* scale,
                      float* y, int64_t M, int64_t N, int64_t K);
// y ~= x @ (q * scale)^T with each row of x quantized to int8 first, on AVX512-VNNI (gemm_int8.cpp)
void skinny_gemm_w8a8(const float* x, const int8_t* q, const int32_t* qsum, const float* scale, float* y, int64_t M,
                      int64_t N, int64_t K);
// y = x @ w^T (+ bias) for bfloat16 x and w, fp32 sums and y (gemm_bf16.cpp)
void skinny_gemm_bf16(const uint16_t* x, const uint16_t* w, const float* bias, float* y, int64_t M, int64_t N,
                      int64_t K, int isa);
// group-quantized weights (gemm_group_quant.cpp): w[n, k] = scale[n, k / group] * code[n, k] (+ min[n, k / group])
// (the float-input kernel takes stored mins only; the int8-input one also a zero point)
// kCodes*x16: the same codes tiled for the int8-input kernel, 16 rows of w interleaved (gemm_group_quant_x16.cpp
// says how), N a multiple of 16; their scales and mins are tiled too
enum CodeLayout : int {
  kCodesI8 = 0,
  kCodesU4 = 1,
  kCodesU5 = 2,
  kCodesI8x16 = 3,
  kCodesU4x16 = 4,
  kCodesU5x16 = 5,
};
constexpr int kTileRows = 16;  // rows of w a tiled layout interleaves
inline bool is_tiled_layout(int layout) { return layout >= kCodesI8x16 && layout <= kCodesU5x16; }
// the row-major layout a tiled one tiles (a row-major one itself)
inline int row_layout(int layout) { return is_tiled_layout(layout) ? layout - kCodesI8x16 : layout; }
struct GroupQuantWeight {
  const void* codes;      // kCodesI8: int8 [N, K]; kCodesU4 / kCodesU5: uint8 [N, K / 2], 32-code runs (tiled: the
                          // same bytes in gemm_group_quant_x16.cpp's order)
  const uint32_t* high;   // kCodesU5: [N, K / 32], bit i = bit 4 of code i of the run (tiled: reordered); else unused
  const float* scale;     // [N, K / group] (null where scale16 is given)
  const float* min;       // [N, K / group], or null
  int layout;             // a CodeLayout
  int64_t group;          // inputs per scale: a multiple of 16 (kCodesI8) or 32 (packed), dividing K
  int zero_point = 0;     // > 0 (a power of two, min null): min[n, g] = -zero_point * scale[n, g], exact, not stored
  const uint16_t* scale16 = nullptr;  // float16 scales [N, K / 32] instead of `scale` (int8-input kernel, group 32,
                                      // no stored min): GGUF's Q8_0 / Q4_0 / Q5_0 d, half the bytes
};
bool group_quant_valid(const GroupQuantWeight& w, int64_t K);
// y = x @ w^T (+ bias), fp32 x, y and sums, w de-quantized in registers (gemm_group_quant.cpp)
void skinny_gemm_gq(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
                    int64_t K, int isa);
// the same with each 32-input run of each row of x quantized to int8 (d = max |x| / 127) and integer dot products
// (gemm_group_quant_q8.cpp); K a multiple of 32
void skinny_gemm_gq_q8(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
                       int64_t K, int isa);
// the same for the tiled layouts (gemm_group_quant_x16.cpp), N a multiple of 16
void skinny_gemm_gq_q8_x16(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M,
                           int64_t N, int64_t K, int isa);
// skinny_gemm_gq (float x) or, with `int8_x`, skinny_gemm_gq_q8 on any number of rows, 64 at a time; x and y
// float32, or bfloat16 where `x_bf16` / `y_bf16` (widened exactly, rounded once) (module.cpp)
void gemm_gq_rows(const void* x, bool x_bf16, const GroupQuantWeight& w, const float* bias, void* y, bool y_bf16,
                  int64_t M, int64_t N, int64_t K, int isa, bool int8_x);
// y = w * to_dtype(x * rsqrt(mean(x^2) + eps)) row by row, x, w and y all bfloat16 (`bf16`) or all float32, [rows, H]
// contiguous: the RMSNorm of Llama-family models (module.cpp)
void rms_norm_rows(const void* x, const void* w, void* y, int64_t rows, int64_t H, double eps, bool bf16);
// attention of R query rows of one batch row against L keys, each (head, row) alone in float32 (module.cpp's
// py_rows_attention says the layout): q [H, R, D], k [KVH, L, D], v [KVH, L, Dv] by their strides, mask [R, L]
// (mask_kind 0 none / 1 additive float32 / 2 additive bfloat16 / 3 bool), out [R, H, Dv]
struct RowsAttention {
  const void *q, *k, *v, *mask;
  void* out;
  int64_t H, KVH, R, L, D, Dv, qh, qr, kh, kl, vh, vl;
  int mask_kind;
  float scale;
};
void rows_attention_run(const RowsAttention& a, bool bf16);
// keep[j] = some row m of a (M, N) has a[m, j] + ew[m] coef[j] + eq[m] qn[j] >= floor[m] (select_within.cpp)
void select_within(const float* a, const float* floor, const float* ew, const float* eq, const float* coef,
                   const float* qn, uint8_t* keep, int64_t M, int64_t N);

// ------------------------------------------------------------------------------------------------ helpers
#define HF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define HF_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define HF_VNNI256 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi2")))

HF_AVX2 inline __m128 hsum128_avx2(__m256 a) {
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

HF_AVX2 inline float hsum_avx2(__m256 a) {
  __m128 s = hsum128_avx2(a);
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

HF_AVX512 inline __m128 hsum128_avx512(__m512 a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// the order of the 4-row epilogue's hadd tree, so a row of w gets the same bits in a full tile and in a tail tile
HF_AVX512 inline float hsum_avx512(__m512 a) {
  __m128 s = hsum128_avx512(a);
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// 0x10 in byte i where bit i of `bits` is set
HF_AVX2 inline __m256i bit4_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i lane_bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, lane_bit), lane_bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// a dispatch table of tile functions, table[nr - 1][mr - 1], for 1..4 rows of w and 1..6 rows of x
#define HF_ROW(F, NRT) {F<NRT, 1>, F<NRT, 2>, F<NRT, 3>, F<NRT, 4>, F<NRT, 5>, F<NRT, 6>}
#define HF_TABLE(F) {HF_ROW(F, 1), HF_ROW(F, 2), HF_ROW(F, 3), HF_ROW(F, 4)}

// Tiles of `nr_tile` rows of q (N rows in all), each against all M rows of x in chunks of at most `mr_max` rows
// (split evenly), over torch's threads: tile(n, nr, m, mr, npf) runs rows [n, n + nr) of q against rows [m, m + mr)
// of x while prefetching `npf` rows of the next tile (during a tile's first chunk). `per_tile` is a tile's work in
// multiply-adds: a thread gets at least ~256K of them (a few microseconds) before the tiles are split.
template <typename Tile>
void over_q_tiles(int64_t M, int64_t N, int64_t nr_tile, int mr_max, int64_t per_tile, Tile tile) {
  const int64_t tiles = (N + nr_tile - 1) / nr_tile;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(per_tile, 1));
  const int64_t chunks = (M + mr_max - 1) / mr_max;
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n1 = std::min(N, t1 * nr_tile);
    for (int64_t n = t0 * nr_tile; n < n1; n += nr_tile) {
      const int64_t nr = std::min<int64_t>(nr_tile, n1 - n);
      const int npf = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(nr_tile, n1 - (n + nr_tile))));
      int64_t m = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t mr = (M - m) / (chunks - c);
        tile(n, nr, m, mr, c == 0 ? npf : 0);
        m += mr;
      }
    }
  });
}

}  // namespace hf_spec
