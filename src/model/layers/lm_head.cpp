#include "model/layers/lm_head.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace origami {

template <typename T>
double lm_head_loss(T* dx, T* dw, T* logits_out, const T* x, const T* w, const int32_t* targets, int64_t N,
                    int64_t C, int64_t V, T grad_scale, std::vector<T>& scratch) {
  // Rows per chunk: at most ~8M logits (32 MB in fp32) alive at once.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(8) << 20) / V));
  if (int64_t(scratch.size()) < chunk * V) scratch.resize(size_t(chunk * V));
  double total = 0;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    T* logits = scratch.data();
    gemm<T>(false, true, n, V, C, T(1), x + n0 * C, C, w, C, T(0), logits, V);
    if (logits_out) std::memcpy(logits_out + n0 * V, logits, size_t(n * V) * sizeof(T));
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t r = 0; r < n; ++r) {
      T* lr = logits + r * V;
      T m = lr[0];
      for (int64_t v = 1; v < V; ++v) m = std::max(m, lr[v]);
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += double(exp_fast(lr[v] - m));
      const double lse = double(m) + std::log(sum);
      const int32_t tgt = targets[n0 + r];
      total += lse - double(lr[tgt]);
      if (dx) {  // dlogits in place
        const T lse_t = T(lse);
        for (int64_t v = 0; v < V; ++v) lr[v] = grad_scale * exp_fast(lr[v] - lse_t);
        lr[tgt] -= grad_scale;
      }
    }
    if (dx) {
      gemm<T>(false, false, n, C, V, T(1), logits, V, w, C, T(0), dx + n0 * C, C);  // dx = dlogits·W
      gemm<T>(true, false, V, C, n, T(1), logits, V, x + n0 * C, C, T(1), dw, C);   // dW += dlogitsᵀ·x
    }
  }
  return total;
}

template double lm_head_loss<float>(float*, float*, float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, float, std::vector<float>&);
template double lm_head_loss<double>(double*, double*, double*, const double*, const double*, const int32_t*, int64_t, int64_t, int64_t, double, std::vector<double>&);

}  // namespace origami
