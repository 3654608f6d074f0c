// Fused causal attention on the device (cuda_kernels.h; the CPU twin is model/layers/attention.h):
// FlashAttention's scheme in fp32 on the CUDA cores — scores exist a key tile at a time, an online
// softmax keeps a running max and sum per query row, forward saves the log-sum-exp and backward
// recomputes probabilities from it. A thread owns one query row (forward, dq) or one key row (dk, dv);
// the tiles its block shares sit in shared memory. Rows are visible as on the CPU: key j ≤ query i,
// and with document ids the same document. Every sum runs in a fixed order: a run repeats bit for bit.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {
constexpr int kRows = 64;  // query rows (forward, dq) or key rows (dk, dv) per block: one per thread
constexpr int kTile = 32;  // rows of the shared tile a block walks

// Rows [r0, r0 + kTile) of one head into a shared tile (zeros past T): src is the head at t = 0 of its
// batch row, `row` the stride between tokens.
template <int D>
__device__ void load_tile(float (*tile)[D], const float* src, int64_t r0, int64_t T, int64_t row) {
  for (int e = threadIdx.x; e < kTile * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    tile[r][d] = r0 + r < T ? src[(r0 + r) * row + d] : 0.f;
  }
}

template <int D>
__device__ float dot(const float* a, const float* b) {
  float s = 0.f;
#pragma unroll
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// grid (⌈T/kRows⌉, H, B); thread: query i = blockIdx.x·kRows + threadIdx.x.
template <int D>
__global__ void forward_kernel(float* out, float* lse, const float* qkv, Dims m) {
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / m.group, i0 = int64_t(blockIdx.x) * kRows;
  const int64_t i = i0 + threadIdx.x, i1 = min(m.T, i0 + kRows);
  const bool active = i < m.T;
  __shared__ float ks[kTile][D], vs[kTile][D];
  float q[D], acc[D];
#pragma unroll
  for (int d = 0; d < D; ++d) q[d] = active ? qkv[m.q_at(b, i, h) + d] : 0.f, acc[d] = 0.f;
  float mx = -INFINITY, sum = 0.f;
  for (int64_t j0 = 0; j0 < i1; j0 += kTile) {
    const int64_t j1 = min(m.T, j0 + kTile);
    if (m.empty(b, i0, i1, j0, j1)) continue;  // the same for the whole block
    __syncthreads();
    load_tile<D>(ks, qkv + m.k_at(b, 0, g), j0, m.T, m.S);
    load_tile<D>(vs, qkv + m.v_at(b, 0, g), j0, m.T, m.S);
    __syncthreads();
    if (!active) continue;
    float s[kTile], tile_max = -INFINITY;
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const bool vis = j0 + r < j1 && m.visible(b, i, j0 + r);
      s[r] = vis ? dot<D>(q, ks[r]) * m.scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[r]);
    }
    if (tile_max == -INFINITY) continue;
    const float new_max = fmaxf(mx, tile_max), keep = expf(mx - new_max);  // exp(−∞) = 0 on the first tile
    sum *= keep;
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] *= keep;
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const float p = expf(s[r] - new_max);  // 0 where not visible
      sum += p;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] += p * vs[r][d];
    }
    mx = new_max;
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < D; ++d) out[m.o_at(b, i, h) + d] = acc[d] / sum;
  lse[m.l_at(b, i, h)] = mx + logf(sum);
}

// delta[b,h,i] = Σ_d dout·out (FlashAttention-2's D term): a thread per query row and head. With
// round_dout, dout as the bf16 kernels read it (rounded), so delta and dP agree.
__global__ void delta_kernel(float* delta, const float* dout, const float* out, int64_t B, Dims m, bool round_dout) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // over (b, h, i)
  if (e >= B * m.H * m.T) return;
  const int64_t i = e % m.T, h = (e / m.T) % m.H, b = e / (m.T * m.H);
  const int64_t at = (b * m.T + i) * m.H * m.D + h * m.D;
  float s = 0.f;
  for (int64_t d = 0; d < m.D; ++d)
    s += (round_dout ? __bfloat162float(__float2bfloat16_rn(dout[at + d])) : dout[at + d]) * out[at + d];
  delta[e] = s;
}

// dq_i = scale·Σ_j p_ij(dp_ij − delta_i)·k_j with p = exp(s − lse), dp = dout_i·v_j.
// grid (⌈T/kRows⌉, H, B); thread: query i.
template <int D>
__global__ void dq_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* delta,
                          Dims m) {
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / m.group, i0 = int64_t(blockIdx.x) * kRows;
  const int64_t i = i0 + threadIdx.x, i1 = min(m.T, i0 + kRows);
  const bool active = i < m.T;
  __shared__ float ks[kTile][D], vs[kTile][D];
  float q[D], dO[D], dq[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    q[d] = active ? qkv[m.q_at(b, i, h) + d] : 0.f;
    dO[d] = active ? dout[m.o_at(b, i, h) + d] : 0.f;
    dq[d] = 0.f;
  }
  const float L = active ? lse[m.l_at(b, i, h)] : 0.f, dl = active ? delta[m.l_at(b, i, h)] : 0.f;
  for (int64_t j0 = 0; j0 < i1; j0 += kTile) {
    const int64_t j1 = min(m.T, j0 + kTile);
    if (m.empty(b, i0, i1, j0, j1)) continue;
    __syncthreads();
    load_tile<D>(ks, qkv + m.k_at(b, 0, g), j0, m.T, m.S);
    load_tile<D>(vs, qkv + m.v_at(b, 0, g), j0, m.T, m.S);
    __syncthreads();
    if (!active) continue;
    for (int r = 0; r < kTile; ++r) {
      if (j0 + r >= j1 || !m.visible(b, i, j0 + r)) continue;
      const float p = expf(dot<D>(q, ks[r]) * m.scale - L), ds = p * (dot<D>(dO, vs[r]) - dl);
#pragma unroll
      for (int d = 0; d < D; ++d) dq[d] += ds * ks[r][d];
    }
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < D; ++d) dqkv[m.q_at(b, i, h) + d] = dq[d] * m.scale;
}

// dv_j = Σ_i p_ij·dout_i and dk_j = scale·Σ_i ds_ij·q_i over the query heads of kv head g and the
// queries i ≥ j. grid (⌈T/kRows⌉, KV, B); thread: key j.
template <int D>
__global__ void dkv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* delta,
                           Dims m) {
  const int64_t b = blockIdx.z, g = blockIdx.y, j0 = int64_t(blockIdx.x) * kRows;
  const int64_t j = j0 + threadIdx.x, j1 = min(m.T, j0 + kRows);
  const bool active = j < m.T;
  __shared__ float qs[kTile][D], os[kTile][D], Ls[kTile], dls[kTile];
  float k[D], v[D], dk[D], dv[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    k[d] = active ? qkv[m.k_at(b, j, g) + d] : 0.f;
    v[d] = active ? qkv[m.v_at(b, j, g) + d] : 0.f;
    dk[d] = dv[d] = 0.f;
  }
  for (int64_t h = g * m.group; h < (g + 1) * m.group; ++h)
    for (int64_t i0 = j0; i0 < m.T; i0 += kTile) {  // queries before j0 see no key here
      const int64_t i1 = min(m.T, i0 + kTile);
      if (m.empty(b, i0, i1, j0, j1)) continue;
      __syncthreads();
      load_tile<D>(qs, qkv + m.q_at(b, 0, h), i0, m.T, m.S);
      load_tile<D>(os, dout + m.o_at(b, 0, h), i0, m.T, m.H * m.D);
      if (threadIdx.x < kTile && i0 + threadIdx.x < m.T)
        Ls[threadIdx.x] = lse[m.l_at(b, i0 + threadIdx.x, h)], dls[threadIdx.x] = delta[m.l_at(b, i0 + threadIdx.x, h)];
      __syncthreads();
      if (!active) continue;
      for (int r = 0; r < kTile; ++r) {
        if (i0 + r >= i1 || !m.visible(b, i0 + r, j)) continue;
        const float p = expf(dot<D>(qs[r], k) * m.scale - Ls[r]), ds = p * (dot<D>(os[r], v) - dls[r]);
#pragma unroll
        for (int d = 0; d < D; ++d) dv[d] += p * os[r][d], dk[d] += ds * qs[r][d];
      }
    }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < D; ++d) dqkv[m.k_at(b, j, g) + d] = dk[d] * m.scale, dqkv[m.v_at(b, j, g) + d] = dv[d];
}

}  // namespace

void attention_delta(float* delta, const float* dout, const float* out, int64_t B, const Dims& m, bool round_dout) {
  delta_kernel<<<blocks_for(B * m.H * m.T, 256), 256, 0, cu_stream()>>>(delta, dout, out, B, m, round_dout);
  check_launch("attention delta");
}

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KV,
                       int64_t D, const int32_t* doc) {
  if (B * T == 0) return;
  const Dims m = dims(T, H, KV, D, doc);
  with_head_dim(D, [&]<int HD>() {
    forward_kernel<HD><<<dim3(blocks_for(T, kRows), unsigned(H), unsigned(B)), kRows, 0, cu_stream()>>>(out, lse,
                                                                                                       qkv, m);
  });
  check_launch("attention_forward");
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        float* delta, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const int32_t* doc) {
  if (B * T == 0) return;
  const Dims m = dims(T, H, KV, D, doc);
  attention_delta(delta, dout, out, B, m, false);
  with_head_dim(D, [&]<int HD>() {
    dq_kernel<HD><<<dim3(blocks_for(T, kRows), unsigned(H), unsigned(B)), kRows, 0, cu_stream()>>>(dqkv, dout, qkv,
                                                                                                   lse, delta, m);
    check_launch("attention_backward dq");
    dkv_kernel<HD><<<dim3(blocks_for(T, kRows), unsigned(KV), unsigned(B)), kRows, 0, cu_stream()>>>(dqkv, dout,
                                                                                                    qkv, lse, delta, m);
  });
  check_launch("attention_backward dk dv");
}

}  // namespace origami::cuda
