// k3/core/gate_cumsum.hpp — the chunk-local cumsum of log decays, split at hard resets.
#pragma once
#include "k3/core/config.hpp"
#include "k3/core/math.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::detail {

// Accuracy with hard resets (KDA's and DPLR's chunked forms). Every factor is e^{G_i - G_j}
// (i >= j) from the rounded chunk-local cumsum G, so its exponent is off by about |G| u (u the
// unit roundoff), however small G_i - G_j is. A reset inside a chunk makes |G| >= 112
// (full_decay_log) for the rest of the chunk, and in float that alone cost 1e-5 relative RMS
// at T = 8192 with 10% reset tokens, while the pairs that matter (no reset between i and j)
// have small exponents. So a chunk holding a log decay below split_log_decay() keeps two
// cumsums per channel: H of the large log decays (clamped) and G of the others. An exponent is
// (G_i - G_j) + (H_i - H_j): for a pair with no large decay between them H_i and H_j are the
// same float, their difference is exactly 0 and the exponent is as accurate as in a chunk
// without resets; across a large decay the factor is below e^{-16} and the error of its
// exponent is too small to matter (e^{-16} |H| u). Factors from the chunk start, e^{G_i + H_i},
// carry an absolute error of the same size.
// Rows r < c of G and H (row stride ld) from the gate rows g (row stride g_row_stride, K each).
template <class Acc, class In>
void split_gate_cumsum(Acc* G, Acc* H, index_t ld, In const* g, index_t g_row_stride, index_t c, index_t K) noexcept {
  Acc const t = split_log_decay<Acc>();
  for (index_t r = 0; r < c; ++r) {
    Acc* Gr = G + r * ld;
    Acc* Hr = H + r * ld;
    In const* gr = g + r * g_row_stride;
    for (index_t d = 0; d < K; ++d) {
      Acc const x = clamp_log_decay(load_as<Acc>(gr[d]));
      bool const large = x < t;
      Acc const hp = r > 0 ? Hr[d - ld] : Acc(0), gp = r > 0 ? Gr[d - ld] : Acc(0);
      Hr[d] = large ? hp + x : hp;
      Gr[d] = large ? gp : gp + x;
    }
  }
}

}  // namespace k3::detail
