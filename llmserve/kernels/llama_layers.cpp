// The Llama decoder stack on int8, int4, K-quant or packed float32 weights in one native
// call: per layer RMSNorm, fused qkv (with its bias: Qwen2), q and k head norms (Qwen3,
// Gemma 3), rotary (a layer's own tables: Gemma's local layers), KV-cache write, paged
// attention (soft-capped: Gemma 2), o, [RMSNorm of the output: Gemma], residual, RMSNorm,
// gate/up, SiLU*up (tanh-GELU*up: Gemma), down (or a mixture of experts: moe.cpp),
// [RMSNorm of the output: Gemma], residual. It calls the very kernels the per-op path
// calls, in the same order, so both give the same bits; it only removes the Python and
// dispatch between them (~0.3 ms per layer at batch 1, measured: most of a decode step).

#include "packed_weight.h"

// the argument structs of llmserve_llama_layers (kernels.h), as llama_native.py builds them
struct LlamaLayer {
  const float* input_norm;  // nullptr: none, the layer reads the stream as it is (EAGLE's)
  const float* mlp_norm;  // before the MLP (Llama's post_attention_layernorm)
  PackedWeight qkv, o, gate_up, down;
  const float* q_norm;  // per-head RMSNorm weights of q and k (Qwen3); nullptr: none
  const float* k_norm;
  void* key_cache;
  void* value_cache;
  float* key_scales;
  float* value_scales;
  int64_t window;  // sliding attention window (0: none)
  // Gemma: RMSNorms of the attention's and the MLP's outputs before their residual adds
  // (its post_attention_layernorm and post_feedforward_layernorm); nullptr: none
  const float* attention_out_norm;
  const float* mlp_out_norm;
  const float* cos_table;  // this layer's rotary tables; nullptr: the step's
  const float* sin_table;
  const MoeLayer* moe;  // a mixture of experts in place of gate_up and down; nullptr: none
};

// A step's LoRA updates (lora/manager.py, kernels/lora.cpp): per layer and per linear (qkv,
// o, gate_up, down), each adapter slot's update (kernels.h's LoraSlot)
struct LoraLayer {
  const LoraSlot* linears[4];
};

struct LoraStep {
  const int32_t* slot_of_row;  // (T,), -1: the base model
  int64_t num_slots;
  const LoraLayer* layers;
  float* scratch;  // T * (max input width + 2 * max rank + max output width) floats
};

struct LlamaShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, attention_scale;
  float softcap;  // attention logits soft-capped (0: not)
  int32_t activation;
};

struct AttentionStep {
  const int64_t* positions;
  const float* cos_table;
  const float* sin_table;
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* query_start;
  const int32_t* context_lens;
  int64_t num_seqs;
  int64_t block_size;
  int32_t kv_dtype;
};

namespace {

void lora(const LoraStep* step, int64_t layer, int which, const float* x, int64_t T,
          int64_t K, float* y, int64_t N) {
  if (step == nullptr) return;
  llmserve_lora_apply(x, T, K, y, N, step->slot_of_row, step->num_slots,
                      step->layers[layer].linears[which], step->scratch);
}

enum Activation : int32_t { kSilu = 0, kGeluTanh = 1 };  // LlamaShape::activation

void add_(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

// x += delta (T, C), or x += RMSNorm(delta) with weights `norm` (Gemma; `h` its scratch)
void residual_add(float* x, const float* delta, int64_t T, int64_t C, const float* norm,
                  float eps, float* h) {
  if (norm != nullptr) {
    llmserve_rms_norm(delta, T, C, norm, eps, h);
    delta = h;
  }
  add_(x, delta, T * C);
}

}  // namespace

extern "C" {

// x (T, hidden): the residual stream, updated in place through `num_layers` layers.
// scratch: T * (2 * hidden + (H + 2 * Hkv) * D + H * D + 3 * intermediate) floats;
// qscratch: T * (2 * K_pad_max + K_pad_max / 4 + 4) bytes (either format's workspace).
// lora_step: the step's LoRA updates, each added after its linear (nullptr: none).
void llmserve_llama_layers(float* x, int64_t T, const LlamaShape* shape,
                                const LlamaLayer* layers, int64_t num_layers,
                                const AttentionStep* step, float* scratch, uint8_t* qscratch,
                                const LoraStep* lora_step) {
  const LlamaShape& s = *shape;
  const int64_t C = s.hidden, H = s.num_heads, Hkv = s.num_kv_heads, D = s.head_dim;
  const int64_t qkv_width = (H + 2 * Hkv) * D;
  float* h = scratch;                      // (T, C)
  float* qkv = h + T * C;                  // (T, qkv_width)
  float* attn = qkv + T * qkv_width;       // (T, H * D)
  float* gate_up = attn + T * H * D;       // (T, 2 I)
  float* act = gate_up + T * 2 * s.intermediate;  // (T, I)
  float* delta = act + T * s.intermediate;         // (T, C)
  for (int64_t i = 0; i < num_layers; ++i) {
    const LlamaLayer& L = layers[i];
    const float* normed = x;  // no input norm: the stream as it is
    if (L.input_norm != nullptr) {
      llmserve_rms_norm(x, T, C, L.input_norm, s.eps, h);
      normed = h;
    }
    linear(normed, T, L.qkv, qkv, qscratch);
    lora(lora_step, i, 0, normed, T, C, qkv, qkv_width);
    if (L.q_norm != nullptr) {
      llmserve_rms_norm_heads(qkv, T, qkv_width, H, D, L.q_norm, s.eps);
      llmserve_rms_norm_heads(qkv + H * D, T, qkv_width, Hkv, D, L.k_norm, s.eps);
    }
    llmserve_rotary_inplace(qkv, T, qkv_width, H + Hkv, D, step->positions,
                            L.cos_table ? L.cos_table : step->cos_table,
                            L.sin_table ? L.sin_table : step->sin_table);
    llmserve_kv_cache_write(qkv + H * D, qkv + (H + Hkv) * D, qkv_width, T, Hkv, D,
                            step->slot_mapping, L.key_cache, L.value_cache, L.key_scales,
                            L.value_scales, step->kv_dtype);
    llmserve_paged_attention(qkv, qkv_width, H, D, L.key_cache, L.value_cache, L.key_scales,
                             L.value_scales, step->kv_dtype, step->block_size, Hkv,
                             step->block_tables, step->max_blocks, step->query_start,
                             step->context_lens, step->num_seqs, s.attention_scale,
                             L.window, s.softcap, attn);
    linear(attn, T, L.o, delta, qscratch);
    lora(lora_step, i, 1, attn, T, H * D, delta, C);
    residual_add(x, delta, T, C, L.attention_out_norm, s.eps, h);
    llmserve_rms_norm(x, T, C, L.mlp_norm, s.eps, h);
    if (L.moe != nullptr) {  // LoRA steps on a mixture run per op (models/llama_native.py)
      llmserve_moe_block(h, T, C, L.moe, delta, qscratch);
      residual_add(x, delta, T, C, L.mlp_out_norm, s.eps, h);
      continue;
    }
    linear(h, T, L.gate_up, gate_up, qscratch);
    lora(lora_step, i, 2, h, T, C, gate_up, 2 * s.intermediate);
    if (s.activation == kGeluTanh)
      llmserve_gelu_tanh_and_mul(gate_up, T, s.intermediate, act);
    else
      llmserve_silu_and_mul(gate_up, T, s.intermediate, act);
    linear(act, T, L.down, delta, qscratch);
    lora(lora_step, i, 3, act, T, s.intermediate, delta, C);
    residual_add(x, delta, T, C, L.mlp_out_norm, s.eps, h);
  }
}

}  // extern "C"
