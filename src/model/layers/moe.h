// Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE's routed experts), in phases, over this rank's
// share of the tokens (N of them; the Nt tokens of the micro-batch are shared by the dispatcher's
// token group, Nt = N·ranks):
//   route    logits_NE = x·gateᵀ; scores p = softmax(logits) or sigmoid(logits); the top K by p + bias
//            (the bias of aux-loss-free balancing, for selection only; ties: the lower expert index);
//            weights w_k = p[n, e_k], divided by Σ_k p[n, e_k] + 1e-20 when renormalised (mixtral, sigmoid,
//            qwen2_moe's norm_topk_prob)
//   drop     with a capacity cap = ceil(factor·N·K/E), each expert keeps at most cap of its assignments:
//            the highest p (ties: the earlier token) or the earliest tokens; a dropped assignment adds
//            nothing (the token keeps its residual). With padding every expert gets exactly cap rows.
//   permute  the kept (token, slot) assignments sorted by expert, stably (token order within one),
//            each expert's padding rows (zeros) after its own
//   dispatch to the ranks holding those experts: TokenDispatcher::to_experts → expert-side rows
//            grouped by local expert
//   experts  one GEMM pair per local expert over its rows: gu = xe·[w1;w3]ᵀ, act = silu(g)·u, ye = act·w2ᵀ
//   return   TokenDispatcher::from_experts → y, this rank's rows in permuted order
//   combine  out[n] = Σ_{kept k} w_k·y[row(n,k)]
// Backward runs the phases in reverse; the dispatcher's two calls swap roles on the gradients.
//
// Router losses (DESIGN.md, "MoE routing"), all of the form coef·E/Nt · Σ_n Σ_e φ[n,e]·pa[n,e], where
// pa = p (softmax) or p/(Σ_e p + 1e-20) (sigmoid; moe.cpp's floor) carries the gradient and φ, the
// assignment fractions, none:
//   micro   φ = f_e = count_e/(Nt·K), counted over the micro-batch (summed over the token group)
//   seq     φ = f_{b,e} = count_{b,e}/(T·K) of the token's own sequence b (T = Nt/B its length)
//   global  φ = f̄_e: the counts of the step's micro-batches so far, also summed over the data-parallel
//           replicas, over (micro-batches · replicas · Nt · K)
//   z       z_coef·(1/Nt)·Σ_n (logsumexp_e logits[n,e])²
// count_e counts the router's choices before dropping. Each rank's aux and z are its share's terms:
// they sum over the token group to the micro-batch's.
// Under document batching (MoeSequences) rows hold whole sequences of any length and then padding:
// padding routes to no expert and counts in no loss or count; `seq` counts over each token's own
// sequence (T its length, wherever its tokens are), and Nt becomes the caller's `tokens` (the step's
// real tokens over micro-batches·replicas), so the losses do not depend on how sequences were packed.
// Legend: N tokens here in B rows of N/B (a row's tokens contiguous), C channels, F expert inner size
// on this rank (the FFN over ETP), E experts, K experts per token, El = E/EP local experts, R = N·K.
// Expert weights: `experts` points at local expert 0; each local expert's block, 3·F·C floats, is
// [w1 (F×C) | w3 (F×C) | w2 (C×F)] (Hugging Face Linear layouts), as the parameter table lays it out.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/checked.h"

#include "model/config.h"
#include "kernels/cpu/matmul.h"
#include "parallel/token_dispatcher.h"

namespace origami {

struct MoeSizes {
  int64_t N, C, F, E, K;
  int64_t B = 1;        // rows (sequences) among the N tokens
  int64_t cap = 0;      // capacity per expert (0: dropless)
  bool pad = false;     // every expert padded to cap
  bool low = false;     // bf16 runs: the cache keeps the experts' inputs and activations in bf16 (MoeCache)
  bool sequences = false;  // document batching (MoeSequences): the cache keeps each token's sequence, and φ
                           // for up to N sequences (one-token ones at worst)
  // Permuted rows this rank sends: the kept assignments (at most N·K), or E·cap when padded.
  int64_t sent_rows() const { return pad ? E * cap : N * K; }
};

// AuxLoss::global: a layer's counts of the step's micro-batches so far, summed over the stage's ranks.
struct GlobalCounts {
  std::vector<double> sum;  // [E]
  int64_t micro = 0;
};

// What a forward reads: this rank's tokens and the layer's weights.
template <typename T>
struct MoeInputs {
  const T* x_NC;     // [N, C]
  const T* gate_EC;  // the router [E, C]
  Weights<T> experts;  // local expert 0's block (the legend above), in the run's precision
  // Called once the plan says how many rows each local expert computes, before any expert weight is
  // read: FSSDP gathers there the experts with rows, and returns where they are (used instead of
  // `experts`). Null: the weights are in place.
  std::function<Weights<T>(const DispatchPlan&)> before_experts = nullptr;
};

// Document batching: the sequences among the micro-batch's tokens.
struct MoeSequences {
  const int32_t* id_N = nullptr;  // [N] each token's sequence in [0, count), or −1: padding
  int64_t count = 0;              // sequences over the ranks of `group` (the same count on each)
  Comm* group = nullptr;          // the ranks the sequences' tokens are spread over (each counts its own)
  double tokens = 0;              // the router losses' denominator, in place of Nt
};

// What a call's router uses beyond the weights.
struct MoeBalance {
  const float* bias = nullptr;                 // [E] added to the scores for selection; null: none
  GlobalCounts* global = nullptr;              // AuxLoss::global: add this micro-batch's counts to these
  const std::vector<double>* reuse = nullptr;  // AuxLoss::global, recomputation: the first forward's φ
  const MoeSequences* docs = nullptr;          // document batching; null: B rows of one sequence each
};

// A top-K decision this close (the K-th selection score over the best left out) is a near tie: the
// float rounding of another layout (~1e-7 relative), grown over training steps, can flip it, and the
// curves then part for a reason that is not a bug. The metrics count them (expert_near_ties), so a
// layout test can tell such a flip from a wrong routing.
constexpr double kNearTie = 1e-5;

// What forward keeps for backward. Expert-side buffers hold up to `rows` rows (the dispatcher's
// worst case, TokenDispatcher::max_rows): dropless routing may send any share of the tokens to a rank.
template <typename T>
struct MoeCache {
  std::vector<T> logits_NE, lse_N;
  std::vector<int32_t> expert_NK;     // chosen experts per token, best first
  std::vector<T> score_NK;            // their scores p[n, e_k]
  std::vector<T> weight_NK;           // routing weights
  std::vector<int64_t> row_NK;        // permuted row of assignment (n, k); -1: dropped
  std::vector<int64_t> expert_begin;  // [E+1] first permuted row of each expert
  std::vector<int64_t> count_E;       // permuted rows of each expert (kept assignments, plus padding)
  std::vector<int64_t> routed_E;      // this rank's choices per expert, before dropping
  std::vector<double> frac;           // φ of the aux loss: [E] (micro, global), [B·E] (seq) or, under
                                      // MoeSequences, [N·E]: a row per sequence with tokens here
  std::vector<int32_t> seq_N;         // MoeSequences: each token's sequence (−1: padding); empty otherwise
  DispatchPlan plan;
  std::vector<T> xe_RC, gu_R2F, act_RF;  // expert side: inputs, gate|up, activations [rows, .]
  // Under MoeSizes::low the inputs and activations are kept as their GEMMs read them (xe_RC and
  // act_RF then empty): only those GEMMs read them (forward and the weight gradients), and they
  // round them anyway, so no rounding point is added.
  std::vector<bf16> xe_low, act_low;
  std::vector<T> y_RC;                   // this rank's rows' expert outputs [sent_rows, C], permuted order
  int64_t tokens_total = 0;              // Nt
  double loss_tokens = 0;                // the router losses' denominator: Nt, or MoeSequences::tokens
  int64_t dropped = 0;                   // assignments dropped by the capacity
  int64_t near_ties = 0;                 // tokens whose K-th choice led the best expert left out by less
                                         // than kNearTie
  double aux = 0, z = 0;                 // coefficient-weighted router losses: this share's terms
  // Sizes every buffer (a caller may call it ahead so the memory is allocated, and counted, before use).
  void resize(const MoeSizes& s, int64_t rows) {
    using std::size_t;
    const size_t N = size_t(s.N), R = size_t(s.N * s.K), C = size_t(s.C), F = size_t(s.F), E = size_t(s.E);
    logits_NE.resize(N * E), lse_N.resize(N), expert_NK.resize(R), score_NK.resize(R), weight_NK.resize(R);
    row_NK.resize(R), expert_begin.resize(E + 1), count_E.resize(E), routed_E.resize(E);
    frac.resize(size_t(s.sequences ? s.N : s.B) * E);  // under MoeSequences: a row per sequence, at most N
    seq_N.resize(s.sequences ? N : 0);
    const size_t X = size_t(rows), kept = s.low ? 0 : X, low = s.low ? X : 0;
    xe_RC.resize(kept * C), gu_R2F.resize(X * 2 * F), act_RF.resize(kept * F);
    xe_low.resize(low * C), act_low.resize(low * F);
    y_RC.resize(size_t(s.sent_rows()) * C);
  }
  // Bytes resize(s, rows) allocates, without allocating.
  static int64_t bytes(const MoeSizes& s, int64_t rows) {  // checked (core/checked.h)
    const Size N = s.N, R = N * s.K, t = int64_t(sizeof(T)), sent = s.pad ? Size(s.E) * s.cap : R;
    const Size kept = s.low ? 2 : t;  // bytes of a kept input or activation element
    const Size phi_rows = s.sequences ? N : Size(s.B), seq = s.sequences ? N : 0;
    return (t * (N * s.E + N + 2 * R + sent * s.C + Size(rows) * 2 * s.F) + kept * Size(rows) * (s.C + s.F) +
            4 * (R + seq) + 8 * (R + 3 * Size(s.E) + 1 + phi_rows * s.E)).get();
  }
  int64_t bytes() const {  // what resize() allocated
    auto b = [](const auto& v) { return int64_t(v.size() * sizeof(v[0])); };
    return b(logits_NE) + b(lse_N) + b(expert_NK) + b(score_NK) + b(weight_NK) + b(row_NK) + b(expert_begin) +
           b(count_E) + b(routed_E) + b(frac) + b(seq_N) + b(xe_RC) + b(gu_R2F) + b(act_RF) + b(y_RC) + b(xe_low) +
           b(act_low);
  }
};

// Work buffers of forward and backward, not kept between calls (one for all layers).
template <typename T>
struct MoeScratch {
  std::vector<T> xs_RC;    // this rank's permuted rows [sent_rows, C]: inputs, then ∂/∂y and ∂/∂(inputs)
  std::vector<T> e_RC;     // expert side [rows, C]: outputs, then ∂/∂(outputs) and ∂/∂(inputs)
  std::vector<T> dgu_R2F;  // ∂/∂[gate | up] [rows, 2F]
  std::vector<T> dact_RF;  // ∂/∂(silu(gate)·up) [rows, F]
  std::vector<T> d_weight; // ∂/∂(routing weights) [R]
  std::vector<T> xe_RC;    // MoeSizes::low: the expert inputs [rows, C] as received, before the cache rounds them
  DispatchBuffers<T> dispatch;
  void resize(const MoeSizes& s, int64_t rows, int etp) {
    using std::size_t;
    const size_t R = size_t(s.N * s.K), C = size_t(s.C), F = size_t(s.F), X = size_t(rows);
    xs_RC.resize(size_t(s.sent_rows()) * C), e_RC.resize(X * C), dgu_R2F.resize(X * 2 * F), dact_RF.resize(X * F);
    d_weight.resize(R);
    xe_RC.resize(s.low ? X * C : 0);
    dispatch.gathered.resize(X * C);
    dispatch.mine.resize(etp > 1 ? X * C : 0);
  }
  static int64_t bytes(const MoeSizes& s, int64_t rows, int etp) {  // checked (core/checked.h)
    const Size R = Size(s.N) * s.K, sent = s.pad ? Size(s.E) * s.cap : R, X = rows;
    return (int64_t(sizeof(T)) *
            (sent * s.C + R + X * (2 * Size(s.C) + 3 * Size(s.F)) + (etp > 1 ? X * s.C : 0) + (s.low ? X * s.C : 0)))
        .get();
  }
};

// Forward over this rank's N tokens; `rows` for cache.resize is the dispatcher's max_rows.
template <typename T>
void moe_forward(T* out_NC, MoeCache<T>& cache, const MoeInputs<T>& in, const MoeSizes& s, const MoeRouting& r,
                 const MoeBalance& balance, TokenDispatcher& dispatcher, MoeScratch<T>& scratch);

// Backward in two phases (the model runs them back to back; the router's phase needs the complete
// routing-weight gradients, which the experts' phase leaves in scratch.d_weight).
// Phase 1, experts and combine: dx_NC = gradient through the experts (overwritten), dexperts accumulates (+=).
template <typename T>
void moe_backward_experts(T* dx_NC, T* dexperts, const T* dout_NC, const MoeCache<T>& cache, MoeScratch<T>& scratch,
                          Id<Weights<T>> experts, const MoeSizes& s, TokenDispatcher& dispatcher);
// Phase 2, router (from scratch.d_weight, plus the aux and z losses): dgate_EC accumulates; dx_NC
// accumulates the router's part of the input gradient. loss_scale multiplies the router losses' gradient.
template <typename T>
void moe_backward_router(T* dx_NC, T* dgate_EC, const MoeScratch<T>& scratch, const MoeCache<T>& cache, const T* x_NC,
                         const T* gate_EC, const MoeSizes& s, const MoeRouting& r, T loss_scale);

// The layer on one rank (every expert local, work buffers of its own): forward, and both backward
// phases with dx_NC overwritten, dgate_EC and dexperts accumulated (+=). dout_NC already carries
// the scale of the main loss.
template <typename T>
void moe_forward(T* out_NC, MoeCache<T>& cache, const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s,
                 const MoeRouting& r, const MoeBalance& balance = {});
template <typename T>
void moe_backward(T* dx_NC, T* dgate_EC, T* dexperts, const T* dout_NC, const MoeCache<T>& cache,
                  const T* x_NC, const T* gate_EC, const T* experts, const MoeSizes& s, const MoeRouting& r,
                  T loss_scale);

}  // namespace origami
