#include "kernels/cpu/gemm_bf16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"

namespace origami {

namespace {

// One call's arguments but the pointers: the key of the path choice and of the oneDNN primitive.
struct Shape {
  bool ta, tb;
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  bool bias = false;  // a bias row added to C's every row (beta 0)
  bool operator==(const Shape&) const = default;
};

struct ShapeHash {
  size_t operator()(const Shape& s) const {
    size_t h = size_t(s.ta) * 2 + size_t(s.tb);
    for (int64_t v : {s.M, s.N, s.K, s.lda, s.ldb, s.ldc}) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return (h * 1000003u ^ std::hash<float>{}(s.alpha) * 31u ^ std::hash<float>{}(s.beta)) * 2 + size_t(s.bias);
  }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- portable path: widen to fp32 block by block, then gemm<float> --------------------------------

// Both widened blocks of one sub-GEMM fit in this many floats (16 MiB), the scratch's largest size.
// Measured on GPT-2's shapes against 4 MiB (more, narrower sub-GEMMs, each packing its operands
// again) and against pieces that each thread widens and multiplies alone (cache-local, but more
// sub-GEMMs): both cost more on one core, neither less on two.
constexpr int64_t kScratchFloats = int64_t(1) << 22;
// Conversions of at least this many elements (a panel, a strided operand) spread their rows over the threads.
constexpr int64_t kThreadedConversion = int64_t(1) << 16;

float* scratch(int64_t floats) {
  thread_local std::vector<float> buffer;  // grows to the largest need, kept for the next calls
  if (buffer.size() < size_t(floats)) buffer.resize(size_t(floats));
  return buffer.data();
}

// A block of an operand as gemm<float> reads it: fp32 values at bf16 precision, row stride ld.
struct Panel {
  const float* v;
  int64_t ld;
};

// The portable path reads an operand's fp32 values in place where they are exact, else converts.
bool read_in_place(const Bf16Operand& X) { return X.values && X.exact; }

// Rows i0 .. i0+ni and columns k0 .. k0+nk of a matrix seen as [I, K], in the layout the matrix is
// stored in: X is [I, K] with row stride X.ld when k_contiguous, else [K, I]. (A is op(A) = [M, K]
// stored untransposed when !ta; B is op(B)ᵀ = [N, K] stored that way when tb.) Exact fp32 values
// are read where they are; else the block is widened compactly into dst (its bf16 values, or its
// fp32 ones rounded to bf16's precision on the way), large blocks' rows spread over the threads.
Panel widen_panel(float* dst, const Bf16Operand& X, bool k_contiguous, int64_t i0, int64_t ni, int64_t k0,
                  int64_t nk) {
  const int64_t at = k_contiguous ? i0 * X.ld + k0 : k0 * X.ld + i0;
  if (read_in_place(X)) return {X.values + at, X.ld};
  const int64_t rows = k_contiguous ? ni : nk, cols = k_contiguous ? nk : ni;
  over_rows(rows, rows * cols >= kThreadedConversion, [&](int64_t r) {
    if (X.low) to_float(dst + r * cols, X.low + at + r * X.ld, cols);
    else to_bf16_precision(dst + r * cols, X.values + at + r * X.ld, cols);
  });
  return {dst, cols};
}

// Every element is widened exactly once, and each widened block is multiplied by one gemm<float>
// call — which packs both its operands again, so fewer, larger calls are better:
//  - where both operands are read in place, one call;
//  - where slices of K with both operands whole are deep enough (kc >= 256, or all of K), K is cut
//    into such slices and each is one call (one call in all when both fit);
//  - else (a side of tens of thousands: the LM head's vocabulary) the smaller operand's K-slice is
//    widened whole (all of K when it takes at most half the scratch) and the larger one in pieces
//    that fill the rest, one call each.
// Later slices accumulate into C with beta 1.
void portable_gemm(const Shape& call, const Bf16Operand& A, const Bf16Operand& B, float* C, const float* bias) {
  Shape s = call;
  if (s.bias) {  // C = the bias rows, then the product added to them
    fill_rows(s.M, s.N, bias, C, s.ldc);
    s.bias = false, s.beta = 1.f;
  }
  if (read_in_place(A) && read_in_place(B))
    return gemm<float>(s.ta, s.tb, s.M, s.N, s.K, s.alpha, A.values, A.ld, B.values, B.ld, s.beta, C, s.ldc);
  const bool a_whole = s.M <= s.N;
  const int64_t small = a_whole ? s.M : s.N, large = a_whole ? s.N : s.M;
  const int64_t kc_both = kScratchFloats / (s.M + s.N);
  const bool both_whole = kc_both >= std::min<int64_t>(s.K, 256);
  const int64_t kc_max = std::min(s.K, both_whole ? kc_both : std::max<int64_t>(1, kScratchFloats / 2 / small));
  const int64_t kc = ceil_div(s.K, ceil_div(s.K, kc_max));  // slices of equal depth
  const int64_t num_pieces = both_whole ? 1 : ceil_div(large, std::max<int64_t>(1, (kScratchFloats - small * kc) / kc));
  const int64_t piece = ceil_div(large, num_pieces);
  float* small_buf = scratch(small * kc + piece * kc);
  float* piece_buf = small_buf + small * kc;
  for (int64_t k0 = 0; k0 < s.K; k0 += kc) {
    const int64_t kb = std::min(kc, s.K - k0);
    const float beta = k0 == 0 ? s.beta : 1.f;  // later slices add to the first one's result
    const Panel whole = a_whole ? widen_panel(small_buf, A, !s.ta, 0, s.M, k0, kb)
                                : widen_panel(small_buf, B, s.tb, 0, s.N, k0, kb);
    for (int64_t p0 = 0; p0 < large; p0 += piece) {
      const int64_t pb = std::min(piece, large - p0);
      if (a_whole) {
        const Panel b = widen_panel(piece_buf, B, s.tb, p0, pb, k0, kb);
        gemm<float>(s.ta, s.tb, s.M, pb, kb, s.alpha, whole.v, whole.ld, b.v, b.ld, beta, C + p0, s.ldc);
      } else {
        const Panel a = widen_panel(piece_buf, A, !s.ta, p0, pb, k0, kb);
        gemm<float>(s.ta, s.tb, pb, s.N, kb, s.alpha, a.v, a.ld, whole.v, whole.ld, beta, C + p0 * s.ldc, s.ldc);
      }
    }
  }
}

// ---- oneDNN path ---------------------------------------------------------------------------------

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The operands' descriptors of a shape (M or K may be DNNL_RUNTIME_DIM_VAL).
struct Descs {
  dnnl::memory::desc a, b, c, bias;  // (bias: empty where none)
};
Descs describe(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool bias) {
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  return {dnnl::memory::desc({M, K}, dt::bf16, ta ? dims{1, lda} : dims{lda, 1}),
          dnnl::memory::desc({K, N}, dt::bf16, tb ? dims{1, ldb} : dims{ldb, 1}),
          dnnl::memory::desc({M, N}, dt::f32, dims{ldc, 1}),
          bias ? dnnl::memory::desc({1, N}, dt::f32, dims{N, 1}) : dnnl::memory::desc()};
}

struct OnednnMatmul {
  dnnl::matmul primitive;
  Descs operands;
  dnnl::memory::desc scratchpad;
  bool runtime_mk = false;  // M and K given at each call (the descriptors are made there)
};

// The matmul primitive of one shape and its implementation's name ("brg:avx512_core_amx_bf16",
// "gemm:jit", ...), or nothing where oneDNN has no bf16 matmul (below AVX-512) or only its reference
// loops, which are far slower than the portable path. A key of varying sizes (M and K of -1,
// varying_key) leaves M and K to each call (oneDNN's runtime dimensions: its gemm:jit kernels rather
// than the brgemm ones, which need them fixed), and the library keeps the scratchpad.
std::optional<OnednnMatmul> create_onednn(const Shape& s, std::string* impl) {
  const bool runtime_mk = s.M < 0;
  const int64_t M = runtime_mk ? DNNL_RUNTIME_DIM_VAL : s.M, K = runtime_mk ? DNNL_RUNTIME_DIM_VAL : s.K;
  const Descs d = describe(s.ta, s.tb, M, s.N, K, s.lda, s.ldb, s.ldc, s.bias);
  dnnl::primitive_attr attr;
  if (!runtime_mk) attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // a per-thread buffer, see run_onednn
  if (s.alpha != 1.f) attr.set_output_scales(0, {s.alpha});
  if (s.beta != 0.f) {  // C = alpha·AB + beta·C; without the post-op C is only written
    dnnl::post_ops ops;
    ops.append_sum(s.beta);
    attr.set_post_ops(ops);
  }
  try {
    const dnnl::matmul::desc md = s.bias ? dnnl::matmul::desc(d.a, d.b, d.bias, d.c) : dnnl::matmul::desc(d.a, d.b, d.c);
    const dnnl::matmul::primitive_desc pd(md, attr, cpu_engine());
    *impl = pd.impl_info_str();
    if (impl->starts_with("ref")) return std::nullopt;
    return OnednnMatmul{dnnl::matmul(pd), d, pd.scratchpad_desc(), runtime_mk};
  } catch (const dnnl::error&) {
    return std::nullopt;
  }
}

// Runs m on the call of shape s (whose M and K a runtime-dimension primitive takes from it).
void run_onednn(const OnednnMatmul& m, const Shape& s, const bf16* A, const bf16* B, float* C, const float* bias) {
  thread_local dnnl::stream stream(cpu_engine());
  thread_local std::vector<uint8_t> scratchpad;  // grows to the largest need, kept
  const dnnl::engine& e = cpu_engine();
  const Descs d = m.runtime_mk ? describe(s.ta, s.tb, s.M, s.N, s.K, s.lda, s.ldb, s.ldc, s.bias) : m.operands;
  std::unordered_map<int, dnnl::memory> args = {{DNNL_ARG_SRC, dnnl::memory(d.a, e, const_cast<bf16*>(A))},
                                                {DNNL_ARG_WEIGHTS, dnnl::memory(d.b, e, const_cast<bf16*>(B))},
                                                {DNNL_ARG_DST, dnnl::memory(d.c, e, C)}};
  if (s.bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(d.bias, e, const_cast<float*>(bias)));
  if (!m.runtime_mk) {  // a user scratchpad (create_onednn)
    if (scratchpad.size() < m.scratchpad.get_size()) scratchpad.resize(m.scratchpad.get_size());
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(m.scratchpad, e, scratchpad.data()));
  }
  m.primitive.execute(stream, args);
  stream.wait();
}

// ---- the choice ----------------------------------------------------------------------------------

Bf16GemmMode mode_from_env() {
  const std::string s = env_choice("ORIGAMI_BF16_GEMM", {"auto", "portable", "onednn"});
  if (s == "auto") return Bf16GemmMode::automatic;
  return s == "portable" ? Bf16GemmMode::portable : Bf16GemmMode::onednn;
}

std::atomic<Bf16GemmMode>& mode() {
  static std::atomic<Bf16GemmMode> m{mode_from_env()};
  return m;
}

struct Choice {
  Bf16GemmPath path;
  std::optional<OnednnMatmul> onednn;  // when path is onednn: the whole call's, or a row block's
  std::string onednn_impl;             // what oneDNN offered; empty when nothing
  int64_t block_rows = 0;              // > 0: the call runs as row blocks of this many rows (row_block_rows)
  std::optional<OnednnMatmul> last_block;  // the last block's, when it has fewer rows
};

// oneDNN's bf16 matmul accumulating into a C far larger than the cache (beta ≠ 0, 2²⁴ elements or
// more: 64 MiB of fp32) ran the LM head's dW += dlogitsᵀ·x (50304×768×256) at about 600 GFLOP/s on a
// Zen 5 host, against 830–900 for the same product in row blocks of 512 to 16384 rows, or with beta 0;
// oneDNN's fp32 sgemm runs it whole at full rate (and loses in blocks). So where oneDNN's bf16 path is
// chosen for such a call, it runs as row blocks of at most kBlockRows rows, all of one size but the
// last (which may be up to one row a block shorter), each block its own rows of C. The choice is the
// whole shape's (timed on a slab of its first rows), so every block takes the path the call took.
constexpr int64_t kBlockRows = 1024, kLargeAccumulation = int64_t(1) << 24;

int64_t row_block_rows(const Shape& s) {
  if (s.beta == 0.f || s.M <= kBlockRows || s.M * s.N < kLargeAccumulation) return 0;
  const int64_t blocks = (s.M + kBlockRows - 1) / kBlockRows;
  return (s.M + blocks - 1) / blocks;
}

Shape rows_of(Shape s, int64_t rows) {
  s.M = rows;
  return s;
}

// The call s on oneDNN's path as its choice says: whole, or row block by row block.
void run_choice(const Choice& c, const Shape& s, const bf16* A, const bf16* B, float* C, const float* bias) {
  if (c.block_rows == 0) return run_onednn(*c.onednn, s, A, B, C, bias);
  for (int64_t m0 = 0; m0 < s.M; m0 += c.block_rows) {
    const int64_t rows = std::min(c.block_rows, s.M - m0);
    run_onednn(rows == c.block_rows ? *c.onednn : *c.last_block, rows_of(s, rows), s.ta ? A + m0 : A + m0 * s.lda,
               B, C + m0 * s.ldc, bias);
  }
}

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Times both paths alternately on a slab of the shape — its first rows, at most 4M elements of C,
// beta 0, written to a scratch buffer — best of 3 to 7 runs (more while the runs are short), so a
// burst of load from elsewhere rarely decides. The portable path must be 20% faster to be kept: the
// two paths sum in different orders, so a shape where they are about as fast would otherwise take
// either from one process to the next, and runs (or the ranks of one) would not repeat each other's
// last bits.
bool onednn_is_faster(const Shape& s, const bf16* A, const bf16* B) {
  Shape slab = s;
  slab.M = std::min(s.M, std::max<int64_t>(1, (int64_t(1) << 22) / s.N));
  slab.beta = 0.f;
  slab.ldc = s.N;
  std::string impl;
  const auto matmul = create_onednn(slab, &impl);
  if (!matmul) return false;
  std::vector<float> C(size_t(slab.M * slab.N)), bias(size_t(s.bias ? s.N : 0), 0.f);
  double onednn = std::numeric_limits<double>::infinity(), portable = onednn, spent = 0;
  for (int run = 0; run < 7 && (run < 3 || spent < 0.05); ++run) {
    const double t_onednn = seconds([&] { run_onednn(*matmul, slab, A, B, C.data(), bias.data()); });
    const double t_portable = seconds([&] { portable_gemm(slab, {A, s.lda}, {B, s.ldb}, C.data(), bias.data()); });
    onednn = std::min(onednn, t_onednn), portable = std::min(portable, t_portable);
    spent += t_onednn + t_portable;
  }
  return onednn < 1.2 * portable;
}

// Below this many multiply-adds a GEMM takes microseconds, and timing it decides by noise: such
// shapes follow the choice made once for a GPT-2 projection at 512 tokens (512×768×768).
constexpr int64_t kTimedWork = int64_t(1) << 24;

// That layer-sized GEMM, compact operands; also the shape the startup line describes.
constexpr Shape kLayerGemm{false, false, 512, 768, 768, 768, 768, 768, 1.f, 0.f};

// Constant operands of kLayerGemm (the speed does not depend on the values).
struct LayerGemmOperands {
  std::vector<bf16> a = std::vector<bf16>(size_t(kLayerGemm.M * kLayerGemm.K), to_bf16(0.01f));
  std::vector<bf16> b = std::vector<bf16>(size_t(kLayerGemm.K * kLayerGemm.N), to_bf16(0.02f));
};

// The small shapes' path: -1 until timed (or agreed), then 1 for oneDNN's, 0 for the portable one.
std::atomic<int>& small_shapes_onednn() {
  static std::atomic<int> choice{-1};
  return choice;
}

bool onednn_is_faster_on_a_layer_gemm() {
  std::atomic<int>& choice = small_shapes_onednn();
  if (choice.load() < 0) {
    static std::mutex timing;
    std::lock_guard<std::mutex> lock(timing);
    const LayerGemmOperands ops;
    if (choice.load() < 0) choice = onednn_is_faster(kLayerGemm, ops.a.data(), ops.b.data()) ? 1 : 0;
  }
  return choice.load() == 1;
}

// The key of a call whose M and K vary with the data: one choice and primitive for all of them.
Shape varying_key(const Shape& s) { return {s.ta, s.tb, -1, s.N, -1, s.lda, s.ldb, s.ldc, s.alpha, s.beta, s.bias}; }

// Evicts the lines of [p, p + bytes) from every cache level.
void flush_from_caches(const void* p, size_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); line < end; line += 64)
    _mm_clflush(reinterpret_cast<const void*>(line));
  _mm_mfence();
}

// Bytes from a stored matrix's first element to past its last: rows of `cols` at row stride `ld`.
size_t stored_bytes(int64_t rows, int64_t cols, int64_t ld, size_t element) {
  return size_t((rows - 1) * ld + cols) * element;
}

// A weight gradient, C += op(A)ᵀ·op(B) (ta, beta ≠ 0), reads and writes its fp32 C, which in a training
// step comes from memory: the layer's gradient was last touched a micro-batch earlier. There, on a
// Zen 5 host (AVX512-BF16), oneDNN's fixed-size kernels (brg:avx512_core_bf16, whose sum post-op adds
// into C) ran the dense layers' dW at 256 rows 1.5× slower than its runtime-size kernel (gemm:jit),
// at 1024–2048 rows 1.1–1.25× slower, though both run at the same rate with C in the caches. So such
// a call times both with its operands and a C of its size flushed from the caches before each run,
// and keeps the fixed-size kernel only where it is 20% faster (AMX tiles would be): the preference
// keeps runs from choosing differently near a tie. Only for a C of at most 2²² elements (its
// scratch copy, 16 MiB, allocated for the timing); larger ones keep the fixed-size kernel (or run as
// row blocks, row_block_rows). Other accumulating calls find their C in the caches, and keep it.
constexpr int64_t kColdTimedC = int64_t(1) << 22;

void take_runtime_kernel_if_faster_cold(const Shape& s, const bf16* A, const bf16* B, Choice& c) {
  if (!s.ta || s.beta == 0.f || s.M * s.ldc > kColdTimedC || c.onednn->runtime_mk) return;
  std::string impl;
  auto runtime = create_onednn(varying_key(s), &impl);
  if (!runtime) return;
  std::vector<float> C(size_t(s.M * s.ldc), 0.f);
  const size_t a_bytes = stored_bytes(s.K, s.M, s.lda, sizeof(bf16)),  // (ta: A stored [K, M])
      b_bytes = stored_bytes(s.tb ? s.N : s.K, s.tb ? s.K : s.N, s.ldb, sizeof(bf16));
  auto cold = [&](const OnednnMatmul& m) {
    flush_from_caches(A, a_bytes), flush_from_caches(B, b_bytes), flush_from_caches(C.data(), C.size() * sizeof(float));
    return seconds([&] { run_onednn(m, s, A, B, C.data(), nullptr); });  // (beta ≠ 0: no bias)
  };
  double fixed = std::numeric_limits<double>::infinity(), runtime_s = fixed;
  for (int run = 0; run < 3; ++run) fixed = std::min(fixed, cold(*c.onednn)), runtime_s = std::min(runtime_s, cold(*runtime));
  if (fixed * 1.2 < runtime_s) return;
  c.onednn = std::move(runtime);
  c.onednn_impl = impl;
}

bool is_timed(const Shape& s) { return s.M >= 0 && s.M * s.N * s.K >= kTimedWork; }

// A kept path for a timed shape (keep_bf16_gemms) where it can be taken here: true and c set.
bool take_kept(const Shape& s, const KeptBf16Path* kept, Choice& c) {
  if (!kept || !is_timed(s) || mode() != Bf16GemmMode::automatic) return false;
  if (*kept == KeptBf16Path::portable) {
    c.onednn.reset();
    return true;
  }
  if (*kept == KeptBf16Path::onednn_runtime) {
    std::string impl;
    auto runtime = create_onednn(varying_key(s), &impl);
    if (!runtime) return false;
    c.onednn = std::move(runtime), c.onednn_impl = impl;
  }
  c.path = Bf16GemmPath::onednn;
  return true;
}

// The choice for key s (a call's shape, or a varying_key), made at its first call: a path kept by a
// checkpoint; else sizes that vary, and shapes too small to time, follow the layer-sized GEMM's
// timing; others are timed themselves (a weight gradient also cold, take_runtime_kernel_if_faster_cold).
Choice decide(const Shape& s, const bf16* A, const bf16* B, const KeptBf16Path* kept) {
  std::string impl;
  Choice c{Bf16GemmPath::portable, create_onednn(s, &impl), impl, 0, std::nullopt};
  if (!c.onednn) return c;
  const bool timed = is_timed(s);
  if (!take_kept(s, kept, c)) {
    if (mode() == Bf16GemmMode::onednn || (timed ? onednn_is_faster(s, A, B) : onednn_is_faster_on_a_layer_gemm())) {
      c.path = Bf16GemmPath::onednn;
      if (timed && mode() != Bf16GemmMode::onednn) take_runtime_kernel_if_faster_cold(s, A, B, c);
    } else {
      c.onednn.reset();
    }
  }
  if (const int64_t rows = row_block_rows(s); rows > 0 && c.onednn) {
    const int64_t last = s.M - (s.M - 1) / rows * rows;
    auto block = create_onednn(rows_of(s, rows), &impl);
    auto last_block = last == rows ? std::nullopt : create_onednn(rows_of(s, last), &impl);
    if (block && (last == rows || last_block)) {
      c.onednn = std::move(block), c.last_block = std::move(last_block);
      c.block_rows = rows;
    }
  }
  return c;
}

struct Choices {
  std::mutex mutex;
  std::unordered_map<Shape, Choice, ShapeHash> by_shape;
  std::unordered_map<Shape, KeptBf16Path, ShapeHash> kept;  // a checkpoint's paths (keep_bf16_gemms)
};

Choices& choices() {
  static Choices c;
  return c;
}

// The shape's choice, made at its first call (A and B: its operands, for the timing), or where A is
// null only looked up (null before the first call). Entries are never erased while GEMMs run (only
// set_bf16_gemm_mode and keep_bf16_gemms, called between runs, erase them), so the reference stays
// valid after the lock is released.
const Choice* choice_for(const Shape& s, const bf16* A, const bf16* B) {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.by_shape.find(s);
  if (it == c.by_shape.end()) {
    if (!A) return nullptr;
    const auto kept = c.kept.find(s);
    it = c.by_shape.emplace(s, decide(s, A, B, kept == c.kept.end() ? nullptr : &kept->second)).first;
  }
  return &it->second;
}

// An operand's bf16 values, rows × cols stored with row stride X.ld: its own, or its fp32 values
// rounded compactly into this thread's scratch `slot` (0: A, 1: B), kept for the next calls. *ld: the
// row stride of the result.
const bf16* low_values(const Bf16Operand& X, int64_t rows, int64_t cols, int slot, int64_t* ld) {
  *ld = X.low ? X.ld : cols;
  if (X.low) return X.low;
  thread_local std::vector<bf16> scratch[2];
  std::vector<bf16>& s = scratch[slot];
  if (s.size() < size_t(rows * cols)) s.resize(size_t(rows * cols));
  if (X.ld == cols) {
    round_to_bf16(s.data(), X.values, rows * cols);
  } else {
    over_rows(rows, rows * cols >= kThreadedConversion,
              [&](int64_t r) { to_bf16(s.data() + r * cols, X.values + r * X.ld, cols); });
  }
  return s.data();
}

thread_local Bf16GemmPath last_path = Bf16GemmPath::portable;

// "AMX", "AVX512-BF16" or "AVX-512", from the implementation's name where it says, else from the
// ISA oneDNN runs at (gemm:jit's bf16 kernels use AVX512-BF16 instructions where the CPU has them).
std::string isa_of(const std::string& impl) {
  if (impl.find("amx") != std::string::npos) return "AMX";
  if (impl.find("avx512_core_bf16") != std::string::npos) return "AVX512-BF16";
  const unsigned isa = dnnl_get_effective_cpu_isa(), bf16_isa = dnnl_cpu_isa_avx512_core_bf16;
  return (isa & bf16_isa) == bf16_isa ? "AVX512-BF16" : "AVX-512";
}

// gemm_bf16 and gemm_bf16_varying: the path kept for the call's shape, or for its varying_key. The
// shape's key has an fp32 operand's stride as oneDNN would see it, that of its compact rounded copy;
// the portable path reads the operand where it is.
void multiply(Shape s, bool varying, const Bf16Operand& A, const Bf16Operand& B, float* C, const float* bias) {
  if (s.M == 0 || s.N == 0) return;
  ORIGAMI_ASSERT(s.lda >= std::max<int64_t>(1, s.ta ? s.M : s.K) && s.ldb >= std::max<int64_t>(1, s.tb ? s.K : s.N) &&
                 s.ldc >= std::max<int64_t>(1, s.N));
  last_path = Bf16GemmPath::portable;
  if (s.K == 0) return s.bias ? fill_rows(s.M, s.N, bias, C, s.ldc) : scale_matrix(s.M, s.N, s.beta, C, s.ldc);
  if (omp_in_parallel() || mode() == Bf16GemmMode::portable) return portable_gemm(s, A, B, C, bias);
  const int64_t a_rows = s.ta ? s.K : s.M, a_cols = s.ta ? s.M : s.K;  // as stored
  const int64_t b_rows = s.tb ? s.N : s.K, b_cols = s.tb ? s.K : s.N;
  Shape key = s;
  key.lda = A.low ? A.ld : a_cols, key.ldb = B.low ? B.ld : b_cols;
  if (varying) key = varying_key(key);
  const Choice* c = choice_for(key, nullptr, nullptr);
  if (c && c->path == Bf16GemmPath::portable) return portable_gemm(s, A, B, C, bias);
  Shape rounded = s;  // oneDNN's operands: bf16, an fp32 one rounded compactly
  const bf16* a = low_values(A, a_rows, a_cols, 0, &rounded.lda);
  const bf16* b = low_values(B, b_rows, b_cols, 1, &rounded.ldb);
  if (!c) c = choice_for(key, a, b);
  last_path = c->path;
  if (c->path == Bf16GemmPath::onednn) run_choice(*c, rounded, a, b, C, bias);
  else portable_gemm(rounded, {a, rounded.lda}, {b, rounded.ldb}, C, bias);
}

// ---- attention's tiles ------------------------------------------------------------------------

// Attention's bf16 products (model/layers/attention.cpp): 64 queries against up to 256 keys, head dim 64.
constexpr int64_t kQueries = 64, kKeys = 256, kHeadDim = 64;
constexpr Shape kScoresTile{false, true, kQueries, kKeys, kHeadDim, kHeadDim, kHeadDim, kKeys, 0.125f, 0.f};

// What oneDNN offers for a bf16 tile ("" where nothing but its reference loops).
const std::string& onednn_tile_impl() {
  static const std::string impl = [] {
    std::string name;
    return create_onednn(kScoresTile, &name) ? name : std::string();
  }();
  return impl;
}

// Seconds of attention's two forward products (scores = Q·Kᵀ, acc += P·V) at kScoresTile's sizes on
// every thread at once, 32 of each: bf16 through tile_gemm_bf16, or fp32 through gemm<float>'s tiles.
double time_tiles(Bf16Tiles path) {
  constexpr int64_t q = kQueries, k = kKeys, d = kHeadDim, reps = 32;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    std::vector<float> scores(size_t(q * k), 0.f), acc(size_t(q * d), 0.f);
    // Q [q, d] | K and V [k, d] | P [q, k], as one buffer of constant values (the speed does not depend on them)
    const size_t n = size_t(q * d + 2 * k * d + q * k);
    auto run = [&](auto* x, auto product) {
      auto *Q = x, *K = Q + q * d, *V = K + k * d, *P = V + k * d;
      for (int r = 0; r < reps; ++r) {
        product(false, true, q, k, d, 0.125f, Q, d, K, d, 0.f, scores.data(), k);
        product(false, false, q, d, k, 1.f, P, k, V, d, 1.f, acc.data(), d);
      }
    };
    if (path == Bf16Tiles::onednn) {
      const std::vector<bf16> x(n, to_bf16(0.01f));
      run(x.data(), tile_gemm_bf16);
    } else {
      const std::vector<float> x(n, 0.01f);
      run(x.data(), gemm<float>);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A tile shape's primitive with its memory objects, made once: a tile takes about 2 µs on AMX, and
// making the four objects at each call (run_onednn) costs as much again.
class TilePrimitive {
 public:
  explicit TilePrimitive(OnednnMatmul m)
      : m_(std::move(m)), scratchpad_(m_.scratchpad.get_size()), a_(m_.operands.a, cpu_engine(), nullptr),
        b_(m_.operands.b, cpu_engine(), nullptr), c_(m_.operands.c, cpu_engine(), nullptr),
        args_{{DNNL_ARG_SRC, a_},
              {DNNL_ARG_WEIGHTS, b_},
              {DNNL_ARG_DST, c_},
              {DNNL_ARG_SCRATCHPAD, dnnl::memory(m_.scratchpad, cpu_engine(), scratchpad_.data())}} {}
  void run(const bf16* A, const bf16* B, float* C) {
    thread_local dnnl::stream stream(cpu_engine());
    a_.set_data_handle(const_cast<bf16*>(A));
    b_.set_data_handle(const_cast<bf16*>(B));
    c_.set_data_handle(C);
    m_.primitive.execute(stream, args_);
    stream.wait();
  }

 private:
  OnednnMatmul m_;
  std::vector<uint8_t> scratchpad_;
  dnnl::memory a_, b_, c_;  // args_ holds handles to the same objects
  std::unordered_map<int, dnnl::memory> args_;
};

struct TileChoice {
  Bf16Tiles path = Bf16Tiles::fp32;
  double fp32_over_onednn = 0;  // measured time ratio (0: not timed)
  bool agreed = false;          // replaced by rank 0's (set_bf16_tiles)
  bool kept = false;            // the resumed checkpoint's (set_bf16_tiles)
  bool lacks_onednn = false;    // rank 0's was oneDNN, which this CPU does not have: fp32 tiles
};

TileChoice choose_tiles() {
  if (mode() == Bf16GemmMode::portable || onednn_tile_impl().empty()) return {};
  if (mode() == Bf16GemmMode::onednn) return {Bf16Tiles::onednn};
  tile_gemm_library();  // chosen before the timing's parallel regions
  double t[2] = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int round = 0; round < 6; ++round)  // alternated, best of each; round 0 also creates the kernels
    for (Bf16Tiles path : {Bf16Tiles::fp32, Bf16Tiles::onednn}) {
      const double seconds = time_tiles(path);
      if (round > 0) t[int(path)] = std::min(t[int(path)], seconds);
    }
  const double ratio = t[0] / t[1];
  return {ratio > 1.2 ? Bf16Tiles::onednn : Bf16Tiles::fp32, ratio};
}

// The choice, made at the first call (set_bf16_gemm_mode forgets it).
std::optional<TileChoice>& tile_choice_slot() {
  static std::optional<TileChoice> choice;
  return choice;
}

TileChoice& tile_choice() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  std::optional<TileChoice>& c = tile_choice_slot();
  if (!c) c = choose_tiles();
  return *c;
}

}  // namespace

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Bf16Operand A, Bf16Operand B,
               float beta, float* C, int64_t ldc, const float* bias) {
  ORIGAMI_ASSERT(!bias || beta == 0.f);
  multiply({ta, tb, M, N, K, A.ld, B.ld, ldc, alpha, beta, bias != nullptr}, false, A, B, C, bias);
}

void gemm_bf16_varying(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Bf16Operand A,
                       Bf16Operand B, float beta, float* C, int64_t ldc) {
  multiply({ta, tb, M, N, K, A.ld, B.ld, ldc, alpha, beta}, true, A, B, C, nullptr);
}

void tile_gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
                    const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_matrix(M, N, beta, C, ldc);
  const Shape s{ta, tb, M, N, K, lda, ldb, ldc, alpha, beta};
  // This thread's primitive per shape (no lock); none where oneDNN offers only its reference loops
  // for a shape (bf16_tiles() checked one): that shape takes the portable path.
  thread_local std::unordered_map<Shape, std::optional<TilePrimitive>, ShapeHash> primitives;
  auto it = primitives.find(s);
  if (it == primitives.end()) {
    std::string impl;
    std::optional<OnednnMatmul> m = create_onednn(s, &impl);
    it = primitives.emplace(s, m ? std::optional<TilePrimitive>(std::in_place, std::move(*m)) : std::nullopt).first;
  }
  if (it->second) it->second->run(A, B, C);
  else portable_gemm(s, {A, lda}, {B, ldb}, C, nullptr);
}

bool bf16_small_gemms_onednn() { return mode() == Bf16GemmMode::automatic && onednn_is_faster_on_a_layer_gemm(); }

void set_bf16_small_gemms_onednn(bool onednn) {
  if (mode() == Bf16GemmMode::automatic) small_shapes_onednn() = onednn ? 1 : 0;
}

std::vector<KeptBf16Gemm> bf16_gemms_to_keep() {
  std::vector<KeptBf16Gemm> out;
  if (bf16_gemm_always_portable()) return out;
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (const auto& [s, choice] : c.by_shape) {
    if (!is_timed(s) || choice.onednn_impl.empty()) continue;  // (small shapes: bf16_small_gemms_to_keep)
    const KeptBf16Path path = choice.path == Bf16GemmPath::portable ? KeptBf16Path::portable
                              : choice.onednn->runtime_mk            ? KeptBf16Path::onednn_runtime
                                                                     : KeptBf16Path::onednn;
    out.push_back({s.ta, s.tb, s.M, s.N, s.K, s.lda, s.ldb, s.ldc, s.alpha, s.beta, path, s.bias});
  }
  return out;
}

void keep_bf16_gemms(const std::vector<KeptBf16Gemm>& kept) {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (const KeptBf16Gemm& k : kept) {
    const Shape s{k.ta, k.tb, k.M, k.N, k.K, k.lda, k.ldb, k.ldc, k.alpha, k.beta, k.bias};
    c.kept[s] = k.path;
    c.by_shape.erase(s);  // (decided already, by a timing at start: decided again at its next call)
  }
}

Bf16Tiles bf16_tiles() { return tile_choice().path; }

std::optional<bool> bf16_small_gemms_to_keep() {
  if (bf16_gemm_always_portable()) return std::nullopt;
  return mode() == Bf16GemmMode::onednn || bf16_small_gemms_onednn();
}

void set_bf16_tiles(Bf16Tiles tiles, ChoiceFrom from) {
  TileChoice& c = tile_choice();
  // oneDNN's where this CPU lacks it: a job of unlike CPUs, or a checkpoint saved on another host
  c.lacks_onednn = tiles == Bf16Tiles::onednn && onednn_tile_impl().empty();
  if (c.lacks_onednn) tiles = Bf16Tiles::fp32;
  c.agreed = c.agreed || (from == ChoiceFrom::rank0 && tiles != c.path);
  c.kept = c.kept || from == ChoiceFrom::checkpoint;
  c.path = tiles;
}

std::string describe_bf16_tiles() {
  const TileChoice& c = tile_choice();
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.2f", c.fp32_over_onednn);
  std::string why = c.lacks_onednn ? cat(c.kept ? "the checkpoint's" : "rank 0's", " choice was oneDNN's, which this CPU lacks")
                    : mode() == Bf16GemmMode::portable ? "forced by ORIGAMI_BF16_GEMM=portable"
                    : onednn_tile_impl().empty()       ? "oneDNN has no bf16 matmul here"
                    : c.fp32_over_onednn == 0          ? "forced by ORIGAMI_BF16_GEMM=onednn"
                                                       : cat("timed: fp32 tiles at ", ratio, "x oneDNN's time");
  if (!c.lacks_onednn) why += c.kept ? "; the checkpoint's choice" : c.agreed ? "; rank 0's choice" : "";
  if (c.path == Bf16Tiles::fp32) return cat("bf16 attention tiles: fp32 (", why, ")");
  return cat("bf16 attention tiles: ", isa_of(onednn_tile_impl()), " (oneDNN; ", why, ")");
}

void set_bf16_gemm_mode(Bf16GemmMode m) {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  mode() = m;
  c.by_shape.clear();
  c.kept.clear();
  tile_choice_slot().reset();
  small_shapes_onednn() = -1;
}

Bf16GemmMode bf16_gemm_mode() { return mode(); }
void check_bf16_gemm_env() { mode_from_env(); }

bool bf16_gemm_always_portable() {
  static const bool no_onednn = [] {
    std::string impl;
    return !create_onednn(kLayerGemm, &impl);
  }();
  return mode() == Bf16GemmMode::portable || no_onednn;
}

bool bf16_gemm_reads_fp32() {
  return bf16_gemm_always_portable() || (mode() == Bf16GemmMode::automatic && !onednn_is_faster_on_a_layer_gemm());
}

Bf16GemmPath last_bf16_gemm_path() { return last_path; }

std::string describe_bf16_gemm() {
  if (mode() == Bf16GemmMode::portable) return "bf16 GEMM: portable (forced by ORIGAMI_BF16_GEMM=portable)";
  const Shape& s = kLayerGemm;
  const LayerGemmOperands ops;
  std::vector<float> c(size_t(s.M * s.N));
  gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, s.alpha, {ops.a.data(), s.lda}, {ops.b.data(), s.ldb}, s.beta, c.data(), s.ldc);
  const Choice& choice = *choice_for(s, ops.a.data(), ops.b.data());
  if (choice.path == Bf16GemmPath::onednn) return cat("bf16 GEMM: ", isa_of(choice.onednn_impl), " (oneDNN)");
  if (choice.onednn_impl.empty()) return "bf16 GEMM: portable (no faster bf16 path on this CPU: oneDNN has no bf16 matmul here)";
  return cat("bf16 GEMM: portable (no faster bf16 path on this CPU: oneDNN's ", choice.onednn_impl, " is slower)");
}

}  // namespace origami
