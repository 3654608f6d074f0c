// LM head with fused softmax cross-entropy on the device (cuda_kernels.h; the CPU twin is
// model/layers/lm_head.h): per chunk of rows, logits = x·Wᵀ by one GEMM, then a block per row finds
// the max and Σ exp (in double), writes its loss and overwrites its logits with
// dlogits = grad_scale·(softmax − onehot(target)); two GEMMs give dx and dW. A target of −1 adds no
// loss and no gradient.
#include <algorithm>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {
constexpr int kThreads = 256;

__global__ void cross_entropy_kernel(float* logits, double* loss, const int32_t* targets, int64_t V, float grad_scale,
                                     bool grad) {
  float* lr = logits + blockIdx.x * V;
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, lr[v]);
  mx = block_max(mx);
  double s = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += double(expf(lr[v] - mx));
  const double lse = double(mx) + log(block_sum(s));
  const int32_t t = targets[blockIdx.x];
  const float target_logit = t >= 0 && t < V ? lr[t] : 0.f;
  __syncthreads();  // every thread has read lr[t] before the logits are overwritten below
  if (threadIdx.x == 0) loss[blockIdx.x] = t >= 0 ? lse - double(target_logit) : 0.0;
  if (!grad) return;
  const float coef = t >= 0 ? grad_scale : 0.f, shift = float(lse);
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    lr[v] = coef * expf(lr[v] - shift) - (v == t ? grad_scale : 0.f);
}
}  // namespace

double lm_head_loss(float* dx, float* dw, const float* x, Weights<float> w, const int32_t* targets, int64_t N, int64_t C,
                    int64_t V, float grad_scale, Buffer<float>& scratch) {
  if (N == 0) return 0.0;
  const Precision p = w.p;
  // Chunks of equal size with at most 2^28 logits (1 GiB) alive: the GPU has the memory, and its GEMMs
  // run well only on thousands of rows (the CPU's 16M-logit chunks are 333 rows of GPT-2).
  const int64_t max_rows = std::max<int64_t>(1, (int64_t(1) << 28) / V), chunks = (N + max_rows - 1) / max_rows;
  const int64_t chunk = (N + chunks - 1) / chunks;
  // logits [chunk, V], then the rows' losses (N doubles as 2N floats, 8-byte aligned)
  float* logits = grown(scratch, chunk * V + 2 * N + 1);
  double* loss = reinterpret_cast<double*>(scratch.data() + chunk * V + (chunk * V) % 2);  // 8-byte aligned
  static auto& low = *new Buffer<bf16>;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    matmul(p, false, true, n, V, C, 1.f, {x + n0 * C, C}, w.mat(C), 0.f, logits, V);
    cross_entropy_kernel<<<unsigned(n), kThreads, 0, cu_stream()>>>(logits, loss + n0, targets + n0, V, grad_scale,
                                                                   dx != nullptr);
    check_launch("lm_head cross_entropy");
    if (!dx) continue;
    Mat<float> g{logits, V};
    if (p == Precision::bf16) {  // dlogits rounded once for both GEMMs
      g.low = grown(low, chunk * V);
      cuda::round_to_bf16(low.data(), logits, n * V);
    }
    matmul(p, false, false, n, C, V, 1.f, g, w.mat(C), 0.f, dx + n0 * C, C);  // dx = dlogits·W
    matmul(p, true, false, V, C, n, 1.f, g, {x + n0 * C, C}, 1.f, dw, C);     // dW += dlogitsᵀ·x
  }
  std::vector<double> host(static_cast<size_t>(N));
  copy_to_host(host.data(), loss, host.size() * sizeof(double));
  double total = 0;
  for (double l : host) total += l;
  return total;
}

}  // namespace origami::cuda
