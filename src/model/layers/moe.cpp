#include "model/layers/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/gemm.h"
#include "model/layers/activation.h"

namespace origami {

template <typename T>
void moe_forward(T* out, MoeCache<T>& c, const T* x, const T* gate, const T* experts, const MoeSizes& s,
                 double aux_coef, double z_coef) {
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K, R = N * K;
  // Route.
  c.resize(s);
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
  std::fill(c.expert_begin.begin(), c.expert_begin.end(), 0);
  for (int64_t e = 0; e < E; ++e) c.expert_begin[size_t(e + 1)] = c.expert_begin[size_t(e)] + c.count_E[size_t(e)];
  {
    std::vector<int64_t> next(c.expert_begin.begin(), c.expert_begin.end() - 1);
    for (int64_t i = 0; i < R; ++i) c.row_NK[size_t(i)] = next[size_t(c.expert_NK[size_t(i)])]++;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(c.xs_RC.data() + c.row_NK[size_t(i)] * C, x + (i / K) * C, size_t(C) * sizeof(T));
  // Experts: one GEMM pair per expert over its contiguous rows.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = c.expert_begin[size_t(e)], rn = c.count_E[size_t(e)];
    if (rn == 0) continue;
    const T* w13 = experts + e * 3 * F * C;
    const T* w2 = w13 + 2 * F * C;
    gemm<T>(false, true, rn, 2 * F, C, T(1), c.xs_RC.data() + r0 * C, C, w13, C, T(0), c.gu_R2F.data() + r0 * 2 * F, 2 * F);
    swiglu_forward(c.act_RF.data() + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    gemm<T>(false, true, rn, C, F, T(1), c.act_RF.data() + r0 * F, F, w2, F, T(0), c.y_RC.data() + r0 * C, C);
  }
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
  // Router losses.
  double aux = 0, z = 0;
  for (int64_t e = 0; e < E; ++e) {
    double P = 0;
    for (int64_t n = 0; n < N; ++n) P += c.probs_NE[size_t(n * E + e)];
    aux += double(c.count_E[size_t(e)]) / double(R) * (P / double(N));
  }
  for (int64_t n = 0; n < N; ++n) z += double(c.lse_N[size_t(n)]) * c.lse_N[size_t(n)];
  c.aux = aux_coef * double(E) * aux;
  c.z = z_coef * z / double(N);
}

template <typename T>
void moe_backward_experts(T* dx, T* dweight, T* dexperts, const T* dout, const MoeCache<T>& c, MoeScratch<T>& scratch,
                          const T* experts, const MoeSizes& s) {
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K, R = N * K;
  scratch.dy_RC.resize(size_t(R * C));  // every element is written below before it is read
  scratch.dgu_R2F.resize(size_t(R * 2 * F));
  scratch.dact_RF.resize(size_t(R * F));
  T *dy = scratch.dy_RC.data(), *dgu = scratch.dgu_R2F.data(), *dact = scratch.dact_RF.data();
  T* dxs = dy;  // expert e's rows of dy are dead once its dact and dw2 are computed
  // Combine backward: dy[row(n,k)] = weight·dout[n]; dweight[n,k] = dout[n]·y[row(n,k)].
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const T* d = dout + (i / K) * C;
    const int64_t row = c.row_NK[size_t(i)];
    const T* y = c.y_RC.data() + row * C;
    T* g = dy + row * C;
    const T w = c.weight_NK[size_t(i)];
    T dot = 0;
    for (int64_t ch = 0; ch < C; ++ch) {
      g[ch] = w * d[ch];
      dot += d[ch] * y[ch];
    }
    dweight[i] = dot;
  }
  // Experts backward (dxs overwrites dy, expert by expert).
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = c.expert_begin[size_t(e)], rn = c.count_E[size_t(e)];
    if (rn == 0) continue;
    const T* w13 = experts + e * 3 * F * C;
    const T* w2 = w13 + 2 * F * C;
    T* dw13 = dexperts + e * 3 * F * C;
    T* dw2 = dw13 + 2 * F * C;
    gemm<T>(false, false, rn, F, C, T(1), dy + r0 * C, C, w2, F, T(0), dact + r0 * F, F);
    gemm<T>(true, false, C, F, rn, T(1), dy + r0 * C, C, c.act_RF.data() + r0 * F, F, T(1), dw2, F);
    swiglu_backward(dgu + r0 * 2 * F, dact + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    gemm<T>(false, false, rn, C, 2 * F, T(1), dgu + r0 * 2 * F, 2 * F, w13, C, T(0), dxs + r0 * C, C);
    gemm<T>(true, false, 2 * F, C, rn, T(1), dgu + r0 * 2 * F, 2 * F, c.xs_RC.data() + r0 * C, C, T(1), dw13, C);
  }
  // Unpermute: dx[n] = Σ_k dxs[row(n,k)].
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* d = dx + n * C;
    for (int64_t ch = 0; ch < C; ++ch) d[ch] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const T* g = dxs + c.row_NK[size_t(n * K + k)] * C;
      for (int64_t ch = 0; ch < C; ++ch) d[ch] += g[ch];
    }
  }
}

template <typename T>
void moe_backward_router(T* dx, T* dgate, const T* dweight, const MoeCache<T>& c, const T* x, const T* gate,
                         const MoeSizes& s, double aux_coef, double z_coef, T loss_scale) {
  const int64_t N = s.N, C = s.C, E = s.E, K = s.K, R = N * K;
  // d logits from the renormalised weights, the aux loss and the z-loss.
  std::vector<T> dlogits(size_t(N * E));
  const T aux_g = T(aux_coef * double(E) / double(N)) * loss_scale;  // ∂aux/∂p[n,e] = aux_g·f_e
  const T z_g = T(2.0 * z_coef / double(N)) * loss_scale;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* p = c.probs_NE.data() + n * E;
    T* dl = dlogits.data() + n * E;
    T* dp = dl;  // dprobs first, turned into dlogits in place
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_g * T(c.count_E[size_t(e)]) / T(R);
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
  if (dx) gemm<T>(false, false, N, C, E, T(1), dlogits.data(), E, gate, C, T(1), dx, C);  // dx += dlogits·gate
}

template <typename T>
void moe_backward(T* dx, T* dgate, T* dexperts, const T* dout, const MoeCache<T>& c, const T* x, const T* gate,
                  const T* experts, const MoeSizes& s, double aux_coef, double z_coef, T loss_scale) {
  std::vector<T> dweight(static_cast<size_t>(s.N * s.K));
  MoeScratch<T> scratch;
  moe_backward_experts(dx, dweight.data(), dexperts, dout, c, scratch, experts, s);
  moe_backward_router(dx, dgate, dweight.data(), c, x, gate, s, aux_coef, z_coef, loss_scale);
}

#define INSTANTIATE(T)                                                                                         \
  template void moe_forward<T>(T*, MoeCache<T>&, const T*, const T*, const T*, const MoeSizes&, double, double); \
  template void moe_backward<T>(T*, T*, T*, const T*, const MoeCache<T>&, const T*, const T*, const T*,        \
                                const MoeSizes&, double, double, T);                                          \
  template void moe_backward_experts<T>(T*, T*, T*, const T*, const MoeCache<T>&, MoeScratch<T>&, const T*,      \
                                        const MoeSizes&);                                                     \
  template void moe_backward_router<T>(T*, T*, const T*, const MoeCache<T>&, const T*, const T*, const MoeSizes&, \
                                       double, double, T);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
