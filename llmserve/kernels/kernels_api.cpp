// llmserve's native CPU kernels: the library's identity (ABI version, instruction-set level)
// and the thread pool every kernel runs on.
//
// Plain C ABI (called through ctypes with tensor data pointers), no dependency on torch.
// Built at first use for one instruction-set level (kernels/__init__.py); the kernels are
// in gemm_int8.cpp, gemm_q4.cpp and gemm_f32.cpp (the GEMMs, sharing gemm.h), attention.cpp
// (paged attention, KV-cache writes), elementwise.cpp (RMSNorm, rotary, SiLU*up, argmax,
// token bitmask) and llama_layers.cpp (the Llama stack as one call), each written once on
// simd.h.

#include "common.h"

#include <memory>
#include <mutex>
#include <vector>

namespace {

// The pool kernels use. A replaced pool is retired, never destroyed: a kernel still
// running on another thread may hold it (pools are replaced rarely, when an engine asks
// for another thread count).
std::atomic<llmserve::ThreadPool*> g_pool{nullptr};
std::vector<std::unique_ptr<llmserve::ThreadPool>> g_pools;
std::mutex g_pools_mutex;
std::atomic<bool> g_stream_nontemporal{false};

}  // namespace

namespace llmserve {
ThreadPool* current_pool() { return g_pool.load(); }
bool stream_nontemporal() { return g_stream_nontemporal.load(std::memory_order_relaxed); }
}  // namespace llmserve

extern "C" {

int32_t llmserve_kernels_abi() { return LLMSERVE_KERNELS_ABI; }

// The instruction-set level the library was built for ("avx2", "avx512+vnni", ...).
const char* llmserve_kernels_level() { return simd::level_name(); }

// Whether decodes prefetch their weights non-temporally (1) or into the caches (0, the
// default); see prefetch_weights in common.h.
void llmserve_set_stream_prefetch(int32_t nontemporal) {
  g_stream_nontemporal.store(nontemporal != 0);
}

// Starts a pool of `num_threads` in all (the caller included) for the kernels that follow;
// idle workers spin for `spin_us` microseconds before they sleep.
void llmserve_set_num_threads(int32_t num_threads, int64_t spin_us) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  g_pools.push_back(std::make_unique<llmserve::ThreadPool>(std::max(1, num_threads), spin_us));
  g_pool.store(g_pools.back().get());
}

}  // extern "C"
