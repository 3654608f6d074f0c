// gemm (src/kernels/cpu/gemm.h) against a naive double-precision loop: every transpose pair, row
// strides wider than the matrices, beta 0 (C holding NaN must be overwritten, not scaled), 1 and
// 0.5, through both float paths — oneDNN outside an OpenMP parallel region (all threads), OpenBLAS
// inside one (one tile per thread, as attention calls it) — and the double path.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"

using namespace origami;

namespace {

struct Case {
  bool ta, tb;
  int64_t M, N, K;
  double beta;
};

// A matrix of `rows` x `cols` stored with row stride `ld` (>= cols), padding filled with `pad`.
template <typename T>
std::vector<T> matrix(int64_t rows, int64_t cols, int64_t ld, uint32_t seed, T pad) {
  std::vector<T> m(size_t(rows * ld), pad);
  uint32_t s = seed;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      s = s * 1664525u + 1013904223u;
      m[size_t(r * ld + c)] = T(double(s >> 8) / double(1u << 24) - 0.5);
    }
  return m;
}

// Runs gemm<T> on one case and returns the largest |C - reference| relative to the reference's scale;
// the padding of C (outside its N columns) must come back untouched.
template <typename T>
double max_error(const Case& c, uint32_t seed) {
  const int64_t ar = c.ta ? c.K : c.M, ac = c.ta ? c.M : c.K;  // A as stored
  const int64_t br = c.tb ? c.N : c.K, bc = c.tb ? c.K : c.N;
  const int64_t lda = ac + 3, ldb = bc + 5, ldc = c.N + 7;
  const T alpha = T(0.75), pad = T(-7);
  auto A = matrix<T>(ar, ac, lda, seed, pad), B = matrix<T>(br, bc, ldb, seed + 1, pad);
  auto C = matrix<T>(c.M, c.N, ldc, seed + 2, pad);
  if (c.beta == 0)  // BLAS semantics: beta 0 ignores C, so NaN there must not leak into the result
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.N; ++j) C[size_t(i * ldc + j)] = std::numeric_limits<T>::quiet_NaN();
  std::vector<double> ref(size_t(c.M * c.N));
  double scale = 0;
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double a = c.ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)];
        const double b = c.tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)];
        s += a * b, mag += std::fabs(a * b);
      }
      const double c0 = c.beta == 0 ? 0.0 : double(C[size_t(i * ldc + j)]);
      ref[size_t(i * c.N + j)] = double(alpha) * s + c.beta * c0;
      scale = std::max(scale, double(alpha) * mag + std::fabs(c.beta * c0));
    }
  gemm<T>(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, T(c.beta), C.data(), ldc);
  double err = 0;
  for (int64_t i = 0; i < c.M; ++i) {
    for (int64_t j = 0; j < c.N; ++j) {
      const double e = std::fabs(double(C[size_t(i * ldc + j)]) - ref[size_t(i * c.N + j)]) / scale;
      if (!(e <= err)) err = e;  // a NaN result becomes the error (std::max would drop it)
    }
    for (int64_t j = c.N; j < ldc; ++j)
      if (C[size_t(i * ldc + j)] != pad) return std::numeric_limits<double>::infinity();
  }
  return err;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (double beta : {0.0, 1.0, 0.5}) {
        out.push_back({ta, tb, 37, 29, 53, beta});    // odd sizes
        out.push_back({ta, tb, 300, 260, 130, beta});  // large enough to be split over threads
      }
  out.push_back({false, false, 1, 1, 1, 0.0});
  out.push_back({true, false, 64, 64, 64, 1.0});  // attention's tile
  return out;
}

std::string name(const Case& c) {
  return cat(c.ta ? "T" : "N", c.tb ? "T" : "N", " ", c.M, "x", c.N, "x", c.K, " beta ", c.beta);
}

}  // namespace

TEST(Gemm, FloatOutsideParallelRegion) {
  set_num_threads(2);
  for (const auto& c : cases()) EXPECT_LT(max_error<float>(c, 11), 1e-6) << name(c);  // false for NaN
}

// Each tile library takes the tiles of a team of 2 and gets them right; a team of 1 (--threads 1)
// is not an active region: its calls take oneDNN's whole-GEMM path whatever the choice.
TEST(Gemm, FloatInsideParallelRegionOneTilePerThread) {
  set_num_threads(2);
  const TileGemm chosen = tile_gemm_library();
  for (TileGemm lib : {TileGemm::openblas, TileGemm::onednn}) {
    set_tile_gemm_library(lib);
    for (int team : {2, 1})
      for (const auto& c : cases()) {
        std::vector<double> err(size_t(team), -1);
        std::vector<std::array<int64_t, 2>> ran(static_cast<size_t>(team));  // tiles run per library, by this call
#pragma omp parallel num_threads(team)
        {
          const size_t t = size_t(omp_get_thread_num());
          const int64_t before[2] = {tiles_run(TileGemm::openblas), tiles_run(TileGemm::onednn)};
          err[t] = max_error<float>(c, 20 + uint32_t(t));
          ran[t] = {tiles_run(TileGemm::openblas) - before[0], tiles_run(TileGemm::onednn) - before[1]};
        }
        const std::string what = cat(name(c), lib == TileGemm::onednn ? " oneDNN" : " OpenBLAS", " team ", team);
        for (double e : err) EXPECT_TRUE(e >= 0 && e < 1e-6) << what << ": " << e;
        std::array<int64_t, 2> want = {0, 0};  // one tile per thread, on `lib`, in a team of 2
        if (team > 1) want[size_t(lib)] = 1;
        for (const auto& r : ran) EXPECT_EQ(r, want) << what;
      }
  }
  set_tile_gemm_library(chosen);
}

TEST(Gemm, Double) {
  set_num_threads(2);
  for (const auto& c : cases()) EXPECT_LT(max_error<double>(c, 31), 1e-14) << name(c);
}

TEST(Gemm, FloatRejectsALeadingDimensionTooSmall) {  // oneDNN would leave C untouched and say so only by status
  set_num_threads(2);
  std::vector<float> A(16, 1.f), B(16, 1.f), C(16, -3.f);
  EXPECT_THROW(gemm<float>(false, false, 4, 4, 4, 1.f, A.data(), 2, B.data(), 4, 0.f, C.data(), 4), Error);
}

// K = 0 leaves C = beta·C on every path (oneDNN's sgemm alone would leave C unchanged): beta 0
// writes zeros over a NaN, beta 0.5 halves, outside a parallel region and in a team of 2's tiles.
TEST(Gemm, NoInnerDimensionScalesC) {
  set_num_threads(2);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int team : {1, 2})
    for (TileGemm lib : {TileGemm::openblas, TileGemm::onednn}) {
      const TileGemm chosen = tile_gemm_library();
      set_tile_gemm_library(lib);
      std::vector<std::array<float, 6>> got(static_cast<size_t>(team));
#pragma omp parallel num_threads(team)
      {
        std::array<float, 6>& C = got[size_t(omp_get_thread_num())];
        C = {nan, 2.f, -7.f, 3.f, 4.f, 9.f};  // [2, 2] with row stride 3 (9 is outside)
        gemm<float>(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.f, C.data(), 3);
        C[0] = 3.f;
        gemm<float>(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.5f, C.data(), 3);
      }
      set_tile_gemm_library(chosen);
      for (const auto& C : got) EXPECT_EQ(C, (std::array<float, 6>{1.5f, 0.f, -7.f, 0.f, 0.f, 9.f})) << team;
    }
  std::vector<double> D = {4., 8.};
  gemm<double>(false, false, 1, 2, 0, 1., nullptr, 1, nullptr, 2, 0.25, D.data(), 2);
  EXPECT_EQ(D, (std::vector<double>{1., 2.}));
}

// The process flushes subnormals (flush_denormals, called by this binary's main as by origami's) on
// every thread: the OpenMP pool's, started after it, and a thread started now. A product whose exact
// value is subnormal comes out zero, and SiLU's blended-away clamped lanes cost no assists.
TEST(Threads, EveryThreadFlushesSubnormals) {
  auto flushes = [] {
    volatile float tiny = 1e-30f, scale = 1e-10f;  // (volatile: computed at run time)
    return flushing_denormals() && tiny * scale == 0.f;
  };
  set_num_threads(2);
  int flushing = 0, threads = 0;
#pragma omp parallel reduction(+ : flushing, threads)
  flushing += flushes() ? 1 : 0, threads += 1;
  EXPECT_EQ(flushing, threads);
  bool in_thread = false;
  std::thread([&] { in_thread = flushes(); }).join();
  EXPECT_TRUE(in_thread);
}
