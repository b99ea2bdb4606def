// y[M, N] = x'[M, K] @ w[N, K]^T (+ bias) for group-quantized w in a tiled layout, x' the rows of x quantized to
// int8 per run of 32 inputs (quantize_x_q8.h).
//
// Tiled layouts keep w's rows in blocks of 16 (N a multiple of 16); block b holds rows 16b..16b + 15:
//   I8x16          uint8 [N / 16][K / 4][16][4]: byte (k4, r, i) = code[16b + r, 4 k4 + i] + 128
//   U4x16, U5x16   uint8 [N / 16][K / 8][16][4]: byte (k8, r, i) holds bits 0-3 of code[16b + r, 8 k8 + i] in its
//                  low nibble and of code[16b + r, 8 k8 + 4 + i] in its high nibble
//   U5x16 high     uint64 [N / 16][K / 8][2]: bit 4r + i of word 0 is bit 4 of code[16b + r, 8 k8 + i], of word 1
//                  bit 4 of code[16b + r, 8 k8 + 4 + i]
//   scale (float32 or float16) and min: [N / 16][K / group][16]
// One 64-byte load gives 4 consecutive codes of 16 rows: the 16 int32 lanes of a VNNI byte dot product, a row a
// lane, against 4 bytes of a row of q broadcast. A tile's codes are unpacked once for all its rows of x, and each
// lane's integer sum reaches float once per 32 inputs (16 where scales are per 16 inputs), where the row-major
// kernel (gemm_group_quant_q8.cpp) converts a lane's sum of 4 or 8 products: a verification's rows cost several
// times less a row.
//
// The function, bit for bit on every ISA: with spans of u = 32 inputs (16 where the group size is not a multiple of
// 32), for each span c of a row in order
//   t_c = sum_{k in c} (code[n, k] - z) q[m, k]                     exact in int32 (z: the zero point)
//   acc = fma(float(t_c), scale[n, g(c)] * d[m, run(c)], acc)      acc from 0
// then, where w stores mins, acc += macc with macc = fma(min[n, g], gsum[m, g], macc) over groups g in order (from
// 0), and y[m, n] = acc (+ bias[n]). A row's bits do not depend on the rows beside it.
#include <cstring>

#include <torch/headeronly/util/Half.h>  // c10::detail::fp16_ieee_to_fp32_value: the scalar path's float16 scales

#include "quantize_x_q8.h"
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

constexpr int kBlocksDecode = 4;  // blocks of 16 rows of w a tile takes with one row of x (memory-bound decoding)
constexpr int kBlocksVerify = 2;  // ... with several: 2 x 4 int32 sums + 2 x 4 fp32 accumulators in 32 zmm
constexpr int kRowsVnni = 4;      // rows of x a tile takes on AVX512-VNNI
constexpr int kRowsVnniWide = 8;  // ... with more than 4 rows of x: one block, 8 int32 sums + 8 fp32 accumulators
constexpr int kRowsAvx2 = 2;      // ... on AVX2 (one block: 2 halves x 2 rows x (int32 sums + fp32) in 16 ymm)
constexpr int kRowsScalar = 4;

// what every tile reads
struct X16 {
  const QuantizedRows& xq;
  const GroupQuantWeight& w;
  const float* bias;
  float* y;
  int64_t N, K, runs, groups, span;  // span: inputs per float conversion (16 or 32)
  int64_t block_bytes;               // bytes of codes a block of 16 rows holds
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// the sum of q over span c of row m, from the half-run sums of quantize_rows
inline int32_t span_q_sum(const X16& a, int64_t m, int64_t k0) {
  const int32_t* hs = a.xq.half_sum.data() + m * (a.K / 16) + k0 / 16;
  return a.span == 16 ? hs[0] : hs[0] + hs[1];
}

// ---------------------------------------------------------------------------------------------- plain C++

inline int32_t tiled_code(const GroupQuantWeight& w, int64_t n, int64_t k, int64_t K) {
  const int64_t b = n / kTileRows, r = n % kTileRows;
  const auto* codes = static_cast<const uint8_t*>(w.codes);
  if (w.layout == kCodesI8x16) return static_cast<int32_t>(codes[(b * (K / 4) + k / 4) * 64 + r * 4 + k % 4]) - 128;
  const int64_t k8 = k / 8, i = k % 4;
  const bool upper = k % 8 >= 4;
  const uint8_t byte = codes[(b * (K / 8) + k8) * 64 + r * 4 + i];
  int32_t c = upper ? byte >> 4 : byte & 15;
  if (w.layout == kCodesU5x16) {
    uint64_t word;
    std::memcpy(&word, reinterpret_cast<const char*>(w.high) + ((b * (K / 8) + k8) * 2 + upper) * 8, sizeof word);
    c |= static_cast<int32_t>((word >> (r * 4 + i)) & 1u) << 4;
  }
  return c;
}

// element (n, g) of a tiled [N, groups] table
inline int64_t tiled_at(int64_t n, int64_t g, int64_t groups) {
  return ((n / kTileRows) * groups + g) * kTileRows + n % kTileRows;
}

void rows_scalar_x16(const X16& a, int64_t n0, int64_t nr, int64_t m0, int64_t mr) {
  const GroupQuantWeight& w = a.w;
  for (int64_t n = n0; n < n0 + nr; ++n)
    for (int64_t m = m0; m < m0 + mr; ++m) {
      const int8_t* q = a.xq.q.data() + m * a.K;
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < a.K; k0 += a.span) {
        int32_t t = -w.zero_point * span_q_sum(a, m, k0);
        for (int64_t k = k0; k < k0 + a.span; ++k) t += tiled_code(w, n, k, a.K) * q[k];
        const int64_t j = tiled_at(n, k0 / w.group, a.groups);
        const float s = w.scale16 ? c10::detail::fp16_ieee_to_fp32_value(w.scale16[j]) : w.scale[j];
        const float sd = s * a.xq.d[m * a.runs + k0 / RUN_Q8];
        acc = std::fma(static_cast<float>(t), sd, acc);
      }
      if (w.min) {
        float macc = 0.f;
        for (int64_t g = 0; g < a.groups; ++g)
          macc = std::fma(w.min[tiled_at(n, g, a.groups)], a.xq.gsum[m * a.groups + g], macc);
        acc += macc;
      }
      a.y[m * a.N + n] = a.bias ? acc + a.bias[n] : acc;
    }
}

// ---------------------------------------------------------------------------------------------- AVX-512 VNNI

// blocks [b, b + T) of w against rows [m, m + MR) of x; `prefetch`: the next tile's codes and high bits a step ahead
template <int LAYOUT, int T, int MR>
HF_VNNI256 void tile_x16_vnni(const X16& a, int64_t b, int64_t m, bool prefetch) {
  constexpr bool kI8 = LAYOUT == kCodesI8x16, kU5 = LAYOUT == kCodesU5x16;
  const GroupQuantWeight& w = a.w;
  const int64_t K = a.K, runs = a.runs, groups = a.groups, bb = a.block_bytes;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + b * bb;
  const int64_t high_words = K / 8 * 2;  // a block's
  const uint64_t* high = kU5 ? reinterpret_cast<const uint64_t*>(w.high) + b * high_words : nullptr;
  const int off = (kI8 ? 128 : 0) + w.zero_point;  // what each stored code is above code - z
  const int8_t* q = a.xq.q.data() + m * K;
  const float* d = a.xq.d.data() + m * runs;
  if (prefetch) {  // the next tile's scales and mins: small streams of their own
    const auto side = [&](const void* base, int64_t size) {
      const char* from = static_cast<const char*>(base) + (b + T) * groups * kTileRows * size;
      for (int64_t i = 0; i < T * groups * kTileRows * size; i += 64) _mm_prefetch(from + i, _MM_HINT_T1);
    };
    if (w.scale16)
      side(w.scale16, 2);
    else
      side(w.scale, 4);
    if (w.min) side(w.min, 4);
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
  __m512 acc[T][MR];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < MR; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += a.span) {
    __m512i sum[T][MR];
    for (int j = 0; j < MR; ++j) {
      const __m512i init = _mm512_set1_epi32(-off * span_q_sum(a, m + j, k0));
      for (int t = 0; t < T; ++t) sum[t][j] = init;
    }
    if constexpr (kI8) {
      for (int64_t k = k0; k < k0 + a.span; k += 4) {
        for (int t = 0; t < T; ++t) {
          const uint8_t* p = codes + t * bb + k * 16;
          if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + T * bb), _MM_HINT_T1);
          const __m512i c = _mm512_loadu_si512(p);
          for (int j = 0; j < MR; ++j)
            sum[t][j] = _mm512_dpbusd_epi32(sum[t][j], c, _mm512_set1_epi32(load_i32(q + j * K + k)));
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + a.span; k += 8) {
        for (int t = 0; t < T; ++t) {
          const uint8_t* p = codes + t * bb + k * 8;
          if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + T * bb), _MM_HINT_T1);
          const __m512i raw = _mm512_loadu_si512(p);
          __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
          if constexpr (kU5) {
            const uint64_t* h = high + t * high_words + k / 8 * 2;
            if (prefetch && (k / 8) % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(h + T * high_words), _MM_HINT_T1);
            lo = _mm512_mask_add_epi8(lo, h[0], lo, b4);
            hi = _mm512_mask_add_epi8(hi, h[1], hi, b4);
          }
          for (int j = 0; j < MR; ++j) {
            sum[t][j] = _mm512_dpbusd_epi32(sum[t][j], lo, _mm512_set1_epi32(load_i32(q + j * K + k)));
            sum[t][j] = _mm512_dpbusd_epi32(sum[t][j], hi, _mm512_set1_epi32(load_i32(q + j * K + k + 4)));
          }
        }
      }
    }
    const int64_t g = k0 / w.group, r = k0 / RUN_Q8;
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((b + t) * groups + g) * kTileRows;
      const __m512 s = w.scale16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scale16 + at)))
                                 : _mm512_loadu_ps(w.scale + at);
      for (int j = 0; j < MR; ++j)
        acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t][j]), _mm512_mul_ps(s, _mm512_set1_ps(d[j * runs + r])),
                                    acc[t][j]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < MR; ++j) {
      __m512 out = acc[t][j];
      if (w.min) {
        const float* gs = a.xq.gsum.data() + (m + j) * groups;
        __m512 macc = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g)
          macc = _mm512_fmadd_ps(_mm512_loadu_ps(w.min + ((b + t) * groups + g) * kTileRows), _mm512_set1_ps(gs[g]),
                                 macc);
        out = _mm512_add_ps(out, macc);
      }
      if (a.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(a.bias + (b + t) * kTileRows));
      _mm512_storeu_ps(a.y + (m + j) * a.N + (b + t) * kTileRows, out);
    }
}

// ---------------------------------------------------------------------------------------------- AVX2

// one block of w (two halves of 8 rows) against rows [m, m + MR) of x, with AVX2's two-step byte products: the
// same integer sums as VNNI's, so the same bits
template <int LAYOUT, int MR>
HF_AVX2 void tile_x16_avx2(const X16& a, int64_t b, int64_t m, bool prefetch) {
  constexpr bool kI8 = LAYOUT == kCodesI8x16, kU5 = LAYOUT == kCodesU5x16;
  const GroupQuantWeight& w = a.w;
  const int64_t K = a.K, runs = a.runs, groups = a.groups, bb = a.block_bytes;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + b * bb;
  const auto* high = kU5 ? reinterpret_cast<const uint64_t*>(w.high) + b * (K / 8 * 2) : nullptr;
  const int8_t* q = a.xq.q.data() + m * K;
  const float* d = a.xq.d.data() + m * runs;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < MR; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += a.span) {
    __m256i sum[2][MR];
    for (int j = 0; j < MR; ++j) sum[0][j] = sum[1][j] = _mm256_set1_epi32(-w.zero_point * span_q_sum(a, m + j, k0));
    if constexpr (kI8) {
      for (int64_t k = k0; k < k0 + a.span; k += 4) {
        const uint8_t* p = codes + k * 16;
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + bb), _MM_HINT_T1);
        for (int h = 0; h < 2; ++h) {
          const __m256i c = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)), flip);
          const __m256i ac = _mm256_sign_epi8(c, c);  // |code| as uint8 (-128 -> 128)
          for (int j = 0; j < MR; ++j) {
            const __m256i qx = _mm256_set1_epi32(load_i32(q + j * K + k));
            // |c| q pairs <= 2 * 128 * 127: no int16 saturation
            const __m256i pairs = _mm256_maddubs_epi16(ac, _mm256_sign_epi8(qx, c));
            sum[h][j] = _mm256_add_epi32(sum[h][j], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + a.span; k += 8) {
        const uint8_t* p = codes + k * 8;
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + bb), _MM_HINT_T1);
        uint64_t bits[2] = {0, 0};
        if constexpr (kU5) std::memcpy(bits, high + k / 8 * 2, sizeof bits);
        for (int h = 0; h < 2; ++h) {  // rows 8h..8h + 7: bytes 32h..32h + 31, mask bits 32h..32h + 31
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
          __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          if constexpr (kU5) {
            lo = _mm256_or_si256(lo, bit4_of_bits(static_cast<uint32_t>(bits[0] >> (32 * h))));
            hi = _mm256_or_si256(hi, bit4_of_bits(static_cast<uint32_t>(bits[1] >> (32 * h))));
          }
          for (int j = 0; j < MR; ++j) {
            // 4 products of codes <= 31 and |q| <= 127 per int16 lane: no saturation
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(q + j * K + k))),
                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(q + j * K + k + 4))));
            sum[h][j] = _mm256_add_epi32(sum[h][j], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    const int64_t at = (b * groups + k0 / w.group) * kTileRows, r = k0 / RUN_Q8;
    for (int h = 0; h < 2; ++h) {
      const __m256 s = w.scale16
                           ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scale16 + at + 8 * h)))
                           : _mm256_loadu_ps(w.scale + at + 8 * h);
      for (int j = 0; j < MR; ++j)
        acc[h][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][j]), _mm256_mul_ps(s, _mm256_set1_ps(d[j * runs + r])),
                                    acc[h][j]);
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < MR; ++j) {
      __m256 out = acc[h][j];
      if (w.min) {
        const float* gs = a.xq.gsum.data() + (m + j) * groups;
        __m256 macc = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g)
          macc = _mm256_fmadd_ps(_mm256_loadu_ps(w.min + (b * groups + g) * kTileRows + 8 * h), _mm256_set1_ps(gs[g]),
                                 macc);
        out = _mm256_add_ps(out, macc);
      }
      if (a.bias) out = _mm256_add_ps(out, _mm256_loadu_ps(a.bias + b * kTileRows + 8 * h));
      _mm256_storeu_ps(a.y + (m + j) * a.N + b * kTileRows + 8 * h, out);
    }
}

using TileX16Fn = void (*)(const X16&, int64_t, int64_t, bool);

#define HF_X16_ROW(L, T) {tile_x16_vnni<L, T, 1>, tile_x16_vnni<L, T, 2>, tile_x16_vnni<L, T, 3>, tile_x16_vnni<L, T, 4>}
#define HF_X16_TABLE(L) {HF_X16_ROW(L, 1), HF_X16_ROW(L, 2), HF_X16_ROW(L, 3), HF_X16_ROW(L, 4)}
// [layout - kCodesI8x16][blocks - 1][rows of x - 1]
static const TileX16Fn kX16Vnni[3][4][kRowsVnni] = {
    HF_X16_TABLE(kCodesI8x16), HF_X16_TABLE(kCodesU4x16), HF_X16_TABLE(kCodesU5x16)};
#define HF_X16_WIDE(L) \
  {tile_x16_vnni<L, 1, 1>, tile_x16_vnni<L, 1, 2>, tile_x16_vnni<L, 1, 3>, tile_x16_vnni<L, 1, 4>, \
   tile_x16_vnni<L, 1, 5>, tile_x16_vnni<L, 1, 6>, tile_x16_vnni<L, 1, 7>, tile_x16_vnni<L, 1, 8>}
static const TileX16Fn kX16VnniWide[3][kRowsVnniWide] = {
    HF_X16_WIDE(kCodesI8x16), HF_X16_WIDE(kCodesU4x16), HF_X16_WIDE(kCodesU5x16)};
static const TileX16Fn kX16Avx2[3][kRowsAvx2] = {
    {tile_x16_avx2<kCodesI8x16, 1>, tile_x16_avx2<kCodesI8x16, 2>},
    {tile_x16_avx2<kCodesU4x16, 1>, tile_x16_avx2<kCodesU4x16, 2>},
    {tile_x16_avx2<kCodesU5x16, 1>, tile_x16_avx2<kCodesU5x16, 2>}};

}  // namespace

void skinny_gemm_gq_q8_x16(const float* x, const GroupQuantWeight& w, const float* bias, float* y, int64_t M,
                           int64_t N, int64_t K, int isa) {
  thread_local QuantizedRows rows;  // reused: a decoding step quantizes a row per linear
  QuantizedRows& xq = rows;          // the caller's, named so that the threads below share it
  const bool simd = isa >= kIsaAvx2;
  quantize_rows(x, w, M, K, xq, simd);
  const X16 a{xq, w, bias, y, N, K, K / RUN_Q8, K / w.group, w.group % 32 ? 16 : 32,
              K * (w.layout == kCodesI8x16 ? 16 : 8)};
  const int li = w.layout - kCodesI8x16;
  const int64_t blocks = N / kTileRows;
  // the work of one block of 16 rows against x, from which the threads' grain is sized
  const int64_t tile_work = kTileRows * K * std::max<int64_t>(M, 4) / 4;
  if (simd && isa >= kIsaAvx512 && has_vnni256()) {
    if (M > kRowsVnni) {
      over_q_tiles(M, blocks, 1, kRowsVnniWide, tile_work, [&](int64_t b, int64_t, int64_t m, int64_t mr, int npf) {
        kX16VnniWide[li][mr - 1](a, b, m, npf > 0);
      });
    } else {
      const int64_t per_tile = M == 1 ? kBlocksDecode : kBlocksVerify;
      over_q_tiles(M, blocks, per_tile, kRowsVnni, per_tile * tile_work,
                   [&](int64_t b, int64_t nb, int64_t m, int64_t mr, int npf) {
                     kX16Vnni[li][nb - 1][mr - 1](a, b, m, npf > 0);
                   });
    }
  } else if (simd) {
    over_q_tiles(M, blocks, 1, kRowsAvx2, tile_work,
                 [&](int64_t b, int64_t, int64_t m, int64_t mr, int npf) { kX16Avx2[li][mr - 1](a, b, m, npf > 0); });
  } else {
    over_q_tiles(M, blocks, 1, kRowsScalar, tile_work,
                 [&](int64_t b, int64_t, int64_t m, int64_t mr, int) {
                   rows_scalar_x16(a, b * kTileRows, kTileRows, m, mr);
                 });
  }
}

}  // namespace hf_spec
