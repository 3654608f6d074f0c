#include "model/layers/lm_head.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/reduce.h"

namespace origami {

template <typename T>
void merge_vocab_stats(T* out, const T* stats, int64_t k, int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    T m = stats[r * 3];
    for (int64_t j = 1; j < k; ++j) m = std::max(m, stats[(j * n + r) * 3]);
    double sum = 0, tgt = 0;
    for (int64_t j = 0; j < k; ++j) {
      const T* s = stats + (j * n + r) * 3;
      // A shard of padding only (max −∞, Σ 0) adds nothing; where every shard is (a whole stage's
      // slice under vocabulary parallelism merged over TP), s[0] − m would be −∞ − (−∞), NaN.
      if (s[0] != -std::numeric_limits<T>::infinity()) sum += double(s[1]) * std::exp(double(s[0] - m));
      tgt += double(s[2]);
    }
    out[r * 3] = m, out[r * 3 + 1] = T(sum), out[r * 3 + 2] = T(tgt);
  }
}

int64_t lm_head_chunk_rows(int64_t N, int64_t V) {
  // At most ~16M logits (64 MB in fp32) alive at once, in chunks of equal size: a small remainder
  // chunk runs its three GEMMs at a much lower rate (GPT-2, V=50257, N=256: 166+90 rows took 350 ms
  // for the three GEMMs, one chunk of 256 rows 318 ms).
  const int64_t max_rows = std::max<int64_t>(1, (int64_t(16) << 20) / V);
  const int64_t num_chunks = (N + max_rows - 1) / max_rows;
  return std::max<int64_t>(1, (N + num_chunks - 1) / num_chunks);
}

template <typename T>
double lm_head_loss(T* dx, T* dw, T* logits_out, const T* x, Id<Weights<T>> w, const int32_t* targets, int64_t N,
                    int64_t C, int64_t V, T grad_scale, std::vector<T>& scratch, const VocabShard<T>& shard) {
  const Precision p = w.p;
  const int64_t valid = shard.valid < 0 ? V : shard.valid, v0 = shard.vocab_begin;
  const int64_t chunk = lm_head_chunk_rows(N, V);
  if (int64_t(scratch.size()) < chunk * (V + 4)) scratch.resize(size_t(chunk * (V + 4)));
  double total = 0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    T* logits = scratch.data();
    T* stats = logits + chunk * V;  // [n][3]: max, Σ exp(logit − max), target logit
    T* local_max = stats + chunk * 3;  // [n]: this shard's max (stats are replaced by the whole vocabulary's)
    matmul<T>(p, false, true, n, V, C, T(1), {x + n0 * C, C}, w.mat(C), T(0), logits, V);
    if (logits_out) std::memcpy(logits_out + n0 * V, logits, size_t(n * V) * sizeof(T));
    // With dx, exp(logit − max) replaces the logit in place, so that dlogits need no second exp.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      T* lr = logits + r * V;
      // A shard of padding only (a small vocabulary over many ranks) contributes nothing: max −∞, Σ 0.
      const T m = valid > 0 ? lane_max(lr, valid) : -std::numeric_limits<T>::infinity();
      const int64_t t = int64_t(targets[n0 + r]) - v0;
      stats[r * 3 + 2] = t >= 0 && t < valid ? lr[t] : T(0);
      double sum = 0;
      if (dx) {
        for (int64_t v = 0; v < valid; ++v) lr[v] = exp_fast(lr[v] - m);
        sum = lane_sum<double>(valid, [lr](int64_t v) { return lr[v]; });
      } else {
        sum = lane_sum<double>(valid, [lr, m](int64_t v) { return exp_fast(lr[v] - m); });
      }
      stats[r * 3] = local_max[r] = m, stats[r * 3 + 1] = T(sum);
    }
    if (shard.combine) shard.combine(stats, n);
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t r = 0; r < n; ++r) {
      T* lr = logits + r * V;
      const double lse = double(stats[r * 3]) + std::log(double(stats[r * 3 + 1]));
      const bool counted = targets[n0 + r] >= 0;  // −1: the row predicts nothing (no loss, no gradient)
      if (counted) total += lse - double(stats[r * 3 + 2]);
      if (dx) {  // dlogits = grad_scale·exp(logit − lse) = grad_scale·exp(logit − max)·exp(max − lse); padding gets none
        const T coef = counted ? T(double(grad_scale) * std::exp(double(local_max[r]) - lse)) : T(0);
        for (int64_t v = 0; v < valid; ++v) lr[v] *= coef;
        for (int64_t v = valid; v < V; ++v) lr[v] = T(0);
        const int64_t t = int64_t(targets[n0 + r]) - v0;
        if (t >= 0 && t < valid) lr[t] -= grad_scale;
      }
    }
    if (dx) {
      thread_local std::vector<bf16> dlogits_low;  // dlogits rounded once, in place, for both GEMMs (bf16)
      const Mat<T> g = operand_in_place(p, logits, n, V, dlogits_low);
      matmul<T>(p, false, false, n, C, V, T(1), g, w.mat(C), T(0), dx + n0 * C, C);  // dx = dlogits·W
      matmul<T>(p, true, false, V, C, n, T(1), g, {x + n0 * C, C}, T(1), dw, C);           // dW += dlogitsᵀ·x
    }
  }
  return total;
}

#define INSTANTIATE(T)                                                                                            \
  template void merge_vocab_stats<T>(T*, const T*, int64_t, int64_t);                                            \
  template double lm_head_loss<T>(T*, T*, T*, const T*, Weights<T>, const int32_t*, int64_t, int64_t, int64_t, T, \
                                  std::vector<T>&, const VocabShard<T>&);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
