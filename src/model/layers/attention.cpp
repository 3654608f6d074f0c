#include "model/layers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace origami {

namespace {
constexpr int64_t kBlock = 64;  // query and key block size
}

template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t H, int64_t KV,
                       int64_t D) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D, group = H / KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
#pragma omp parallel
  {
    std::vector<T> scores(kBlock * kBlock), acc(kBlock * D), row_max(kBlock), row_sum(kBlock);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / group;
        const T* Q = qkv + b * Tn * S + h * D;
        const T* K = qkv + b * Tn * S + (H + g) * D;
        const T* V = qkv + b * Tn * S + (H + KV + g) * D;
        for (int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
          const int64_t nq = std::min(kBlock, Tn - i0);
          std::fill(acc.begin(), acc.end(), T(0));
          std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<T>::infinity());
          std::fill(row_sum.begin(), row_sum.end(), T(0));
          for (int64_t j0 = 0; j0 < i0 + nq; j0 += kBlock) {
            const int64_t nk = std::min(kBlock, Tn - j0);
            // scores[nq, nk] = scale · Q_i·K_jᵀ
            gemm<T>(false, true, nq, nk, D, scale, Q + i0 * S, S, K + j0 * S, S, T(0), scores.data(), kBlock);
            for (int64_t r = 0; r < nq; ++r) {
              T* p = scores.data() + r * kBlock;
              const int64_t allowed = std::min(nk, i0 + r - j0 + 1);  // causal: keys j ≤ i
              if (allowed <= 0) {
                std::fill(p, p + nk, T(0));
                continue;
              }
              T m = row_max[r];
              for (int64_t k = 0; k < allowed; ++k) m = std::max(m, p[k]);
              const T rescale = std::exp(row_max[r] - m);  // 0 on the first block (−inf)
              T sum = 0;
              for (int64_t k = 0; k < allowed; ++k) {
                p[k] = exp_fast(p[k] - m);
                sum += p[k];
              }
              std::fill(p + allowed, p + nk, T(0));
              row_sum[r] = row_sum[r] * rescale + sum;
              row_max[r] = m;
              T* a = acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
            }
            // acc[nq, D] += P·V_j
            gemm<T>(false, false, nq, D, nk, T(1), scores.data(), kBlock, V + j0 * S, S, T(1), acc.data(), D);
          }
          for (int64_t r = 0; r < nq; ++r) {
            T* o = out + (b * Tn + i0 + r) * HD + h * D;
            const T inv = T(1) / row_sum[r];
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
            lse[(b * H + h) * Tn + i0 + r] = row_max[r] + std::log(row_sum[r]);
          }
        }
      }
  }
}

template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int64_t B,
                        int64_t Tn, int64_t H, int64_t KV, int64_t D) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D, group = H / KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
  // One task per (batch row, kv head): it owns dK, dV of that kv head and dQ of its query heads.
#pragma omp parallel
  {
    std::vector<T> prob(kBlock * kBlock), dprob(kBlock * kBlock), delta(static_cast<size_t>(Tn));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g) {
        const T* K = qkv + b * Tn * S + (H + g) * D;
        const T* V = qkv + b * Tn * S + (H + KV + g) * D;
        T* dK = dqkv + b * Tn * S + (H + g) * D;
        T* dV = dqkv + b * Tn * S + (H + KV + g) * D;
        for (int64_t t = 0; t < Tn; ++t)
          for (int64_t d = 0; d < D; ++d) dK[t * S + d] = dV[t * S + d] = T(0);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const T* Q = qkv + b * Tn * S + h * D;
          T* dQ = dqkv + b * Tn * S + h * D;
          const T* O = out + b * Tn * HD + h * D;
          const T* dO = dout + b * Tn * HD + h * D;
          const T* L = lse + (b * H + h) * Tn;
          for (int64_t t = 0; t < Tn; ++t) {
            T s = 0;
            for (int64_t d = 0; d < D; ++d) {
              s += dO[t * HD + d] * O[t * HD + d];
              dQ[t * S + d] = T(0);
            }
            delta[size_t(t)] = s;  // Σ_d dO·O = Σ_j P_ij·dP_ij
          }
          for (int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
            const int64_t nq = std::min(kBlock, Tn - i0);
            for (int64_t j0 = 0; j0 < i0 + nq; j0 += kBlock) {
              const int64_t nk = std::min(kBlock, Tn - j0);
              gemm<T>(false, true, nq, nk, D, scale, Q + i0 * S, S, K + j0 * S, S, T(0), prob.data(), kBlock);
              for (int64_t r = 0; r < nq; ++r) {
                T* p = prob.data() + r * kBlock;
                const int64_t allowed = std::max<int64_t>(0, std::min(nk, i0 + r - j0 + 1));
                for (int64_t k = 0; k < allowed; ++k) p[k] = exp_fast(p[k] - L[i0 + r]);
                std::fill(p + allowed, p + nk, T(0));
              }
              // dV_j += Pᵀ·dO_i ; dP = dO_i·V_jᵀ
              gemm<T>(true, false, nk, D, nq, T(1), prob.data(), kBlock, dO + i0 * HD, HD, T(1), dV + j0 * S, S);
              gemm<T>(false, true, nq, nk, D, T(1), dO + i0 * HD, HD, V + j0 * S, S, T(0), dprob.data(), kBlock);
              // dS = P ∘ (dP − delta_i)
              for (int64_t r = 0; r < nq; ++r) {
                T *p = prob.data() + r * kBlock, *dp = dprob.data() + r * kBlock;
                const T dl = delta[size_t(i0 + r)];
                for (int64_t k = 0; k < nk; ++k) dp[k] = p[k] * (dp[k] - dl);
              }
              // dQ_i += scale·dS·K_j ; dK_j += scale·dSᵀ·Q_i
              gemm<T>(false, false, nq, D, nk, scale, dprob.data(), kBlock, K + j0 * S, S, T(1), dQ + i0 * S, S);
              gemm<T>(true, false, nk, D, nq, scale, dprob.data(), kBlock, Q + i0 * S, S, T(1), dK + j0 * S, S);
            }
          }
        }
      }
  }
}

template void attention_forward<float>(float*, float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_forward<double>(double*, double*, const double*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_backward<float>(float*, const float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_backward<double>(double*, const double*, const double*, const double*, const double*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace origami
