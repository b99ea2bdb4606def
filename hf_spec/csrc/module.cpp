// The Python module: each kernel takes raw data pointers (ints) and sizes, checked for null and positive sizes
// here (shapes, dtypes and contiguity are checked by the Python wrapper, hf_spec/kernels/cpu_skinny_gemm.py), and
// runs without the GIL. A plain CPython extension (no pybind11, no <torch/extension.h>) so it builds in seconds.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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
// x_bf16, y_bf16): `skinny_gemm_gq` (float x) or, with `int8_x`, `skinny_gemm_gq_q8`, without the GIL, on
// `kGqChunkRows` rows at a time; x and y are float32, or bfloat16 where `x_bf16` / `y_bf16` (widened into and
// rounded from float32 buffers, as torch's `.float()` and `.to(torch.bfloat16)` do)
PyObject* run_gemm_gq(PyObject* args, bool int8_x) {
  const char* name = int8_x ? "gemm_gq_q8" : "gemm_gq";
  unsigned long long p[7];
  long long M, N, K, group;
  int layout, isa, x_bf16, y_bf16;
  if (!PyArg_ParseTuple(args, "KKKKKKKLLLiLiii", &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &M, &N, &K,
                        &layout, &group, &isa, &x_bf16, &y_bf16))
    return nullptr;
  const GroupQuantWeight w{reinterpret_cast<const void*>(p[1]), reinterpret_cast<const uint32_t*>(p[2]),
                           reinterpret_cast<const float*>(p[3]), reinterpret_cast<const float*>(p[4]), layout, group};
  if (M < 1 || N < 1 || K < 1 || !p[0] || !p[6] || !group_quant_valid(w, K) || (int8_x && K % 32)) {
    PyErr_Format(PyExc_ValueError, "%s: bad shape, layout, group size or null pointer", name);
    return nullptr;
  }
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  const auto gemm = int8_x ? skinny_gemm_gq_q8 : skinny_gemm_gq;
  const auto* bias = reinterpret_cast<const float*>(p[5]);
  return without_gil(name, [&] {
    thread_local std::vector<float> xbuf, ybuf;  // reused: a decoding step converts a row per linear
    for (int64_t start = 0; start < M; start += kGqChunkRows) {
      const int64_t m = std::min<int64_t>(kGqChunkRows, M - start);
      const float* xc = reinterpret_cast<const float*>(p[0]) + start * K;
      if (x_bf16) {
        const auto* xb = reinterpret_cast<const uint16_t*>(p[0]) + start * K;
        xbuf.resize(m * K);
        for (int64_t i = 0; i < m * K; ++i) xbuf[i] = bf16_to_f32(xb[i]);
        xc = xbuf.data();
      }
      float* yc = reinterpret_cast<float*>(p[6]) + start * N;
      if (y_bf16) {
        ybuf.resize(m * N);
        yc = ybuf.data();
      }
      gemm(xc, w, bias, yc, m, N, K, isa);
      if (y_bf16) {
        uint16_t* yb = reinterpret_cast<uint16_t*>(p[6]) + start * N;
        const float* src = ybuf.data();
        at::parallel_for(0, m * N, 16384, [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) yb[i] = f32_to_bf16(src[i]);
        });
      }
    }
  });
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
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / H), [&](int64_t r0, int64_t r1) {
      std::vector<float> xf(H);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < H; ++i)
          xf[i] = bf16 ? bf16_to_f32(reinterpret_cast<const uint16_t*>(p[0])[r * H + i])
                       : reinterpret_cast<const float*>(p[0])[r * H + i];
        float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
          for (int l = 0; l < 8; ++l) lanes[l] += xf[i + l] * xf[i + l];
        for (; i < H; ++i) lanes[i % 8] += xf[i] * xf[i];
        const float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
        if (bf16) {
          const auto* w = reinterpret_cast<const uint16_t*>(p[1]);
          auto* y = reinterpret_cast<uint16_t*>(p[2]) + r * H;
          for (int64_t k = 0; k < H; ++k) y[k] = f32_to_bf16(bf16_to_f32(w[k]) * bf16_to_f32(f32_to_bf16(xf[k] * inv)));
        } else {
          const auto* w = reinterpret_cast<const float*>(p[1]);
          float* y = reinterpret_cast<float*>(p[2]) + r * H;
          for (int64_t k = 0; k < H; ++k) y[k] = w[k] * (xf[k] * inv);
        }
      }
    });
  });
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
     "isa, x_bf16, y_bf16)"},
    {"gemm_gq_q8", py_gemm_gq_q8, METH_VARARGS,
     "gemm_gq_q8(x_ptr, codes_ptr, high_ptr_or_0, scale_ptr, min_ptr_or_0, bias_ptr_or_0, y_ptr, M, N, K, layout, "
     "group, isa, x_bf16, y_bf16)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x_ptr, w_ptr, y_ptr, rows, H, eps, bf16)"},
    {"select_within", py_select_within, METH_VARARGS,
     "select_within(a_ptr, floor_ptr, ew_ptr, eq_ptr, coef_ptr, qn_ptr, keep_ptr, M, N)"},
    {"best_isa", py_best_isa, METH_NOARGS, "0 scalar, 1 AVX2+FMA, 2 AVX-512"},
    {"has_vnni", py_has_vnni, METH_NOARGS, "AVX-512 F, BW and VNNI"},
    {"has_bf16", py_has_bf16, METH_NOARGS, "AVX-512 F, BW and BF16"},
    {nullptr, nullptr, 0, nullptr}};


}  // namespace
}  // namespace hf_spec

#define HF_STR2(a) #a
#define HF_STR(a) HF_STR2(a)
#define HF_CONCAT2(a, b) a##b
#define HF_CONCAT(a, b) HF_CONCAT2(a, b)
static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, HF_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                                      hf_spec::kMethods};
PyMODINIT_FUNC HF_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
