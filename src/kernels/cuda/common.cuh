// What the .cu files share: error checks that throw origami::Error naming the call, the launch
// geometry helpers, and the bf16 bits ↔ __nv_bfloat16 view.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error.h"

namespace origami::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}
// After a launch: a bad configuration shows here, a fault at the next synchronising call.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

cudaStream_t cu_stream();  // context.cu: the one stream (stream() as its type)

// The block's threads' values reduced (every thread gets the result); blockDim.x a multiple of 32, ≤ 1024.
// A fixed tree, so a run repeats bit for bit.
template <typename V, typename Op>
__device__ V block_reduce(V v, V identity, Op op) {
  __shared__ V part[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // part may still be read by the previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? part[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline double block_sum(double v) {
  return block_reduce(v, 0.0, [](double a, double b) { return a + b; });
}
__device__ inline float block_max(float v) {
  return block_reduce(v, -INFINITY, [](float a, float b) { return a > b ? a : b; });
}

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace origami::cuda
