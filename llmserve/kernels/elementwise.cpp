// Row-wise kernels around the GEMMs: RMSNorm, rotary embedding, SiLU*up, greedy argmax and
// the grammar's token bitmask, on simd.h's 16-lane values at every instruction-set level.

#include "common.h"

#include <vector>

using namespace llmserve;
using simd::F16;
using simd::I16;

namespace {

// One row of RMSNorm (`out` may be `row`: each value is read before its own is written).
void rms_norm_row(const float* row, int64_t C, const float* weight, float eps, float* o) {
  F16 acc = simd::zero();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const F16 v = simd::load(row + c);
    acc = simd::fmadd(v, v, acc);
  }
  float sum = simd::sum_tree(acc);
  for (; c < C; ++c) sum = std::fma(row[c], row[c], sum);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(C) + eps);
  const F16 rv = simd::set1(r);
  for (c = 0; c + 16 <= C; c += 16)
    simd::store(o + c, simd::load(weight + c) * (simd::load(row + c) * rv));
  for (; c < C; ++c) o[c] = weight[c] * (row[c] * r);
}

// out (T, I) = act(gate) * up for gate_up (T, 2I) = [gate | up], elementwise (the same bits
// however the work is split, and at every level: simd::exp), split over rows and columns
// so a decode's one row uses every thread.
template <typename Act>
void act_and_mul(const float* gate_up, int64_t T, int64_t I, float* out, Act act) {
  parallel_for(0, T * I, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e;) {
      const int64_t t = i / I, c = i % I, n = std::min(e - i, I - c);  // along one row
      const float* g = gate_up + t * 2 * I + c;
      const float* u = g + I;
      float* o = out + t * I + c;
      for (int64_t j = 0; j < n; j += 16) {  // the tail through the same lane arithmetic
        const int64_t lanes = std::min<int64_t>(16, n - j);
        store_part(o + j, act(load_part(g + j, lanes)) * load_part(u + j, lanes), lanes);
      }
      i += n;
    }
  });
}

}  // namespace

extern "C" {

// out (T, C) = weight * x * rsqrt(mean(x^2) + eps), row by row (fp32, as HF Llama's RMSNorm).
// The sum of squares runs in 16 lanes (fused multiply-adds, chunk by chunk) and then the one
// lane tree of simd.h, so it is the same at every level.
void llmserve_rms_norm(const float* x, int64_t T, int64_t C, const float* weight, float eps,
                       float* out) {
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rms_norm_row(x + t * C, C, weight, eps, out + t * C);
  });
}

// Per-head RMSNorm (Qwen3's q and k norms) in place on `num_heads` heads of D values at the
// start of each row of qkv (T rows, `row_stride` apart): each head as one row of
// llmserve_rms_norm, so the same bits.
void llmserve_rms_norm_heads(float* qkv, int64_t T, int64_t row_stride, int64_t num_heads,
                             int64_t D, const float* weight, float eps) {
  parallel_for(0, T * num_heads, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* head = qkv + (i / num_heads) * row_stride + (i % num_heads) * D;
      rms_norm_row(head, D, weight, eps, head);
    }
  });
}

// Rotary embedding (rotate-half layout) in place on the q and k heads of a fused qkv row
// (T, row_stride): heads [0, num_heads) start at column 0, k heads follow, each D wide.
// cos/sin tables (max_position, D); the same products and sums as the torch formula (no
// fused multiply-adds), 16 lanes at a time.
void llmserve_rotary_inplace(float* qkv, int64_t T, int64_t row_stride, int64_t num_heads,
                             int64_t D, const int64_t* positions, const float* cos_table,
                             const float* sin_table) {
  const int64_t half = D / 2;
  parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos_table + positions[t] * D;
      const float* s = sin_table + positions[t] * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = qkv + t * row_stride + h * D;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const F16 x1 = simd::load(x + i), x2 = simd::load(x + i + half);
          simd::store(&tmp[i], x1 * simd::load(c + i) +
                                   (simd::zero() - x2) * simd::load(s + i));
          simd::store(&tmp[i + half], x2 * simd::load(c + i + half) +
                                          x1 * simd::load(s + i + half));
        }
        for (; i < half; ++i) {
          tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
          tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        std::memcpy(x, tmp.data(), D * sizeof(float));
      }
    }
  });
}

// silu(g) * u = g / (1 + exp(-g)) * u
void llmserve_silu_and_mul(const float* gate_up, int64_t T, int64_t I, float* out) {
  const F16 one = simd::set1(1.f);
  act_and_mul(gate_up, T, I, out, [&](F16 g) { return g / (one + simd::exp(simd::zero() - g)); });
}

// gelu_tanh(g) * u (Gemma's GeGLU): 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),
// y = sqrt(2 / pi) (g + 0.044715 g^3)
void llmserve_gelu_tanh_and_mul(const float* gate_up, int64_t T, int64_t I, float* out) {
  const F16 one = simd::set1(1.f), c1 = simd::set1(-2.f * 0.7978845608028654f),
            c3 = simd::set1(-2.f * 0.7978845608028654f * 0.044715f);
  act_and_mul(gate_up, T, I, out, [&](F16 g) {
    const F16 minus_2y = g * (c1 + c3 * (g * g));
    return g / (one + simd::exp(minus_2y));
  });
}

// Structured output: row rows[r] of x (N floats a row) gets -inf wherever bit n % 32 of
// words[r * ceil(N / 32) + n / 32] is clear (a grammar forbids token n). Rows in parallel;
// a word of 32 allowed tokens costs one compare.
void llmserve_apply_token_bitmask(float* x, int64_t N, const int32_t* words, int64_t R,
                                  const int64_t* rows) {
  const int64_t W = (N + 31) / 32;
  parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    const F16 neg_inf = simd::set1(-INFINITY);
    for (int64_t r = b; r < e; ++r) {
      float* row = x + rows[r] * N;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + r * W);
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t forbidden = ~bits[w];
        if (forbidden == 0) continue;
        const int64_t base = w * 32;
        if (base + 32 <= N) {
          for (int h = 0; h < 2; ++h) {
            float* p = row + base + 16 * h;
            simd::store(p, simd::select(simd::mask_bits(forbidden >> (16 * h)), neg_inf,
                                        simd::load(p)));
          }
          continue;
        }
        for (int64_t i = 0; i < 32 && base + i < N; ++i) {
          if (forbidden >> i & 1u) row[base + i] = -INFINITY;
        }
      }
    }
  });
}

// out[m] = the index of row m's largest value (the first of equal ones, as torch.argmax),
// or -1 when the row holds a NaN (the caller asks torch then). Rows in parallel.
void llmserve_argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out) {
  parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* row = x + m * N;
      float best = -INFINITY;
      int64_t arg = 0;
      bool nan = false;
      int64_t n = 0;
      if (N >= 16) {  // per lane: the largest value and its first index (N < 2^31)
        F16 vmax = simd::load(row);
        I16 vidx = simd::iota(), idx = vidx;
        const I16 step = simd::set1_i(16);
        simd::M16 unordered = simd::is_nan(vmax);
        for (n = 16; n + 16 <= N; n += 16) {
          idx = idx + step;
          const F16 v = simd::load(row + n);
          unordered = unordered | simd::is_nan(v);
          const simd::M16 greater = simd::greater(v, vmax);
          vmax = simd::select(greater, v, vmax);
          vidx = simd::select(greater, idx, vidx);
        }
        nan = simd::any(unordered);
        alignas(64) float lane_max[16];
        alignas(64) int32_t lane_idx[16];
        simd::store(lane_max, vmax);
        simd::store_i(lane_idx, vidx);
        arg = lane_idx[0];
        best = lane_max[0];
        for (int l = 1; l < 16; ++l)
          if (lane_max[l] > best || (lane_max[l] == best && lane_idx[l] < arg)) {
            best = lane_max[l];
            arg = lane_idx[l];
          }
      }
      for (; n < N; ++n) {
        const float v = row[n];
        if (std::isnan(v)) {
          nan = true;
        } else if (v > best) {
          best = v;
          arg = n;
        }
      }
      out[m] = nan ? -1 : arg;
    }
  });
}

}  // extern "C"
