// The CPU kernels of the operators `hf_spec::rms_norm` (hf_spec/kernels/rms_norm.py) and `hf_spec::rows_attention`
// (hf_spec/kernels/rows_attention.py): the checks and the kernel call in C++, so a compiled step, which calls them
// once a norm and once a layer's attention, pays the dispatcher's C++ call instead of boxing the arguments into
// Python. What they do not take (other dtypes or layouts, a gradient wanted, HF_SPEC_NO_CPP_KERNELS set) goes to
// `hf_spec::rms_norm_py` / `hf_spec::rows_attention_py`, the same functions in Python.
//
// Registered when the kernel module loads, as op_group_quant.cpp's kernel is; until then the Python functions
// serve the operators (registered for CompositeExplicitAutograd, which a CPU kernel takes precedence over).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>

#include <optional>

#include "op_common.h"
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

using OptTensor = std::optional<at::Tensor>;

bool kernel_dtype(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool takes = !kernels_switched_off() && kernel_dtype(x) && weight.scalar_type() == x.scalar_type() &&
                     kernel_dtype(weight) && x.dim() > 0 && weight.dim() == 1 && x.numel() > 0 &&
                     x.size(-1) == weight.numel() && x.is_contiguous() && weight.is_contiguous() &&
                     !wants_grad(x) && !wants_grad(weight);
  if (!takes) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("hf_spec::rms_norm_py", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x, weight, eps);
  }
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t H = weight.numel();
  rms_norm_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() / H, H, eps,
                x.scalar_type() == at::kBFloat16);
  return y;
}

// what rows_attention.py's `_applies` and `_rows_attention` leave to the kernel: batch 1, q/k/v of one dtype with
// their last dimension contiguous, heads a multiple of the KV heads, a (rows, keys) mask or none
bool attention_fits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask) {
  if (!kernel_dtype(q) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type() ||
      !kernel_dtype(k) || !kernel_dtype(v))
    return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || q.size(0) != 1 || k.size(0) != 1 || v.size(0) != 1)
    return false;
  if (q.size(2) < 1 || k.size(2) < 1 || k.size(2) != v.size(2) || k.size(3) != q.size(3) || v.size(1) != k.size(1) ||
      k.size(1) < 1 || q.size(1) % k.size(1) || q.size(3) < 1 || v.size(3) < 1)
    return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  if (wants_grad(q) || wants_grad(k) || wants_grad(v)) return false;
  if (mask.has_value()) {
    const auto mt = mask->scalar_type();
    if ((mt != at::kFloat && mt != at::kBFloat16 && mt != at::kBool) || !mask->device().is_cpu() ||
        mask->dim() != 2 || mask->size(0) != q.size(2) || mask->size(1) != k.size(2))
      return false;
  }
  return true;
}

at::Tensor rows_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const OptTensor& mask, double scaling, bool causal) {
  if (kernels_switched_off() || !attention_fits(query, key, value, mask)) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("hf_spec::rows_attention_py", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const OptTensor&, double, bool)>();
    return op.call(query, key, value, mask, scaling, causal);
  }
  const int64_t H = query.size(1), R = query.size(2), D = query.size(3);
  const int64_t KVH = key.size(1), L = key.size(2), Dv = value.size(3);
  at::Tensor m;
  int mask_kind = 0;
  if (mask.has_value()) {
    m = mask->contiguous();
    mask_kind = m.scalar_type() == at::kFloat ? 1 : m.scalar_type() == at::kBFloat16 ? 2 : 3;
  } else if (causal && R > 1) {  // row r sees keys 0..r, as `sdpa`'s is_causal (rows_attention.py's `_causal`)
    m = at::ones({R, L}, at::TensorOptions().dtype(at::kBool)).tril();
    mask_kind = 3;
  }
  at::Tensor out = at::empty({1, R, H, Dv}, query.options());
  const RowsAttention a{query.data_ptr(), key.data_ptr(), value.data_ptr(), m.defined() ? m.data_ptr() : nullptr,
                        out.data_ptr(), H, KVH, R, L, D, Dv, query.stride(1), query.stride(2), key.stride(1),
                        key.stride(2), value.stride(1), value.stride(2), mask_kind, static_cast<float>(scaling)};
  rows_attention_run(a, query.scalar_type() == at::kBFloat16);
  return out;
}

}  // namespace
}  // namespace hf_spec

TORCH_LIBRARY_IMPL(hf_spec, CPU, m) {
  m.impl("rms_norm", &hf_spec::rms_norm_cpu);
  m.impl("rows_attention", &hf_spec::rows_attention_cpu);
}
