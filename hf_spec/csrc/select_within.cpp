// The screened LM head's candidates in one pass over the scores a (M, N): keep[j] = 1 where some row m has
// a[m, j] + ew[m] * coef[j] + eq[m] * qn[j] >= floor[m], else 0.
#include "skinny_gemm.h"

namespace hf_spec {

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

}  // namespace hf_spec
