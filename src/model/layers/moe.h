// Sparse mixture-of-experts MLP (Mixtral), in phases:
//   route   logits_NE = x·gateᵀ, probs = softmax over all E, top-K by prob, weights renormalised
//   permute the N·K (token, slot) assignments grouped by expert (rows R = N·K in expert order)
//   experts grouped GEMM per expert: gu = xs·[w1;w3]ᵀ, act = silu(g)·u, y = act·w2ᵀ
//   combine out[n] = Σ_k weight[n,k]·y[row(n,k)]
// Router losses for the micro-batch (Switch / Megatron convention; see DESIGN.md):
//   aux = aux_coef·E·Σ_e f_e·P_e with f_e = count_e/(N·K) (no gradient), P_e = mean_n probs[n,e]
//   z   = z_coef·mean_n (logsumexp_e logits[n,e])²
// Legend: N tokens, C channels, F expert inner size, E experts, K experts per token.
// Expert weights: `experts` points at expert 0; expert e's block, 3·F·C floats, is
// [w1 (F×C) | w3 (F×C) | w2 (C×F)] (Hugging Face Linear layouts), as the parameter table lays it out.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace origami {

struct MoeSizes {
  int64_t N, C, F, E, K;
};

// What forward keeps for backward.
template <typename T>
struct MoeCache {
  std::vector<T> probs_NE, lse_N;
  std::vector<int32_t> expert_NK;     // chosen experts per token, best first
  std::vector<T> weight_NK;           // renormalised routing weights
  std::vector<int64_t> row_NK;        // permuted row of assignment (n, k)
  std::vector<int64_t> expert_begin;  // [E+1] first permuted row of each expert
  std::vector<T> xs_RC, gu_R2F, act_RF, y_RC;
  std::vector<int64_t> count_E;  // tokens routed to each expert (for metrics and f_e)
  double aux = 0, z = 0;         // coefficient-weighted router losses of this call
  // Sizes every buffer for s (R = N·K routed rows, fixed by top-K): moe_forward calls it, and a
  // caller may call it ahead so the cache's memory is allocated (and counted) before first use.
  void resize(const MoeSizes& s) {
    using std::size_t;
    const size_t N = size_t(s.N), R = size_t(s.N * s.K), C = size_t(s.C), F = size_t(s.F), E = size_t(s.E);
    probs_NE.resize(N * E), lse_N.resize(N), expert_NK.resize(R), weight_NK.resize(R), row_NK.resize(R);
    expert_begin.resize(E + 1), count_E.resize(E);
    xs_RC.resize(R * C), gu_R2F.resize(R * 2 * F), act_RF.resize(R * F), y_RC.resize(R * C);
  }
  int64_t bytes() const {  // what resize() allocated
    auto b = [](const auto& v) { return int64_t(v.size() * sizeof(v[0])); };
    return b(probs_NE) + b(lse_N) + b(expert_NK) + b(weight_NK) + b(row_NK) + b(expert_begin) + b(count_E) +
           b(xs_RC) + b(gu_R2F) + b(act_RF) + b(y_RC);
  }
};

// Backward work buffers, kept by the caller between calls (one for all layers: sized on first use,
// so backward allocates, and page-faults in, nothing per call).
template <typename T>
struct MoeScratch {
  std::vector<T> dy_RC;    // ∂/∂(expert outputs); per expert, reused for ∂/∂(permuted inputs)
  std::vector<T> dgu_R2F;  // ∂/∂[gate | up]
  std::vector<T> dact_RF;  // ∂/∂(silu(gate)·up)
};

template <typename T>
void moe_forward(T* out_NC, MoeCache<T>& cache, const T* x_NC, const T* gate_EC, const T* experts,
                 const MoeSizes& s, double aux_coef, double z_coef);

// Backward in two phases, so tensor parallelism can reduce in between: with experts split by TP
// inside each expert, the expert outputs y — and with them dweight and the experts' dx — are
// partial sums over TP ranks, while the router is replicated.
// Phase 1, experts and combine: dx_NC = gradient through the experts (overwritten), dweight_NK =
// gradient of the routing weights (overwritten), dexperts accumulates (+=).
template <typename T>
void moe_backward_experts(T* dx_NC, T* dweight_NK, T* dexperts, const T* dout_NC, const MoeCache<T>& cache,
                          MoeScratch<T>& scratch, const T* experts, const MoeSizes& s);
// Phase 2, router (from the complete dweight_NK, plus the aux and z losses): dgate_EC accumulates;
// dx_NC (may be null) accumulates the router's part of the input gradient.
template <typename T>
void moe_backward_router(T* dx_NC, T* dgate_EC, const T* dweight_NK, const MoeCache<T>& cache, const T* x_NC,
                         const T* gate_EC, const MoeSizes& s, double aux_coef, double z_coef, T loss_scale);
// Both phases on one rank (with scratch of its own). dx_NC is overwritten; dgate_EC and dexperts accumulate (+=). loss_scale
// multiplies the router losses' gradient (dout_NC already carries the scale of the main loss).
template <typename T>
void moe_backward(T* dx_NC, T* dgate_EC, T* dexperts, const T* dout_NC, const MoeCache<T>& cache,
                  const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s, double aux_coef,
                  double z_coef, T loss_scale);

}  // namespace origami
