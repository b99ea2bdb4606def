// The tile of gemm_group_quant_q8.cpp, included there once per instruction set (no include guard): the includer
// defines HF_Q8_TARGET (the function's target attribute), HF_Q8_TILE (its name) and the integer dot products
// HF_Q8_DOT4(u, s) / HF_Q8_DOT8(lo, qa, hi, qb) (int32 lanes: sums of 4 / 8 products of unsigned bytes u, lo, hi
// with signed bytes s, qa, qb) and U5's bit 4 setters HF_Q8_SET_BIT4_OF_PAIR(pair, lo, hi) (in place, the paired
// order) / HF_Q8_SET_BIT4(v, bits) (returns v, natural order), and gets them undefined again at the end.
//
// A tile: rows [n, n + NRT) of w against rows [m, m + MR) of x (quantized), fp32 lanes summed over runs in order.

template <int LAYOUT, int NRT, int MR, bool SF16>
HF_Q8_TARGET void HF_Q8_TILE(const QuantizedRows& xq, const GroupQuantWeight& w, const float* bias, float* __restrict y,
                          int64_t n, int64_t m, int64_t N, int64_t K, int npf) {
  const int64_t groups = xq.groups, runs = xq.runs;
  const int32_t* hg = xq.half_group.data();  // hg[k / 16]: the scale's group of input k
  const int64_t row_bytes = LAYOUT == kCodesI8 ? K : K / 2;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + n * row_bytes;
  // float32 scales, or (SF16) float16 ones with groups of 32: scale j of row i is run j's
  const float* scale = SF16 ? nullptr : w.scale + n * groups;
  const uint16_t* scale16 = SF16 ? w.scale16 + n * groups : nullptr;
  const uint32_t* high = LAYOUT == kCodesU5 ? w.high + n * runs : nullptr;
  const int8_t* q = xq.q.data() + m * K;
  const float* d = xq.d.data() + m * runs;
  // prefetch the next tile's rows, or with one row of x (decoding: reading w is all the time) the rows
  // kPrefetchBytes ahead (whole tiles), enough to cover DRAM's latency
  const int64_t ahead = NRT * (MR > 1 ? 1 : std::max<int64_t>(1, kPrefetchBytes / (NRT * row_bytes)));
  const int pfr = npf > 0 ? static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(NRT, N - n - ahead))) : 0;
  const uint8_t* next = codes + ahead * row_bytes;
  const auto prefetch_codes = [&](int64_t at) {  // the ahead rows' codes at byte `at` of a row, a line at a time
    if ((at & 63) == 0)
      for (int i = 0; i < pfr; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * row_bytes + at), _MM_HINT_T1);
  };
  if (pfr > 0 && MR == 1) {  // the same rows' scales, mins and high bits: streams of their own
    const auto side = [&](const void* base, int64_t row_size) {
      const char* from = static_cast<const char*>(base) + ahead * row_size;
      for (int64_t b = 0; b < pfr * row_size; b += 64) _mm_prefetch(from + b, _MM_HINT_T1);
    };
    if (SF16)
      side(scale16, groups * 2);
    else
      side(scale, groups * 4);
    if (w.min) side(w.min + n * groups, groups * 4);
    if (LAYOUT == kCodesU5) side(high, runs * 4);
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[NRT][MR];
  for (int i = 0; i < NRT; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  if (LAYOUT == kCodesI8) {
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t k = r * RUN_Q8;
      prefetch_codes(k);
      __m256i qx[MR];
      for (int j = 0; j < MR; ++j) qx[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k));
      for (int i = 0; i < NRT; ++i) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i * row_bytes + k));
        const __m256i ac = _mm256_sign_epi8(c, c);  // |code| as uint8 (-128 -> 128)
        const __m256 s = SF16 ? _mm256_set1_ps(_cvtsh_ss(scale16[i * groups + r]))
                              : halves(scale[i * groups + hg[k / 16]], scale[i * groups + hg[k / 16 + 1]]);
        for (int j = 0; j < MR; ++j) {
          const __m256i sums = HF_Q8_DOT4(ac, _mm256_sign_epi8(qx[j], c));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s, _mm256_set1_ps(d[j * runs + r])),
                                      acc[i][j]);
        }
      }
    }
  } else {
    const int64_t pairs = runs / 2;
    const float* dpair = xq.dpair.data() + m * pairs * 8;
#ifdef HF_Q8_ZMM
    if constexpr (NRT % 2 == 0) {
      // rows i and i + 1 of w side by side in 512-bit registers, each half doing lane for lane what the 256-bit
      // loop below does for its row (the same integer sums, products and sums in the same order: the same bits)
      // with half the instructions a code
      __m512 acc2[NRT / 2][MR];
      for (int i = 0; i < NRT / 2; ++i)
        for (int j = 0; j < MR; ++j) acc2[i][j] = _mm512_setzero_ps();
      const __m512i low4x2 = _mm512_set1_epi8(0x0F);
      for (int64_t p = 0; p < pairs; ++p) {
        const int64_t k = p * 64, off = p * 32;
        prefetch_codes(off);
        __m512i qa[MR], qb[MR];
        __m512 dp[MR];
        for (int j = 0; j < MR; ++j) {
          qa[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k)));
          qb[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k + 32)));
          dp[j] = _mm512_castpd_ps(
              _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(dpair + j * pairs * 8 + 8 * p))));
        }
        for (int i = 0; i < NRT; i += 2) {
          const __m512i raw = join_zmm(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i * row_bytes + off)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (i + 1) * row_bytes + off)));
          __m512i lo = _mm512_and_si512(raw, low4x2);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4x2);
          if (LAYOUT == kCodesU5) set_bit4_of_pairs_zmm(high + i * runs + 2 * p, high + (i + 1) * runs + 2 * p, lo, hi);
          __m512 s;
          if constexpr (SF16) {  // [a_i x 4 | b_i x 4 | a_i+1 x 4 | b_i+1 x 4]
            int32_t pa, pb;
            std::memcpy(&pa, scale16 + i * groups + 2 * p, sizeof pa);
            std::memcpy(&pb, scale16 + (i + 1) * groups + 2 * p, sizeof pb);
            s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                      _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(pa, pb, 0, 0))));
          } else {
            s = join_zmm(halves(scale[i * groups + hg[k / 16]], scale[i * groups + hg[k / 16 + 2]]),
                         halves(scale[(i + 1) * groups + hg[k / 16]], scale[(i + 1) * groups + hg[k / 16 + 2]]));
          }
          for (int j = 0; j < MR; ++j) {
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, qa[j]), hi, qb[j]);
            acc2[i / 2][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(s, dp[j]), acc2[i / 2][j]);
          }
        }
      }
      for (int i = 0; i < NRT; i += 2)
        for (int j = 0; j < MR; ++j) {
          acc[i][j] = _mm512_castps512_ps256(acc2[i / 2][j]);
          acc[i + 1][j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[i / 2][j]), 1));
        }
    } else
#endif
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t k = p * 64, off = p * 32;
      prefetch_codes(off);
      for (int i = 0; i < NRT; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i * row_bytes + off));
        __m256i lo = _mm256_and_si256(raw, low4);                         // codes 0-15 of runs 2p, 2p + 1
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);  // codes 16-31 of both
        if (LAYOUT == kCodesU5) HF_Q8_SET_BIT4_OF_PAIR(high + i * runs + 2 * p, lo, hi);
        __m256 s;
        if constexpr (SF16) {  // runs 2p and 2p + 1's scales, adjacent: [a x 4 | b x 4]
          int32_t pair;
          std::memcpy(&pair, scale16 + i * groups + 2 * p, sizeof pair);
          s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))),
                                       _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        } else {
          s = halves(scale[i * groups + hg[k / 16]], scale[i * groups + hg[k / 16 + 2]]);
        }
        for (int j = 0; j < MR; ++j) {
          const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k));
          const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k + 32));
          const __m256i sums = HF_Q8_DOT8(lo, qa, hi, qb);
          const __m256 dp = _mm256_loadu_ps(dpair + j * pairs * 8 + 8 * p);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s, dp), acc[i][j]);
        }
      }
    }
    if (runs & 1) {  // the last run alone, natural order
      const int64_t r = runs - 1, k = r * RUN_Q8;
      for (int i = 0; i < NRT; ++i) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * row_bytes + k / 2));
        const __m128i l4 = _mm_set1_epi8(0x0F);
        __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), l4), _mm_and_si128(raw, l4));
        if (LAYOUT == kCodesU5) c = HF_Q8_SET_BIT4(c, high[i * runs + r]);
        const float sr = SF16 ? _cvtsh_ss(scale16[i * groups + r]) : scale[i * groups + hg[k / 16]];
        for (int j = 0; j < MR; ++j) {
          const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k));
          const __m256 sd = _mm256_set1_ps(sr * d[j * runs + r]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(HF_Q8_DOT4(c, qx)), sd, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < NRT; ++i)
    for (int j = 0; j < MR; ++j) {
      float out = hsum_avx2(acc[i][j]);
      if (w.min || w.zero_point) {  // sum_g min[n, g] * gsum[m, g], 8 groups a step then the rest
        // a zero point's min -zp * scale is exact (zp a power of two): the same bits as a stored min
        const float* mn = w.min ? w.min + (n + i) * groups : (SF16 ? nullptr : scale + i * groups);
        const uint16_t* mn16 = SF16 ? scale16 + i * groups : nullptr;
        const float zp = w.min ? 1.f : -static_cast<float>(w.zero_point);
        const __m256 zpv = _mm256_set1_ps(zp);
        const float* gs = xq.gsum.data() + (m + j) * groups;
        __m256 macc = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) {
          const __m256 v = SF16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn16 + g)))
                                : _mm256_loadu_ps(mn + g);
          macc = _mm256_fmadd_ps(_mm256_mul_ps(zpv, v), _mm256_loadu_ps(gs + g), macc);
        }
        float tail = 0.f;
        // fused in every build, whatever it vectorises
        for (; g < groups; ++g) tail = std::fma(zp * (SF16 ? _cvtsh_ss(mn16[g]) : mn[g]), gs[g], tail);
        out += hsum_avx2(macc) + tail;
      }
      y[(m + j) * N + n + i] = out + (bias ? bias[n + i] : 0.f);
    }
}

#undef HF_Q8_TARGET
#undef HF_Q8_TILE
#undef HF_Q8_DOT4
#undef HF_Q8_DOT8
#undef HF_Q8_SET_BIT4_OF_PAIR
#undef HF_Q8_SET_BIT4
#undef HF_Q8_ZMM
