// A mixture-of-experts layer in native calls (models/moe.py): the router's scores, each
// token's top-k experts and weights (`llmserve_moe_route`), the experts (the step's (token,
// slot) entries grouped by expert in flat order, each expert's gated MLP run once over its
// rows: gather, gate_up, SiLU*up, down, each output row scaled by its routing weight into its
// slot), the slots' sum and the shared expert behind its sigmoid gate
// (`llmserve_moe_combine`); `llmserve_moe_block` runs them all, for the decoder stack
// (llama_layers.cpp) and the per-op path alike. Under tensor parallelism the per-op path
// calls the pieces with the slots' all-reduce between them: the same kernels in the same
// order, so the same bits everywhere.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "packed_weight.h"

extern "C" {

// scores (T, E): the router's logits -> per token its top_k experts, ascending (ids), and
// their weights: softmax over all E in float32, the top_k largest (ties: the lower expert),
// divided by their sum where `renormalize`.
void llmserve_moe_route(const float* scores, int64_t T, int64_t E, int64_t top_k,
                        int32_t renormalize, int64_t* ids, float* weights) {
  std::vector<float> p(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* s = scores + t * E;
    float top = s[0];
    for (int64_t e = 1; e < E; ++e) top = std::max(top, s[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(s[e] - top);
      sum += p[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
    // a NaN score (a broken model) sorts last: the comparison stays a strict order
    auto key = [&](int64_t e) { return std::isnan(p[e]) ? -1.f : p[e]; };
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) {
                        return key(a) > key(b) || (key(a) == key(b) && a < b);
                      });
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    std::sort(order.begin(), order.begin() + top_k);
    for (int64_t j = 0; j < top_k; ++j) {
      ids[t * top_k + j] = order[j];
      weights[t * top_k + j] = renormalize ? p[order[j]] / chosen : p[order[j]];
    }
  }
}

// y (T, C) = the slots (T * top_k, C) of each token added in slot (ascending expert) order,
// plus sigmoid(gate_logits[t]) * shared (T, C) where the layer has a shared expert
// (shared nullptr: none).
void llmserve_moe_combine(const float* slots, int64_t T, int64_t top_k, int64_t C,
                          const float* shared, const float* gate_logits, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    float* out = y + t * C;
    const float* first = slots + t * top_k * C;
    for (int64_t c = 0; c < C; ++c) out[c] = first[c];
    for (int64_t j = 1; j < top_k; ++j) {
      const float* slot = first + j * C;
      for (int64_t c = 0; c < C; ++c) out[c] = out[c] + slot[c];
    }
    if (shared == nullptr) continue;
    const float gate = 1.f / (1.f + std::exp(-gate_logits[t]));
    for (int64_t c = 0; c < C; ++c) out[c] = out[c] + gate * shared[t * C + c];
  }
}

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

// y (T, C) = the mixture layer `moe` of x (T, C): router, routing, experts, shared expert,
// combined. qscratch: the GEMMs' workspace for T rows of the widest input.
void llmserve_moe_block(const float* x, int64_t T, int64_t C, const MoeLayer* moe, float* y,
                        uint8_t* qscratch) {
  const MoeLayer& m = *moe;
  const int64_t k = m.top_k, I = m.intermediate, S = m.shared_intermediate;
  const bool shared = m.shared_gate_up.packed != nullptr;
  // grown, never shrunk: a step allocates nothing once the largest batch has run
  thread_local std::vector<float> buffer;
  thread_local std::vector<int64_t> ids;
  const size_t need = T * (m.num_experts + k + k * C + 2 * C + 3 * I) +
                      (shared ? T * (C + 3 * S + 1) : 0);
  if (buffer.size() < need) buffer.resize(need);
  if (ids.size() < static_cast<size_t>(T * k)) ids.resize(T * k);
  float* scores = buffer.data();                 // (T, E)
  float* weights = scores + T * m.num_experts;   // (T, k)
  float* slots = weights + T * k;                // (T * k, C)
  float* scratch = slots + T * k * C;            // T * (2 C + 3 I): the experts'
  linear(x, T, m.router, scores, qscratch);
  llmserve_moe_route(scores, T, m.num_experts, k, m.renormalize, ids.data(), weights);
  llmserve_moe_experts(x, T, C, I, m.gate_up, m.down, m.first, m.num_held, ids.data(), weights,
                       k, slots, scratch, qscratch);
  float* shared_out = nullptr;
  float* gate_logits = nullptr;
  if (shared) {
    shared_out = scratch + T * (2 * C + 3 * I);  // (T, C)
    float* hidden = shared_out + T * C;          // (T, 2 S)
    float* act = hidden + T * 2 * S;             // (T, S)
    gate_logits = act + T * S;                   // (T, 1)
    linear(x, T, m.shared_gate_up, hidden, qscratch);
    llmserve_silu_and_mul(hidden, T, S, act);
    linear(act, T, m.shared_down, shared_out, qscratch);
    linear(x, T, m.shared_gate, gate_logits, qscratch);
  }
  llmserve_moe_combine(slots, T, k, C, shared_out, gate_logits, y);
}

}  // extern "C"
