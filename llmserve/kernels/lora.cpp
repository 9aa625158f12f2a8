// LoRA updates of one linear for a step's rows (lora/manager.py): the rows of each adapter
// gathered, shrunk to its ranks (x . A^T) and, per target of the linear (q, k and v of a
// fused qkv), expanded by that target's B onto its own output rows and added to the base
// output, on the float32 GEMM whose rows do not depend on the batch. One native call a
// linear, where the same in torch ops took a dozen per adapter; the torch path's
// arithmetic (lora/adapter.py's LinearUpdate), so the same bits.

#include <vector>

#include "kernels.h"

extern "C" {

// x (T, K) the linear's input, y (T, N) its base output, updated in place. slot_of_row (T,):
// each row's adapter slot, -1 for none. slots[s]: slot s's update of this linear (rank 0:
// none). scratch: T * (K + 2 * max rank + N) floats.
void llmserve_lora_apply(const float* x, int64_t T, int64_t K, float* y, int64_t N,
                         const int32_t* slot_of_row, int64_t num_slots, const LoraSlot* slots,
                         float* scratch) {
  std::vector<int64_t> rows;
  rows.reserve(T);
  for (int64_t s = 0; s < num_slots; ++s) {
    const LoraSlot& slot = slots[s];
    const int64_t r = slot.rank;
    if (r == 0) continue;
    rows.clear();
    for (int64_t t = 0; t < T; ++t)
      if (slot_of_row[t] == s) rows.push_back(t);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    float* gathered = scratch;          // (n, K)
    float* shrunk = gathered + n * K;   // (n, r)
    float* part = shrunk + n * r;       // (n, a piece's ranks)
    float* delta = part + n * r;        // (n, a piece's rows)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K; ++k) gathered[i * K + k] = x[rows[i] * K + k];
    llmserve_f32_linear(gathered, n, K, slot.a, nullptr, r, shrunk);
    for (int64_t p = 0; p < slot.num_pieces; ++p) {
      const LoraPiece& piece = slot.pieces[p];
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < piece.rank; ++j)
          part[i * piece.rank + j] = shrunk[i * r + piece.rank_start + j];
      llmserve_f32_linear(part, n, piece.rank, piece.b, nullptr, piece.rows, delta);
      for (int64_t i = 0; i < n; ++i) {
        float* out = y + rows[i] * N + piece.row_start;
        for (int64_t c = 0; c < piece.rows; ++c) out[c] = out[c] + delta[i * piece.rows + c];
      }
    }
  }
}

}  // extern "C"
