// Row-major GEMM on the CPU: C = alpha·op(A)·op(B) + beta·C, op(X) = X or Xᵀ.
// op(A) is [M, K], op(B) is [K, N], C is [M, N]; lda/ldb/ldc are row strides, so a block of
// rows or columns inside a wider matrix (one head inside a packed qkv row) is passed directly.
// Libraries, chosen by measurement on the model's shapes (bench/README.md, "Choosing the BLAS"):
//   float, outside an OpenMP parallel region: oneDNN's dnnl_sgemm on all threads (its JIT kernels
//     beat OpenBLAS on the layer GEMMs, and beta = 0 costs no separate pass over C);
//   float, inside one (attention's 64×64 tiles, one per thread): single-threaded, the library
//     tile_gemm_library() chose by timing both on such tiles — OpenBLAS's small-matrix kernels beat
//     oneDNN's by ~15% on Zen 4, while on an Emerald Rapids host OpenBLAS 0.3.21 (which knows the CPU
//     only as Cooper Lake) ran them at a quarter of oneDNN's speed;
//   double (finite-difference tests): OpenBLAS.
// Both libraries are OpenMP builds, so they and our own loops share one thread pool.
// oneDNN 2.x's JIT kernels are not safe against handled signals (core/stop_signals.h says why and
// how the trainer keeps SIGINT/SIGTERM away from them).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace origami {

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// C = beta·C over [M, N] with row stride ldc (beta 0 writes zeros: NaN in C does not survive, as in
// BLAS). A GEMM with K = 0 is this; every path does it itself, since oneDNN's sgemm leaves C unchanged.
template <typename T>
void scale_matrix(int64_t M, int64_t N, T beta, T* C, int64_t ldc);

// C's rows [M, N] (row stride ldc) each set to `row` [N]: a bias, for a GEMM to add its product to
// (beta 1). Large ones over the threads, outside a parallel region (over_rows).
template <typename T>
void fill_rows(int64_t M, int64_t N, const T* row, T* C, int64_t ldc);

// Sets the thread count of OpenMP (our loops, oneDNN) and OpenBLAS: one pool.
void set_num_threads(int n);
int num_threads();

// Subnormal floats read as zero and results that would be subnormal written as zero (MXCSR's DAZ
// and FTZ bits) on the calling thread, and on every thread it starts afterwards (Linux copies a
// thread's MXCSR into the threads it creates: the OpenMP pool, oneDNN's, ours). `origami` and the
// unit tests call it first thing, before any thread exists. Why: an assist for each
// subnormal operand or result costs ~100 cycles, and the vectorised exp_fast's clamp invites them —
// GCC computes SiLU's value for a clamped lane, g / (1 + e^88.37), on every lane and blends it
// away, and for |g| < 1 that quotient is subnormal: swiglu_forward ran at 7.4 ns an element on
// an Intel host against 0.8 with the bits set. What it changes: values below 1.18e-38 in
// magnitude read and compute as 0, also when converted to double (TensorFlow's CPU runtime sets
// the same bits).
void flush_denormals();
// Whether this thread flushes (tests).
bool flushing_denormals();

// The library of the per-thread tiles (a gemm<float> call inside an active OpenMP parallel region),
// chosen at its first call: ORIGAMI_TILE_GEMM=openblas|onednn forces one; auto (the default) times
// 64×64×64 tiles (attention's scores and P·V) through both on every thread at once and keeps
// OpenBLAS unless oneDNN is 1.1× faster (gemm.cpp, kOnednnTilesFrom: why there). With one thread
// there are no such tiles (a team of one is not active: its calls take oneDNN, deterministically — a single thread's timing sits near the
// margin, measured 1.39 on Emerald Rapids, and separate runs must sum alike); auto then times
// nothing. Call it first outside a parallel region (the trainer's warm-up and attention do).
enum class TileGemm { openblas, onednn };
TileGemm tile_gemm_library();
// Reads ORIGAMI_TILE_GEMM: an invalid value throws (the trainer checks it on every rank at start).
void check_tile_gemm_env();
// Where a choice that replaces this process's timing comes from (the startup line names it): rank 0's
// timing, so that a job's processes sum in one order; or the checkpoint a run resumes, so that it sums
// as the run that saved it did (a timing near a threshold can choose differently in two runs).
enum class ChoiceFrom { rank0, checkpoint };
// Replaces the choice, outside any parallel region. Forcing the library (ORIGAMI_TILE_GEMM) makes
// separate fresh runs repeatable too.
void set_tile_gemm_library(TileGemm lib, ChoiceFrom from = ChoiceFrom::rank0);
// Whether ORIGAMI_TILE_GEMM names a library (a resume then takes it, not the checkpoint's).
bool tile_gemm_forced();
// The choice a checkpoint keeps: none with one thread (no tile ran on either library).
std::optional<TileGemm> tile_gemm_to_keep();
// How many tiles this thread has run on `lib` (tests).
int64_t tiles_run(TileGemm lib);
// The startup line's words for the choice, e.g. "attention tiles: oneDNN (timed: OpenBLAS at 4.20x
// oneDNN's time here)".
std::string describe_tile_gemm();

// Chooses the tiles' library, then runs each GEMM path once — a layer-sized GEMM through oneDNN on
// every thread, a 64×64 tile per thread through the chosen library — so the thread pool, the JIT
// kernels and the libraries' per-thread buffers exist before the memory check measures the process
// (they are part of its runtime figure).
void warm_up_gemm();

}  // namespace origami
