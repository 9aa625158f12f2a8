// LoRA updates of one linear for a step's rows (lora/manager.py): the rows of each adapter
// gathered, shrunk to its ranks (x . A^T), expanded (. B^T) and added to the base output,
// on the float32 GEMM whose rows do not depend on the batch. One native call a linear,
// where the same in torch ops took a dozen per adapter; the per-op path's arithmetic (the
// same GEMMs, then one add), so the same bits.

#include <vector>

#include "kernels.h"

extern "C" {

// x (T, K) the linear's input, y (T, N) its base output, updated in place. slot_of_row (T,):
// each row's adapter slot, -1 for none. a[s] (packed (r_s, K)) and b[s] (packed (N, r_s)):
// slot s's stacked A and B, ranks[s] = r_s (0: the adapter leaves this linear alone).
// scratch: T * (K + max rank + N) floats.
void llmserve_lora_apply(const float* x, int64_t T, int64_t K, float* y, int64_t N,
                         const int32_t* slot_of_row, int64_t num_slots,
                         const float* const* a, const float* const* b, const int64_t* ranks,
                         float* scratch) {
  std::vector<int64_t> rows;
  rows.reserve(T);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t r = ranks[s];
    if (r == 0) continue;
    rows.clear();
    for (int64_t t = 0; t < T; ++t)
      if (slot_of_row[t] == s) rows.push_back(t);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    float* gathered = scratch;          // (n, K)
    float* shrunk = gathered + n * K;   // (n, r)
    float* delta = shrunk + n * r;      // (n, N)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K; ++k) gathered[i * K + k] = x[rows[i] * K + k];
    llmserve_f32_linear(gathered, n, K, a[s], nullptr, r, shrunk);
    llmserve_f32_linear(shrunk, n, r, b[s], nullptr, N, delta);
    for (int64_t i = 0; i < n; ++i) {
      float* out = y + rows[i] * N;
      for (int64_t c = 0; c < N; ++c) out[c] = out[c] + delta[i * N + c];
    }
  }
}

}  // extern "C"
