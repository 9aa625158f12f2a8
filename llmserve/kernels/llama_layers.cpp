// The Llama decoder stack on int8, int4, K-quant or packed float32 weights in one native
// call: per layer RMSNorm, fused qkv (with its bias: Qwen2), q and k head norms (Qwen3,
// Gemma 3), rotary (a layer's own tables: Gemma's local layers), KV-cache write, paged
// attention (soft-capped: Gemma 2), o, [RMSNorm of the output: Gemma], residual, RMSNorm,
// gate/up, SiLU*up (tanh-GELU*up: Gemma), down (or a mixture of experts: moe.cpp),
// [RMSNorm of the output: Gemma], residual. It calls the very kernels the per-op path
// calls, in the same order, so both give the same bits; it only removes the Python and
// dispatch between them (~0.3 ms per layer at batch 1, measured: most of a decode step).

#include "packed_weight.h"

#include <cmath>
#include <cstring>
#include <vector>

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

// An EAGLE-1 head's drafting (spec_decode/eagle.py's `EagleProposer.propose`, which this
// follows step for step): the first pass over the verified rows; from each sequence's last
// row, the draft LM head's greedy draft and its probability; then, while a sequence wants more,
// its last draft's embedding beside its features through fc and the head's layers at the
// next position (their K/V into the slot there), the next draft. A chain stops before the
// draft whose running product of probabilities falls below keep_at, and after the one
// where it falls below go_on_at. The same kernels as the per-op path; what it removes is
// the Python between them (a head pass ~0.7 ms hot, ~1.5 ms after the target's weights have
// streamed through the caches and taken the interpreter's with them: session 43).
struct EagleChain {
  PackedWeight fc;            // (C, 2C): [embedding, feature] -> C
  PackedWeight lm_head;       // (V, C): the draft vocabulary's rows
  const int64_t* draft_ids;   // (V,) each row's target id
  const float* draft_embeds;  // (V, C) the target's embedding of each
  const LlamaShape* shape;
  const LlamaLayer* layers;
  int64_t num_layers;
  const float* cos_table;
  const float* sin_table;
  int64_t block_size;
  int32_t kv_dtype;
};

namespace {

// the first largest logit's row and, with `chance`, its softmax probability (else 1)
int64_t greedy_draft(const float* logits, int64_t V, bool chance, float* probability) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > logits[best]) best = v;
  float p = 1.0f;
  if (chance) {
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(logits[v] - logits[best]));
    p = static_cast<float>(1.0 / sum);
  }
  *probability = p;
  return best;
}

}  // namespace

extern "C" {

// The head's first pass and its chains. The first pass: N sequences' verified rows, T in
// all, sequence b's `query_lens[b]` of them from position `starts[b]`: embeds and hidden
// (T, C) each, [embedding of the next token, the target's feature] through fc and the
// head's layers (their K/V into the slots there); block_tables (N, max_blocks). Then each
// sequence with wanted[b] >= 1 drafts from its last row (the others wanted 0: their rows'
// K/V only), on return wanted[b] how many it got, in drafts (N, max_drafts) as target
// ids. T >= N (a sequence has a row at least). scratch: T * (3 C + the layer stack's
// width) + N * (C + V) floats; qscratch: the stack's workspace for T rows and the widest
// K_pad (fc's 2C).
void llmserve_eagle_draft(const EagleChain* chain, const float* embeds, const float* hidden,
                          int64_t T, int64_t N, const int32_t* query_lens,
                          const int64_t* starts, const int32_t* block_tables,
                          int64_t max_blocks, int32_t* wanted, const float* keep_at,
                          const float* go_on_at, int32_t cut, int64_t* drafts,
                          int64_t max_drafts, float* scratch, uint8_t* qscratch) {
  const EagleChain& e = *chain;
  const int64_t C = e.shape->hidden, V = e.lm_head.out_features;
  const int64_t rows_max = T > N ? T : N;
  float* x = scratch;                  // (rows, 2C) [embedding, feature]
  float* y = x + rows_max * 2 * C;     // (rows, C) the head's output
  float* features = y + rows_max * C;  // (N, C) each chain's feature
  float* logits = features + N * C;    // (N, V)
  float* layer_scratch = logits + N * V;
  std::vector<float> chance(N);
  std::vector<int64_t> row_of(N), count(N, 0), going, last(N);
  std::vector<int64_t> positions(rows_max), slots(rows_max);
  std::vector<int32_t> tables(N * max_blocks), query_start(N + 1), context(N);
  // the cache slot of sequence b's position p
  auto slot_of = [&](int64_t b, int64_t p) {
    return static_cast<int64_t>(block_tables[b * max_blocks + p / e.block_size]) *
               e.block_size + p % e.block_size;
  };
  // the first pass, all N sequences' rows
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(x + t * 2 * C, embeds + t * C, C * sizeof(float));
    std::memcpy(x + t * 2 * C + C, hidden + t * C, C * sizeof(float));
  }
  query_start[0] = 0;
  for (int64_t b = 0, t = 0; b < N; ++b) {
    for (int32_t i = 0; i < query_lens[b]; ++i, ++t) {
      const int64_t p = starts[b] + i;
      positions[t] = p;
      slots[t] = slot_of(b, p);
    }
    query_start[b + 1] = query_start[b] + query_lens[b];
    context[b] = static_cast<int32_t>(starts[b]);
    last[b] = starts[b] + query_lens[b] - 1;
  }
  const AttentionStep first{positions.data(), e.cos_table, e.sin_table, slots.data(),
                            block_tables, max_blocks, query_start.data(), context.data(),
                            N, e.block_size, e.kv_dtype};
  linear(x, T, e.fc, y, qscratch);
  llmserve_llama_layers(y, T, e.shape, e.layers, e.num_layers, &first, layer_scratch,
                        qscratch, nullptr);
  // each drafting sequence's last row: its first draft's logits and its chain's feature
  std::vector<int64_t> asked;
  for (int64_t b = 0; b < N; ++b) {
    if (wanted[b] < 1) continue;
    std::memcpy(features + b * C, y + (query_start[b + 1] - 1) * C, C * sizeof(float));
    std::memcpy(x + asked.size() * C, features + b * C, C * sizeof(float));
    asked.push_back(b);
  }
  const bool with_chance = cut != 0;
  // the drafts of the rows of logits of sequences `seqs`, a chain's `step`-th
  auto take = [&](const std::vector<int64_t>& seqs, int64_t step) {
    for (size_t j = 0; j < seqs.size(); ++j) {
      const int64_t b = seqs[j];
      float p;
      const int64_t row = greedy_draft(logits + j * V, V, with_chance, &p);
      chance[b] = step == 0 ? p : chance[b] * p;
      if (chance[b] < keep_at[b]) {
        wanted[b] = static_cast<int32_t>(step);  // the chain ends before this draft
        continue;
      }
      drafts[b * max_drafts + count[b]++] = e.draft_ids[row];
      row_of[b] = row;
      if (chance[b] < go_on_at[b]) wanted[b] = static_cast<int32_t>(step + 1);
    }
  };
  if (!asked.empty()) {
    linear(x, static_cast<int64_t>(asked.size()), e.lm_head, logits, qscratch);
    take(asked, 0);
  }
  for (int64_t step = 1; !asked.empty(); ++step) {
    going.clear();
    for (const int64_t b : asked)
      if (wanted[b] > step) going.push_back(b);
    const int64_t n = static_cast<int64_t>(going.size());
    if (n == 0) break;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = going[j];
      std::memcpy(x + j * 2 * C, e.draft_embeds + row_of[b] * C, C * sizeof(float));
      std::memcpy(x + j * 2 * C + C, features + b * C, C * sizeof(float));
      const int64_t p = last[b] + step;
      std::memcpy(tables.data() + j * max_blocks, block_tables + b * max_blocks,
                  max_blocks * sizeof(int32_t));
      positions[j] = p;
      slots[j] = slot_of(b, p);
      query_start[j] = static_cast<int32_t>(j);
      context[j] = static_cast<int32_t>(p);
    }
    query_start[n] = static_cast<int32_t>(n);
    const AttentionStep at{positions.data(), e.cos_table, e.sin_table, slots.data(),
                           tables.data(), max_blocks, query_start.data(), context.data(),
                           n, e.block_size, e.kv_dtype};
    linear(x, n, e.fc, y, qscratch);
    llmserve_llama_layers(y, n, e.shape, e.layers, e.num_layers, &at, layer_scratch, qscratch,
                          nullptr);
    for (int64_t j = 0; j < n; ++j)  // EAGLE-1: the next step's feature is the output
      std::memcpy(features + going[j] * C, y + j * C, C * sizeof(float));
    linear(y, n, e.lm_head, logits, qscratch);
    take(going, step);
  }
  for (int64_t b = 0; b < N; ++b) wanted[b] = static_cast<int32_t>(count[b]);
}

}  // extern "C"
