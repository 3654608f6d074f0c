#include "model/layers/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/gemm.h"
#include "core/error.h"
#include "model/layers/activation.h"

namespace origami {

template <typename T>
void moe_forward(T* out, MoeCache<T>& c, const T* x, const T* gate, const T* experts, const MoeSizes& s,
                 double aux_coef, double z_coef, TokenDispatcher& d, MoeScratch<T>& scratch) {
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K, R = N * K;
  ORIGAMI_ASSERT(int64_t(c.y_RC.size()) == R * C && int64_t(scratch.xs_RC.size()) >= R * C);
  // Route.
  gemm<T>(false, true, N, E, C, T(1), x, C, gate, C, T(0), c.probs_NE.data(), E);  // logits, softmaxed in place
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* p = c.probs_NE.data() + n * E;
    T m = p[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, p[e]);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - m));
    c.lse_N[size_t(n)] = m + std::log(sum);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    // Top-K by probability (ties: lower expert index first), then renormalise.
    int32_t* idx = c.expert_NK.data() + n * K;
    T* w = c.weight_NK.data() + n * K;
    T wsum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int32_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (std::find(idx, idx + k, int32_t(e)) != idx + k) continue;
        if (best < 0 || p[e] > p[best]) best = int32_t(e);
      }
      idx[k] = best;
      wsum += (w[k] = p[best]);
    }
    for (int64_t k = 0; k < K; ++k) w[k] /= wsum;
  }
  // Permute: counting sort of assignments by expert (stable: token order within an expert).
  std::fill(c.count_E.begin(), c.count_E.end(), 0);
  for (int64_t i = 0; i < R; ++i) c.count_E[size_t(c.expert_NK[size_t(i)])]++;
  c.expert_begin[0] = 0;
  for (int64_t e = 0; e < E; ++e) c.expert_begin[size_t(e + 1)] = c.expert_begin[size_t(e)] + c.count_E[size_t(e)];
  {
    std::vector<int64_t> next(c.expert_begin.begin(), c.expert_begin.end() - 1);
    for (int64_t i = 0; i < R; ++i) c.row_NK[size_t(i)] = next[size_t(c.expert_NK[size_t(i)])]++;
  }
  T* xs = scratch.xs_RC.data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(xs + c.row_NK[size_t(i)] * C, x + (i / K) * C, size_t(C) * sizeof(T));
  // The load-balancing counts over the whole micro-batch, and the exchange.
  std::copy(c.count_E.begin(), c.count_E.end(), c.total_E.begin());
  d.global_counts(c.total_E.data(), E);
  c.tokens_total = N * d.token_ranks();
  d.plan(c.plan, c.count_E.data(), E);
  ORIGAMI_ASSERT(c.plan.rows * C <= int64_t(c.xe_RC.size()) && int64_t(scratch.e_RC.size()) >= c.plan.rows * C);
  d.to_experts(c.xe_RC.data(), xs, c.plan, C, scratch.dispatch);
  // Local experts: one GEMM pair per expert over its contiguous rows (partial outputs over ETP).
  T* ye = scratch.e_RC.data();
  for (int64_t j = 0, r0 = 0; j < int64_t(c.plan.expert_rows.size()); r0 += c.plan.expert_rows[size_t(j)], ++j) {
    const int64_t rn = c.plan.expert_rows[size_t(j)];
    if (rn == 0) continue;
    const T* w13 = experts + j * 3 * F * C;
    const T* w2 = w13 + 2 * F * C;
    gemm<T>(false, true, rn, 2 * F, C, T(1), c.xe_RC.data() + r0 * C, C, w13, C, T(0), c.gu_R2F.data() + r0 * 2 * F, 2 * F);
    swiglu_forward(c.act_RF.data() + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    gemm<T>(false, true, rn, C, F, T(1), c.act_RF.data() + r0 * F, F, w2, F, T(0), ye + r0 * C, C);
  }
  d.from_experts(c.y_RC.data(), ye, c.plan, C, scratch.dispatch);
  // Combine.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* o = out + n * C;
    std::fill(o, o + C, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const T w = c.weight_NK[size_t(n * K + k)];
      const T* y = c.y_RC.data() + c.row_NK[size_t(n * K + k)] * C;
      for (int64_t ch = 0; ch < C; ++ch) o[ch] += w * y[ch];
    }
  }
  // Router losses: this share's terms of the micro-batch's.
  const double Nt = double(c.tokens_total);
  double aux = 0, z = 0;
  for (int64_t e = 0; e < E; ++e) {
    double P = 0;
    for (int64_t n = 0; n < N; ++n) P += c.probs_NE[size_t(n * E + e)];
    aux += double(c.total_E[size_t(e)]) / (Nt * double(K)) * (P / Nt);
  }
  for (int64_t n = 0; n < N; ++n) z += double(c.lse_N[size_t(n)]) * c.lse_N[size_t(n)];
  c.aux = aux_coef * double(E) * aux;
  c.z = z_coef * z / Nt;
}

template <typename T>
void moe_backward_experts(T* dx, T* dexperts, const T* dout, const MoeCache<T>& c, MoeScratch<T>& scratch,
                          const T* experts, const MoeSizes& s, TokenDispatcher& d) {
  const int64_t N = s.N, C = s.C, F = s.F, K = s.K, R = N * K;
  T *dy = scratch.xs_RC.data(), *dweight = scratch.d_weight.data();
  T *dye = scratch.e_RC.data(), *dgu = scratch.dgu_R2F.data(), *dact = scratch.dact_RF.data();
  // Combine backward: dy[row(n,k)] = weight·dout[n]; dweight[n,k] = dout[n]·y[row(n,k)].
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const T* dn = dout + (i / K) * C;
    const int64_t row = c.row_NK[size_t(i)];
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
  // Return's backward is a dispatch; the experts' backward overwrites dye with ∂/∂xe, expert by
  // expert (its rows of dye are dead once its dact and dw2 are computed); dispatch's backward returns them.
  d.to_experts(dye, dy, c.plan, C, scratch.dispatch);
  for (int64_t j = 0, r0 = 0; j < int64_t(c.plan.expert_rows.size()); r0 += c.plan.expert_rows[size_t(j)], ++j) {
    const int64_t rn = c.plan.expert_rows[size_t(j)];
    if (rn == 0) continue;
    const T* w13 = experts + j * 3 * F * C;
    const T* w2 = w13 + 2 * F * C;
    T* dw13 = dexperts + j * 3 * F * C;
    T* dw2 = dw13 + 2 * F * C;
    gemm<T>(false, false, rn, F, C, T(1), dye + r0 * C, C, w2, F, T(0), dact + r0 * F, F);
    gemm<T>(true, false, C, F, rn, T(1), dye + r0 * C, C, c.act_RF.data() + r0 * F, F, T(1), dw2, F);
    swiglu_backward(dgu + r0 * 2 * F, dact + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    gemm<T>(false, false, rn, C, 2 * F, T(1), dgu + r0 * 2 * F, 2 * F, w13, C, T(0), dye + r0 * C, C);
    gemm<T>(true, false, 2 * F, C, rn, T(1), dgu + r0 * 2 * F, 2 * F, c.xe_RC.data() + r0 * C, C, T(1), dw13, C);
  }
  T* dxs = dy;
  d.from_experts(dxs, dye, c.plan, C, scratch.dispatch);
  // Unpermute: dx[n] = Σ_k dxs[row(n,k)].
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* dn = dx + n * C;
    for (int64_t ch = 0; ch < C; ++ch) dn[ch] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const T* g = dxs + c.row_NK[size_t(n * K + k)] * C;
      for (int64_t ch = 0; ch < C; ++ch) dn[ch] += g[ch];
    }
  }
}

template <typename T>
void moe_backward_router(T* dx, T* dgate, const MoeScratch<T>& scratch, const MoeCache<T>& c, const T* x,
                         const T* gate, const MoeSizes& s, double aux_coef, double z_coef, T loss_scale) {
  const int64_t N = s.N, C = s.C, E = s.E, K = s.K;
  const T* dweight = scratch.d_weight.data();
  const double Nt = double(c.tokens_total);
  // d logits from the renormalised weights, the aux loss and the z-loss.
  std::vector<T> dlogits(size_t(N * E));
  const T aux_g = T(aux_coef * double(E) / Nt) * loss_scale;  // ∂aux/∂p[n,e] = aux_g·f_e
  const T z_g = T(2.0 * z_coef / Nt) * loss_scale;
  const T RK = T(Nt * double(K));
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* p = c.probs_NE.data() + n * E;
    T* dl = dlogits.data() + n * E;
    T* dp = dl;  // dprobs first, turned into dlogits in place
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_g * T(c.total_E[size_t(e)]) / RK;
    // weight_k = p_k / Σ_j p_j over the chosen: dp_j += (dw_j − Σ_k dw_k·weight_k) / Σ p
    T psum = 0, dot = 0;
    for (int64_t k = 0; k < K; ++k) {
      psum += p[c.expert_NK[size_t(n * K + k)]];
      dot += dweight[n * K + k] * c.weight_NK[size_t(n * K + k)];
    }
    for (int64_t k = 0; k < K; ++k) dp[c.expert_NK[size_t(n * K + k)]] += (dweight[n * K + k] - dot) / psum;
    // Softmax backward, then the z-loss term 2·lse·p.
    T pdp = 0;
    for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[e];
    const T zl = z_g * c.lse_N[size_t(n)];
    for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dp[e] - pdp) + zl * p[e];
  }
  gemm<T>(true, false, E, C, N, T(1), dlogits.data(), E, x, C, T(1), dgate, C);  // dgate += dlogitsᵀ·x
  gemm<T>(false, false, N, C, E, T(1), dlogits.data(), E, gate, C, T(1), dx, C);  // dx += dlogits·gate
}

template <typename T>
void moe_forward(T* out, MoeCache<T>& c, const T* x, const T* gate, const T* experts, const MoeSizes& s,
                 double aux_coef, double z_coef) {
  TokenDispatcher local;
  MoeScratch<T> scratch;
  const int64_t rows = TokenDispatcher::max_rows(s.N, s.K, s.E, 1, 1);
  c.resize(s, rows);
  scratch.resize(s, rows, 1);
  moe_forward(out, c, x, gate, experts, s, aux_coef, z_coef, local, scratch);
}

template <typename T>
void moe_backward(T* dx, T* dgate, T* dexperts, const T* dout, const MoeCache<T>& c, const T* x, const T* gate,
                  const T* experts, const MoeSizes& s, double aux_coef, double z_coef, T loss_scale) {
  TokenDispatcher local;
  MoeScratch<T> scratch;
  scratch.resize(s, TokenDispatcher::max_rows(s.N, s.K, s.E, 1, 1), 1);
  moe_backward_experts(dx, dexperts, dout, c, scratch, experts, s, local);
  moe_backward_router(dx, dgate, scratch, c, x, gate, s, aux_coef, z_coef, loss_scale);
}

#define INSTANTIATE(T)                                                                                          \
  template void moe_forward<T>(T*, MoeCache<T>&, const T*, const T*, const T*, const MoeSizes&, double, double,   \
                               TokenDispatcher&, MoeScratch<T>&);                                                \
  template void moe_forward<T>(T*, MoeCache<T>&, const T*, const T*, const T*, const MoeSizes&, double, double);  \
  template void moe_backward<T>(T*, T*, T*, const T*, const MoeCache<T>&, const T*, const T*, const T*,         \
                                const MoeSizes&, double, double, T);                                           \
  template void moe_backward_experts<T>(T*, T*, const T*, const MoeCache<T>&, MoeScratch<T>&, const T*,           \
                                        const MoeSizes&, TokenDispatcher&);                                    \
  template void moe_backward_router<T>(T*, T*, const MoeScratch<T>&, const MoeCache<T>&, const T*, const T*,      \
                                       const MoeSizes&, double, double, T);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
