// Norms, activations, rotary embedding, embedding, the linear layer's bias parts and the optimizer
// update on the device (cuda_kernels.h). Each follows its CPU twin's formula; reductions over rows
// (dw, db, dwte) run in a fixed order, so a run repeats bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {
constexpr int kThreads = 256;

// Column sums over rows, accumulated: out[c] += Σ_n f(n, c), in two passes with a fixed order. Pass 1:
// block (x, r) of 32×8 threads sums rows [r·chunk, (r+1)·chunk) of 32 columns, each thread every 8th
// row, then the 8 partial sums in order; pass 2 adds the row chunks' sums per column in order.
constexpr int kChunks = 128;
template <typename F>
__global__ void column_chunk_sums(float* part, int64_t N, int64_t C, int64_t chunk, F f) {
  __shared__ float acc[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x, n0 = int64_t(blockIdx.y) * chunk;
  const int64_t n1 = n0 + chunk < N ? n0 + chunk : N;
  float s = 0.f;
  if (c < C)
    for (int64_t n = n0 + threadIdx.y; n < n1; n += 8) s += f(n, c);
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  for (int y = 1; y < 8; ++y) s += acc[y][threadIdx.x];
  part[blockIdx.y * C + c] = s;
}
__global__ void add_chunk_sums(float* out, const float* part, int chunks, int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.f;
  for (int r = 0; r < chunks; ++r) s += part[r * C + c];
  out[c] += s;
}
float* chunk_sums_scratch(int64_t C) {
  static auto& part = *new Buffer<float>;
  return grown(part, kChunks * C);
}
template <typename F>
void column_sums(float* out, int64_t N, int64_t C, const char* what, F f) {
  if (N == 0) return;
  float* part = chunk_sums_scratch(C);
  const int64_t chunk = std::max<int64_t>(64, (N + kChunks - 1) / kChunks);
  const int chunks = int((N + chunk - 1) / chunk);
  column_chunk_sums<<<dim3(blocks_for(C, 32), unsigned(chunks)), dim3(32, 8), 0, cu_stream()>>>(part, N, C,
                                                                                                 chunk, f);
  check_launch(what);
  add_chunk_sums<<<blocks_for(C, 128), 128, 0, cu_stream()>>>(out, part, chunks, C);
  check_launch(what);
}
}  // namespace

// ---- Norms: a block per row; the row statistics and backward's row sums in double ----
__global__ void layernorm_fwd(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                              int64_t C, double eps) {
  const float* xr = x + blockIdx.x * C;
  double s = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
  const double m = block_sum(s) / double(C);
  double v = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) v += (xr[c] - m) * (xr[c] - m);
  const float r = float(1.0 / sqrt(block_sum(v) / double(C) + eps)), mt = float(m);
  float* yr = y + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) yr[c] = (xr[c] - mt) * r * w[c] + b[c];
  if (threadIdx.x == 0) mean[blockIdx.x] = mt, rstd[blockIdx.x] = r;
}
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                       int64_t C, double eps) {
  if (N == 0) return;
  layernorm_fwd<<<unsigned(N), kThreads, 0, cu_stream()>>>(y, mean, rstd, x, w, b, C, eps);
  check_launch("layernorm_forward");
}

// dx += s·(dy·w − mean(dy·w) − x̂·mean(dy·w·x̂)), a block per row.
__global__ void layernorm_bwd_dx(float* dx, const float* dy, const float* x, const float* w, const float* mean,
                                 const float* rstd, int64_t C) {
  const int64_t n = blockIdx.x;
  const float *xr = x + n * C, *dyr = dy + n * C;
  const float m = mean[n], s = rstd[n];
  double sd = 0, sdx = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (xr[c] - m) * s, d = dyr[c] * w[c];
    sd += d, sdx += d * xh;
  }
  const float md = float(block_sum(sd) / double(C)), mdx = float(block_sum(sdx) / double(C));
  float* dxr = dx + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (xr[c] - m) * s;
    dxr[c] += s * (dyr[c] * w[c] - md - xh * mdx);
  }
}
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N == 0) return;
  layernorm_bwd_dx<<<unsigned(N), kThreads, 0, cu_stream()>>>(dx, dy, x, w, mean, rstd, C);
  check_launch("layernorm_backward dx");
  column_sums(dw, N, C, "layernorm_backward dw",
              [=] __device__(int64_t n, int64_t c) { return dy[n * C + c] * ((x[n * C + c] - mean[n]) * rstd[n]); });
  column_sums(db, N, C, "layernorm_backward db", [=] __device__(int64_t n, int64_t c) { return dy[n * C + c]; });
}

__global__ void rmsnorm_fwd(float* y, float* rstd, const float* x, const float* w, int64_t C, double eps) {
  const float* xr = x + blockIdx.x * C;
  double ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += double(xr[c]) * xr[c];
  const float s = float(1.0 / sqrt(block_sum(ss) / double(C) + eps));
  float* yr = y + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) yr[c] = xr[c] * s * w[c];
  if (threadIdx.x == 0) rstd[blockIdx.x] = s;
}
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C, double eps) {
  if (N == 0) return;
  rmsnorm_fwd<<<unsigned(N), kThreads, 0, cu_stream()>>>(y, rstd, x, w, C, eps);
  check_launch("rmsnorm_forward");
}

// y = x·s·w: dx += s·(dy·w − x̂·mean(dy·w·x̂)) with x̂ = x·s.
__global__ void rmsnorm_bwd_dx(float* dx, const float* dy, const float* x, const float* w, const float* rstd,
                               int64_t C) {
  const int64_t n = blockIdx.x;
  const float *xr = x + n * C, *dyr = dy + n * C;
  const float s = rstd[n];
  double sdx = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) sdx += dyr[c] * w[c] * (xr[c] * s);
  const float mdx = float(block_sum(sdx) / double(C));
  float* dxr = dx + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dxr[c] += s * (dyr[c] * w[c] - xr[c] * s * mdx);
}
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t C) {
  if (N == 0) return;
  rmsnorm_bwd_dx<<<unsigned(N), kThreads, 0, cu_stream()>>>(dx, dy, x, w, rstd, C);
  check_launch("rmsnorm_backward dx");
  column_sums(dw, N, C, "rmsnorm_backward dw",
              [=] __device__(int64_t n, int64_t c) { return dy[n * C + c] * (x[n * C + c] * rstd[n]); });
}

// ---- Activations ----
namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // √(2/π)
__device__ float gelu_of(float v) { return 0.5f * v * (1.f + tanhf(kGeluScale * (v + 0.044715f * v * v * v))); }
__device__ float gelu_slope(float v) {
  const float t = tanhf(kGeluScale * (v + 0.044715f * v * v * v));
  const float du = kGeluScale * (1.f + 3.f * 0.044715f * v * v);
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
}
}  // namespace

void gelu_forward(float* y, const float* x, int64_t n) {
  launch_each(n, "gelu_forward", [=] __device__(int64_t i) { y[i] = gelu_of(x[i]); });
}
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
  launch_each(n, "gelu_backward", [=] __device__(int64_t i) { dx[i] = dy[i] * gelu_slope(x[i]); });
}
void swiglu_forward(float* h, const float* gu, int64_t N, int64_t F) {
  launch_each(N * F, "swiglu_forward", [=] __device__(int64_t i) {
    const int64_t r = i / F, f = i % F;
    const float g = gu[r * 2 * F + f], u = gu[r * 2 * F + F + f];
    h[i] = g / (1.f + expf(-g)) * u;
  });
}
void swiglu_backward(float* dgu, const float* dh, const float* gu, int64_t N, int64_t F) {
  launch_each(N * F, "swiglu_backward", [=] __device__(int64_t i) {
    const int64_t r = i / F, f = i % F;
    const float g = gu[r * 2 * F + f], u = gu[r * 2 * F + F + f], d = dh[i];
    const float sig = 1.f / (1.f + expf(-g));
    dgu[r * 2 * F + F + f] = d * g * sig;
    dgu[r * 2 * F + f] = d * u * sig * (1.f + g * (1.f - sig));
  });
}

// ---- Rotary embedding: a thread per (token, q/k head, pair i) ----
Buffer<float> rope_table(const double* cos, const double* sin, int64_t max_T, int64_t half) {
  std::vector<float> host(size_t(max_T * half * 2));
  for (int64_t i = 0; i < max_T * half; ++i) host[size_t(2 * i)] = float(cos[i]), host[size_t(2 * i + 1)] = float(sin[i]);
  Buffer<float> table(host.size());
  copy_to_device(table.data(), host.data(), host.size() * sizeof(float));
  return table;
}
static void rotate(float* qkv, const float* cs, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos, float sign, const char* what) {
  const int64_t half = D / 2, S = (H + 2 * KV) * D, heads = H + KV;  // q heads then k heads; v untouched
  launch_each(B * T * heads * half, what, [=] __device__(int64_t e) {
    const int64_t i = e % half, h = (e / half) % heads, bt = e / (half * heads);
    const int64_t p = pos ? pos[bt] : bt % T;
    const float c = cs[2 * (p * half + i)], s = sign * cs[2 * (p * half + i) + 1];
    float* x = qkv + bt * S + h * D;
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  });
}
void rope_forward(float* qkv, const float* cs, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                  const int64_t* pos) {
  rotate(qkv, cs, B, T, H, KV, D, pos, 1.f, "rope_forward");
}
void rope_backward(float* dqkv, const float* cs, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos) {
  rotate(dqkv, cs, B, T, H, KV, D, pos, -1.f, "rope_backward");
}

// ---- Embedding: wte holds token ids [vocab_begin, vocab_begin + vocab_rows); others embed as zeros ----
void embedding_forward(float* x, const int32_t* tokens, int64_t tok_stride, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C, int64_t vocab_begin, int64_t vocab_rows, const int64_t* pos) {
  launch_each(B * T * C, "embedding_forward", [=] __device__(int64_t e) {
    const int64_t c = e % C, bt = e / C, b = bt / T, t = bt % T;
    const int64_t row = int64_t(tokens[b * tok_stride + t]) - vocab_begin;
    const float p = wpe ? wpe[(pos ? pos[bt] : t) * C + c] : 0.f;
    x[e] = (row >= 0 && row < vocab_rows ? wte[row * C + c] : 0.f) + p;
  });
}
// A thread per channel walks the tokens in order (the CPU's order): rows of the same token never race.
__global__ void embedding_bwd(float* dwte, float* dwpe, const float* dx, const int32_t* tokens, int64_t tok_stride,
                              int64_t B, int64_t T, int64_t C, int64_t vocab_begin, int64_t vocab_rows,
                              const int64_t* pos) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float d = dx[(b * T + t) * C + c];
      const int64_t row = int64_t(tokens[b * tok_stride + t]) - vocab_begin;
      if (row >= 0 && row < vocab_rows) dwte[row * C + c] += d;
      if (dwpe) dwpe[(pos ? pos[b * T + t] : t) * C + c] += d;
    }
}
void embedding_backward(float* dwte, float* dwpe, const float* dx, const int32_t* tokens, int64_t tok_stride,
                        int64_t B, int64_t T, int64_t C, int64_t vocab_begin, int64_t vocab_rows, const int64_t* pos) {
  if (B * T == 0) return;
  embedding_bwd<<<blocks_for(C, 64), 64, 0, cu_stream()>>>(dwte, dwpe, dx, tokens, tok_stride, B, T, C, vocab_begin,
                                                           vocab_rows, pos);
  check_launch("embedding_backward");
}

// ---- Linear layer: the GEMMs of kernels/cpu/matmul.h's meaning, the bias in fp32 ----
void linear_forward(float* y, Operand<float> x, Weights<float> w, const float* b, int64_t N, int64_t in, int64_t out,
                    bool w_in_out) {
  if (b) launch_each(N * out, "linear bias", [=] __device__(int64_t e) { y[e] = b[e % out]; });
  matmul(w.p, false, !w_in_out, N, out, in, 1.f, x.mat(in), w.mat(w_in_out ? out : in), b ? 1.f : 0.f, y, out);
}
void linear_backward(float* dx, float* dw, float* db, const float* dy, Operand<float> x, Weights<float> w, int64_t N,
                     int64_t in, int64_t out, bool w_in_out, bool accumulate_dx) {
  static auto& dy_low = *new Buffer<bf16>;  // dy rounded once for both GEMMs (bf16)
  Mat<float> g{dy, out};
  if (w.p == Precision::bf16) {
    g.low = grown(dy_low, N * out);
    cuda::round_to_bf16(dy_low.data(), dy, N * out);
  }
  if (dx) matmul(w.p, false, w_in_out, N, in, out, 1.f, g, w.mat(w_in_out ? out : in), accumulate_dx ? 1.f : 0.f, dx, in);
  if (dw) {
    if (!w_in_out) matmul(w.p, true, false, out, in, N, 1.f, g, x.mat(in), 1.f, dw, in);  // dW[out,in] += dyᵀ·x
    else matmul(w.p, true, false, in, out, N, 1.f, x.mat(in), g, 1.f, dw, out);          // dW[in,out] += xᵀ·dy
  }
  if (db) column_sums(db, N, out, "linear_backward db", [=] __device__(int64_t n, int64_t o) { return dy[n * out + o]; });
}

// ---- Optimizer ----
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, float b1, float b2, float step_size,
                  float inv_sqrt_bc2, float eps, float keep, float grad_scale) {
  launch_each(n, "adamw_update", [=] __device__(int64_t j) {
    const float gj = g[j] * grad_scale;
    m[j] = b1 * m[j] + (1.f - b1) * gj;
    v[j] = b2 * v[j] + (1.f - b2) * gj * gj;
    w[j] = w[j] * keep - step_size * m[j] / (sqrtf(v[j]) * inv_sqrt_bc2 + eps);
  });
}

// Σ x²: a fixed grid of blocks, each summing a strided share in double, then their partial sums on the host.
__global__ void sum_squares_kernel(double* part, const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += double(x[i]) * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}
double sum_squares(const float* x, int64_t n) {
  constexpr int kBlocks = 264;  // two per H100 multiprocessor
  static auto& part = *new Buffer<float>(2 * kBlocks);  // kBlocks doubles
  sum_squares_kernel<<<kBlocks, kThreads, 0, cu_stream()>>>(reinterpret_cast<double*>(part.data()), x, n);
  check_launch("sum_squares");
  double host[kBlocks];
  copy_to_host(host, part.data(), sizeof host);
  double total = 0;
  for (double p : host) total += p;
  return total;
}

}  // namespace origami::cuda
