// What the C++ operator kernels (op_group_quant.cpp, op_norm_attention.cpp) share: the tests that decide whether a
// call stays in C++ or goes to the operator's Python twin.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <cstdlib>

namespace hf_spec {

// HF_SPEC_NO_CPP_KERNELS set (non-empty): every call goes to the Python twin, which reads it as it does everywhere
inline bool kernels_switched_off() {
  const char* off = std::getenv("HF_SPEC_NO_CPP_KERNELS");
  return off && *off;
}

// a dense CPU tensor laid out in order
inline bool plain(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous();
}

inline bool wants_grad(const at::Tensor& t) { return t.requires_grad() && c10::GradMode::is_enabled(); }

}  // namespace hf_spec
