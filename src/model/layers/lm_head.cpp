#include "model/layers/lm_head.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace origami {

template <typename T>
void merge_vocab_stats(T* out, const T* stats, int64_t k, int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    T m = stats[r * 3];
    for (int64_t j = 1; j < k; ++j) m = std::max(m, stats[(j * n + r) * 3]);
    double sum = 0, tgt = 0;
    for (int64_t j = 0; j < k; ++j) {
      const T* s = stats + (j * n + r) * 3;
      sum += double(s[1]) * std::exp(double(s[0] - m));
      tgt += double(s[2]);
    }
    out[r * 3] = m, out[r * 3 + 1] = T(sum), out[r * 3 + 2] = T(tgt);
  }
}

template <typename T>
double lm_head_loss(T* dx, T* dw, T* logits_out, const T* x, const T* w, const int32_t* targets, int64_t N,
                    int64_t C, int64_t V, T grad_scale, std::vector<T>& scratch, const VocabShard<T>& shard) {
  const int64_t valid = shard.valid < 0 ? V : shard.valid, v0 = shard.vocab_begin;
  // Rows per chunk: at most ~8M logits (32 MB in fp32) alive at once.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(8) << 20) / V));
  if (int64_t(scratch.size()) < chunk * (V + 3)) scratch.resize(size_t(chunk * (V + 3)));
  double total = 0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    T* logits = scratch.data();
    T* stats = logits + chunk * V;  // [n][3]: max, Σ exp(logit − max), target logit
    gemm<T>(false, true, n, V, C, T(1), x + n0 * C, C, w, C, T(0), logits, V);
    if (logits_out) std::memcpy(logits_out + n0 * V, logits, size_t(n * V) * sizeof(T));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      const T* lr = logits + r * V;
      T m = lr[0];
      for (int64_t v = 1; v < valid; ++v) m = std::max(m, lr[v]);
      double sum = 0;
      for (int64_t v = 0; v < valid; ++v) sum += double(exp_fast(lr[v] - m));
      const int64_t t = int64_t(targets[n0 + r]) - v0;
      stats[r * 3] = m, stats[r * 3 + 1] = T(sum), stats[r * 3 + 2] = t >= 0 && t < valid ? lr[t] : T(0);
    }
    if (shard.combine) shard.combine(stats, n);
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t r = 0; r < n; ++r) {
      T* lr = logits + r * V;
      const double lse = double(stats[r * 3]) + std::log(double(stats[r * 3 + 1]));
      total += lse - double(stats[r * 3 + 2]);
      if (dx) {  // dlogits in place; padding columns get none
        const T lse_t = T(lse);
        for (int64_t v = 0; v < valid; ++v) lr[v] = grad_scale * exp_fast(lr[v] - lse_t);
        for (int64_t v = valid; v < V; ++v) lr[v] = T(0);
        const int64_t t = int64_t(targets[n0 + r]) - v0;
        if (t >= 0 && t < valid) lr[t] -= grad_scale;
      }
    }
    if (dx) {
      gemm<T>(false, false, n, C, V, T(1), logits, V, w, C, T(0), dx + n0 * C, C);  // dx = dlogits·W
      gemm<T>(true, false, V, C, n, T(1), logits, V, x + n0 * C, C, T(1), dw, C);   // dW += dlogitsᵀ·x
    }
  }
  return total;
}

#define INSTANTIATE(T)                                                                                            \
  template void merge_vocab_stats<T>(T*, const T*, int64_t, int64_t);                                            \
  template double lm_head_loss<T>(T*, T*, T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, T, \
                                  std::vector<T>&, const VocabShard<T>&);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
