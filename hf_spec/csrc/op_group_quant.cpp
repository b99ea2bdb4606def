// The CPU kernel of the operator `hf_spec::group_quant_linear` (defined in hf_spec/kernels/group_quant.py) for
// weights with int8 activations (GGUF's): the checks and the kernel call in C++, so a compiled decoding step, which
// calls the operator once a linear, pays the dispatcher's C++ call instead of boxing its ten arguments into Python
// and the Python checks. Anything it does not take (float activations, other dtypes, odd shapes, a gradient wanted,
// HF_SPEC_NO_CPP_KERNELS set) goes to `hf_spec::group_quant_linear_py`, the same function in Python.
//
// Registered when the kernel module loads; until then (or where it cannot be built) the Python function serves the
// operator (registered for CompositeExplicitAutograd, which a CPU kernel takes precedence over).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "op_common.h"
#include "skinny_gemm.h"

namespace hf_spec {
namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor python_path(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const OptTensor& min,
                       const OptTensor& high, const OptTensor& bias, int64_t layout, int64_t group_size,
                       bool int8_activations, int64_t zero_point) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hf_spec::group_quant_linear_py", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t,
                                               bool, int64_t)>();
  return op.call(x, codes, scale, min, high, bias, layout, group_size, int8_activations, zero_point);
}

// whether the kernel reads these tensors as given (their dtypes, shapes and memory; the layout's own rules are
// `group_quant_valid`'s, on the weight made of them)
bool fits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const OptTensor& min,
          const OptTensor& high, const OptTensor& bias, int64_t layout, int64_t group) {
  const auto xt = x.scalar_type();
  if ((xt != at::kFloat && xt != at::kBFloat16) || !plain(x) || x.dim() == 0 || x.numel() == 0) return false;
  if (wants_grad(x)) return false;
  const int64_t K = x.size(-1);
  if (K % 32 || group < 1 || codes.dim() != 2 || scale.dim() != 2 || !plain(codes) || !plain(scale)) return false;
  const int64_t N = scale.size(0);
  if (layout < kCodesI8 || layout > kCodesU5x16 || (is_tiled_layout(layout) && N % kTileRows)) return false;
  const bool i8 = row_layout(layout) == kCodesI8;  // tiled int8 codes are stored + 128, as uint8
  if (codes.scalar_type() != (layout == kCodesI8 ? at::kChar : at::kByte) || codes.size(0) != N ||
      codes.size(1) != (i8 ? K : K / 2))
    return false;
  if (scale.size(1) * group != K || (scale.scalar_type() != at::kFloat && scale.scalar_type() != at::kHalf))
    return false;
  if (min.has_value() && (min->scalar_type() != at::kFloat || !plain(*min) || min->sizes() != scale.sizes()))
    return false;
  if (high.has_value() && (high->scalar_type() != at::kInt || !plain(*high) || high->dim() != 2 ||
                           high->size(0) != N || high->size(1) != K / 32))
    return false;
  if (bias.has_value() && (bias->dim() != 1 || bias->size(0) != N || !bias->device().is_cpu() ||
                           wants_grad(*bias)))
    return false;
  return true;
}

at::Tensor group_quant_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                  const OptTensor& min, const OptTensor& high, const OptTensor& bias, int64_t layout,
                                  int64_t group_size, bool int8_activations, int64_t zero_point) {
  const auto python = [&] {
    return python_path(x, codes, scale, min, high, bias, layout, group_size, int8_activations, zero_point);
  };
  if (!int8_activations || kernels_switched_off() || best_isa() < kIsaAvx2 || zero_point < 0 || zero_point > 128 ||
      !fits(x, codes, scale, min, high, bias, layout, group_size))
    return python();
  const int64_t K = x.size(-1), N = scale.size(0), M = x.numel() / K;
  GroupQuantWeight w{codes.data_ptr(),
                     high.has_value() ? static_cast<const uint32_t*>(high->data_ptr()) : nullptr,
                     nullptr,
                     min.has_value() ? min->data_ptr<float>() : nullptr,
                     static_cast<int>(layout),
                     group_size,
                     static_cast<int>(zero_point)};
  if (scale.scalar_type() == at::kHalf)
    w.scale16 = static_cast<const uint16_t*>(scale.data_ptr());
  else
    w.scale = scale.data_ptr<float>();
  if (!group_quant_valid(w, K) || high.has_value() != (row_layout(layout) == kCodesU5)) return python();
  at::Tensor b32;  // added in float32, as the Python path adds it
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  gemm_gq_rows(x.data_ptr(), bf16, w, b32.defined() ? b32.data_ptr<float>() : nullptr, y.data_ptr(), bf16, M, N, K,
               best_isa(), true);
  return y;
}

}  // namespace
}  // namespace hf_spec

TORCH_LIBRARY_IMPL(hf_spec, CPU, m) { m.impl("group_quant_linear", &hf_spec::group_quant_linear_cpu); }
