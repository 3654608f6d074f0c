#include "model/layers/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "core/error.h"
#include "core/timer.h"
#include "model/layers/activation.h"

// The layer's phases (moe.h), each forward next to its backward: the router's (route and the
// router losses, whose backward is moe_backward_router), then the capacity rule, permute, the local
// experts and combine; last the entry points moe_forward and moe_backward_experts, which run them in order.

namespace origami {

namespace {

// Scores of one token from its logits: softmax (given its log-sum-exp) or sigmoid.
template <typename T>
void scores(T* p, const T* logits, T lse, int64_t E, RouterScore score) {
  if (score == RouterScore::softmax)
    for (int64_t e = 0; e < E; ++e) p[e] = std::exp(logits[e] - lse);
  else
    for (int64_t e = 0; e < E; ++e) p[e] = T(1) / (T(1) + std::exp(-logits[e]));
}

// The score function's backward, in place: dp [E] ∂/∂p → ∂/∂logits, from the token's scores p.
template <typename T>
void scores_backward(T* dp, const T* p, int64_t E, RouterScore score) {
  if (score == RouterScore::softmax) {
    T pdp = 0;
    for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[e];
    for (int64_t e = 0; e < E; ++e) dp[e] = p[e] * (dp[e] - pdp);
  } else {
    for (int64_t e = 0; e < E; ++e) dp[e] *= p[e] * (T(1) - p[e]);
  }
}

// Added to a sum of scores before dividing by it — the chosen experts' in renormalising their weights,
// the sigmoid scores' in the aux loss — as DeepSeek-V3 adds 1e-20: a sigmoid of a logit below about
// −88 (fp32) is exactly 0, and a sum of such scores made the weights or the aux loss 0/0. (Softmax
// sums are at least 1/E, where it changes nothing; it moves weights whose scores are below ~1e-15.)
constexpr double kScoreSumFloor = 1e-20;

// Σ_e p (the sigmoid scores' normaliser of pa, with the floor; 1 for softmax).
template <typename T>
T score_sum(const T* p, int64_t E, RouterScore score) {
  if (score == RouterScore::softmax) return T(1);
  T s = T(kScoreSumFloor);
  for (int64_t e = 0; e < E; ++e) s += p[e];
  return s;
}

// Document batching: whether token n is padding (it routes nowhere and counts in no loss).
template <typename T>
bool padding(const MoeCache<T>& c, int64_t n) {
  return !c.seq_N.empty() && c.seq_N[size_t(n)] < 0;
}

// φ [E] of token n's aux-loss term: its sequence's (seq: its row, or under MoeSequences its own
// sequence) or the micro-batch's / step's.
template <typename T>
const double* phi_of(const MoeCache<T>& c, const MoeSizes& s, const MoeRouting& r, int64_t n) {
  if (r.aux != AuxLoss::seq) return c.frac.data();
  return c.frac.data() + (c.seq_N.empty() ? n / (s.N / s.B) : int64_t(c.seq_N[size_t(n)])) * s.E;
}

// Route: logits = x·gateᵀ, each token's log-sum-exp, its top K experts by score + bias and their
// routing weights. Its backward, moe_backward_router, follows the router losses below.
template <typename T>
void route_forward(MoeCache<T>& c, const T* x, const T* gate, const MoeSizes& s, const MoeRouting& r,
                   const float* bias) {
  const int64_t N = s.N, C = s.C, E = s.E, K = s.K;
  gemm<T>(false, true, N, E, C, T(1), x, C, gate, C, T(0), c.logits_NE.data(), E);
  int64_t near_ties = 0;
#pragma omp parallel for schedule(static) reduction(+ : near_ties)
  for (int64_t n = 0; n < N; ++n) {
    const T* l = c.logits_NE.data() + n * E;
    T m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
    const T lse = c.lse_N[size_t(n)] = m + std::log(sum);
    std::vector<T> p(static_cast<size_t>(E));
    scores(p.data(), l, lse, E, r.score);
    // Top-K by score + bias (ties: lower expert index first).
    int32_t* idx = c.expert_NK.data() + n * K;
    T* sc = c.score_NK.data() + n * K;
    T* w = c.weight_NK.data() + n * K;
    auto key = [&](int64_t e) { return bias ? p[size_t(e)] + T(bias[e]) : p[size_t(e)]; };
    T psum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int32_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (std::find(idx, idx + k, int32_t(e)) != idx + k) continue;
        if (best < 0 || key(e) > key(best)) best = int32_t(e);
      }
      idx[k] = best;
      psum += (sc[k] = w[k] = p[size_t(best)]);
    }
    T rest = -std::numeric_limits<T>::infinity();  // the best expert left out
    for (int64_t e = 0; e < E; ++e)
      if (std::find(idx, idx + K, int32_t(e)) == idx + K) rest = std::max(rest, key(e));
    near_ties += !padding(c, n) && key(idx[K - 1]) - rest < T(kNearTie);
    if (r.renormalise())
      for (int64_t k = 0; k < K; ++k) w[k] /= psum + T(kScoreSumFloor);
  }
  c.near_ties = near_ties;
}

// Document batching, `seq`: φ of each sequence with tokens here, from its counts summed over the
// ranks its tokens are spread over; seq_N then holds each token's row of frac (−1: padding).
template <typename T>
void sequence_fractions(MoeCache<T>& c, const MoeSizes& s, const MoeSequences& q) {
  const int64_t E = s.E, K = s.K;
  std::vector<int64_t> count(size_t(q.count * E), 0);
  for (int64_t n = 0; n < s.N; ++n)
    if (q.id_N[n] >= 0)
      for (int64_t k = 0; k < K; ++k) count[size_t(q.id_N[n] * E + c.expert_NK[size_t(n * K + k)])]++;
  q.group->all_reduce(count.data(), q.count * E);
  std::vector<int32_t> row(size_t(q.count), -1);  // each sequence's row of frac (at most N rows: N tokens)
  int32_t rows = 0;
  for (int64_t n = 0; n < s.N; ++n) {
    const int32_t id = q.id_N[n];
    if (id < 0) continue;
    if (row[size_t(id)] < 0) {
      row[size_t(id)] = rows++;
      const int64_t* counts = count.data() + id * E;
      const double assigned = double(std::accumulate(counts, counts + E, int64_t(0)));  // its length · K
      for (int64_t e = 0; e < E; ++e) c.frac[size_t(row[size_t(id)] * E + e)] = double(counts[e]) / assigned;
    }
    c.seq_N[size_t(n)] = row[size_t(id)];
  }
}

// The aux loss's fractions φ (counted over the token group, and for `global` over the step so far).
template <typename T>
void aux_fractions(MoeCache<T>& c, const MoeSizes& s, const MoeRouting& r, const MoeBalance& bal,
                   TokenDispatcher& d) {
  const int64_t E = s.E, K = s.K, R = s.N * K, B = s.B, Tn = s.N / B;
  const double Nt = double(c.tokens_total);
  std::fill(c.frac.begin(), c.frac.end(), 0.0);
  if (r.aux == AuxLoss::seq && bal.docs) {
    sequence_fractions(c, s, *bal.docs);
  } else if (r.aux == AuxLoss::seq) {
    std::vector<int64_t> count_BE(size_t(B * E), 0);
    for (int64_t i = 0; i < R; ++i) count_BE[size_t((i / K) / Tn * E + c.expert_NK[size_t(i)])]++;
    d.global_counts(count_BE.data(), B * E);
    const double per = double(Tn * d.token_ranks() * K);  // a sequence's assignments
    for (int64_t i = 0; i < B * E; ++i) c.frac[size_t(i)] = double(count_BE[size_t(i)]) / per;
  } else if (r.aux == AuxLoss::global && bal.reuse) {
    std::copy(bal.reuse->begin(), bal.reuse->end(), c.frac.begin());
  } else if (r.aux != AuxLoss::none) {
    std::vector<int64_t> total(c.routed_E);
    d.global_counts(total.data(), E);
    double denom = Nt * double(K);
    if (r.aux == AuxLoss::global) {
      d.replica_counts(total.data(), E);
      GlobalCounts one{std::vector<double>(size_t(E), 0.0), 0};
      GlobalCounts& g = bal.global ? *bal.global : one;
      if (g.sum.empty()) g.sum.assign(size_t(E), 0.0);
      for (int64_t e = 0; e < E; ++e) g.sum[size_t(e)] += double(total[size_t(e)]);
      ++g.micro;
      denom *= double(g.micro) * double(d.replicas());
      for (int64_t e = 0; e < E; ++e) c.frac[size_t(e)] = g.sum[size_t(e)] / denom;
    } else {
      for (int64_t e = 0; e < E; ++e) c.frac[size_t(e)] = double(total[size_t(e)]) / denom;
    }
  }
}

// Router losses: this share's terms of the micro-batch's.
template <typename T>
void router_losses(MoeCache<T>& c, const MoeSizes& s, const MoeRouting& r) {
  const int64_t N = s.N, E = s.E;
  double aux = 0, z = 0;
  if (r.aux != AuxLoss::none) {
    std::vector<T> p(static_cast<size_t>(E));
    for (int64_t n = 0; n < N; ++n) {
      if (padding(c, n)) continue;
      scores(p.data(), c.logits_NE.data() + n * E, c.lse_N[size_t(n)], E, r.score);
      const double S = double(score_sum(p.data(), E, r.score));
      const double* phi = phi_of(c, s, r, n);
      for (int64_t e = 0; e < E; ++e) aux += phi[e] * double(p[size_t(e)]) / S;
    }
  }
  for (int64_t n = 0; n < N; ++n)
    if (!padding(c, n)) z += double(c.lse_N[size_t(n)]) * c.lse_N[size_t(n)];
  c.aux = r.aux_coef * double(E) * aux / c.loss_tokens;
  c.z = r.z_coef * z / c.loss_tokens;
}

}  // namespace

// The backward of route and of the router losses.
template <typename T>
void moe_backward_router(T* dx, T* dgate, const MoeScratch<T>& scratch, const MoeCache<T>& c, const T* x,
                         const T* gate, const MoeSizes& s, const MoeRouting& r, T loss_scale) {
  const int64_t N = s.N, C = s.C, E = s.E, K = s.K;
  const T* dweight = scratch.d_weight.data();
  const double Nt = c.loss_tokens;
  // d logits from the routing weights, the aux loss and the z-loss (padding: none of them, zeros).
  std::vector<T> dlogits(size_t(N * E));
  const T aux_g = r.aux == AuxLoss::none ? T(0) : T(r.aux_coef * double(E) / Nt) * loss_scale;  // ∂aux/∂pa = aux_g·φ
  const T z_g = T(2.0 * r.z_coef / Nt) * loss_scale;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    if (padding(c, n)) continue;
    std::vector<T> p(static_cast<size_t>(E));
    const T* l = c.logits_NE.data() + n * E;
    const T lse = c.lse_N[size_t(n)];
    scores(p.data(), l, lse, E, r.score);
    T* dp = dlogits.data() + n * E;  // ∂/∂p first, turned into ∂/∂logits in place
    // The aux loss through pa = p / Σp (Σp = 1 for softmax): dp_j = (dpa_j − Σ_e dpa_e·pa_e) / Σp.
    const double* phi = r.aux == AuxLoss::none ? nullptr : phi_of(c, s, r, n);
    const T S = score_sum(p.data(), E, r.score);
    T dot = 0;
    for (int64_t e = 0; e < E; ++e) dp[e] = phi ? aux_g * T(phi[e]) : T(0), dot += dp[e] * p[size_t(e)] / S;
    if (r.score == RouterScore::sigmoid)
      for (int64_t e = 0; e < E; ++e) dp[e] = (dp[e] - dot) / S;
    // The weights: w_k = p_k / Σ_j p_j over the chosen (renormalised): dp_j += (dw_j − Σ_k dw_k·w_k) / Σ p;
    // else w_k = p_k.
    const int32_t* idx = c.expert_NK.data() + n * K;
    const T* dw = dweight + n * K;
    if (r.renormalise()) {
      T psum = 0, wdot = 0;
      for (int64_t k = 0; k < K; ++k) psum += c.score_NK[size_t(n * K + k)], wdot += dw[k] * c.weight_NK[size_t(n * K + k)];
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += (dw[k] - wdot) / (psum + T(kScoreSumFloor));
    } else {
      for (int64_t k = 0; k < K; ++k) dp[idx[k]] += dw[k];
    }
    // The score function's backward, then the z-loss term 2·lse·softmax(logits).
    scores_backward(dp, p.data(), E, r.score);
    const T zl = z_g * lse;
    if (zl != T(0))
      for (int64_t e = 0; e < E; ++e) dp[e] += zl * std::exp(l[e] - lse);
  }
  gemm<T>(true, false, E, C, N, T(1), dlogits.data(), E, x, C, T(1), dgate, C);  // dgate += dlogitsᵀ·x
  gemm<T>(false, false, N, C, E, T(1), dlogits.data(), E, gate, C, T(1), dx, C);  // dx += dlogits·gate
}

namespace {

// The router's choices per expert (padding's not counted, not kept), and the capacity rule: each
// expert keeps at most cap assignments (row_NK −1 marks a dropped one).
template <typename T>
void drop_over_capacity(MoeCache<T>& c, const MoeSizes& s, DropPolicy drop) {
  const int64_t E = s.E, K = s.K, R = s.N * K;
  std::fill(c.routed_E.begin(), c.routed_E.end(), 0);
  for (int64_t i = 0; i < R; ++i) {
    const bool pad = padding(c, i / K);
    c.row_NK[size_t(i)] = pad ? -1 : 0;
    if (!pad) c.routed_E[size_t(c.expert_NK[size_t(i)])]++;
  }
  c.dropped = 0;
  if (s.cap > 0) {
    std::vector<std::vector<int64_t>> cand(static_cast<size_t>(E));  // each expert's assignments, in token order
    for (int64_t i = 0; i < R; ++i)
      if (c.row_NK[size_t(i)] == 0) cand[size_t(c.expert_NK[size_t(i)])].push_back(i);
    for (auto& list : cand) {
      if (int64_t(list.size()) <= s.cap) continue;
      if (drop == DropPolicy::probs)  // highest score first; stable: the earlier token on ties
        std::stable_sort(list.begin(), list.end(),
                         [&](int64_t a, int64_t b) { return c.score_NK[size_t(a)] > c.score_NK[size_t(b)]; });
      for (size_t j = size_t(s.cap); j < list.size(); ++j) c.row_NK[size_t(list[j])] = -1;
      c.dropped += int64_t(list.size()) - s.cap;
    }
  }
}

// Permute: counting sort of the kept assignments by expert (stable: token order within an expert);
// padding rows after each expert's own. xs [sent_rows, C] receives the rows.
template <typename T>
void permute_forward(T* xs, MoeCache<T>& c, const T* x, const MoeSizes& s, DispatchTimes& times) {
  const int64_t C = s.C, E = s.E, K = s.K, R = s.N * K;
  const Stopwatch permute(times.permute_s);
  std::fill(c.count_E.begin(), c.count_E.end(), 0);
  for (int64_t i = 0; i < R; ++i)
    if (c.row_NK[size_t(i)] >= 0) c.count_E[size_t(c.expert_NK[size_t(i)])]++;
  std::vector<int64_t> kept(c.count_E);
  if (s.pad) std::fill(c.count_E.begin(), c.count_E.end(), s.cap);
  c.expert_begin[0] = 0;
  for (int64_t e = 0; e < E; ++e) c.expert_begin[size_t(e + 1)] = c.expert_begin[size_t(e)] + c.count_E[size_t(e)];
  {
    std::vector<int64_t> next(c.expert_begin.begin(), c.expert_begin.end() - 1);
    for (int64_t i = 0; i < R; ++i)
      if (c.row_NK[size_t(i)] >= 0) c.row_NK[size_t(i)] = next[size_t(c.expert_NK[size_t(i)])]++;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i)
    if (c.row_NK[size_t(i)] >= 0) std::memcpy(xs + c.row_NK[size_t(i)] * C, x + (i / K) * C, size_t(C) * sizeof(T));
  for (int64_t e = 0; e < E; ++e)  // padding rows: zeros in, zeros out of the expert
    std::fill(xs + (c.expert_begin[size_t(e)] + kept[size_t(e)]) * C, xs + c.expert_begin[size_t(e + 1)] * C, T(0));
}

// Unpermute (the permute's backward): dx[n] = Σ_{kept k} dxs[row(n,k)].
template <typename T>
void permute_backward(T* dx, const T* dxs, const MoeCache<T>& c, const MoeSizes& s, DispatchTimes& times) {
  const int64_t N = s.N, C = s.C, K = s.K;
  const Stopwatch unpermute(times.permute_s);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* dn = dx + n * C;
    for (int64_t ch = 0; ch < C; ++ch) dn[ch] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = c.row_NK[size_t(n * K + k)];
      if (row < 0) continue;
      const T* g = dxs + row * C;
      for (int64_t ch = 0; ch < C; ++ch) dn[ch] += g[ch];
    }
  }
}

// A kept expert-side tensor [rows, ld] from row r0 as its GEMMs read it: the values (fp32 runs) or
// their bf16 copy (MoeSizes::low), or both while forward still holds the values (keep_rounded has
// rounded them: exact).
template <typename T>
Mat<T> kept_rows(const T* values, const std::vector<bf16>& low, int64_t r0, int64_t ld) {
  const bool kept_low = !low.empty();
  return {values ? values + r0 * ld : nullptr, ld, kept_low ? low.data() + r0 * ld : nullptr, kept_low};
}

// Under MoeSizes::low: n values (read by the experts' GEMMs alone) rounded in place to bf16 precision
// and into their kept copy from `at` (fp64 runs keep none).
template <typename T>
void keep_rounded(std::vector<bf16>& low, int64_t at, T* v, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    if (!low.empty()) round_in_place(v, low.data() + at, n);
}

// The SwiGLU of rows r0 .. r0+rn into act, as the down projection reads it. Under MoeSizes::low into
// its kept bf16 copy as each row is written — and, only where the bf16 GEMMs read fp32 values
// (bf16_gemm_reads_fp32), into act rounded in place too (keep_rounded's work).
template <typename T>
Mat<T> expert_activation(T* act, MoeCache<T>& c, int64_t r0, int64_t rn, int64_t F) {
  const T* gu = c.gu_R2F.data() + r0 * 2 * F;
  if constexpr (std::is_same_v<T, float>)
    if (!c.act_low.empty()) {
      float* values = bf16_gemm_reads_fp32() ? act + r0 * F : nullptr;
      bf16* low = c.act_low.data() + r0 * F;
      swiglu_forward_rounded(values, low, gu, rn, F);
      return {values, F, low, values != nullptr};
    }
  swiglu_forward(act + r0 * F, gu, rn, F);
  return {act + r0 * F, F};
}

// Its backward into dgu [rn, 2F], as its two GEMMs read it (in bf16 rounded as each row is written:
// operand_in_place's result, into the copy alone where there is one).
template <typename T>
Mat<T> expert_activation_backward(Precision p, T* dgu, const T* dact, const T* gu, int64_t rn, int64_t F,
                                  std::vector<bf16>& low) {
  if constexpr (std::is_same_v<T, float>)
    if (p == Precision::bf16) {
      bf16* copy = in_place_copy(low, rn * 2 * F);
      swiglu_backward_rounded(copy ? nullptr : dgu, copy, dact, gu, rn, F);
      return rounded_once<T>(dgu, copy, 2 * F);
    }
  swiglu_backward(dgu, dact, gu, rn, F);
  return {dgu, 2 * F};
}

// Local experts: one GEMM pair per expert over its contiguous rows of xe [rows, C] (as received;
// kept in the cache) (partial outputs over ETP) into ye [rows, C]; gate|up and the activations stay
// in the cache (where the cache keeps the activations in bf16 they are written into it, `act_work`
// [rows, F] holding their fp32 values only where the bf16 GEMMs read those; xe is rounded in place, as
// only the GEMMs read it).
template <typename T>
void experts_forward(T* ye, T* xe, MoeCache<T>& c, Weights<T> experts, const MoeSizes& s, T* act_work) {
  const int64_t C = s.C, F = s.F;
  const Precision p = experts.p;
  keep_rounded(c.xe_low, 0, xe, c.plan.rows * C);
  T* act = s.low ? act_work : c.act_RF.data();
  for (int64_t j = 0, r0 = 0; j < int64_t(c.plan.expert_rows.size()); r0 += c.plan.expert_rows[size_t(j)], ++j) {
    const int64_t rn = c.plan.expert_rows[size_t(j)];
    if (rn == 0) continue;
    const Weights<T> w13 = experts.at(j * 3 * F * C), w2 = w13.at(2 * F * C);
    matmul<T>(p, false, true, rn, 2 * F, C, T(1), kept_rows(xe, c.xe_low, r0, C), w13.mat(C), T(0),
              c.gu_R2F.data() + r0 * 2 * F, 2 * F, Sizes::varying);
    matmul<T>(p, false, true, rn, C, F, T(1), expert_activation(act, c, r0, rn, F), w2.mat(F), T(0), ye + r0 * C, C,
              Sizes::varying);
  }
}

// The experts' backward overwrites dye with ∂/∂xe, expert by expert (its rows of dye are dead once
// its dact and dw2 are computed); dexperts accumulates. scratch's dgu and dact are work buffers.
// In bf16 each expert's dye and dgu rows are rounded once, in place, for their two GEMMs.
template <typename T>
void experts_backward(T* dye, T* dexperts, MoeScratch<T>& scratch, const MoeCache<T>& c, Weights<T> experts,
                      const MoeSizes& s) {
  const int64_t C = s.C, F = s.F;
  const Precision p = experts.p;
  const Sizes vary = Sizes::varying;
  T *dgu = scratch.dgu_R2F.data(), *dact = scratch.dact_RF.data();
  thread_local std::vector<bf16> low;
  const T* act = c.act_RF.empty() ? nullptr : c.act_RF.data();  // null under MoeSizes::low: act_low
  const T* xe = c.xe_RC.empty() ? nullptr : c.xe_RC.data();     // the same: xe_low
  for (int64_t j = 0, r0 = 0; j < int64_t(c.plan.expert_rows.size()); r0 += c.plan.expert_rows[size_t(j)], ++j) {
    const int64_t rn = c.plan.expert_rows[size_t(j)];
    if (rn == 0) continue;
    const Weights<T> w13 = experts.at(j * 3 * F * C), w2 = w13.at(2 * F * C);
    T* dw13 = dexperts + j * 3 * F * C;
    T* dw2 = dw13 + 2 * F * C;
    const Mat<T> g = operand_in_place(p, dye + r0 * C, rn, C, low);
    matmul<T>(p, false, false, rn, F, C, T(1), g, w2.mat(F), T(0), dact + r0 * F, F, vary);
    matmul<T>(p, true, false, C, F, rn, T(1), g, kept_rows(act, c.act_low, r0, F), T(1), dw2, F, vary);
    const Mat<T> ggu = expert_activation_backward(p, dgu + r0 * 2 * F, dact + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn,
                                                  F, low);
    matmul<T>(p, false, false, rn, C, 2 * F, T(1), ggu, w13.mat(C), T(0), dye + r0 * C, C, vary);
    matmul<T>(p, true, false, 2 * F, C, rn, T(1), ggu, kept_rows(xe, c.xe_low, r0, C), T(1), dw13, C, vary);
  }
}

// Combine: out[n] = Σ_{kept k} w_k·y[row(n,k)].
template <typename T>
void combine_forward(T* out, const MoeCache<T>& c, const MoeSizes& s, DispatchTimes& times) {
  const int64_t N = s.N, C = s.C, K = s.K;
  const Stopwatch combine(times.permute_s);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* o = out + n * C;
    std::fill(o, o + C, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = c.row_NK[size_t(n * K + k)];
      if (row < 0) continue;
      const T w = c.weight_NK[size_t(n * K + k)];
      const T* y = c.y_RC.data() + row * C;
      for (int64_t ch = 0; ch < C; ++ch) o[ch] += w * y[ch];
    }
  }
}

// Combine backward: dy[row(n,k)] = weight·dout[n]; dweight[n,k] = dout[n]·y[row(n,k)] (0 when dropped);
// padding rows get zeros.
template <typename T>
void combine_backward(T* dy, T* dweight, const T* dout, const MoeCache<T>& c, const MoeSizes& s,
                      DispatchTimes& times) {
  const int64_t C = s.C, E = s.E, K = s.K, R = s.N * K;
  const Stopwatch combine(times.permute_s);
  // Every row is a kept assignment's, written below, but the padding rows of a padded layout
  // (MoeSizes::pad), which get zeros.
  if (s.pad)
    for (int64_t e = 0; e < E; ++e)
      std::fill(dy + c.expert_begin[size_t(e)] * C, dy + c.expert_begin[size_t(e + 1)] * C, T(0));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const int64_t row = c.row_NK[size_t(i)];
    if (row < 0) {
      dweight[i] = 0;
      continue;
    }
    const T* dn = dout + (i / K) * C;
    const T* y = c.y_RC.data() + row * C;
    T* g = dy + row * C;
    const T w = c.weight_NK[size_t(i)];
    T dot = 0;
    for (int64_t ch = 0; ch < C; ++ch) {
      g[ch] = w * dn[ch];
      dot += dn[ch] * y[ch];
    }
    dweight[i] = dot;
  }
}

}  // namespace

template <typename T>
void moe_forward(T* out, MoeCache<T>& c, const MoeInputs<T>& in, const MoeSizes& s, const MoeRouting& r,
                 const MoeBalance& bal, TokenDispatcher& d, MoeScratch<T>& scratch) {
  const int64_t N = s.N, C = s.C, E = s.E, B = s.B;
  ORIGAMI_ASSERT(int64_t(c.y_RC.size()) == s.sent_rows() * C && int64_t(scratch.xs_RC.size()) >= s.sent_rows() * C);
  ORIGAMI_ASSERT(N % B == 0);
  // Where this rank holds every expert the permute writes the experts' input rows and the experts
  // write their outputs where the combine reads them: no dispatch (on one rank 4.6% of a Mixtral L4
  // d256 E8 step's CPU time went to the copies it made).
  const bool local = d.holds_every_expert();
  T* xe = s.low ? scratch.xe_RC.data() : c.xe_RC.data();  // bf16 runs: received here, kept rounded
  T *xs = local ? xe : scratch.xs_RC.data(), *ye = local ? c.y_RC.data() : scratch.e_RC.data();
  ORIGAMI_ASSERT(s.sequences == (bal.docs != nullptr));
  if (bal.docs) std::copy(bal.docs->id_N, bal.docs->id_N + N, c.seq_N.begin());
  route_forward(c, in.x_NC, in.gate_EC, s, r, bal.bias);
  drop_over_capacity(c, s, r.drop);
  permute_forward(xs, c, in.x_NC, s, d.times());
  // The exchange, the local experts and the return.
  c.tokens_total = N * d.token_ranks();
  c.loss_tokens = bal.docs ? bal.docs->tokens : double(c.tokens_total);
  d.plan(c.plan, c.count_E.data(), E);
  ORIGAMI_ASSERT(c.plan.rows * C <= int64_t(s.low ? scratch.xe_RC.size() : c.xe_RC.size()) &&
                 int64_t(scratch.e_RC.size()) >= c.plan.rows * C);
  if (!local) d.to_experts(xe, xs, c.plan, C, scratch.dispatch);
  experts_forward(ye, xe, c, in.before_experts ? in.before_experts(c.plan) : in.experts, s, scratch.dact_RF.data());
  if (!local) d.from_experts(c.y_RC.data(), ye, c.plan, C, scratch.dispatch);
  combine_forward(out, c, s, d.times());
  aux_fractions(c, s, r, bal, d);
  router_losses(c, s, r);
}

template <typename T>
void moe_backward_experts(T* dx, T* dexperts, const T* dout, const MoeCache<T>& c, MoeScratch<T>& scratch,
                          Id<Weights<T>> experts, const MoeSizes& s, TokenDispatcher& d) {
  const int64_t C = s.C;
  const bool local = d.holds_every_expert();  // as in forward: the rows stay where they are
  T *dye = scratch.e_RC.data(), *dy = local ? dye : scratch.xs_RC.data();
  combine_backward(dy, scratch.d_weight.data(), dout, c, s, d.times());
  // Return's backward is a dispatch; the experts' backward overwrites dye with ∂/∂xe; dispatch's
  // backward returns them.
  if (!local) d.to_experts(dye, dy, c.plan, C, scratch.dispatch);
  experts_backward(dye, dexperts, scratch, c, experts, s);
  T* dxs = dy;
  if (!local) d.from_experts(dxs, dye, c.plan, C, scratch.dispatch);
  permute_backward(dx, dxs, c, s, d.times());
}

template <typename T>
void moe_forward(T* out, MoeCache<T>& c, const T* x, const T* gate, const T* experts, const MoeSizes& s,
                 const MoeRouting& r, const MoeBalance& balance) {
  TokenDispatcher local;
  MoeScratch<T> scratch;
  const int64_t rows = TokenDispatcher::max_rows(s.N, s.K, s.E, 1, 1, s.cap, s.pad);
  c.resize(s, rows);
  scratch.resize(s, rows, 1);
  moe_forward(out, c, {x, gate, experts}, s, r, balance, local, scratch);
}

template <typename T>
void moe_backward(T* dx, T* dgate, T* dexperts, const T* dout, const MoeCache<T>& c, const T* x, const T* gate,
                  const T* experts, const MoeSizes& s, const MoeRouting& r, T loss_scale) {
  TokenDispatcher local;
  MoeScratch<T> scratch;
  scratch.resize(s, TokenDispatcher::max_rows(s.N, s.K, s.E, 1, 1, s.cap, s.pad), 1);
  moe_backward_experts<T>(dx, dexperts, dout, c, scratch, experts, s, local);
  moe_backward_router(dx, dgate, scratch, c, x, gate, s, r, loss_scale);
}

#define INSTANTIATE(T)                                                                                          \
  template void moe_forward<T>(T*, MoeCache<T>&, const MoeInputs<T>&, const MoeSizes&, const MoeRouting&,      \
                               const MoeBalance&, TokenDispatcher&, MoeScratch<T>&);                             \
  template void moe_forward<T>(T*, MoeCache<T>&, const T*, const T*, const T*, const MoeSizes&, const MoeRouting&, \
                               const MoeBalance&);                                                               \
  template void moe_backward<T>(T*, T*, T*, const T*, const MoeCache<T>&, const T*, const T*, const T*,         \
                                const MoeSizes&, const MoeRouting&, T);                                        \
  template void moe_backward_experts<T>(T*, T*, const T*, const MoeCache<T>&, MoeScratch<T>&, Weights<T>,         \
                                        const MoeSizes&, TokenDispatcher&);                                    \
  template void moe_backward_router<T>(T*, T*, const MoeScratch<T>&, const MoeCache<T>&, const T*, const T*,      \
                                       const MoeSizes&, const MoeRouting&, T);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
