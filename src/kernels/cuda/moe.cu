// The mixture-of-experts MLP on one device (cuda_kernels.h; the CPU twin is model/layers/moe.h's
// one-rank moe_forward / moe_backward): route, permute, experts, combine, and their backward, each
// phase the CPU's formula. Permutation is a counting sort with one thread per expert walking the
// assignments in token order (stable, as on the CPU); every sum runs in a fixed order.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {

__device__ float score_of(float logit, float lse, bool softmax) {
  return softmax ? expf(logit - lse) : 1.f / (1.f + expf(-logit));
}

// Added to a sum of scores before dividing by it, as the CPU layer does (moe.cpp): sigmoid scores of
// logits below about −88 are exactly 0.
constexpr float kScoreSumFloor = 1e-20f;

// A thread per token: log-sum-exp of the logits, scores, the top K (ties: the lower expert), weights.
__global__ void route_kernel(float* lse, int32_t* expert, float* score, float* weight, const float* logits, int64_t N,
                             int64_t E, int64_t K, bool softmax, bool renormalise) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* l = logits + n * E;
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = fmaxf(m, l[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += expf(l[e] - m);
  const float ls = lse[n] = m + logf(sum);
  int32_t* idx = expert + n * K;
  float psum = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    int32_t best = -1;
    float best_p = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < k; ++j) taken |= idx[j] == int32_t(e);
      const float p = score_of(l[e], ls, softmax);
      if (!taken && (best < 0 || p > best_p)) best = int32_t(e), best_p = p;
    }
    idx[k] = best;
    psum += (score[n * K + k] = weight[n * K + k] = best_p);
  }
  if (renormalise)
    for (int64_t k = 0; k < K; ++k) weight[n * K + k] /= psum + kScoreSumFloor;
}

// One block, a thread per expert: counts, their exclusive sum, then each assignment's row in token
// order; frac_E = count/(R) for the aux loss. E ≤ 1024.
__global__ void permute_kernel(int32_t* row, int64_t* count, float* frac, const int32_t* expert, int64_t R, int64_t E) {
  __shared__ int64_t begin[1025];
  const int e = threadIdx.x;
  int64_t c = 0;
  if (e < E)
    for (int64_t i = 0; i < R; ++i) c += expert[i] == e;
  if (e < E) count[e] = c, frac[e] = float(double(c) / double(R));
  __syncthreads();
  if (e == 0) {
    begin[0] = 0;
    for (int64_t j = 0; j < E; ++j) begin[j + 1] = begin[j] + count[j];
  }
  __syncthreads();
  if (e >= E) return;
  int64_t next = begin[e];
  for (int64_t i = 0; i < R; ++i)
    if (expert[i] == e) row[i] = int32_t(next++);
}


// Router losses' per-token terms: aux_n = Σ_e φ_e·pa_e (pa = p / Σp), z_n = lse².
__global__ void router_terms(double* terms, const float* logits, const float* lse, const float* frac, int64_t N,
                             int64_t E, bool softmax, bool aux) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  double a = 0;
  if (aux) {
    double S = kScoreSumFloor;
    for (int64_t e = 0; e < E; ++e) S += softmax ? 0.0 : score_of(logits[n * E + e], lse[n], false);
    if (softmax) S = 1;
    for (int64_t e = 0; e < E; ++e) a += double(frac[e]) * double(score_of(logits[n * E + e], lse[n], softmax)) / S;
  }
  terms[2 * n] = a;
  terms[2 * n + 1] = double(lse[n]) * lse[n];
}

// ∂/∂logits of one token (moe.cpp's moe_backward_router, element for element), written into dlogits.
__global__ void router_backward_kernel(float* dlogits, const float* logits, const float* lse, const float* frac,
                                       const int32_t* expert, const float* score, const float* weight,
                                       const float* dweight, int64_t N, int64_t E, int64_t K, bool softmax,
                                       bool renormalise, float aux_g, float z_g) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* l = logits + n * E;
  const float ls = lse[n];
  float* dp = dlogits + n * E;
  float S = 1.f;
  if (!softmax) {
    S = kScoreSumFloor;
    for (int64_t e = 0; e < E; ++e) S += score_of(l[e], ls, false);
  }
  float dot = 0.f;
  for (int64_t e = 0; e < E; ++e) dp[e] = aux_g * frac[e], dot += dp[e] * score_of(l[e], ls, softmax) / S;
  if (!softmax)
    for (int64_t e = 0; e < E; ++e) dp[e] = (dp[e] - dot) / S;
  const int32_t* idx = expert + n * K;
  const float* dw = dweight + n * K;
  if (renormalise) {
    float psum = 0.f, wdot = 0.f;
    for (int64_t k = 0; k < K; ++k) psum += score[n * K + k], wdot += dw[k] * weight[n * K + k];
    for (int64_t k = 0; k < K; ++k) dp[idx[k]] += (dw[k] - wdot) / (psum + kScoreSumFloor);
  } else {
    for (int64_t k = 0; k < K; ++k) dp[idx[k]] += dw[k];
  }
  if (softmax) {
    float pdp = 0.f;
    for (int64_t e = 0; e < E; ++e) pdp += score_of(l[e], ls, true) * dp[e];
    for (int64_t e = 0; e < E; ++e) dp[e] = score_of(l[e], ls, true) * (dp[e] - pdp);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const float p = score_of(l[e], ls, false);
      dp[e] *= p * (1.f - p);
    }
  }
  const float zl = z_g * ls;
  if (zl != 0.f)
    for (int64_t e = 0; e < E; ++e) dp[e] += zl * expf(l[e] - ls);
}

void check_supported(const MoeSizes& s, const MoeRouting& r) {
  if (s.cap > 0 || r.capacity_factor > 0) throw Error("CUDA MoE: a capacity factor is not built (dropless only)");
  if (r.bias_rate > 0) throw Error("CUDA MoE: the router bias (--moe-router-bias-rate) is not built");
  if (r.aux == AuxLoss::seq || r.aux == AuxLoss::global)
    throw Error("CUDA MoE: aux loss 'seq' and 'global' are not built (micro or none)");
  if (s.E > 1024) throw Error(cat("CUDA MoE: ", s.E, " experts; at most 1024 are built"));
}
}  // namespace

void moe_forward(float* out, MoeDeviceCache& c, const float* x, const float* gate, Weights<float> experts,
                 const MoeSizes& s, const MoeRouting& r) {
  check_supported(s, r);
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K, R = N * K;
  const bool softmax = r.score == RouterScore::softmax;
  c.count_E.assign(size_t(E), 0);
  c.aux = c.z = 0;
  if (N == 0) return;
  grown(c.logits_NE, N * E), grown(c.lse_N, N), grown(c.score_NK, R), grown(c.weight_NK, R), grown(c.frac_E, E);
  grown(c.expert_NK, R), grown(c.row_NK, R), grown(c.xe_RC, R * C), grown(c.gu_R2F, R * 2 * F);
  grown(c.act_RF, R * F), grown(c.y_RC, R * C);
  // Route: logits in fp32 (the router GEMM is fp32 in every run, as on the CPU).
  matmul(Precision::fp32, false, true, N, E, C, 1.f, {x, C}, {gate, C}, 0.f, c.logits_NE.data(), E);
  route_kernel<<<blocks_for(N, 128), 128, 0, cu_stream()>>>(c.lse_N.data(), c.expert_NK.data(), c.score_NK.data(),
                                                            c.weight_NK.data(), c.logits_NE.data(), N, E, K, softmax,
                                                            r.renormalise());
  check_launch("moe route");
  // Permute: rows by expert, then the rows' inputs.
  int64_t* count = grown(c.count_dev, E);
  permute_kernel<<<1, unsigned((E + 31) / 32 * 32), 0, cu_stream()>>>(c.row_NK.data(), count, c.frac_E.data(),
                                                                      c.expert_NK.data(), R, E);
  check_launch("moe permute");
  copy_to_host(c.count_E.data(), count, size_t(E) * sizeof(int64_t));
  float* xe = c.xe_RC.data();
  const int32_t* row = c.row_NK.data();
  launch_each(R * C, "moe gather", [=] __device__(int64_t e) {
    const int64_t i = e / C, ch = e % C;
    xe[int64_t(row[i]) * C + ch] = x[(i / K) * C + ch];
  });
  // Experts: one GEMM pair per expert over its rows.
  for (int64_t j = 0, r0 = 0; j < E; r0 += c.count_E[size_t(j)], ++j) {
    const int64_t rn = c.count_E[size_t(j)];
    if (rn == 0) continue;
    const Weights<float> w13 = experts.at(j * 3 * F * C), w2 = w13.at(2 * F * C);
    matmul(experts.p, false, true, rn, 2 * F, C, 1.f, {xe + r0 * C, C}, w13.mat(C), 0.f, c.gu_R2F.data() + r0 * 2 * F,
           2 * F);
    swiglu_forward(c.act_RF.data() + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    matmul(experts.p, false, true, rn, C, F, 1.f, {c.act_RF.data() + r0 * F, F}, w2.mat(F), 0.f, c.y_RC.data() + r0 * C,
           C);
  }
  // Combine: out[n] = Σ_k w_k·y[row(n,k)].
  const float *y = c.y_RC.data(), *w = c.weight_NK.data();
  launch_each(N * C, "moe combine", [=] __device__(int64_t e) {
    const int64_t n = e / C, ch = e % C;
    float o = 0.f;
    for (int64_t k = 0; k < K; ++k) o += w[n * K + k] * y[int64_t(row[n * K + k]) * C + ch];
    out[e] = o;
  });
  // Router losses (their per-token terms summed on the host, in order).
  double* terms = grown(c.terms_N2, 2 * N);
  router_terms<<<blocks_for(N, 128), 128, 0, cu_stream()>>>(terms, c.logits_NE.data(), c.lse_N.data(),
                                                            c.frac_E.data(), N, E, softmax, r.aux != AuxLoss::none);
  check_launch("moe router losses");
  std::vector<double> host(size_t(2 * N));
  copy_to_host(host.data(), terms, host.size() * sizeof(double));
  double aux = 0, z = 0;
  for (int64_t n = 0; n < N; ++n) aux += host[size_t(2 * n)], z += host[size_t(2 * n + 1)];
  c.aux = r.aux == AuxLoss::none ? 0.0 : r.aux_coef * double(E) * aux / double(N);
  c.z = r.z_coef * z / double(N);
}

void moe_backward(float* dx, float* dgate, float* dexperts, const float* dout, MoeDeviceCache& c, const float* x,
                  const float* gate, Weights<float> experts, const MoeSizes& s, const MoeRouting& r, float loss_scale) {
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K, R = N * K;
  if (N == 0) return;
  // Work buffers, kept in the cache between calls (grown(): common.cuh).
  float *g = grown(c.dye_RC, R * C), *dwt = grown(c.dweight_NK, R), *dgu = grown(c.dgu_R2F, R * 2 * F);
  float *dact = grown(c.dact_RF, R * F), *dlogits = grown(c.dlogits_NE, N * E);
  // Combine backward: dye[row] = w·dout[n]; dweight = dout[n]·y[row].
  const float *y = c.y_RC.data(), *w = c.weight_NK.data();
  const int32_t* row = c.row_NK.data();
  launch_each(R * C, "moe combine backward", [=] __device__(int64_t e) {
    const int64_t i = e / C, ch = e % C;
    g[int64_t(row[i]) * C + ch] = w[i] * dout[(i / K) * C + ch];
  });
  launch_each(R, "moe weight gradient", [=] __device__(int64_t i) {
    float d = 0.f;
    for (int64_t ch = 0; ch < C; ++ch) d += dout[(i / K) * C + ch] * y[int64_t(row[i]) * C + ch];
    dwt[i] = d;
  });
  // Experts backward, expert by expert; dye becomes ∂/∂xe.
  for (int64_t j = 0, r0 = 0; j < E; r0 += c.count_E[size_t(j)], ++j) {
    const int64_t rn = c.count_E[size_t(j)];
    if (rn == 0) continue;
    const Weights<float> w13 = experts.at(j * 3 * F * C), w2 = w13.at(2 * F * C);
    float *dw13 = dexperts + j * 3 * F * C, *dw2 = dw13 + 2 * F * C;
    const Mat<float> gy{g + r0 * C, C}, ggu{dgu + r0 * 2 * F, 2 * F};
    matmul(experts.p, false, false, rn, F, C, 1.f, gy, w2.mat(F), 0.f, dact + r0 * F, F);
    matmul(experts.p, true, false, C, F, rn, 1.f, gy, {c.act_RF.data() + r0 * F, F}, 1.f, dw2, F);
    swiglu_backward(dgu + r0 * 2 * F, dact + r0 * F, c.gu_R2F.data() + r0 * 2 * F, rn, F);
    matmul(experts.p, false, false, rn, C, 2 * F, 1.f, ggu, w13.mat(C), 0.f, g + r0 * C, C);
    matmul(experts.p, true, false, 2 * F, C, rn, 1.f, ggu, {c.xe_RC.data() + r0 * C, C}, 1.f, dw13, C);
  }
  // Unpermute: dx[n] = Σ_k ∂xe[row(n,k)].
  launch_each(N * C, "moe unpermute", [=] __device__(int64_t e) {
    const int64_t n = e / C, ch = e % C;
    float d = 0.f;
    for (int64_t k = 0; k < K; ++k) d += g[int64_t(row[n * K + k]) * C + ch];
    dx[e] = d;
  });
  // Router: ∂/∂logits, then dgate += dlogitsᵀ·x and dx += dlogits·gate.
  const float aux_g = r.aux == AuxLoss::none ? 0.f : float(r.aux_coef * double(E) / double(N)) * loss_scale;
  const float z_g = float(2.0 * r.z_coef / double(N)) * loss_scale;
  router_backward_kernel<<<blocks_for(N, 128), 128, 0, cu_stream()>>>(
      dlogits, c.logits_NE.data(), c.lse_N.data(), c.frac_E.data(), c.expert_NK.data(), c.score_NK.data(), w,
      dwt, N, E, K, r.score == RouterScore::softmax, r.renormalise(), aux_g, z_g);
  check_launch("moe router backward");
  matmul(Precision::fp32, true, false, E, C, N, 1.f, {dlogits, E}, {x, C}, 1.f, dgate, C);
  matmul(Precision::fp32, false, false, N, C, E, 1.f, {dlogits, E}, {gate, C}, 1.f, dx, C);
}

}  // namespace origami::cuda
