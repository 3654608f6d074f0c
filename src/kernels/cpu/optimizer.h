// The optimizer's element-wise kernels (train/optimizer.h and the gradient norm of
// parallel/data_parallel.h call them): each runs on the calling thread over one contiguous run of
// elements; the callers split their buffers over the threads. The CUDA twins are in
// kernels/cuda/cuda_kernels.h ("Optimizer").
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace origami {

// One AdamW step's scalars. keep = 1 − lr·wd (1 for vectors), step_size = lr/(1 − β1^t),
// inv_sqrt_bc2 = 1/√(1 − β2^t); the gradients enter as g·grad_scale (the clipping coefficient).
struct AdamWScalars {
  float b1, b2, step_size, inv_sqrt_bc2, eps, keep, grad_scale;
};

// w, m, v updated in place over n elements (PyTorch's AdamW, decoupled weight decay):
//   m = β1·m + (1−β1)·g,  v = β2·v + (1−β2)·g²,  w = keep·w − step_size·m/(√v·inv_sqrt_bc2 + ε).
// With `low` given, low[i] = to_bf16(w[i]) too: the GEMMs' bf16 copy written while the new values are
// in cache (one pass over the weights less than refreshing the copy afterwards).
void adamw_update(float* w, bf16* low, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);

// x[0..n) = 0 with streaming stores, which do not read the lines first nor keep them in cache: a step's
// gradients, cleared at its start, are next written by the backward, after the forward's activations
// have passed through the cache (a single-threaded memset of GPT-2 124M's 496 MB of gradients took
// 64 ms on an AMX host, two threads of this 16: 6% of a bf16 step).
void zero_streaming(float* x, int64_t n);

// Σ x[i]² in double: the clipping norm's part (lane_sum's order, kernels/cpu/reduce.h). From 2^16
// elements on, x is read as 8 equal parts in lockstep, each summed in its own lanes, then the parts
// in order and the rest: more of a core's loads in flight (one stream leaves memory idle between its
// misses). On an AMX host's two cores, over GPT-2 124M's gradients, 15 → 23.5 GB/s. The result
// depends on n and the values only.
double sum_squares(const float* x, int64_t n);

}  // namespace origami
