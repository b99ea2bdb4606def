// y[M, N] = x'[M, K] @ w[N, K]^T (+ bias) for group-quantized w (the layouts of gemm_group_quant.cpp) where x' is x
// with each run of 32 inputs of each row quantized to int8 as llama.cpp quantizes activations for its integer dot
// products: d = max |x| / 127, q = round-to-nearest-even(x / d) (q = 0 where d = 0), x' = d * q.
//
// The products are integer: for a run r of 32 inputs, sum_k code[n, k] * q[m, k] is exact in int32, then
//   y[m, n] = sum_r (scale[n, g(r)] * d[m, r]) * isum[n, m, r] (+ sum_g min[n, g] * sum_{k in g} x'[m, k]) (+ bias)
// with fp32 sums over runs kept lane by lane in a fixed order, so a row of x gets the same bits alone (decoding) as
// among 64 (verification). Per 64 packed codes this costs two byte shuffles and a handful of integer multiply-adds
// where the float kernel (gemm_group_quant.cpp) widens every code to fp32.
//
// Packed (U4 / U5) weights are read two runs at a time: one 32-byte load holds runs 2p and 2p + 1, its low nibbles
// codes 0-15 of both and its high nibbles codes 16-31 of both. The quantized rows of x are stored in that order
// (q of run 2p codes 0-15, run 2p + 1 codes 0-15, run 2p codes 16-31, run 2p + 1 codes 16-31), natural order
// for an odd last run and for int8 (I8) weights.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <torch/headeronly/util/Half.h>  // c10::detail::fp16_ieee_to_fp32_value: the scalar paths' float16 scales

#include "quantize_x_q8.h"
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

constexpr int NR_Q8 = 2;  // rows of w per tile
// rows of w per tile where registers allow (one row of x on AVX2's 16, up to 4 on AVX-512's 32): x's loads and the
// tile's overhead shared by twice the rows of w, for rows of w up to kShortRows long (no gain measured on 4864)
constexpr int NR_Q8_WIDE = 4;
constexpr int64_t kShortRows = 2048;
constexpr int MR_Q8 = 4;  // rows of x per tile: 2 x 4 accumulators; a row of w is unpacked once for 4 rows of x
// how far ahead of a tile its rows of w are prefetched when x has one row: the next tile alone (1.8 KB of U5 rows
// of 896) left decoding Q5_0 rows short of the memory's bandwidth; with more rows of x, going further cost time
constexpr int64_t kPrefetchBytes = 8192;


// ---------------------------------------------------------------------------------------------- plain C++

// code k of row n of w (the same unpacking as gemm_group_quant.cpp)
inline int32_t code_at(const GroupQuantWeight& w, int64_t n, int64_t k, int64_t K) {
  if (w.layout == kCodesI8) return static_cast<const int8_t*>(w.codes)[n * K + k];
  const uint8_t* row = static_cast<const uint8_t*>(w.codes) + n * (K / 2);
  const int64_t run = k / 32, i = k % 32;
  const uint8_t byte = row[run * 16 + (i & 15)];
  int32_t c = i < 16 ? (byte & 15) : (byte >> 4);
  if (w.layout == kCodesU5) c |= static_cast<int32_t>((w.high[n * (K / 32) + run] >> i) & 1u) << 4;
  return c;
}

// scale j of w, float32 or float16
inline float scale_at(const GroupQuantWeight& w, int64_t j) {
  return w.scale16 ? c10::detail::fp16_ieee_to_fp32_value(w.scale16[j]) : w.scale[j];
}

// q of input k of row m (undoing the pairing)
inline int32_t q_at(const QuantizedRows& xq, const GroupQuantWeight& w, int64_t m, int64_t k) {
  const int64_t r = k / RUN_Q8, i = k % RUN_Q8;
  int64_t at = r * RUN_Q8 + i;
  if (w.layout != kCodesI8 && (r | 1) < xq.runs)
    at = (r & ~int64_t{1}) * RUN_Q8 + (r & 1) * 16 + (i < 16 ? i : 32 + i - 16);
  return xq.q[m * xq.K + at];
}

void rows_scalar_q8(const QuantizedRows& xq, const GroupQuantWeight& w, const float* bias, float* y, int64_t n0,
                    int64_t nr, int64_t m0, int64_t mr, int64_t N, int64_t K) {
  for (int64_t n = n0; n < n0 + nr; ++n)
    for (int64_t m = m0; m < m0 + mr; ++m) {
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += 16) {  // half runs: a scale covers at least 16 inputs
        int32_t s = 0;
        for (int64_t k = k0; k < k0 + 16; ++k) s += code_at(w, n, k, K) * q_at(xq, w, m, k);
        acc += scale_at(w, n * xq.groups + k0 / w.group) * xq.d[m * xq.runs + k0 / RUN_Q8] * static_cast<float>(s);
      }
      for (int64_t g = 0; w.min && g < xq.groups; ++g) acc += w.min[n * xq.groups + g] * xq.gsum[m * xq.groups + g];
      for (int64_t g = 0; w.zero_point && g < xq.groups; ++g)
        acc += -static_cast<float>(w.zero_point) * scale_at(w, n * xq.groups + g) * xq.gsum[m * xq.groups + g];
      y[m * N + n] = acc + (bias ? bias[n] : 0.f);
    }
}

// ---------------------------------------------------------------------------------------------- AVX2

// bit 4 of the codes of runs 2p and 2p + 1 of a U5 row set in lo and hi, from their two 32-bit words of high bits
// (`pair`: run 2p's word then run 2p + 1's, adjacent in memory): 0x10 or-ed into each byte whose code has it, in the
// paired order of the low nibbles (`lo`: codes 0-15 of both runs) and of the high nibbles (`hi`: codes 16-31 of both)
HF_AVX2 inline void set_bit4_of_pair_avx2(const uint32_t* pair, __m256i& lo, __m256i& hi) {
  long long both;
  std::memcpy(&both, pair, sizeof both);
  const __m256i v = _mm256_set1_epi64x(both);  // bytes 0-3: run 2p's bits, 4-7: run 2p + 1's, in each 64-bit lane
  // byte j of a 128-bit lane copies the byte of `v` holding its bit: lo takes bytes 0, 1 (run 2p, codes 0-15) then
  // 4, 5 (run 2p + 1); hi bytes 2, 3 then 6, 7 (codes 16-31)
  const __m256i lo_src = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0404040404040404LL, 0x0505050505050505LL);
  const __m256i hi_src = _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL, 0x0606060606060606LL,
                                            0x0707070707070707LL);
  const __m256i lane_bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i b4 = _mm256_set1_epi8(0x10);
  const __m256i l = _mm256_and_si256(_mm256_shuffle_epi8(v, lo_src), lane_bit);
  const __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(v, hi_src), lane_bit);
  lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(l, lane_bit), b4));
  hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(h, lane_bit), b4));
}

// set_bit4_of_pair_avx2 and bit4_of_bits with AVX-512 BW / VL byte masks: bit i of a mask adds 0x10 to byte i (bit
// 4 of a nibble is clear)
HF_VNNI256 inline void set_bit4_of_pair_avx512(const uint32_t* pair, __m256i& lo, __m256i& hi) {
  uint64_t both;  // run 2p's word in bits 0-31, run 2p + 1's in bits 32-63
  std::memcpy(&both, pair, sizeof both);
  const __m256i b4 = _mm256_set1_epi8(0x10);
  // lo: bits 0-15 of each run's word (codes 0-15), hi: bits 16-31 (codes 16-31), one bit extraction each
  const auto lo_mask = static_cast<__mmask32>(_pext_u64(both, 0x0000FFFF0000FFFFull));
  const auto hi_mask = static_cast<__mmask32>(_pext_u64(both, 0xFFFF0000FFFF0000ull));
  lo = _mm256_mask_add_epi8(lo, lo_mask, lo, b4);
  hi = _mm256_mask_add_epi8(hi, hi_mask, hi, b4);
}

// set_bit4_of_pair_avx512 for rows a and b of w at once: a's bytes in the low 256 bits of lo / hi, b's in the high
HF_VNNI256 inline void set_bit4_of_pairs_zmm(const uint32_t* pair_a, const uint32_t* pair_b, __m512i& lo,
                                             __m512i& hi) {
  uint64_t a, b;
  std::memcpy(&a, pair_a, sizeof a);
  std::memcpy(&b, pair_b, sizeof b);
  constexpr uint64_t kLo = 0x0000FFFF0000FFFFull, kHi = 0xFFFF0000FFFF0000ull;
  const __m512i b4 = _mm512_set1_epi8(0x10);
  lo = _mm512_mask_add_epi8(lo, _pext_u64(a, kLo) | (_pext_u64(b, kLo) << 32), lo, b4);
  hi = _mm512_mask_add_epi8(hi, _pext_u64(a, kHi) | (_pext_u64(b, kHi) << 32), hi, b4);
}

// [a | b] in one 512-bit register
HF_VNNI256 inline __m512i join_zmm(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
HF_VNNI256 inline __m512 join_zmm(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

HF_VNNI256 inline __m256i set_bit4_avx512(__m256i v, uint32_t bits) {
  return _mm256_mask_add_epi8(v, static_cast<__mmask32>(bits), v, _mm256_set1_epi8(0x10));
}

// int32 sums of 4 products each: lanes 0-3 codes 0-15 of the 32 bytes' first half, lanes 4-7 the second half
HF_AVX2 inline __m256i dot_u8s8(__m256i codes_u8, __m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes_u8, q), _mm256_set1_epi16(1));
}

// [a x 4 | b x 4]
HF_AVX2 inline __m256 halves(float a, float b) { return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)); }

// the tile, once with AVX2's two-step byte products and once with AVX512-VNNI's fused ones (same integer sums, so
// the same bits); the dot macros give int32 lanes of 4 (DOT4) or 8 (DOT8) products of unsigned codes and int8 q
#define HF_Q8_TARGET HF_AVX2
#define HF_Q8_TILE tile_q8_avx2
#define HF_Q8_DOT4(u, s) dot_u8s8(u, s)
#define HF_Q8_SET_BIT4_OF_PAIR(pair, lo, hi) set_bit4_of_pair_avx2(pair, lo, hi)
#define HF_Q8_SET_BIT4(v, bits) _mm256_or_si256(v, bit4_of_bits(bits))
// 4 products of codes <= 31 and |q| <= 127 per int16 lane, two such sums added: no int16 saturation
#define HF_Q8_DOT8(lo, qa, hi, qb) \
  _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, qa), _mm256_maddubs_epi16(hi, qb)), _mm256_set1_epi16(1))
#include "gemm_group_quant_q8_tile.h"

#define HF_Q8_TARGET HF_VNNI256
#define HF_Q8_TILE tile_q8_vnni
#define HF_Q8_DOT4(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#define HF_Q8_SET_BIT4_OF_PAIR(pair, lo, hi) set_bit4_of_pair_avx512(pair, lo, hi)
#define HF_Q8_SET_BIT4(v, bits) set_bit4_avx512(v, bits)
#define HF_Q8_DOT8(lo, qa, hi, qb) _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, qa), hi, qb)
#define HF_Q8_ZMM  // packed rows of w two at a time in 512-bit registers
#include "gemm_group_quant_q8_tile.h"

using TileQ8Fn = void (*)(const QuantizedRows&, const GroupQuantWeight&, const float*, float*, int64_t, int64_t,
                          int64_t, int64_t, int);

#define HF_Q8_ROW(F, L, NRT) {F<L, NRT, 1, H>, F<L, NRT, 2, H>, F<L, NRT, 3, H>, F<L, NRT, 4, H>}
#define HF_Q8_TABLE2(F, L) {HF_Q8_ROW(F, L, 1), HF_Q8_ROW(F, L, 2)}
#define HF_Q8_TABLE4(F, L) {HF_Q8_ROW(F, L, 1), HF_Q8_ROW(F, L, 2), HF_Q8_ROW(F, L, 3), HF_Q8_ROW(F, L, 4)}
#define HF_Q8_TABLES(T, F) {T(F, kCodesI8), T(F, kCodesU4), T(F, kCodesU5)}

// (AVX2's tiles of 3-4 rows of w run for one row of x only: more would spill its 16 registers)
// [float16 scales][layout][rows of w - 1][rows of x - 1]
#define H false
static const TileQ8Fn kQ8Avx2F32[3][NR_Q8_WIDE][MR_Q8] = HF_Q8_TABLES(HF_Q8_TABLE4, tile_q8_avx2);
static const TileQ8Fn kQ8VnniF32[3][NR_Q8_WIDE][MR_Q8] = HF_Q8_TABLES(HF_Q8_TABLE4, tile_q8_vnni);
#undef H
#define H true
static const TileQ8Fn kQ8Avx2F16[3][NR_Q8_WIDE][MR_Q8] = HF_Q8_TABLES(HF_Q8_TABLE4, tile_q8_avx2);
static const TileQ8Fn kQ8VnniF16[3][NR_Q8_WIDE][MR_Q8] = HF_Q8_TABLES(HF_Q8_TABLE4, tile_q8_vnni);
#undef H

}  // namespace

void skinny_gemm_gq_q8(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
                       int64_t K, int isa) {
  if (is_tiled_layout(w.layout)) return skinny_gemm_gq_q8_x16(x, w, bias, y, M, N, K, isa);
  thread_local QuantizedRows rows;  // reused: a decoding step quantizes a row per linear
  QuantizedRows& xq = rows;          // the caller's, named so that the threads below share it
  quantize_rows(x, w, M, K, xq, isa >= kIsaAvx2);
  const bool simd = isa >= kIsaAvx2;
  // AVX-512 asked for and VNNI present: the fused byte products (256-bit, so the same lanes and bits as AVX2)
  const bool vnni = simd && isa >= kIsaAvx512 && has_vnni256();
  const int64_t nr_tile = (vnni || M == 1) && K <= kShortRows ? NR_Q8_WIDE : NR_Q8;  // AVX2: 4 x 1 accumulators
  const bool f16 = w.scale16 != nullptr;
  const TileQ8Fn(*table)[MR_Q8] = (vnni ? (f16 ? kQ8VnniF16 : kQ8VnniF32) : (f16 ? kQ8Avx2F16 : kQ8Avx2F32))[w.layout];
  over_q_tiles(M, N, nr_tile, MR_Q8, nr_tile * K * std::max<int64_t>(M, 4) / 4,
               [&](int64_t n, int64_t nr, int64_t m, int64_t mr, int npf) {
                 if (simd)
                   table[nr - 1][mr - 1](xq, w, bias, y, n, m, N, K, npf);
                 else
                   rows_scalar_q8(xq, w, bias, y, n, nr, m, mr, N, K);
               });
}

}  // namespace hf_spec
