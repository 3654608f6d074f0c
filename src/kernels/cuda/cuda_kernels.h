// The CUDA side of the kernel seam (issue 34): every layer kernel of model/layers/*.h and the optimizer's
// update, with the CPU kernel's signature and meaning, on device pointers. A kernel here computes what
// its CPU twin computes (same formulas, same rounding points in bf16); tests/gpu/test_cuda_kernels.cpp
// checks each against its twin on the device. This header is plain C++ (no CUDA headers), so code
// built by the host compiler calls these; the definitions are in the .cu files beside it.
//
// Every call is queued on one stream (stream()) and returns without waiting, except those that return
// a host value (lm_head_loss, sum_squares: the metrics need it) and the copies to the host. Sizes and
// layouts: as in the CPU headers named at each group.
#pragma once
#include <cstddef>
#include <climits>
#include <cstdint>
#include <string>

#include <vector>

#include "kernels/cpu/matmul.h"
#include "model/config.h"
#include "model/layers/moe.h"

namespace origami::cuda {

// ---- Device, stream, memory ----
// The number of CUDA devices; 0 when there is no driver or no device (why: in *why, if given).
int device_count(std::string* why = nullptr);
// "NVIDIA H100 80GB HBM3, sm_90, 80 GiB" for the current device.
std::string device_name();
void* stream();  // the cudaStream_t every kernel here runs on
void synchronize();

// Device memory, owned (freed on destruction), moved not copied. Elements of T, uninitialised.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n);
  ~Buffer();
  Buffer(Buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};
// Host ↔ device copies of n elements (they wait for the stream, then copy).
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void fill_zero(void* dst, size_t bytes);  // queued

// ---- GEMM (kernels/cpu/matmul.h): C = alpha·op(A)·op(B) + beta·C, row-major, strides as there ----
// cuBLASLt. fp32: fp32 products and accumulation (no TF32, so it agrees with the CPU to fp32 rounding).
// bf16: both operands rounded to bf16 (a weight through its copy when Mat::low is given, else rounded
// here), accumulation and C in fp32 — the CPU bf16 matmul's rounding points.
void matmul(Precision p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Mat<float> A,
            Mat<float> B, float beta, float* C, int64_t ldc);
// dst[i] = bf16(src[i]), round to nearest even (kernels/cpu/bf16.h's conversion).
void round_to_bf16(bf16* dst, const float* src, int64_t n);

// ---- Linear layer (model/layers/linear.h), W's precision as there ----
void linear_forward(float* y, Operand<float> x, Weights<float> w, const float* b, int64_t N, int64_t in, int64_t out,
                    bool w_in_out);
void linear_backward(float* dx, float* dw, float* db, const float* dy, Operand<float> x, Weights<float> w, int64_t N,
                     int64_t in, int64_t out, bool w_in_out, bool accumulate_dx = false);

// ---- Norms (model/layers/norm.h): dx += , dw/db += ----
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t N,
                       int64_t C, double eps);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C, double eps);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t C);

// ---- Activations (model/layers/activation.h): backward overwrites ----
void gelu_forward(float* y, const float* x, int64_t n);
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n);
void swiglu_forward(float* h_NF, const float* gu_NF2, int64_t N, int64_t F);
void swiglu_backward(float* dgu_NF2, const float* dh_NF, const float* gu_NF2, int64_t N, int64_t F);

// ---- Rotary embedding (model/layers/rope.h), in place; cos_sin: [max_T, D/2] pairs (cos, sin) ----
// Built from the CPU's double table (RopeTable) by rope_table.
Buffer<float> rope_table(const double* cos, const double* sin, int64_t max_T, int64_t half);
void rope_forward(float* qkv, const float* cos_sin, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                  const int64_t* pos = nullptr);
void rope_backward(float* dqkv, const float* cos_sin, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos = nullptr);

// ---- Embedding (model/layers/embedding.h, its vocabulary-parallel form too); backward += in the CPU's
// summation order ----
void embedding_forward(float* x, const int32_t* tokens, int64_t tok_stride, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C, int64_t vocab_begin = 0, int64_t vocab_rows = INT64_MAX,
                       const int64_t* pos = nullptr);
void embedding_backward(float* dwte, float* dwpe, const float* dx, const int32_t* tokens, int64_t tok_stride,
                        int64_t B, int64_t T, int64_t C, int64_t vocab_begin = 0, int64_t vocab_rows = INT64_MAX,
                        const int64_t* pos = nullptr);

// ---- Causal attention (model/layers/attention.h), fused, online softmax, GQA, document masks ----
// Forward writes out_BTHD and lse_BHT; backward overwrites dqkv_BTS. scratch_BHT: B·H·T floats (the
// rows' Σ dout·out). Head dims 16, 32, 64 and 128; H a multiple of KV (else an Error).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KV,
                       int64_t D, const int32_t* doc = nullptr);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        float* scratch_BHT, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                        const int32_t* doc = nullptr);

// In bf16 on the tensor cores (FlashAttention-2's rounding points, attention_bf16.cu): q, k, v rounded to
// bf16 as read, scores and softmax in fp32, probabilities rounded for P·V; backward rounds dout, P and dS
// for its products. Same arguments and layouts as above (fp32 in and out).
void attention_forward_bf16(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KV,
                            int64_t D, const int32_t* doc = nullptr);
void attention_backward_bf16(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                             float* scratch_BHT, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D,
                             const int32_t* doc = nullptr);

// ---- LM head with cross-entropy (model/layers/lm_head.h, one vocabulary shard) ----
// In chunks of at most 2^28 logits (lm_head.cu); scratch grows as needed. A target of −1 adds nothing, one
// outside [0, V) the loss with no target logit (another shard's, as on the CPU). Returns Σ loss over rows
// with a target (waits for the stream).
double lm_head_loss(float* dx, float* dw, const float* x, Weights<float> w, const int32_t* targets, int64_t N, int64_t C,
                    int64_t V, float grad_scale, Buffer<float>& scratch);

// ---- Mixture-of-experts MLP on one device (model/layers/moe.h's one-rank moe_forward / moe_backward) ----
// Routing as there (softmax or sigmoid scores, top K with ties to the lower expert, renormalised
// weights), dropless (no capacity, no router bias), aux loss `micro` or none, z-loss; each expert's
// rows one GEMM pair through cuBLASLt. The rows per expert come back to the host once per forward
// (the GEMMs' sizes). Experts' weights as in moe.h's legend, in their precision.
struct MoeDeviceCache {
  Buffer<float> logits_NE, lse_N, score_NK, weight_NK, frac_E;
  Buffer<int32_t> expert_NK, row_NK;  // chosen experts, best first; each assignment's permuted row
  std::vector<int64_t> count_E;       // rows per expert (host)
  Buffer<float> xe_RC, gu_R2F, act_RF, y_RC;
  double aux = 0, z = 0;              // coefficient-weighted router losses
  // Work buffers of the calls, kept between them: the counts and the router losses' per-token terms
  // (forward); the gradients of the expert side, the routing weights and the logits (backward).
  Buffer<int64_t> count_dev;
  Buffer<double> terms_N2;
  Buffer<float> dye_RC, dweight_NK, dgu_R2F, dact_RF, dlogits_NE;
};
void moe_forward(float* out_NC, MoeDeviceCache& cache, const float* x_NC, const float* gate_EC, Weights<float> experts,
                 const MoeSizes& s, const MoeRouting& r);
// dx overwritten, dgate and dexperts accumulated (+=); loss_scale multiplies the router losses' gradient.
void moe_backward(float* dx_NC, float* dgate_EC, float* dexperts, const float* dout_NC, MoeDeviceCache& cache,
                  const float* x_NC, const float* gate_EC, Weights<float> experts, const MoeSizes& s,
                  const MoeRouting& r, float loss_scale);

// ---- Optimizer (kernels/cpu/optimizer.h): one segment's AdamW update on g·grad_scale ----
// (AdamWScalars' fields as arguments; the CPU kernel's bf16 copy has no device twin yet: Params has
// no device buffers.)
// keep = 1 − lr·wd (1 for vectors), step_size = lr/(1 − β1^t), inv_sqrt_bc2 = 1/√(1 − β2^t).
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, float b1, float b2, float step_size,
                  float inv_sqrt_bc2, float eps, float keep, float grad_scale);
// Σ x², summed in double in a fixed order (the clipping norm). Waits for the stream.
double sum_squares(const float* x, int64_t n);

}  // namespace origami::cuda
