// Runs every exported kernel on fixed pseudo-random inputs and writes inputs and outputs as
// raw blobs, so test_kernel_levels.py can compare builds of the kernels at each
// instruction-set level with one another and with numpy references.
//
//   kernel_check OUT_DIR    writes OUT_DIR/<name>.bin (raw little-endian) for every array
//                           and OUT_DIR/index.txt, one "<name> <dtype> <d0,d1,...>" a line;
//                           prints llmserve_kernels_level()
//
// Built together with llmserve/kernels/{kernels_api,gemm,attention,elementwise,
// llama_layers}.cpp. Shapes are small and chosen for tails: N not a multiple of 16, K not
// a multiple of 64, M = 1, 3, 5, 33, head sizes 64, 80, 48 (and 40, not a multiple of 16).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../../llmserve/kernels/kernels.h"

namespace {

using Shape = std::vector<int64_t>;

// A 64-bit LCG (Knuth's MMIX constants): integer arithmetic only, so every platform and
// standard library draws the same numbers.
struct Lcg {
  uint64_t state;
  uint32_t next() {  // 31 bits
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 33);
  }
  int32_t below(int32_t n) { return static_cast<int32_t>(next() % static_cast<uint32_t>(n)); }
  // uniform in [-scale, scale) on a grid of 2^-23 * scale (exact floats for a power-of-two
  // scale)
  float uniform(float scale = 1.f) {
    return static_cast<float>(static_cast<int32_t>(next() >> 7) - (1 << 23)) * scale /
           static_cast<float>(1 << 23);
  }
  std::vector<float> floats(int64_t n, float scale = 1.f) {
    std::vector<float> r(n);
    for (auto& x : r) x = uniform(scale);
    return r;
  }
};

const char* dtype_name(float) { return "f32"; }
const char* dtype_name(int64_t) { return "i64"; }
const char* dtype_name(int32_t) { return "i32"; }
const char* dtype_name(int8_t) { return "i8"; }
const char* dtype_name(uint8_t) { return "u8"; }
const char* dtype_name(uint16_t) { return "u16"; }

// The blobs of one run: OUT_DIR/<name>.bin and a line of OUT_DIR/index.txt each.
class Blobs {
 public:
  explicit Blobs(std::string dir)
      : dir_(std::move(dir)), index_(std::fopen((dir_ + "/index.txt").c_str(), "w")) {
    if (index_ == nullptr) fail("cannot create index.txt");
  }
  ~Blobs() { std::fclose(index_); }
  template <typename T>
  void put(const std::string& name, const std::vector<T>& data, const Shape& shape) {
    int64_t count = 1;
    std::string dims;
    for (int64_t d : shape) {
      count *= d;
      dims += (dims.empty() ? "" : ",") + std::to_string(d);
    }
    if (count != static_cast<int64_t>(data.size())) fail(name + ": shape and data disagree");
    std::FILE* blob = std::fopen((dir_ + "/" + name + ".bin").c_str(), "wb");
    const bool written = blob != nullptr &&
                         std::fwrite(data.data(), sizeof(T), data.size(), blob) == data.size();
    if (blob == nullptr || std::fclose(blob) != 0 || !written) fail("cannot write " + name);
    std::fprintf(index_, "%s %s %s\n", name.c_str(), dtype_name(T{}), dims.c_str());
  }

 private:
  void fail(const std::string& what) {
    std::fprintf(stderr, "%s: %s\n", dir_.c_str(), what.c_str());
    std::exit(1);
  }
  std::string dir_;
  std::FILE* index_;
};

std::string tag(const char* prefix, int64_t value) { return prefix + std::to_string(value); }

void check_rms_norm(Lcg& g, Blobs& out) {
  for (auto [T, C] : {std::pair<int64_t, int64_t>{3, 200}, {1, 64}}) {
    const std::string p = "rms_norm." + tag("C", C) + ".";
    const auto x = g.floats(T * C, 4.f), w = g.floats(C);
    std::vector<float> y(T * C), eps{1e-5f};
    llmserve_rms_norm(x.data(), T, C, w.data(), eps[0], y.data());
    out.put(p + "x", x, {T, C});
    out.put(p + "w", w, {C});
    out.put(p + "eps", eps, {1});
    out.put(p + "out", y, {T, C});
  }
}

// q heads, then k heads, then v heads in each row; the v heads stay as they are
void check_rotary(Lcg& g, Blobs& out) {
  const int64_t T = 5, H = 3, Hkv = 1, max_position = 11;
  for (int64_t D : {64, 80, 48}) {
    const std::string p = "rotary." + tag("D", D) + ".";
    const int64_t row = (H + 2 * Hkv) * D;
    const auto qkv_in = g.floats(T * row, 2.f);
    const auto cos = g.floats(max_position * D), sin = g.floats(max_position * D);
    std::vector<int64_t> positions(T);
    for (auto& pos : positions) pos = g.below(max_position);
    auto qkv = qkv_in;
    llmserve_rotary_inplace(qkv.data(), T, row, H + Hkv, D, positions.data(), cos.data(),
                            sin.data());
    out.put(p + "qkv", qkv_in, {T, row});
    out.put(p + "cos", cos, {max_position, D});
    out.put(p + "sin", sin, {max_position, D});
    out.put(p + "positions", positions, {T});
    out.put(p + "num_heads", std::vector<int64_t>{H + Hkv}, {1});
    out.put(p + "out", qkv, {T, row});
  }
}

// gates up to +-16, and +-100 in places (exp's clamps); one row of 5000 (split over threads)
void check_silu(Lcg& g, Blobs& out) {
  for (auto [T, I] : {std::pair<int64_t, int64_t>{3, 37}, {1, 5000}}) {
    const std::string p = "silu." + tag("I", I) + ".";
    auto gate_up = g.floats(T * 2 * I, 16.f);
    gate_up[3] = 100.f;
    gate_up[5] = -100.f;
    std::vector<float> y(T * I);
    llmserve_silu_and_mul(gate_up.data(), T, I, y.data());
    out.put(p + "gate_up", gate_up, {T, 2 * I});
    out.put(p + "out", y, {T, I});
    std::vector<float> gelu(T * I);  // Gemma's tanh-GELU on the same rows
    llmserve_gelu_tanh_and_mul(gate_up.data(), T, I, gelu.data());
    out.put("gelu." + tag("I", I) + ".out", gelu, {T, I});
  }
}

// activations in [-2, 2); row 2 of M = 5 all zeros (the scale's floor)
std::vector<float> activations(Lcg& g, int64_t M, int64_t K) {
  auto x = g.floats(M * K, 2.f);
  if (M == 5) std::fill(x.begin() + 2 * K, x.begin() + 3 * K, 0.f);
  return x;
}

const int64_t kRowCounts[] = {1, 3, 5, 33};

void check_int8_linear(Lcg& g, Blobs& out) {
  const int64_t N = 40, K = 100, Np = 48, Kp = 128;
  std::vector<int8_t> w(N * K), packed(Np * Kp);
  for (auto& v : w) v = static_cast<int8_t>(g.below(255) - 127);
  std::vector<int32_t> wsum(N, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wsum[n] += w[n * K + k];
  std::vector<float> wscale(N);
  for (auto& s : wscale) s = 0.01f + 0.005f * g.uniform();
  const auto bias = g.floats(N);
  llmserve_pack_int8_weight(w.data(), N, K, packed.data());
  out.put("int8_linear.w", w, {N, K});
  out.put("int8_linear.wscale", wscale, {N});
  out.put("int8_linear.bias", bias, {N});
  for (int64_t M : kRowCounts) {
    const std::string p = "int8_linear." + tag("M", M) + ".";
    const bool with_bias = M != 1;  // M = 1 without
    const auto x = activations(g, M, K);
    std::vector<float> y(M * N);
    std::vector<uint8_t> workspace(M * 2 * Kp + M * sizeof(float));
    llmserve_int8_linear(x.data(), M, K, packed.data(), wsum.data(), wscale.data(),
                         with_bias ? bias.data() : nullptr, N, y.data(), workspace.data());
    out.put(p + "x", x, {M, K});
    out.put(p + "with_bias", std::vector<int32_t>{with_bias}, {1});
    out.put(p + "y", y, {M, N});
  }
}

// fp16 bits: d positive in [2^-8, 2^-4), m of either sign in [2^-9, 2^-4); one subnormal
// of each (exact conversions at every level)
void check_q4_linear(Lcg& g, Blobs& out) {
  const int64_t N = 40, K = 96, G = K / 32, Np = 48;
  std::vector<uint8_t> codes(N * K), packed(Np / 16 * G * 320);
  for (auto& c : codes) c = static_cast<uint8_t>(g.below(16));
  std::vector<uint16_t> d(N * G), m(N * G);
  for (auto& h : d) {  // (draws in statements of their own: an expression's order is unspecified)
    const int32_t exponent = 7 + g.below(4);
    h = static_cast<uint16_t>(exponent << 10 | g.below(1024));
  }
  for (auto& h : m) {
    const int32_t sign = g.below(2), exponent = 6 + g.below(5);
    h = static_cast<uint16_t>(sign << 15 | exponent << 10 | g.below(1024));
  }
  d[3 * G + 1] = 0x0123;
  m[5 * G] = 0x8001;
  const auto bias = g.floats(N);
  llmserve_pack_q4_weight(codes.data(), d.data(), m.data(), N, K, packed.data());
  out.put("q4_linear.codes", codes, {N, K});
  out.put("q4_linear.d", d, {N, G});
  out.put("q4_linear.m", m, {N, G});
  out.put("q4_linear.bias", bias, {N});
  for (const int32_t bits : {15, 8})  // activations in two int8 parts, or one
    for (int64_t M : kRowCounts) {
      const std::string p = (bits == 15 ? "q4_linear." : "q4_linear_a8.") + tag("M", M) + ".";
      const bool with_bias = M != 1;  // M = 1 without
      auto x = activations(g, M, K);
      if (M == 33) std::fill(x.begin() + 7 * K + 32, x.begin() + 7 * K + 64, 0.f);  // a group
      std::vector<float> y(M * N);
      std::vector<uint8_t> workspace(2 * M * K + 2 * M * G * sizeof(float));
      llmserve_q4_linear(x.data(), M, K, packed.data(), with_bias ? bias.data() : nullptr, N,
                         y.data(), workspace.data(), bits);
      out.put(p + "x", x, {M, K});
      out.put(p + "with_bias", std::vector<int32_t>{with_bias}, {1});
      out.put(p + "y", y, {M, N});
    }
}

// GGUF block bytes per 256 values and the offsets of each block's fp16 scales (d, dmin / m)
struct BlockFormat {
  int32_t type;
  const char* name;
  int64_t bytes;       // per 256 values
  int64_t block;       // bytes per GGUF block (256 values for the K-quants, 32 for legacy)
  int halves[2];       // offsets of the fp16 scales in a block, -1: none
};
constexpr BlockFormat kFormats[] = {
    {kQ4K, "q4_k", 144, 144, {0, 2}},    {kQ5K, "q5_k", 176, 176, {0, 2}},
    {kQ6K, "q6_k", 210, 210, {208, -1}}, {kQ4_0, "q4_0", 144, 18, {0, -1}},
    {kQ4_1, "q4_1", 160, 20, {0, 2}},   {kQ5_0, "q5_0", 176, 22, {0, -1}},
    {kQ5_1, "q5_1", 192, 24, {0, 2}},   {kQ8_0, "q8_0", 272, 34, {0, -1}},
    {kQ3K, "q3_k", 110, 110, {108, -1}},  {kIQ4XS, "iq4_xs", 136, 136, {0, -1}}};

// One weight on a file's own blocks, of segments `types` x `rows` (a fused projection whose
// parts a file stores in different types) from random GGUF blocks (every byte pattern is a
// block, but Q8_0's -128, which ggml never writes; fp16 scales in [2^-8, 2^-4), one
// subnormal, and Q4_1/Q5_1's mins either sign), its rows dequantized, and the GEMM at every
// row count (bias where M != 1).
void check_blocks(Lcg& g, Blobs& out, const std::string& name, std::vector<int32_t> types,
                  std::vector<int64_t> rows) {
  const int64_t K = 512, G = K / 256, S = static_cast<int64_t>(types.size());
  int64_t N = 0;
  for (int64_t r : rows) N += r;
  KQuantWeight w{S, {}, N, K};
  std::vector<std::vector<uint8_t>> packed(S);
  for (int64_t i = 0; i < S; ++i) {
    const BlockFormat& f = kFormats[types[i]];
    std::vector<uint8_t> blocks(rows[i] * G * f.bytes);
    for (auto& b : blocks) b = static_cast<uint8_t>(g.below(256));
    for (int64_t blk = 0; blk < rows[i] * G * f.bytes / f.block; ++blk) {
      uint8_t* p = blocks.data() + blk * f.block;
      if (f.type == kQ8_0)
        for (int l = 2; l < 34; ++l) p[l] = p[l] == 0x80 ? 0x81 : p[l];
      for (int half = 0; half < 2 && f.halves[half] >= 0; ++half) {
        const int32_t exponent = 7 + g.below(4);
        uint16_t h = static_cast<uint16_t>(exponent << 10 | g.below(1024));
        if (blk == 1 && half == 0) h = 0x0123;
        if (half == 1 && f.type >= kQ4_0 && g.below(2)) h |= 0x8000;  // a negative min
        std::memcpy(p + f.halves[half], &h, 2);
      }
    }
    packed[i].resize((rows[i] + 15) / 16 * G * llmserve_kquant_record_bytes(f.type));
    llmserve_pack_kquant(blocks.data(), f.type, rows[i], K, packed[i].data());
    w.segments[i] = KQuantSegment{f.type, rows[i], packed[i].data()};
    const std::string part = name + ".part" + std::to_string(i) + "_" + f.name;
    out.put(part + ".blocks", blocks, {rows[i], G * f.bytes});
    std::vector<int64_t> ids(rows[i]);
    for (int64_t r = 0; r < rows[i]; ++r) ids[r] = rows[i] - 1 - r;  // every row, reversed
    std::vector<float> rows_out(rows[i] * K);
    llmserve_kquant_rows(packed[i].data(), f.type, rows[i], K, ids.data(), rows[i],
                         rows_out.data());
    out.put(part + ".rows", rows_out, {rows[i], K});
  }
  const auto bias = g.floats(N);
  out.put(name + ".bias", bias, {N});
  for (int64_t M : kRowCounts) {
    const std::string p = name + "_linear." + tag("M", M) + ".";
    const bool with_bias = M != 1;
    const auto x = activations(g, M, K);
    std::vector<float> y(M * N);
    std::vector<uint8_t> workspace(M * K + 4 * M * G + 4 * M * K / 16);
    llmserve_kquant_linear(x.data(), M, K, &w, with_bias ? bias.data() : nullptr, y.data(),
                           workspace.data());
    out.put(p + "x", x, {M, K});
    out.put(p + "with_bias", std::vector<int32_t>{with_bias}, {1});
    out.put(p + "y", y, {M, N});
  }
}

// The K-quants as a Q4_K_M file mixes them (Q4_K, Q6_K, Q5_K), the legacy types two ways,
// Q8_0 as one whole weight, Q3_K beside Q6_K and IQ4_XS beside Q5_K
void check_kquant(Lcg& g, Blobs& out) {
  check_blocks(g, out, "kquant", {kQ4K, kQ6K, kQ5K}, {16, 16, 8});
  check_blocks(g, out, "legacy", {kQ4_0, kQ4_1, kQ5_0, kQ5_1}, {16, 16, 16, 8});
  check_blocks(g, out, "q8", {kQ8_0}, {24});
  check_blocks(g, out, "q3", {kQ3K, kQ6K}, {16, 8});  // a Q3_K_M file's Q3_K and Q6_K
  check_blocks(g, out, "iq4", {kIQ4XS, kQ5K}, {16, 8});
}

// plain (bias on M = 3, 5) and continuing from `init` (M = 3, 7, 33); besides kRowCounts,
// M = 7 and 13 (a few rows: tiles of every height, the last one short) and 49 (tiles again)
void check_f32_linear(Lcg& g, Blobs& out) {
  const int64_t N = 40, K = 37, Np = 48;
  const auto w = g.floats(N * K), bias = g.floats(N);
  std::vector<float> packed(Np * K);
  llmserve_pack_f32_weight(w.data(), N, K, packed.data());
  out.put("f32_linear.w", w, {N, K});
  out.put("f32_linear.bias", bias, {N});
  for (int64_t M : {1, 3, 5, 7, 13, 33, 49}) {
    const std::string p = "f32_linear." + tag("M", M) + ".";
    const bool with_bias = M == 3 || M == 5;
    const auto x = g.floats(M * K, 2.f);
    std::vector<float> y(M * N);
    llmserve_f32_linear_from(x.data(), M, K, packed.data(), with_bias ? bias.data() : nullptr,
                             nullptr, N, y.data());
    out.put(p + "x", x, {M, K});
    out.put(p + "with_bias", std::vector<int32_t>{with_bias}, {1});
    out.put(p + "y", y, {M, N});
  }
  for (int64_t M : {3, 7, 33}) {
    const std::string p = "f32_linear_from." + tag("M", M) + ".";
    const auto x = g.floats(M * K, 2.f), init = g.floats(M * N, 8.f);
    std::vector<float> y(M * N);
    llmserve_f32_linear_from(x.data(), M, K, packed.data(), nullptr, init.data(), N, y.data());
    out.put(p + "x", x, {M, K});
    out.put(p + "init", init, {M, N});
    out.put(p + "y", y, {M, N});
  }
}

// rows: random; a NaN in the vector part; a NaN in the tail; ties across lanes (first
// index 20); ties between the vector part and the tail (50); the largest only in the tail
// (97); all -inf (0); -0 before +0 as the largest (30)
// random groups, a constant one (d = 0), a tiny one (subnormal halves), a large one
void check_quantize_q4(Lcg& g, Blobs& out) {
  const int64_t N = 6, K = 128, G = K / 32;
  auto w = g.floats(N * K);
  std::fill(w.begin() + 32, w.begin() + 64, 0.25f);
  for (int64_t i = K; i < K + 32; ++i) w[i] *= 1e-5f;
  for (int64_t i = 2 * K + 64; i < 2 * K + 96; ++i) w[i] *= 1e4f;
  std::vector<uint8_t> codes(N * K);
  std::vector<uint16_t> d(N * G), m(N * G);
  llmserve_quantize_q4(w.data(), N, K, codes.data(), d.data(), m.data());
  out.put("quantize_q4.w", w, {N, K});
  out.put("quantize_q4.codes", codes, {N, K});
  out.put("quantize_q4.d", d, {N, G});
  out.put("quantize_q4.m", m, {N, G});
}

void check_argmax(Lcg& g, Blobs& out) {
  const int64_t N = 100, M = 8;
  auto x = g.floats(M * N);
  float* r = x.data();
  r[1 * N + 5] = NAN;
  r[2 * N + 98] = NAN;
  for (int64_t i : {37, 20, 70, 98}) r[3 * N + i] = 2.f;
  for (int64_t i : {99, 50}) r[4 * N + i] = 2.f;
  r[5 * N + 97] = 2.f;
  std::fill(r + 6 * N, r + 7 * N, -INFINITY);
  for (int64_t i = 0; i < N; ++i) r[7 * N + i] = -1.f - std::fabs(r[7 * N + i]);
  r[7 * N + 30] = -0.f;
  r[7 * N + 60] = 0.f;
  std::vector<int64_t> arg(M);
  llmserve_argmax_rows(x.data(), M, N, arg.data());
  out.put("argmax.N100.x", x, {M, N});
  out.put("argmax.N100.out", arg, {M});
  // N < 16: the scalar loop only, ties at 2 and 7, then 6 and 8
  auto small = g.floats(2 * 10);
  small[2] = small[7] = small[10 + 6] = small[10 + 8] = 3.f;
  std::vector<int64_t> small_arg(2);
  llmserve_argmax_rows(small.data(), 2, 10, small_arg.data());
  out.put("argmax.N10.x", small, {2, 10});
  out.put("argmax.N10.out", small_arg, {2});
}

// 3 of 5 rows masked; N = 100: three full words and a partial one; one word all allowed
void check_bitmask(Lcg& g, Blobs& out) {
  const int64_t N = 100, W = 4, R = 3;
  const auto x_in = g.floats(5 * N);
  std::vector<int32_t> words(R * W);
  for (auto& w : words) {
    const uint32_t high = g.next() << 1;
    w = static_cast<int32_t>(high ^ g.next());
  }
  words[1] = -1;
  const std::vector<int64_t> rows{3, 0, 4};
  auto x = x_in;
  llmserve_apply_token_bitmask(x.data(), N, words.data(), R, rows.data());
  out.put("bitmask.x", x_in, {5, N});
  out.put("bitmask.words", words, {R, W});
  out.put("bitmask.rows", rows, {R});
  out.put("bitmask.out", x, {5, N});
}

// Three sequences in a paged cache of 8 blocks of 16 tokens, their blocks a shuffle of
// the cache's: a prefill of 5 tokens from nothing, a decode step after 20 cached tokens and
// a chunk of 9 after 37 (two query tiles, keys over 3 blocks). H = 4 query heads on
// Hkv = 2; the cache holds every token of the steps (the write comes first).
struct PagedBatch {
  static constexpr int64_t kBlockSize = 16, kBlocks = 8, kMaxBlocks = 4, B = 3, H = 4, Hkv = 2;
  std::vector<int32_t> context_lens{0, 20, 37}, query_start{0, 5, 6, 15};
  std::vector<int32_t> block_tables = std::vector<int32_t>(B * kMaxBlocks, 0);
  std::vector<int64_t> slot_mapping;  // every token of every sequence, in order

  explicit PagedBatch(Lcg& g) {
    std::vector<int32_t> blocks{0, 1, 2, 3, 4, 5, 6, 7};
    for (int32_t i = 7; i > 0; --i) std::swap(blocks[i], blocks[g.below(i + 1)]);
    auto next_block = blocks.begin();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = context_lens[b] + query_start[b + 1] - query_start[b];
      for (int64_t i = 0; i * kBlockSize < n; ++i) block_tables[b * kMaxBlocks + i] = *next_block++;
      for (int64_t t = 0; t < n; ++t)
        slot_mapping.push_back(block_tables[b * kMaxBlocks + t / kBlockSize] * kBlockSize +
                               t % kBlockSize);
    }
  }
};

template <typename T>
std::vector<T> read_back(const std::vector<uint8_t>& bytes) {
  const T* t = reinterpret_cast<const T*>(bytes.data());
  return std::vector<T>(t, t + bytes.size() / sizeof(T));
}

// a cache as its dtype's values: fp32, bf16 bits or int8
void put_cache(Blobs& out, const std::string& name, const std::vector<uint8_t>& cache,
               int32_t dtype, const Shape& shape) {
  if (dtype == 0) out.put(name, read_back<float>(cache), shape);
  if (dtype == 1) out.put(name, read_back<uint16_t>(cache), shape);
  if (dtype == 2) out.put(name, read_back<int8_t>(cache), shape);
}

// The cache write of a batch's keys and values, then paged attention over them: plain, in
// a window of 7, and with softcap 2 on scores 4x larger.
void check_attention(Lcg& g, Blobs& out, int32_t dtype, int64_t D) {
  static const char* kDtypes[] = {"f32", "bf16", "int8"};
  const std::string p = std::string("attention.") + kDtypes[dtype] + "." + tag("D", D) + ".";
  const PagedBatch batch(g);
  const int64_t B = batch.B, H = batch.H, Hkv = batch.Hkv, block_size = batch.kBlockSize;
  // keys and values (T, Hkv, D) in rows `kv_stride` apart (a fused qkv row's k or v part)
  const int64_t T = static_cast<int64_t>(batch.slot_mapping.size()), kv_stride = Hkv * D + 8;
  const auto k = g.floats(T * kv_stride), v = g.floats(T * kv_stride);
  const int64_t rows = batch.kBlocks * block_size * Hkv;
  const int64_t bytes = dtype == 0 ? 4 : dtype == 1 ? 2 : 1;
  std::vector<uint8_t> k_cache(rows * D * bytes), v_cache(rows * D * bytes);
  std::vector<float> k_scales(rows), v_scales(rows);
  llmserve_kv_cache_write(k.data(), v.data(), kv_stride, T, Hkv, D, batch.slot_mapping.data(),
                          k_cache.data(), v_cache.data(), k_scales.data(), v_scales.data(),
                          dtype);
  out.put(p + "k", k, {T, kv_stride});
  out.put(p + "v", v, {T, kv_stride});
  out.put(p + "slot_mapping", batch.slot_mapping, {T});
  put_cache(out, p + "k_cache", k_cache, dtype, {batch.kBlocks, block_size, Hkv, D});
  put_cache(out, p + "v_cache", v_cache, dtype, {batch.kBlocks, block_size, Hkv, D});
  if (dtype == 2) {
    out.put(p + "k_scales", k_scales, {batch.kBlocks, block_size, Hkv});
    out.put(p + "v_scales", v_scales, {batch.kBlocks, block_size, Hkv});
  }
  out.put(p + "block_tables", batch.block_tables, {B, batch.kMaxBlocks});
  out.put(p + "context_lens", batch.context_lens, {B});
  out.put(p + "query_start", batch.query_start, {B + 1});

  // queries (Tq, H, D) in rows q_stride floats apart
  const int64_t Tq = batch.query_start[B], q_stride = H * D + 16;
  const auto q = g.floats(Tq * q_stride);
  out.put(p + "q", q, {Tq, q_stride});
  const float base = 1.f / std::sqrt(static_cast<float>(D));
  struct Variant { const char* name; float scale; int64_t window; float softcap; };
  for (const Variant& variant : {Variant{"plain", base, 0, 0.f}, Variant{"window", base, 7, 0.f},
                                 Variant{"softcap", 4.f * base, 0, 2.f}}) {
    std::vector<float> o(Tq * H * D);
    llmserve_paged_attention(q.data(), q_stride, H, D, k_cache.data(), v_cache.data(),
                             k_scales.data(), v_scales.data(), dtype, block_size, Hkv,
                             batch.block_tables.data(), batch.kMaxBlocks,
                             batch.query_start.data(), batch.context_lens.data(), B,
                             variant.scale, variant.window, variant.softcap, o.data());
    const std::string name = p + variant.name + ".";
    out.put(name + "params",
            std::vector<float>{variant.scale, static_cast<float>(variant.window),
                               variant.softcap},
            {3});
    out.put(name + "out", o, {Tq, H, D});
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  llmserve_set_num_threads(2, 100);
  Blobs out(argv[1]);
  Lcg g{20240611};
  check_rms_norm(g, out);
  check_rotary(g, out);
  check_silu(g, out);
  check_int8_linear(g, out);
  check_q4_linear(g, out);
  check_f32_linear(g, out);
  check_quantize_q4(g, out);
  check_argmax(g, out);
  check_bitmask(g, out);
  for (int32_t dtype : {0, 1, 2})
    for (int64_t D : {64, 80, 48, 40}) check_attention(g, out, dtype, D);
  check_kquant(g, out);
  std::printf("%s\n", llmserve_kernels_level());
  return 0;
}
