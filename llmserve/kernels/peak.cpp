// The level's int8 dot-product peak, for `llmserve bench kernels` to report the GEMMs
// against: simd.h's dot4 (unsigned 7-bit by signed 8-bit, int32 sums: what the int4 and
// K-quant kernels run) on registers alone, no memory traffic, on every thread of the pool.

#include "common.h"

using namespace llmserve;

extern "C" {

// Runs `iterations` rounds of 8 independent dot4 steps on each pool thread; returns the
// integer operations done (a multiply and an add per product) and writes a checksum to
// `sink` (so that nothing is optimised away).
int64_t llmserve_int8_dot_peak(int64_t iterations, int32_t* sink) {
  const int64_t threads = current_pool()->size();
  std::vector<int32_t> sums(threads, 0);
  parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      alignas(64) uint8_t bytes[64];
      for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>((i * 7 + t) & 0x7F);
      const simd::B64 u = simd::load_bytes(bytes);
      simd::I16 acc[8];
      for (auto& a : acc) a = simd::zero_i();
      int32_t x = static_cast<int32_t>(0x01020304 + t);
      for (int64_t it = 0; it < iterations; ++it) {
        for (int j = 0; j < 8; ++j) acc[j] = simd::dot4_u7s8(acc[j], u, x + j);
        x ^= static_cast<int32_t>(it & 0x0F0F0F0F);
      }
      simd::I16 total = acc[0];
      for (int j = 1; j < 8; ++j) total = total + acc[j];
      sums[t] = simd::reduce_add(total);
    }
  });
  int32_t check = 0;
  for (int32_t s : sums) check ^= s;
  *sink = check;
  return iterations * threads * 8 * 16 * 4 * 2;
}

}  // extern "C"
