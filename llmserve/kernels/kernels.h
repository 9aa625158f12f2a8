// The kernels' C ABI: every function the library exports (called from Python through
// kernels/binding.py, which declares each one to match and reads LLMSERVE_KERNELS_ABI from
// this file), for the C++ that calls them too (llama_layers.cpp, moe.cpp,
// tests/kernels/kernel_check.cpp).
#pragma once

#include <cstdint>

// The library's ABI version, returned by llmserve_kernels_abi: bumped whenever a function
// here or an argument struct changes, so a library built from older sources is refused.
#define LLMSERVE_KERNELS_ABI 32

// The layer calls' argument structs (packed_weight.h, llama_layers.cpp).
struct PackedWeight;
struct MoeLayer;
struct LlamaShape;
struct EagleChain;
struct LlamaLayer;
struct AttentionStep;
struct LoraStep;

extern "C" {
int32_t llmserve_kernels_abi();
const char* llmserve_kernels_level();
void llmserve_set_num_threads(int32_t num_threads, int64_t spin_us);
void llmserve_set_stream_prefetch(int32_t nontemporal);
int32_t llmserve_set_amx(int32_t on);
void llmserve_rms_norm(const float* x, int64_t T, int64_t C, const float* weight, float eps,
                       float* out);
void llmserve_rms_norm_heads(float* qkv, int64_t T, int64_t row_stride, int64_t num_heads,
                             int64_t D, const float* weight, float eps);
void llmserve_rotary_inplace(float* qkv, int64_t T, int64_t row_stride, int64_t num_heads,
                             int64_t D, const int64_t* positions, const float* cos_table,
                             const float* sin_table);
void llmserve_silu_and_mul(const float* gate_up, int64_t T, int64_t I, float* out);
void llmserve_gelu_tanh_and_mul(const float* gate_up, int64_t T, int64_t I, float* out);
void llmserve_pack_int8_weight(const int8_t* w, int64_t N, int64_t K, int8_t* packed);
void llmserve_int8_linear(const float* x, int64_t M, int64_t K, const int8_t* w,
                          const int32_t* wsum, const float* wscale, const float* bias,
                          int64_t N, float* y, uint8_t* workspace);
void llmserve_quantize_q4(const float* w, int64_t N, int64_t K, uint8_t* codes, uint16_t* d,
                          uint16_t* m);
void llmserve_pack_q4_weight(const uint8_t* codes, const uint16_t* d, const uint16_t* m,
                             int64_t N, int64_t K, uint8_t* packed);
void llmserve_q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* w,
                        const float* bias, int64_t N, float* y, uint8_t* workspace,
                        int32_t activation_bits);
void llmserve_pack_f32_weight(const float* w, int64_t N, int64_t K, float* packed);
void llmserve_f32_linear_from(const float* x, int64_t M, int64_t K, const float* w,
                              const float* bias, const float* init, int64_t N, float* y);
void llmserve_argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out);
void llmserve_apply_token_bitmask(float* x, int64_t N, const int32_t* words, int64_t R,
                                  const int64_t* rows);
void llmserve_kv_cache_write(const float* k, const float* v, int64_t kv_stride, int64_t T,
                             int64_t Hkv, int64_t D, const int64_t* slot_mapping, void* k_cache,
                             void* v_cache, float* k_scales, float* v_scales, int32_t dtype);
void llmserve_paged_attention(const float* q, int64_t q_stride, int64_t H, int64_t D,
                              const void* k_cache, const void* v_cache, const float* k_scales,
                              const float* v_scales, int32_t dtype, int64_t block_size,
                              int64_t Hkv, const int32_t* block_tables, int64_t max_blocks,
                              const int32_t* query_start, const int32_t* context_lens,
                              int64_t B, float scale, int64_t window, float softcap,
                              float* out);
void llmserve_f32_linear(const float* x, int64_t M, int64_t K, const float* w,
                         const float* bias, int64_t N, float* y);
// one adapter's update of one linear (kernels/lora.cpp): the stacked A (rank, K) and each
// target's B (rows, rank) on output rows [row_start, row_start + rows) and ranks
// [rank_start, rank_start + rank), all packed for the float32 GEMM
struct LoraPiece {
  const float* b;
  int64_t row_start, rows, rank_start, rank;
};
struct LoraSlot {
  const float* a;
  int64_t rank;  // 0: the adapter leaves this linear alone
  int64_t num_pieces;
  const LoraPiece* pieces;
};
void llmserve_lora_apply(const float* x, int64_t T, int64_t K, float* y, int64_t N,
                         const int32_t* slot_of_row, int64_t num_slots, const LoraSlot* slots,
                         float* scratch);
// a weight on a GGUF file's own blocks (kernels/gemm_kquant.cpp): its rows in up to 4
// segments, each packed from GGUF blocks of one type
enum KQuantType : int32_t {
  kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ4_0 = 3, kQ4_1 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ8_0 = 7,
  kQ3K = 8, kIQ4XS = 9
};
struct KQuantSegment {
  int32_t type;
  int64_t rows;
  const uint8_t* packed;
};
struct KQuantWeight {
  int64_t num_segments;
  KQuantSegment segments[4];
  int64_t out_features, in_features;
};
int64_t llmserve_kquant_record_bytes(int32_t type);
void llmserve_pack_kquant(const uint8_t* blocks, int32_t type, int64_t N, int64_t K,
                          uint8_t* packed);
int32_t llmserve_kquant_rows(const uint8_t* packed, int32_t type, int64_t N, int64_t K,
                             const int64_t* ids, int64_t T, float* out);
void llmserve_kquant_linear(const float* x, int64_t M, int64_t K, const KQuantWeight* w,
                            const float* bias, float* y, uint8_t* workspace);
int64_t llmserve_int8_dot_peak(int64_t iterations, int32_t* sink);
int32_t llmserve_int8_embedding(const int8_t* packed, int64_t N, int64_t Kp, const int64_t* ids,
                                int64_t T, int64_t K, const float* scale, float* out);
// a mixture-of-experts layer (moe.cpp): its pieces, and all of them in one call
void llmserve_moe_route(const float* scores, int64_t T, int64_t E, int64_t top_k,
                        int32_t renormalize, int64_t* ids, float* weights);
void llmserve_moe_combine(const float* slots, int64_t T, int64_t top_k, int64_t C,
                          const float* shared, const float* gate_logits, float* y);
void llmserve_moe_experts(const float* x, int64_t T, int64_t C, int64_t I,
                          const PackedWeight* gate_up, const PackedWeight* down,
                          int64_t first, int64_t num_held, const int64_t* ids,
                          const float* weights, int64_t top_k, float* slots, float* scratch,
                          uint8_t* qscratch);
void llmserve_moe_block(const float* x, int64_t T, int64_t C, const MoeLayer* moe, float* y,
                        uint8_t* qscratch);
// the Llama decoder stack in one call (llama_layers.cpp)
void llmserve_llama_layers(float* x, int64_t T, const LlamaShape* shape,
                           const LlamaLayer* layers, int64_t num_layers,
                           const AttentionStep* step, float* scratch, uint8_t* qscratch,
                           const LoraStep* lora_step);
// an EAGLE-1 head's first pass and draft chains (llama_layers.cpp)
void llmserve_eagle_draft(const EagleChain* chain, const float* embeds, const float* hidden,
                          int64_t T, int64_t N, const int32_t* query_lens,
                          const int64_t* starts, const int32_t* block_tables,
                          int64_t max_blocks, int32_t* wanted, const float* keep_at,
                          const float* go_on_at, int32_t cut, int64_t* drafts,
                          int64_t max_drafts, float* scratch, uint8_t* qscratch);
}
