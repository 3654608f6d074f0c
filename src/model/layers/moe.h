// Sparse mixture-of-experts MLP (Mixtral), in phases, over this rank's share of the tokens (N of
// them; the Nt tokens of the micro-batch are shared by the dispatcher's token group, Nt = N·ranks):
//   route    logits_NE = x·gateᵀ, probs = softmax over all E, top-K by prob, weights renormalised
//   permute  the R = N·K (token, slot) assignments sorted by expert, stably (token order within one)
//   dispatch to the ranks holding those experts: TokenDispatcher::to_experts → Re expert-side rows
//            grouped by local expert
//   experts  one GEMM pair per local expert over its rows: gu = xe·[w1;w3]ᵀ, act = silu(g)·u, ye = act·w2ᵀ
//   return   TokenDispatcher::from_experts → y, this rank's R rows in permuted order
//   combine  out[n] = Σ_k weight[n,k]·y[row(n,k)]
// Backward runs the phases in reverse; the dispatcher's two calls swap roles on the gradients.
// Router losses of the micro-batch (Switch / Megatron convention; see DESIGN.md), with f_e counted
// over the whole micro-batch (the counts are summed over the token group first):
//   aux = aux_coef·E·Σ_e f_e·P_e with f_e = count_e/(Nt·K) (no gradient), P_e = (1/Nt)·Σ_n probs[n,e]
//   z   = z_coef·(1/Nt)·Σ_n (logsumexp_e logits[n,e])²
// Each rank's aux and z are its share's terms: they sum over the token group to the micro-batch's.
// Legend: N tokens here, C channels, F expert inner size on this rank (the FFN over ETP), E experts,
// K experts per token, El = E/EP local experts.
// Expert weights: `experts` points at local expert 0; each local expert's block, 3·F·C floats, is
// [w1 (F×C) | w3 (F×C) | w2 (C×F)] (Hugging Face Linear layouts), as the parameter table lays it out.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "parallel/token_dispatcher.h"

namespace origami {

struct MoeSizes {
  int64_t N, C, F, E, K;
};

// What forward keeps for backward. Expert-side buffers hold up to `rows` rows (the dispatcher's
// worst case, TokenDispatcher::max_rows): dropless routing may send any share of the tokens to a rank.
template <typename T>
struct MoeCache {
  std::vector<T> probs_NE, lse_N;
  std::vector<int32_t> expert_NK;     // chosen experts per token, best first
  std::vector<T> weight_NK;           // renormalised routing weights
  std::vector<int64_t> row_NK;        // permuted row of assignment (n, k)
  std::vector<int64_t> expert_begin;  // [E+1] first permuted row of each expert
  std::vector<int64_t> count_E;       // rows this rank routed to each expert
  std::vector<int64_t> total_E;       // the same over the token group (f_e)
  DispatchPlan plan;
  std::vector<T> xe_RC, gu_R2F, act_RF;  // expert side: inputs, gate|up, activations [rows, .]
  std::vector<T> y_RC;                   // this rank's rows' expert outputs [R, C], permuted order
  int64_t tokens_total = 0;              // Nt
  double aux = 0, z = 0;                 // coefficient-weighted router losses: this share's terms
  // Sizes every buffer (a caller may call it ahead so the memory is allocated, and counted, before use).
  void resize(const MoeSizes& s, int64_t rows) {
    using std::size_t;
    const size_t N = size_t(s.N), R = size_t(s.N * s.K), C = size_t(s.C), F = size_t(s.F), E = size_t(s.E);
    probs_NE.resize(N * E), lse_N.resize(N), expert_NK.resize(R), weight_NK.resize(R), row_NK.resize(R);
    expert_begin.resize(E + 1), count_E.resize(E), total_E.resize(E);
    xe_RC.resize(size_t(rows) * C), gu_R2F.resize(size_t(rows) * 2 * F), act_RF.resize(size_t(rows) * F);
    y_RC.resize(R * C);
  }
  // Bytes resize(s, rows) allocates, without allocating.
  static int64_t bytes(const MoeSizes& s, int64_t rows) {
    const int64_t N = s.N, R = N * s.K, t = int64_t(sizeof(T));
    return t * (N * s.E + N + R + R * s.C + rows * (s.C + 3 * s.F)) + 4 * R + 8 * (R + 3 * s.E + 1);
  }
  int64_t bytes() const {  // what resize() allocated
    auto b = [](const auto& v) { return int64_t(v.size() * sizeof(v[0])); };
    return b(probs_NE) + b(lse_N) + b(expert_NK) + b(weight_NK) + b(row_NK) + b(expert_begin) + b(count_E) +
           b(total_E) + b(xe_RC) + b(gu_R2F) + b(act_RF) + b(y_RC);
  }
};

// Work buffers of forward and backward, not kept between calls (one for all layers).
template <typename T>
struct MoeScratch {
  std::vector<T> xs_RC;    // this rank's permuted rows [R, C]: inputs, then ∂/∂y and ∂/∂(inputs)
  std::vector<T> e_RC;     // expert side [rows, C]: outputs, then ∂/∂(outputs) and ∂/∂(inputs)
  std::vector<T> dgu_R2F;  // ∂/∂[gate | up] [rows, 2F]
  std::vector<T> dact_RF;  // ∂/∂(silu(gate)·up) [rows, F]
  std::vector<T> d_weight; // ∂/∂(routing weights) [R]
  DispatchBuffers<T> dispatch;
  void resize(const MoeSizes& s, int64_t rows, int etp) {
    using std::size_t;
    const size_t R = size_t(s.N * s.K), C = size_t(s.C), F = size_t(s.F), X = size_t(rows);
    xs_RC.resize(R * C), e_RC.resize(X * C), dgu_R2F.resize(X * 2 * F), dact_RF.resize(X * F), d_weight.resize(R);
    dispatch.gathered.resize(X * C);
    dispatch.mine.resize(etp > 1 ? X * C : 0);
  }
  static int64_t bytes(const MoeSizes& s, int64_t rows, int etp) {
    const int64_t R = s.N * s.K;
    return int64_t(sizeof(T)) * (R * s.C + R + rows * (2 * s.C + 3 * s.F) + (etp > 1 ? rows * s.C : 0));
  }
};

// Forward over this rank's N tokens; `rows` for cache.resize is the dispatcher's max_rows.
template <typename T>
void moe_forward(T* out_NC, MoeCache<T>& cache, const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s,
                 double aux_coef, double z_coef, TokenDispatcher& dispatcher, MoeScratch<T>& scratch);

// Backward in two phases (the model runs them back to back; the router's phase needs the complete
// routing-weight gradients, which the experts' phase leaves in scratch.d_weight).
// Phase 1, experts and combine: dx_NC = gradient through the experts (overwritten), dexperts accumulates (+=).
template <typename T>
void moe_backward_experts(T* dx_NC, T* dexperts, const T* dout_NC, const MoeCache<T>& cache, MoeScratch<T>& scratch,
                          const T* experts, const MoeSizes& s, TokenDispatcher& dispatcher);
// Phase 2, router (from scratch.d_weight, plus the aux and z losses): dgate_EC accumulates; dx_NC
// accumulates the router's part of the input gradient. loss_scale multiplies the router losses' gradient.
template <typename T>
void moe_backward_router(T* dx_NC, T* dgate_EC, const MoeScratch<T>& scratch, const MoeCache<T>& cache, const T* x_NC,
                         const T* gate_EC, const MoeSizes& s, double aux_coef, double z_coef, T loss_scale);

// The layer on one rank (every expert local, work buffers of its own): forward, and both backward
// phases with dx_NC overwritten, dgate_EC and dexperts accumulated (+=). dout_NC already carries
// the scale of the main loss.
template <typename T>
void moe_forward(T* out_NC, MoeCache<T>& cache, const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s,
                 double aux_coef, double z_coef);
template <typename T>
void moe_backward(T* dx_NC, T* dgate_EC, T* dexperts, const T* dout_NC, const MoeCache<T>& cache,
                  const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s, double aux_coef,
                  double z_coef, T loss_scale);

}  // namespace origami
