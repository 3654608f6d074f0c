// What the .cu files share: error checks that throw origami::Error naming the call, the launch
// geometry helpers, and the bf16 bits ↔ __nv_bfloat16 view.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "kernels/cuda/cuda_kernels.h"

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

// Grow-only scratch: b holds at least n elements afterwards. Scratch buffers are process-long statics,
// made with `static auto& b = *new Buffer<T>` (never destroyed: at exit the CUDA runtime may already be
// gone). Reusing one across calls is safe because every kernel runs on the one stream, in order, and
// growing frees the old memory with cudaFree, which first waits for the device.
template <typename T>
T* grown(Buffer<T>& b, int64_t n) {
  if (b.size() < size_t(n)) b = Buffer<T>(size_t(n));
  return b.data();
}

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// f(i) for i < n, a thread each (element-wise kernels as device lambdas), queued on the stream.
template <typename F>
__global__ void for_each(int64_t n, F f) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) f(i);
}
template <typename F>
void launch_each(int64_t n, const char* what, F f) {
  if (n == 0) return;
  for_each<<<blocks_for(n, 256), 256, 0, cu_stream()>>>(n, f);
  check_launch(what);
}

}  // namespace origami::cuda
