// A packed linear weight as the native layer kernels take it (int8, int4 with 15- or 8-bit
// activations, K-quant, or packed float32), and `linear`, which runs it on the kernel of its format:
// the per-op path's kernels, so a fused layer gives the per-op path's bits; and a mixture
// layer's weights (`MoeLayer`).
#pragma once

#include "kernels.h"

struct PackedWeight {
  int32_t format;      // a WeightFormat (below)
  const void* packed;  // int8: (N_pad, K_pad) VNNI blocks; int4: group records; float32:
                       // (N_pad / 16, K, 16)
  const int32_t* row_sums;   // int8 only
  const float* scale;        // int8 only
  int64_t out_features, in_features;  // int4: in_features a multiple of 32
  const float* bias;                  // nullptr: none (Qwen2's q, k and v have one)
};

namespace {

// kInt4A8: int4 weights with 8-bit activations (gemm_q4.cpp); kKQuant: a K-quant weight's
// segments (gemm_kquant.cpp), `packed` pointing at its KQuantWeight
enum WeightFormat : int32_t { kInt8 = 0, kInt4 = 1, kFloat32 = 2, kInt4A8 = 3, kKQuant = 4 };

inline void linear(const float* x, int64_t M, const PackedWeight& w, float* y,
                   uint8_t* workspace) {
  if (w.format == kFloat32) {
    llmserve_f32_linear(x, M, w.in_features, static_cast<const float*>(w.packed), w.bias,
                        w.out_features, y);
  } else if (w.format == kKQuant) {
    llmserve_kquant_linear(x, M, w.in_features, static_cast<const KQuantWeight*>(w.packed),
                           w.bias, y, workspace);
  } else if (w.format == kInt4 || w.format == kInt4A8) {
    llmserve_q4_linear(x, M, w.in_features, static_cast<const uint8_t*>(w.packed), w.bias,
                       w.out_features, y, workspace, w.format == kInt4A8 ? 8 : 15);
  } else {
    llmserve_int8_linear(x, M, w.in_features, static_cast<const int8_t*>(w.packed), w.row_sums,
                         w.scale, w.bias, w.out_features, y, workspace);
  }
}

}  // namespace

// One mixture-of-experts layer's weights as the native calls take them (moe.cpp).
struct MoeLayer {
  PackedWeight router;          // (num_experts, C) float32
  const PackedWeight* gate_up;  // the held experts', experts [first, first + num_held)
  const PackedWeight* down;
  int64_t num_experts, top_k, first, num_held, intermediate;
  int32_t renormalize;  // the chosen experts' weights scaled to sum 1 (Qwen3-MoE, Mixtral)
  PackedWeight shared_gate_up, shared_down;  // the shared expert (Qwen2-MoE); packed
                                             // nullptr: none
  PackedWeight shared_gate;                  // (1, C) float32: its sigmoid gate's logit
  int64_t shared_intermediate;
};
