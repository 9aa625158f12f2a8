// One mixture-of-experts layer's experts in one native call (models/moe.py): the step's
// (token, slot) entries grouped by expert in flat order, and each expert's gated MLP run
// once over its rows (gather, gate_up, SiLU*up, down), each output row scaled by its routing
// weight into its slot. The per-op path's kernels and arithmetic, so the same bits; only
// the Python between them goes.

#include <vector>

#include "packed_weight.h"

extern "C" {

// x (T, C); ids, weights (T, top_k): each token's experts and routing weights; gate_up and
// down: the `num_held` experts this process holds, experts [first, first + num_held).
// slots (T * top_k, C): each entry's weighted output, zero for experts held elsewhere.
// scratch: T * (2 * C + 3 * I) floats; qscratch: the GEMMs' workspace for T rows (as
// llmserve_llama_layers').
void llmserve_moe_experts(const float* x, int64_t T, int64_t C, int64_t I,
                          const PackedWeight* gate_up, const PackedWeight* down,
                          int64_t first, int64_t num_held, const int64_t* ids,
                          const float* weights, int64_t top_k, float* slots, float* scratch,
                          uint8_t* qscratch) {
  const int64_t entries = T * top_k;
  std::vector<int64_t> count(num_held + 1, 0), order(entries);
  for (int64_t f = 0; f < entries; ++f) {
    const int64_t e = ids[f] - first;
    if (e >= 0 && e < num_held) ++count[e + 1];
  }
  for (int64_t e = 0; e < num_held; ++e) count[e + 1] += count[e];
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t f = 0; f < entries; ++f) {
    const int64_t e = ids[f] - first;
    if (e >= 0 && e < num_held) order[next[e]++] = f;
  }
  for (int64_t f = 0; f < entries; ++f) {  // zero the entries of experts held elsewhere
    const int64_t e = ids[f] - first;
    if (e < 0 || e >= num_held)
      for (int64_t c = 0; c < C; ++c) slots[f * C + c] = 0.f;
  }
  float* rows = scratch;             // (n, C)
  float* hidden = rows + T * C;      // (n, 2 I)
  float* act = hidden + T * 2 * I;   // (n, I)
  float* out = act + T * I;          // (n, C)
  for (int64_t e = 0; e < num_held; ++e) {
    const int64_t begin = count[e], n = count[e + 1] - begin;
    if (n == 0) continue;
    for (int64_t i = 0; i < n; ++i) {
      const float* src = x + (order[begin + i] / top_k) * C;
      for (int64_t c = 0; c < C; ++c) rows[i * C + c] = src[c];
    }
    linear(rows, n, gate_up[e], hidden, qscratch);
    llmserve_silu_and_mul(hidden, n, I, act);
    linear(act, n, down[e], out, qscratch);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t f = order[begin + i];
      const float w = weights[f];
      for (int64_t c = 0; c < C; ++c) slots[f * C + c] = out[i * C + c] * w;
    }
  }
}

}  // extern "C"
