// What the kernel files share: the thread pool they run on, small index helpers, and loads
// and stores of a partial block of 16 lanes.
#pragma once

#include "kernels.h"  // the exported functions: their definitions must match
#include "simd.h"
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace llmserve {

// The pool kernels use (kernels_api.cpp owns it).
ThreadPool* current_pool();

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  current_pool()->parallel_for(end - begin, grain,
                               [&](int64_t b, int64_t e) { fn(begin + b, begin + e); });
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kBlockN = 16;  // output channels per block of every packed weight

// The first n (<= 16) lanes from p, zeros after: a block of channels past the weight's end.
inline simd::F16 load_part(const float* p, int64_t n) {
  return n >= 16 ? simd::load(p) : simd::load_first(p, n);
}
inline simd::I16 load_part(const int32_t* p, int64_t n) {
  if (n >= 16) return simd::load_i(p);
  alignas(64) int32_t tmp[16] = {};
  std::memcpy(tmp, p, std::max<int64_t>(n, 0) * sizeof(int32_t));
  return simd::load_i(tmp);
}
inline void store_part(float* p, simd::F16 a, int64_t n) {
  if (n >= 16)
    simd::store(p, a);
  else
    simd::store_first(p, a, n);
}

enum KVDtype : int32_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

// Whether a decode's single pass over the weights prefetches them non-temporally (set by
// llmserve_set_stream_prefetch, chosen by timing: kernel_choice.py).
bool stream_nontemporal();

// Prefetches one line of weights. `kStream` (a decode's single pass over the weights):
// non-temporally where that was timed clearly faster, else into the caches. On a Zen 5
// (32 MiB L3) non-temporal kept ~100 MB of weights a token from evicting the KV cache and
// the interpreter's working set (engine step 3.84-4.29 -> 3.70-3.94 ms); on a Xeon VM with
// a 480 MiB L3 it threw away weights that fit it, and the next token read them from memory
// again (batch-1 step 8.97 ms non-temporal, 3.47 ms kept; a 1B Q4_K_M's pass 17.6 ms
// against 9.6): the caches are the default, the one that costs little where it loses.
template <bool kStream>
inline void prefetch_weights(const void* p) {
  if (kStream && stream_nontemporal())
    simd::prefetch<true>(p);
  else
    simd::prefetch<false>(p);
}

}  // namespace llmserve
