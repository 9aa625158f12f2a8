// The level's int8 dot-product peak, for `llmserve bench kernels` to report the GEMMs
// against: simd.h's dot4 step as the int4 and K-quant kernels run it (4-bit codes by int8
// activations, int16 pair sums widened every 8 steps where the level has no one-instruction
// int8 dot product) on registers alone, no memory traffic, on every thread of the pool.

#include "common.h"

using namespace llmserve;

extern "C" {

// Runs `iterations` (a multiple of 8) rounds of 8 independent dot4 steps on each pool
// thread; returns the
// integer operations done (a multiply and an add per product) and writes a checksum to
// `sink` (so that nothing is optimised away).
int64_t llmserve_int8_dot_peak(int64_t iterations, int32_t* sink) {
  const int64_t threads = current_pool()->size();
  std::vector<int32_t> sums(threads, 0);
  parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      alignas(64) uint8_t bytes[64];
      for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>((i * 7 + t) & 0x0F);
      const simd::B64 u = simd::load_bytes(bytes);  // 4-bit codes: pair sums stay in int16
      simd::I16 acc[8];
      for (auto& a : acc) a = simd::zero_i();
      int32_t x = static_cast<int32_t>(0x01020304 + t);
      for (int64_t it = 0; it < iterations; it += 8) {
        simd::P32 pairs[8];
        for (auto& p : pairs) p = simd::zero_pairs();
        for (int step = 0; step < 8; ++step) {  // the kernels' 8 steps between widenings
          const int32_t xs = x ^ (step << 9);  // another activation each step: no reuse
          for (int j = 0; j < 8; ++j) pairs[j] = simd::dot4_nibbles(pairs[j], u, xs + j);
        }
        for (int j = 0; j < 8; ++j) acc[j] = acc[j] + simd::widen_pairs(pairs[j]);
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
