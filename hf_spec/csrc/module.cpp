// The Python module: each kernel takes raw data pointers (ints) and sizes, checked for null and positive sizes
// here (shapes, dtypes and contiguity are checked by the Python wrapper, hf_spec/kernels/cpu_skinny_gemm.py), and
// runs without the GIL. A plain CPython extension (no pybind11, no <torch/extension.h>) so it builds in seconds.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "skinny_gemm.h"

namespace hf_spec {
namespace {

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

PyObject* py_gemm(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm", true,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                                reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K, isa);
                  });
}

PyObject* py_gemm_i8(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm_i8", false,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm_i8(reinterpret_cast<const float*>(p[0]), reinterpret_cast<const int8_t*>(p[1]),
                                   reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K, isa);
                  });
}

// (xu_ptr, xs_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K): `skinny_gemm_u8s8`, without the GIL
PyObject* py_gemm_u8s8(PyObject*, PyObject* args) {
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
PyObject* py_gemm_w8a8(PyObject*, PyObject* args) {
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
PyObject* py_select_within(PyObject*, PyObject* args) {
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

PyObject* py_gemm_bf16(PyObject*, PyObject* args) {
  return run_gemm(args, "skinny_gemm_bf16", true,
                  [](const unsigned long long* p, int64_t M, int64_t N, int64_t K, int isa) {
                    skinny_gemm_bf16(reinterpret_cast<const uint16_t*>(p[0]), reinterpret_cast<const uint16_t*>(p[1]),
                                     reinterpret_cast<const float*>(p[2]), reinterpret_cast<float*>(p[3]), M, N, K,
                                     isa);
                  });
}

// bfloat16 <-> float32 as torch converts them: widening is exact, narrowing rounds to nearest even (NaN stays NaN)
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

constexpr int64_t kGqChunkRows = 64;  // rows a kernel call takes: their x stays in the cache while W streams by

// (x_ptr, codes_ptr, high_ptr_or_0, scale_ptr, min_ptr_or_0, bias_ptr_or_0, y_ptr, M, N, K, layout, group, isa,
// x_bf16, y_bf16, zero_point, scale_f16): `gemm_gq_rows` without the GIL (`scale_f16`: scale_ptr points to float16
// scales)
PyObject* run_gemm_gq(PyObject* args, bool int8_x) {
  const char* name = int8_x ? "gemm_gq_q8" : "gemm_gq";
  unsigned long long p[7];
  long long M, N, K, group;
  int layout, isa, x_bf16, y_bf16, zero_point, scale_f16;
  if (!PyArg_ParseTuple(args, "KKKKKKKLLLiLiiiii", &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &M, &N, &K,
                        &layout, &group, &isa, &x_bf16, &y_bf16, &zero_point, &scale_f16))
    return nullptr;
  GroupQuantWeight w{reinterpret_cast<const void*>(p[1]), reinterpret_cast<const uint32_t*>(p[2]),
                     reinterpret_cast<const float*>(p[3]), reinterpret_cast<const float*>(p[4]), layout, group,
                     zero_point};
  if (scale_f16) {
    w.scale16 = reinterpret_cast<const uint16_t*>(p[3]);
    w.scale = nullptr;
  }
  if (M < 1 || N < 1 || K < 1 || !p[0] || !p[6] || !group_quant_valid(w, K) || (int8_x && K % 32) ||
      (!int8_x && (zero_point || scale_f16 || is_tiled_layout(layout))) ||
      (is_tiled_layout(layout) && N % kTileRows)) {
    PyErr_Format(PyExc_ValueError, "%s: bad shape, layout, group size, zero point, scales or null pointer", name);
    return nullptr;
  }
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  const auto* bias = reinterpret_cast<const float*>(p[5]);
  return without_gil(name, [&] {
    gemm_gq_rows(reinterpret_cast<const void*>(p[0]), x_bf16, w, bias, reinterpret_cast<void*>(p[6]), y_bf16, M, N, K,
                 isa, int8_x);
  });
}

// a . b over 8 lanes, then the lanes in pairs (a fixed order: the same bits for a row alone or among others)
inline float dot8(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[d + j] * b[d + j];
  for (; d < n; ++d) lanes[d % 8] += a[d] * b[d];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// (x_ptr, w_ptr, y_ptr, rows, H, eps, bf16): y = w * to_dtype(x * rsqrt(mean(x^2) + eps)) row by row, the
// RMSNorm of Llama-family models (transformers' `LlamaRMSNorm.forward`) in one call: x, w and y all bfloat16 (`bf16`)
// or all float32; the mean of squares is summed in float32 over 8 lanes, then the lanes in pairs
PyObject* py_rms_norm(PyObject*, PyObject* args) {
  unsigned long long p[3];
  long long rows, H;
  double eps;
  int bf16;
  if (!PyArg_ParseTuple(args, "KKKLLdi", &p[0], &p[1], &p[2], &rows, &H, &eps, &bf16)) return nullptr;
  if (rows < 1 || H < 1 || !p[0] || !p[1] || !p[2]) {
    PyErr_SetString(PyExc_ValueError, "rms_norm: bad shape or null pointer");
    return nullptr;
  }
  return without_gil("rms_norm", [&] {
    rms_norm_rows(reinterpret_cast<const void*>(p[0]), reinterpret_cast<const void*>(p[1]),
                  reinterpret_cast<void*>(p[2]), rows, H, eps, bf16);
  });
}

template <bool BF16>
inline float load_at(const void* base, int64_t at) {
  if constexpr (BF16)
    return bf16_to_f32(static_cast<const uint16_t*>(base)[at]);
  else
    return static_cast<const float*>(base)[at];
}

template <bool BF16>
inline void widen_row(const void* base, int64_t at, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = load_at<BF16>(base, at + i);
}

// the same sum with AVX2: 8 lanes as one register, fused multiply-adds
HF_AVX2 inline float dot8_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; d < n; ++d) lanes[d % 8] += a[d] * b[d];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// e^x for x <= 0, 8 lanes (Cephes' expf: x = n ln 2 + r, a degree-5 polynomial in r, times 2^n; within 2 ulp of
// std::exp); -inf and anything below -87 give 0
HF_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.f);
  const __m256 dead = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// s[l] = e^(s[l] - best) for the first multiple of 8 of n entries; returns how many
HF_AVX2 inline int64_t exp_shifted_avx2(float* s, int64_t n, float best) {
  const __m256 b = _mm256_set1_ps(best);
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) _mm256_storeu_ps(s + l, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + l), b)));
  return l;
}

// one KV head g and one query row r: the group's query heads against every key, each (head, row) alone; inlined
// into a plain and an AVX2 + FMA caller (the CPU's best is picked per call, so a machine always takes the same one)
template <bool BF16, bool AVX2>
__attribute__((always_inline)) inline void rows_attention_one(const RowsAttention& a, int64_t g, int64_t r) {
  const int64_t group = a.H / a.KVH, h0 = g * group;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> q(group * a.D), row(std::max(a.D, a.Dv)), score(group * a.L, kNegInf), acc(group * a.Dv, 0.f);
  std::vector<float> best(group, kNegInf), total(group, 0.f);
  for (int64_t j = 0; j < group; ++j) widen_row<BF16>(a.q, (h0 + j) * a.qh + r * a.qr, a.D, q.data() + j * a.D);
  std::vector<uint8_t> live(a.L, 1);
  for (int64_t l = 0; l < a.L; ++l) {
    float bias = 0.f;
    if (a.mask_kind == 1) bias = static_cast<const float*>(a.mask)[r * a.L + l];
    if (a.mask_kind == 2) bias = bf16_to_f32(static_cast<const uint16_t*>(a.mask)[r * a.L + l]);
    if (a.mask_kind == 3 && !static_cast<const bool*>(a.mask)[r * a.L + l]) bias = kNegInf;
    if (bias == kNegInf) {  // adds an exact zero: skipped
      live[l] = 0;
      continue;
    }
    widen_row<BF16>(a.k, g * a.kh + l * a.kl, a.D, row.data());
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q.data() + j * a.D;
      float s;
      if constexpr (AVX2)
        s = dot8_avx2(qj, row.data(), a.D) * a.scale + bias;
      else
        s = dot8(qj, row.data(), a.D) * a.scale + bias;
      score[j * a.L + l] = s;
      best[j] = std::max(best[j], s);
    }
  }
  // score -> e^(score - best), in place (masked keys: e^-inf = 0)
  for (int64_t j = 0; j < group; ++j) {
    float* sj = score.data() + j * a.L;
    int64_t l = 0;
    if constexpr (AVX2) l = exp_shifted_avx2(sj, a.L, best[j]);
    for (; l < a.L; ++l) sj[l] = std::exp(sj[l] - best[j]);
  }
  for (int64_t l = 0; l < a.L; ++l) {
    if (!live[l]) continue;
    widen_row<BF16>(a.v, g * a.vh + l * a.vl, a.Dv, row.data());
    for (int64_t j = 0; j < group; ++j) {
      if (best[j] == kNegInf) continue;
      const float w = score[j * a.L + l];
      total[j] += w;
      float* accj = acc.data() + j * a.Dv;
      for (int64_t d = 0; d < a.Dv; ++d) accj[d] += w * row[d];
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;  // every key masked: zeros
    const int64_t at = (r * a.H + h0 + j) * a.Dv;               // out [R, H, Dv]
    for (int64_t d = 0; d < a.Dv; ++d) {
      const float y = acc[j * a.Dv + d] * inv;
      if constexpr (BF16)
        static_cast<uint16_t*>(a.out)[at + d] = f32_to_bf16(y);
      else
        static_cast<float*>(a.out)[at + d] = y;
    }
  }
}

template <bool BF16>
void rows_attention_plain(const RowsAttention& a, int64_t g, int64_t r) {
  rows_attention_one<BF16, false>(a, g, r);
}

template <bool BF16>
HF_AVX2 void rows_attention_avx2(const RowsAttention& a, int64_t g, int64_t r) {
  rows_attention_one<BF16, true>(a, g, r);
}

// (q, k, v, mask, out pointers; H, KVH, R, L, D, Dv; q's head and row strides, k's and v's head and key strides (in
// elements, the last dimension contiguous); mask_kind 0 none / 1 additive float32 / 2 additive bfloat16 / 3 bool
// (true attends), [R, L] contiguous; scale; bf16: q, k, v and out bfloat16, else float32):
// out[r, h, :] = softmax_l(q[h, r] . k[g, l] * scale + mask[r, l]) @ v[g, :] with g = h / (H / KVH), for one batch
// row, out [R, H, Dv]. Float32 throughout, keys in order, so each query row's bits depend on that row and the keys
// only: a verification's rows get what one-row decoding gets. Masked keys (-inf, or false) are skipped (they add
// exact zeros); a row with every key masked gives zeros.
PyObject* py_rows_attention(PyObject*, PyObject* args) {
  unsigned long long p[5];
  long long H, KVH, R, L, D, Dv, qh, qr, kh, kl, vh, vl;
  int mask_kind, bf16;
  double scale;
  if (!PyArg_ParseTuple(args, "KKKKKLLLLLLLLLLLLidi", &p[0], &p[1], &p[2], &p[3], &p[4], &H, &KVH, &R, &L, &D, &Dv,
                        &qh, &qr, &kh, &kl, &vh, &vl, &mask_kind, &scale, &bf16))
    return nullptr;
  if (H < 1 || KVH < 1 || H % KVH || R < 1 || L < 1 || D < 1 || Dv < 1 || !p[0] || !p[1] || !p[2] || !p[4] ||
      (mask_kind && !p[3]) || mask_kind < 0 || mask_kind > 3) {
    PyErr_SetString(PyExc_ValueError, "rows_attention: bad shape, mask kind or null pointer");
    return nullptr;
  }
  const RowsAttention a{reinterpret_cast<const void*>(p[0]), reinterpret_cast<const void*>(p[1]),
                        reinterpret_cast<const void*>(p[2]), reinterpret_cast<const void*>(p[3]),
                        reinterpret_cast<void*>(p[4]), H, KVH, R, L, D, Dv, qh, qr, kh, kl, vh, vl, mask_kind,
                        static_cast<float>(scale)};
  return without_gil("rows_attention", [&] { rows_attention_run(a, bf16); });
}

PyObject* py_gemm_gq(PyObject*, PyObject* args) { return run_gemm_gq(args, false); }

PyObject* py_gemm_gq_q8(PyObject*, PyObject* args) { return run_gemm_gq(args, true); }

PyObject* py_has_bf16(PyObject*, PyObject*) { return PyBool_FromLong(has_bf16()); }

PyObject* py_best_isa(PyObject*, PyObject*) { return PyLong_FromLong(best_isa()); }

PyObject* py_has_vnni(PyObject*, PyObject*) { return PyBool_FromLong(has_vnni()); }

PyMethodDef kMethods[] = {
    {"gemm", py_gemm, METH_VARARGS, "gemm(x_ptr, w_ptr, bias_ptr_or_0, y_ptr, M, N, K, isa)"},
    {"gemm_i8", py_gemm_i8, METH_VARARGS, "gemm_i8(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, isa)"},
    {"gemm_u8s8", py_gemm_u8s8, METH_VARARGS, "gemm_u8s8(xu_ptr, xs_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K)"},
    {"gemm_w8a8", py_gemm_w8a8, METH_VARARGS, "gemm_w8a8(x_ptr, q_ptr, qsum_ptr, scale_ptr, y_ptr, M, N, K)"},
    {"gemm_bf16", py_gemm_bf16, METH_VARARGS, "gemm_bf16(x_ptr, w_ptr, bias_f32_ptr_or_0, y_ptr, M, N, K, isa)"},
    {"gemm_gq", py_gemm_gq, METH_VARARGS,
     "gemm_gq(x_ptr, codes_ptr, high_ptr_or_0, scale_ptr, min_ptr_or_0, bias_ptr_or_0, y_ptr, M, N, K, layout, group, "
     "isa, x_bf16, y_bf16, zero_point, scale_f16)"},
    {"gemm_gq_q8", py_gemm_gq_q8, METH_VARARGS,
     "gemm_gq_q8(x_ptr, codes_ptr, high_ptr_or_0, scale_ptr, min_ptr_or_0, bias_ptr_or_0, y_ptr, M, N, K, layout, "
     "group, isa, x_bf16, y_bf16, zero_point, scale_f16)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x_ptr, w_ptr, y_ptr, rows, H, eps, bf16)"},
    {"rows_attention", py_rows_attention, METH_VARARGS,
     "rows_attention(q, k, v, mask_or_0, out, H, KVH, R, L, D, Dv, q_h, q_r, k_h, k_l, v_h, v_l, mask_kind, scale, "
     "bf16)"},
    {"select_within", py_select_within, METH_VARARGS,
     "select_within(a_ptr, floor_ptr, ew_ptr, eq_ptr, coef_ptr, qn_ptr, keep_ptr, M, N)"},
    {"best_isa", py_best_isa, METH_NOARGS, "0 scalar, 1 AVX2+FMA, 2 AVX-512"},
    {"has_vnni", py_has_vnni, METH_NOARGS, "AVX-512 F, BW and VNNI"},
    {"has_bf16", py_has_bf16, METH_NOARGS, "AVX-512 F, BW and BF16"},
    {nullptr, nullptr, 0, nullptr}};


}  // namespace

void gemm_gq_rows(const void* x, bool x_bf16, const GroupQuantWeight& w, const float* bias, void* y, bool y_bf16,
                  int64_t M, int64_t N, int64_t K, int isa, bool int8_x) {
  const auto gemm = int8_x ? skinny_gemm_gq_q8 : skinny_gemm_gq;
  thread_local std::vector<float> xbuf, ybuf;  // reused: a decoding step converts a row per linear
  for (int64_t start = 0; start < M; start += kGqChunkRows) {
    const int64_t m = std::min<int64_t>(kGqChunkRows, M - start);
    const float* xc = static_cast<const float*>(x) + start * K;
    if (x_bf16) {
      const auto* xb = static_cast<const uint16_t*>(x) + start * K;
      xbuf.resize(m * K);
      for (int64_t i = 0; i < m * K; ++i) xbuf[i] = bf16_to_f32(xb[i]);
      xc = xbuf.data();
    }
    float* yc = static_cast<float*>(y) + start * N;
    if (y_bf16) {
      ybuf.resize(m * N);
      yc = ybuf.data();
    }
    gemm(xc, w, bias, yc, m, N, K, isa);
    if (y_bf16) {
      uint16_t* yb = static_cast<uint16_t*>(y) + start * N;
      const float* src = ybuf.data();
      at::parallel_for(0, m * N, 16384, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) yb[i] = f32_to_bf16(src[i]);
      });
    }
  }
}

void rms_norm_rows(const void* x, const void* w, void* y, int64_t rows, int64_t H, double eps, bool bf16) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / H), [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(H);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < H; ++i)
        xf[i] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[r * H + i]) : static_cast<const float*>(x)[r * H + i];
      const float sum = dot8(xf.data(), xf.data(), H);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      if (bf16) {
        const auto* wb = static_cast<const uint16_t*>(w);
        auto* yb = static_cast<uint16_t*>(y) + r * H;
        for (int64_t k = 0; k < H; ++k)
          yb[k] = f32_to_bf16(bf16_to_f32(wb[k]) * bf16_to_f32(f32_to_bf16(xf[k] * inv)));
      } else {
        const auto* wf = static_cast<const float*>(w);
        float* yf = static_cast<float*>(y) + r * H;
        for (int64_t k = 0; k < H; ++k) yf[k] = wf[k] * (xf[k] * inv);
      }
    }
  });
}

void rows_attention_run(const RowsAttention& a, bool bf16) {
  const bool avx2 = best_isa() >= kIsaAvx2;
  const auto one = bf16 ? (avx2 ? rows_attention_avx2<true> : rows_attention_plain<true>)
                        : (avx2 ? rows_attention_avx2<false> : rows_attention_plain<false>);
  at::parallel_for(0, a.KVH * a.R, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) one(a, i / a.R, i % a.R);
  });
}

}  // namespace hf_spec

#define HF_STR2(a) #a
#define HF_STR(a) HF_STR2(a)
#define HF_CONCAT2(a, b) a##b
#define HF_CONCAT(a, b) HF_CONCAT2(a, b)
static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, HF_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                                      hf_spec::kMethods};
PyMODINIT_FUNC HF_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
