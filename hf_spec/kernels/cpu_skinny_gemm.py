"""A C++ CPU kernel for `x @ W.T (+ bias)` with few rows in x (speculative verification), compiled on first use.

MKL's sgemm runs `F.linear(x, W)` for 4..32 rows of x well below memory bandwidth. This kernel reads each row of
W from memory once: a tile of 4 rows of W is multiplied with up to 6 rows of x at a time (24 AVX-512
accumulators; AVX2: 3 rows of x held in registers, 12 accumulators; x stays in L1/L2), vectorised over K, while
the next tile of W is prefetched; the tiles are split over torch's intra-op threads with `at::parallel_for`.
The ISA is picked at run time (AVX-512, AVX2+FMA, or plain C++), so one build serves any x86-64 CPU; the weight
is used as it is (no copy, no transpose). Besides fp32: bfloat16 x and W on CPUs with AVX512-BF16
(`kernel_linear_bf16`), int8 weights with fp32 x (`kernel_linear_int8`), and u8 x s8 products on AVX512-VNNI.

Built with `torch.utils.cpp_extension.load_inline` (needs a C++ compiler and ninja; ~3 s the first time, then
loaded from `~/.cache/hf-spec/torch_extensions` or `$HF_SPEC_KERNEL_CACHE`). Any failure to build or load logs
one warning and `skinny_gemm` falls back to `F.linear`; `HF_SPEC_NO_CPP_KERNELS=1` turns the kernel off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 1, 32  # rows of x the kernel accepts
ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512 = -1, 0, 1, 2

CPP_SOURCE = r"""
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32, all contiguous. Each row of w is read from memory once.
#include <Python.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 4;       // rows of w per tile (all ISAs)
constexpr int MR_AVX512 = 6;    // rows of x per tile: 4 x 6 accumulators + 4 w + 1 x = 29 of 32 zmm
constexpr int MR_AVX2 = 3;      // 4 x 3 accumulators + 3 x + 1 w = 16 ymm
constexpr int MR_SCALAR = 4;

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
#define HF_AVX2 __attribute__((target("avx2,fma")))

HF_AVX2 inline __m128 hsum128_avx2(__m256 a) {
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

HF_AVX2 inline float hsum_avx2(__m256 a) {
  __m128 s = hsum128_avx2(a);
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

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
#define HF_AVX512 __attribute__((target("avx512f,avx2,fma")))

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
#define HF_ROW(F, NRT) {F<NRT, 1>, F<NRT, 2>, F<NRT, 3>, F<NRT, 4>, F<NRT, 5>, F<NRT, 6>}
#define HF_TABLE(F) {HF_ROW(F, 1), HF_ROW(F, 2), HF_ROW(F, 3), HF_ROW(F, 4)}
static const TileFn kScalar[4][6] = HF_TABLE(tile_scalar);
static const TileFn kAvx2[4][6] = HF_TABLE(tile_avx2);
static const TileFn kAvx512[4][6] = HF_TABLE(tile_avx512);

enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

int detect_isa() {
  __builtin_cpu_init();  // libgcc's checks include the OS saving the AVX / AVX-512 registers (XGETBV)
  if (__builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
  return kIsaScalar;
}

int best_isa() {
  static const int isa = detect_isa();
  return isa;
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

// ------------------------------------------------------------------------------------------------ int8 weights
// y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N]: int8 weights converted to fp32 in registers (exactly: |q| <= 127),
// fp32 products and sums; each row of q is read from memory once (a quarter of an fp32 weight's bytes).
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

// Tiles of `nr_tile` rows of q (N rows in all), each against all M rows of x in chunks of at most `mr_max` rows
// (split evenly), over torch's threads: tile(n, nr, m, mr, npf) runs rows [n, n + nr) of q against rows [m, m + mr)
// of x while prefetching `npf` rows of the next tile (during a tile's first chunk).
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

void skinny_gemm_i8(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
                    int isa) {
  // AVX-512 CPUs take the AVX2 paths: tiles of 4 rows of q and 3 of x, but 2 rows of q against 4-5 rows of x
  // (measured on the AMD EPYC, 151,936 x 896: 4 rows 14.0 -> 12.1 ms; 6 and 9 rows were slower in one wide chunk)
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

// ------------------------------------------------------------------------------------------------ u8 x s8 (VNNI)
// y[M, N] = float((xu[M, K] - 128) @ q[N, K]^T) * (scale[N] * xs[M]) with xu = (an int8 x) + 128 as uint8:
// `vpdpbusd` sums u8 x s8 products exactly in int32 (4 per lane), and sum_k (xu - 128) q = sum_k xu q - 128 qsum
// with qsum[n] = sum_k q[n, k]; 64 products per instruction against 16 fp32 FMAs.
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

bool has_vnni() {
  static const bool vnni = detect_vnni();
  return vnni;
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

// y[M, N] = (x[M, K] with each row quantized to int8, a step of amax / 127) @ (q * scale)^T by the VNNI kernel: an
// approximation for drafts (a draft step of several rows: 11 rows of 22 Qwen2.5-0.5B layers 36 -> ~14 ms)
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

// ------------------------------------------------------------------------------------------------ bf16 (AVX512-BF16)
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for bfloat16 x and w, fp32 y: `vdpbf16ps` multiplies 32 bf16 pairs
// into 16 fp32 sums per instruction (products exact in fp32, fp32 sums), with no conversion of w or x; each row of
// w is read from memory once (half an fp32 weight's bytes). torch's bf16 GEMV reads them at ~0.6 of that pace.
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

// ------------------------------------------------------------------------------------------------ screening
// keep[j] = 1 if a[m, j] + ew[m] * coef[j] + eq[m] * qn[j] >= floor[m] for some row m of a (M, N), else 0:
// the candidates of the screened LM head in one pass over the scores
void select_within(const float* a, const float* floor, const float* ew, const float* eq, const float* coef,
                   const float* qn, uint8_t* keep, int64_t M, int64_t N) {
  constexpr int64_t kBlock = 2048;
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * kBlock, j1 = std::min(N, j0 + kBlock);
      std::fill(keep + j0, keep + j1, uint8_t{0});
      for (int64_t m = 0; m < M; ++m) {
        const float* row = a + m * N;
        const float f = floor[m], w = ew[m], q = eq[m];
        for (int64_t j = j0; j < j1; ++j) keep[j] |= static_cast<uint8_t>(row[j] + w * coef[j] + q * qn[j] >= f);
      }
    }
  });
}

}  // namespace

// ------------------------------------------------------------------------------------------------ Python module
// run `work()` with the GIL released; None, or RuntimeError("<name> failed") if it threw
template <typename Work>
PyObject* without_gil(const char* name, Work work) {
  bool failed = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    work();
  } catch (...) {
    failed = true;
  }
  Py_END_ALLOW_THREADS
  if (failed) {
    PyErr_Format(PyExc_RuntimeError, "%s failed", name);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// Parse (ptr0, ptr1, ptr2, ptr3, M, N, K, isa) and run `gemm(ptrs, M, N, K, isa)` without the GIL; ptr2 may be 0
// where `ptr2_optional` (a bias), the others may not.
template <typename Gemm>
PyObject* run_gemm(PyObject* args, const char* name, bool ptr2_optional, Gemm gemm) {
  unsigned long long p[4];
  long long M, N, K;
  int isa;
  if (!PyArg_ParseTuple(args, "KKKKLLLi", &p[0], &p[1], &p[2], &p[3], &M, &N, &K, &isa)) return nullptr;
  if (M < 1 || N < 1 || K < 1 || !p[0] || !p[1] || !p[3] || (!ptr2_optional && !p[2])) {
    PyErr_Format(PyExc_ValueError, "%s: bad shape or null pointer", name);
    return nullptr;
  }
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  return without_gil(name, [&] { gemm(p, M, N, K, isa); });
}

static PyObject* py_gemm(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm", true,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                                reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K, isa);
                  });
}

static PyObject* py_gemm_i8(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm_i8", false,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm_i8(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const int8_t*>(p[1]),
                                   reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K, isa);
                  });
}

// (xu_ptr, xs_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K): `skinny_gemm_u8s8`, without the GIL
static PyObject* py_gemm_u8s8(PyObject*, PyObject* args) {
  unsigned long long p[6];
  long long M, N, K;
  if (!PyArg_ParseTuple(args, "KKKKKKLLL", &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &M, &N, &K)) return nullptr;
  if (M < 1 || N < 1 || K < 1 || std::find(p, p + 6, 0ULL) != p + 6 || !has_vnni()) {
    PyErr_SetString(PyExc_ValueError, "gemm_u8s8: bad shape, null pointer or no AVX512-VNNI");
    return nullptr;
  }
  return without_gil("gemm_u8s8", [&] {
    skinny_gemm_u8s8(reinterpret_cast<const uint8_t*>(p[0]), reinterpret_cast<const float*>(p[1]),
                     reinterpret_cast<const int8_t*>(p[2]), reinterpret_cast<const int32_t*>(p[3]),
                     reinterpret_cast<const float*>(p[4]), reinterpret_cast<float*>(p[5]), M, N, K);
  });
}

// (x_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K): `skinny_gemm_w8a8`, without the GIL
static PyObject* py_gemm_w8a8(PyObject*, PyObject* args) {
  unsigned long long p[5];
  long long M, N, K;
  if (!PyArg_ParseTuple(args, "KKKKKLLL", &p[0], &p[1], &p[2], &p[3], &p[4], &M, &N, &K)) return nullptr;
  if (M < 1 || N < 1 || K < 1 || std::find(p, p + 5, 0ULL) != p + 5 || !has_vnni()) {
    PyErr_SetString(PyExc_ValueError, "gemm_w8a8: bad shape, null pointer or no AVX512-VNNI");
    return nullptr;
  }
  return without_gil("gemm_w8a8", [&] {
    skinny_gemm_w8a8(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const int8_t*>(p[1]),
                     reinterpret_cast<const int32_t*>(p[2]), reinterpret_cast<const float*>(p[3]),
                     reinterpret_cast<float*>(p[4]), M, N, K);
  });
}

// (a_ptr, floor_ptr, ew_ptr, eq_ptr, coef_ptr, qn_ptr, keep_ptr, M, N): `select_within`, without the GIL
static PyObject* py_select_within(PyObject*, PyObject* args) {
  unsigned long long p[7];
  long long M, N;
  if (!PyArg_ParseTuple(args, "KKKKKKKLL", &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &M, &N)) return nullptr;
  if (M < 1 || N < 1 || std::find(p, p + 7, 0ULL) != p + 7) {
    PyErr_SetString(PyExc_ValueError, "select_within: bad shape or null pointer");
    return nullptr;
  }
  return without_gil("select_within", [&] {
    select_within(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                  reinterpret_cast<const float*>(p[2]), reinterpret_cast<const float*>(p[3]),
                  reinterpret_cast<const float*>(p[4]), reinterpret_cast<const float*>(p[5]),
                  reinterpret_cast<uint8_t*>(p[6]), M, N);
  });
}

static PyObject* py_gemm_bf16(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm_bf16", true,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm_bf16(reinterpret_cast<const uint16_t*>(p[0]), reinterpret_cast<const uint16_t*>(p[1]),
                                     reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K,
                                     isa);
                  });
}

static PyObject* py_has_bf16(PyObject*, PyObject*) { return PyBool_FromLong(has_bf16()); }

static PyObject* py_best_isa(PyObject*, PyObject*) { return PyLong_FromLong(best_isa()); }

static PyObject* py_has_vnni(PyObject*, PyObject*) { return PyBool_FromLong(has_vnni()); }

static PyMethodDef kMethods[] = {
    {"gemm", py_gemm, METH_VARARGS, "gemm(x_ptr, w_ptr, bias_ptr_or_0, y_ptr, M, N, K, isa)"},
    {"gemm_i8", py_gemm_i8, METH_VARARGS, "gemm_i8(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, isa)"},
    {"gemm_u8s8", py_gemm_u8s8, METH_VARARGS, "gemm_u8s8(xu_ptr, xs_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K)"},
    {"gemm_w8a8", py_gemm_w8a8, METH_VARARGS, "gemm_w8a8(x_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K)"},
    {"gemm_bf16", py_gemm_bf16, METH_VARARGS, "gemm_bf16(x_ptr, w_ptr, bias_f32_ptr_or_0, y_ptr, M, N, K, isa)"},
    {"select_within", py_select_within, METH_VARARGS,
     "select_within(a_ptr, floor_ptr, ew_ptr, eq_ptr, coef_ptr, qn_ptr, keep_ptr, M, N)"},
    {"best_isa", py_best_isa, METH_NOARGS, "0 scalar, 1 AVX2+FMA, 2 AVX-512"},
    {"has_vnni", py_has_vnni, METH_NOARGS, "AVX-512 F, BW and VNNI"},
    {"has_bf16", py_has_bf16, METH_NOARGS, "AVX-512 F, BW and BF16"},
    {nullptr, nullptr, 0, nullptr}};

#define HF_STR2(a) #a
#define HF_STR(a) HF_STR2(a)
#define HF_CONCAT2(a, b) a##b
#define HF_CONCAT(a, b) HF_CONCAT2(a, b)
static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, HF_STR(TORCH_EXTENSION_NAME), nullptr, -1, kMethods};
PyMODINIT_FUNC HF_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
"""

_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # ISA via per-function target attributes, not -march
_LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded, so torch.set_num_threads applies
_STALE_LOCK_S = 600  # torch waits forever on a build lock left by a killed build; older locks are removed

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
_best_isa = ISA_SCALAR  # best code path of this CPU, set by load_kernel
compile_seconds: float | None = None  # wall time of this process's build-or-load, for reports
_F32, _STRIDED = torch.float32, torch.strided


def kernels_disabled() -> bool:
    """`HF_SPEC_NO_CPP_KERNELS` set to anything but empty/0/false/no (read on every call, so it can be flipped)."""
    flag = os.environ.get("HF_SPEC_NO_CPP_KERNELS")
    return bool(flag) and flag.strip().lower() not in ("", "0", "false", "no")


def kernel_name() -> str:
    """Module name, unique per source and flags, so an edited kernel builds into a fresh directory."""
    digest = hashlib.sha1("\0".join([CPP_SOURCE, *_CFLAGS, *_LDFLAGS]).encode()).hexdigest()[:12]
    return f"hf_spec_skinny_gemm_{digest}"


def build_directory() -> Path:
    """`$HF_SPEC_KERNEL_CACHE`, else `$XDG_CACHE_HOME/hf-spec/torch_extensions` (default `~/.cache/...`), per
    Python and torch version."""
    root = os.environ.get("HF_SPEC_KERNEL_CACHE")
    if not root:
        root = (
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf-spec" / "torch_extensions"
        )
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.split('+')[0]}"
    return Path(root) / tag / kernel_name()


def _compile() -> ModuleType:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the kernel is for x86-64 CPUs, this one is {platform.machine()}")
    from torch.utils.cpp_extension import is_ninja_available, load_inline

    cxx = os.environ.get("CXX") or "c++"  # what torch's builder runs
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX or install g++)")
    if not is_ninja_available():
        # the `ninja` wheel installs into this environment's scripts folder, which is not on PATH when the
        # environment's python runs without being activated
        scripts = sysconfig.get_path("scripts")
        if scripts and shutil.which("ninja", path=scripts):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if not is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    return load_inline(
        name=kernel_name(),
        cpp_sources=[CPP_SOURCE],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        no_implicit_headers=True,  # no <torch/extension.h>: builds in seconds instead of a minute
        verbose=False,
    )


def load_kernel() -> ModuleType | None:
    """The compiled module (built or loaded on the first call in a process), or None when it is disabled
    (`HF_SPEC_NO_CPP_KERNELS=1`) or cannot be built (then one warning is logged and callers use `F.linear`)."""
    global _module, _tried, _best_isa, compile_seconds
    if kernels_disabled():
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            t0 = time.perf_counter()
            try:
                _module = _compile()
                _best_isa = _module.best_isa()
            except Exception as e:  # no compiler, no ninja, not x86, bad flags: all mean "use F.linear"
                lines = str(e).strip().splitlines()
                logger.warning(
                    "hf-spec: C++ skinny-GEMM kernel unavailable, verification uses F.linear (%s: %s)",
                    type(e).__name__,
                    lines[-1][:300] if lines else "",
                )
                _module = None
            compile_seconds = time.perf_counter() - t0
            _tried = True
    return _module


def _reset_for_tests() -> None:
    """Forget the load attempt, so the next `load_kernel` tries again."""
    global _module, _tried
    with _lock:
        _module, _tried = None, False


def _plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous strided CPU tensor of `dtype`: what the kernel reads through a raw pointer."""
    return t.dtype is dtype and t.is_cpu and t.layout is _STRIDED and t.is_contiguous()


def _rows(x: torch.Tensor) -> int:
    """Rows of `x (..., K)` where the kernel takes it (fp32, plain, 1..32 rows), else 0."""
    if x.dim() == 0 or not x.shape[-1] or not _plain(x, _F32):
        return 0
    rows = x.numel() // x.shape[-1]
    return rows if MIN_ROWS <= rows <= MAX_ROWS else 0


def _usable_kernel(isa: int) -> ModuleType | None:
    mod = load_kernel()
    if mod is None or (isa == ISA_AUTO and _best_isa < ISA_AVX2):
        return None  # the plain C++ path is for tests: on a CPU without AVX2, MKL's F.linear is faster
    return mod


def kernel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` by the kernel, or None where the kernel does not apply: not fp32 / CPU /
    contiguous, rows of x outside 1..32, autograd needed, kernel disabled or not buildable."""
    rows = _rows(x)
    if not rows or weight.dim() != 2:
        return None
    k, n = x.shape[-1], weight.shape[0]
    if not n or weight.shape[1] != k or not _plain(weight, _F32):
        return None
    if bias is not None and (not _plain(bias, _F32) or bias.shape != (n,)):
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return None
    mod = _usable_kernel(isa)
    if mod is None:
        return None
    y = torch.empty(*x.shape[:-1], n, dtype=_F32)
    mod.gemm(
        x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), rows, n, k, isa
    )
    return y


def kernel_linear_int8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`(x @ q.T) * scale` in fp32 arithmetic for fp32 x `(..., K)` with 1..32 rows, int8 q `(N, K)` and fp32 scale
    `(N,)`, all contiguous on CPU; None where the kernel does not apply (as `kernel_linear`)."""
    rows = _rows(x)
    if not rows or q.dim() != 2:
        return None
    k, n = x.shape[-1], q.shape[0]
    if not n or q.shape[1] != k or not _plain(q, torch.int8):
        return None
    if not _plain(scale, _F32) or scale.shape != (n,) or (torch.is_grad_enabled() and x.requires_grad):
        return None
    mod = _usable_kernel(isa)
    if mod is None:
        return None
    y = torch.empty(*x.shape[:-1], n, dtype=_F32)
    mod.gemm_i8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), rows, n, k, isa)
    return y


def has_vnni() -> bool:
    """Whether this CPU runs `kernel_linear_u8s8` (AVX-512 F, BW and VNNI) and the kernel is loaded."""
    mod = _usable_kernel(ISA_AUTO)
    return mod is not None and _best_isa >= ISA_AVX512 and bool(mod.has_vnni())


def kernel_linear_u8s8(
    xu: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | None:
    """`float((xu - 128) @ q.T) * (xs[:, None] * scale)` `(M, N)`: uint8 xu `(M, K)` (an int8 x plus 128), fp32 row
    scales xs `(M,)`, int8 q `(N, K)`, int32 qsum `(N,)` = q's row sums, fp32 scale `(N,)`; the integer products
    are summed exactly. None without AVX512-VNNI or where the inputs do not fit (1..32 rows, contiguous CPU)."""
    if xu.dim() != 2 or q.dim() != 2 or not MIN_ROWS <= xu.shape[0] <= MAX_ROWS or not has_vnni():
        return None
    (m, k), n = xu.shape, q.shape[0]
    if not n or q.shape[1] != k or not _plain(xu, torch.uint8) or not _plain(q, torch.int8):
        return None
    if not (_plain(xs, _F32) and xs.shape == (m,) and _plain(scale, _F32) and scale.shape == (n,)):
        return None
    if not _plain(qsum, torch.int32) or qsum.shape != (n,):
        return None
    y = torch.empty(m, n, dtype=_F32)
    load_kernel().gemm_u8s8(
        xu.data_ptr(), xs.data_ptr(), q.data_ptr(), qsum.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k
    )
    return y


def kernel_linear_w8a8(
    x: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | None:
    """`x @ (q * scale[:, None]).T` `(..., N)` with each row of fp32 x `(..., K)` (1..32 rows) first quantized to int8
    (step amax / 127), by the VNNI kernel: an approximation, for drafts. int8 q `(N, K)`, int32 qsum `(N,)` = q's row
    sums, fp32 scale `(N,)`; None without AVX512-VNNI or where the inputs do not fit."""
    rows = _rows(x)
    if not rows or q.dim() != 2 or not has_vnni():
        return None
    k, n = x.shape[-1], q.shape[0]
    if (
        not n
        or q.shape[1] != k
        or not _plain(q, torch.int8)
        or not _plain(scale, _F32)
        or scale.shape != (n,)
    ):
        return None
    if not _plain(qsum, torch.int32) or qsum.shape != (n,) or (torch.is_grad_enabled() and x.requires_grad):
        return None
    y = torch.empty(*x.shape[:-1], n, dtype=_F32)
    load_kernel().gemm_w8a8(
        x.data_ptr(), q.data_ptr(), qsum.data_ptr(), scale.data_ptr(), y.data_ptr(), rows, n, k
    )
    return y


def has_bf16() -> bool:
    """Whether this CPU runs `kernel_linear_bf16` on its AVX512-BF16 path and the kernel is loaded."""
    mod = _usable_kernel(ISA_AUTO)
    return mod is not None and _best_isa >= ISA_AVX512 and bool(mod.has_bf16())


def kernel_linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for bfloat16 x `(..., K)` (1..32 rows) and weight `(N, K)`: fp32 products and
    sums, one rounding to bfloat16 at the end (torch's bf16 GEMM rounds once too, summing in another order). None
    where it does not apply (as `kernel_linear`) or without AVX512-BF16, unless `isa` forces the plain C++ path."""
    if x.dim() == 0 or not x.shape[-1] or not _plain(x, torch.bfloat16) or weight.dim() != 2:
        return None
    rows = x.numel() // x.shape[-1]
    k, n = x.shape[-1], weight.shape[0]
    if (
        not MIN_ROWS <= rows <= MAX_ROWS
        or not n
        or weight.shape[1] != k
        or not _plain(weight, torch.bfloat16)
    ):
        return None
    if bias is not None and (bias.shape != (n,) or not bias.is_cpu):
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return None
    if isa == ISA_AUTO and not has_bf16():
        return None
    mod = _usable_kernel(isa)
    if mod is None:
        return None
    b32 = None if bias is None else bias.to(_F32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=_F32)
    mod.gemm_bf16(
        x.data_ptr(), weight.data_ptr(), 0 if b32 is None else b32.data_ptr(), y.data_ptr(), rows, n, k, isa
    )
    return y.to(torch.bfloat16)


def kernel_select_within(
    approx: torch.Tensor,
    floor: torch.Tensor,
    err_w: torch.Tensor,
    err_q: torch.Tensor,
    coef: torch.Tensor,
    qnorm: torch.Tensor,
) -> torch.Tensor | None:
    """Bool `(N,)`: columns j of `approx (M, N)` with `approx[m, j] + err_w[m] coef[j] + err_q[m] qnorm[j] >=
    floor[m]` in some row m (fp32, contiguous CPU); None without the kernel."""
    tensors = (approx, floor, err_w, err_q, coef, qnorm)
    if approx.dim() != 2 or not all(_plain(t, _F32) for t in tensors):
        return None
    m, n = approx.shape
    if (
        not m
        or not n
        or any(t.shape != (m,) for t in tensors[1:4])
        or any(t.shape != (n,) for t in tensors[4:])
    ):
        return None
    mod = _usable_kernel(ISA_AUTO)
    if mod is None:
        return None
    keep = torch.empty(n, dtype=torch.uint8)
    mod.select_within(*(t.data_ptr() for t in tensors), keep.data_ptr(), m, n)
    return keep.bool()


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, isa: int = ISA_AUTO
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the C++ kernel for fp32 CPU contiguous x with 1..32 rows (any leading shape),
    else by `F.linear`. `isa` forces a code path (ISA_SCALAR / ISA_AVX2 / ISA_AVX512, capped at what the CPU has)."""
    y = kernel_linear(x, weight, bias, isa)
    return F.linear(x, weight, bias) if y is None else y


def reference_skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference twin of `skinny_gemm`."""
    return F.linear(x, weight, bias)
