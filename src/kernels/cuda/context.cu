// Device, stream and memory (cuda_kernels.h), and the GEMM through cuBLASLt.
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {
void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(cat("cuBLASLt: ", what, ": status ", int(s)));
}

// One stream, one cuBLASLt handle and its workspace for the process (created on first use).
struct Context {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  static constexpr size_t kWorkspace = size_t(32) << 20;  // cuBLASLt's advice for Hopper
  Context() {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_lt(cublasLtCreate(&lt), "cublasLtCreate");
    check(cudaMalloc(&workspace, kWorkspace), "cudaMalloc (cuBLASLt workspace)");
  }
};
Context& ctx() {
  static Context c;
  return c;
}
}  // namespace

cudaStream_t cu_stream() { return ctx().stream; }
void* stream() { return ctx().stream; }
void synchronize() { check(cudaStreamSynchronize(ctx().stream), "cudaStreamSynchronize"); }

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    cudaGetLastError();  // clear it
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

std::string device_name() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  return cat(p.name, ", sm_", p.major, p.minor, ", ", (p.totalGlobalMem + (size_t(1) << 29)) >> 30, " GiB");
}

template <typename T>
Buffer<T>::Buffer(size_t n) : n_(n) {
  if (n) check(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), "cudaMalloc");
}
template <typename T>
Buffer<T>::~Buffer() {
  if (p_) cudaFree(p_);
}
template <typename T>
Buffer<T>& Buffer<T>::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_, n_ = o.n_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}
template class Buffer<float>;
template class Buffer<double>;
template class Buffer<bf16>;
template class Buffer<int32_t>;
template class Buffer<int64_t>;

// On our stream, then waited for: a plain cudaMemcpy runs on the legacy default stream, which our
// non-blocking stream does not wait for, and from pageable memory it may return before the data lands.
void copy_to_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cu_stream()), "cudaMemcpyAsync to device");
  synchronize();
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cu_stream()), "cudaMemcpyAsync to host");
  synchronize();
}
void fill_zero(void* dst, size_t bytes) { check(cudaMemsetAsync(dst, 0, bytes, cu_stream()), "cudaMemsetAsync"); }

// ---- bf16 rounding ----
__global__ void round_kernel(__nv_bfloat16* dst, const float* src, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __float2bfloat16_rn(src[i]);
}
void round_to_bf16(bf16* dst, const float* src, int64_t n) {
  if (n == 0) return;
  round_kernel<<<blocks_for(n, 256), 256, 0, cu_stream()>>>(reinterpret_cast<__nv_bfloat16*>(dst), src, n);
  check_launch("round_to_bf16");
}

// ---- GEMM ----
namespace {
// A cuBLASLt plan for one shape: the descriptors and the heuristic's first algorithm, kept per shape
// (layer shapes repeat every micro-batch; an MoE expert's rows vary with the routing, so the cache is
// emptied when it reaches kMaxPlans).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void destroy() const {
    if (op) cublasLtMatmulDescDestroy(op);
    for (auto l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
  }
};
constexpr size_t kMaxPlans = 4096;
using GemmKey = std::tuple<bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t, uint32_t,
                           uint32_t>;

// The largest power of two ≤ 256 dividing the address: cuBLASLt's heuristic otherwise assumes 256-byte
// aligned operands, and a block of a wider matrix (an LM-head chunk, a head) need not be.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ[N,M] = op(B)ᵀ·op(A)ᵀ: cuBLASLt's first operand is
// our B (a row-major X with stride ld is the column-major Xᵀ with the same ld), its second our A.
const GemmPlan& plan_for(bool bf16_in, bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                         int64_t ldc, const void* a, const void* b, const void* c) {
  static std::map<GemmKey, GemmPlan> plans;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const GemmKey key{bf16_in, ta, tb, M, N, K, lda, ldb, ldc, alignment(a), alignment(b), alignment(c)};
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  if (plans.size() >= kMaxPlans) {  // a queued matmul keeps no reference to its descriptors
    for (auto& [k, p] : plans) p.destroy();
    plans.clear();
  }
  GemmPlan g;
  const cudaDataType_t in = bf16_in ? CUDA_R_16BF : CUDA_R_32F;
  check_lt(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "TRANSB");
  // Stored shapes, column-major: our B is [N,K] (no transpose) or [K,N]; our A [K,M] or [M,K].
  check_lt(cublasLtMatrixLayoutCreate(&g.a, in, tb ? K : N, tb ? N : K, ldb), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&g.b, in, ta ? M : K, ta ? K : M, lda), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&g.c, CUDA_R_32F, N, M, ldc), "layout C");
  cublasLtMatmulPreference_t pref;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  size_t ws = Context::kWorkspace;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
           "workspace");
  // Our B is cuBLASLt's A and our A its B (see above); D is C.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligned[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, std::get<10>(key)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, std::get<9>(key)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, std::get<11>(key)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, std::get<11>(key)}};
  for (const auto& [attr, bytes] : aligned)
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof bytes), "alignment");
  cublasLtMatmulHeuristicResult_t h{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(ctx().lt, g.op, g.a, g.b, g.c, g.c, pref, 1, &h, &found), "heuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) {
    g.destroy();
    throw Error(cat("cuBLASLt: no algorithm for ", M, "x", N, "x", K));
  }
  g.algo = h.algo;
  return plans.emplace(key, g).first->second;
}

__global__ void round_rows(__nv_bfloat16* dst, const float* src, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < rows * cols) dst[i] = __float2bfloat16_rn(src[i / cols * ld + i % cols]);
}

// A bf16 copy of an operand stored [rows, cols] with stride ld: its own copy when given, else rounded
// into a compact scratch (stride cols).
struct Rounded {
  const void* p;
  int64_t ld;
};
Rounded rounded(Mat<float> m, int64_t rows, int64_t cols, Buffer<bf16>& scratch) {
  if (m.low) return {m.low, m.ld};
  grown(scratch, rows * cols);
  round_rows<<<blocks_for(rows * cols, 256), 256, 0, cu_stream()>>>(reinterpret_cast<__nv_bfloat16*>(scratch.data()),
                                                                     m.v, rows, cols, m.ld);
  check_launch("bf16 operand rounding");
  return {scratch.data(), cols};
}
// C = beta * C over [rows, cols] with stride ld: the whole product when K is 0 (cuBLASLt takes no
// empty inner dimension). beta 0 writes zeros, so NaN in C does not survive, as in BLAS.
__global__ void scale_rows(float* C, int64_t rows, int64_t cols, int64_t ld, float beta) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  float& c = C[i / cols * ld + i % cols];
  c = beta == 0.f ? 0.f : beta * c;
}
}  // namespace

void matmul(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Mat<float> A, Mat<float> B,
            float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0 || (K == 0 && beta == 1.f)) return;  // nothing to add
  if (K == 0) {
    scale_rows<<<blocks_for(M * N, 256), 256, 0, cu_stream()>>>(C, M, N, ldc, beta);
    return check_launch("matmul with K = 0");
  }
  const void *a = A.v, *b = B.v;
  int64_t lda = A.ld, ldb = B.ld;
  static auto& a_low = *new Buffer<bf16>;  // rounding scratch (grown(): common.cuh)
  static auto& b_low = *new Buffer<bf16>;
  if (p == Precision::bf16) {
    const Rounded ra = rounded(A, ta ? K : M, ta ? M : K, a_low), rb = rounded(B, tb ? N : K, tb ? K : N, b_low);
    a = ra.p, lda = ra.ld, b = rb.p, ldb = rb.ld;
  }
  const GemmPlan& g = plan_for(p == Precision::bf16, ta, tb, M, N, K, lda, ldb, ldc, a, b, C);
  check_lt(cublasLtMatmul(ctx().lt, g.op, &alpha, b, g.a, a, g.b, &beta, C, g.c, C, g.c, &g.algo, ctx().workspace,
                          Context::kWorkspace, ctx().stream),
           "cublasLtMatmul");
}

}  // namespace origami::cuda
