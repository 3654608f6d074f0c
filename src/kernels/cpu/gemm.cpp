#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>
#include <vector>

#include <cblas.h>
#include <immintrin.h>
#include <dnnl.h>
#include <omp.h>

#include "core/env.h"
#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace origami {

static CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }

namespace {
void sgemm(TileGemm lib, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (lib == TileGemm::openblas) {
    cblas_sgemm(CblasRowMajor, op(ta), op(tb), int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C,
                int(ldc));
    return;
  }
  // dnnl_sgemm reports bad arguments (a leading dimension too small, ...) by its status alone and
  // leaves C untouched: a silent wrong result unless checked. Inside a parallel region it runs on
  // the calling thread only.
  const dnnl_status_t status = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  ORIGAMI_ASSERT(status == dnnl_success);
}

// Seconds of attention's two forward tile products (scores = Q·Kᵀ, acc += P·V) at 64×64×64, on
// every thread at once as attention runs them (OpenBLAS's OpenMP build serialises its concurrent
// calls on a lock, so one thread alone does not show their cost); 64 of each, a few milliseconds.
double time_tiles(TileGemm lib) {
  constexpr int64_t n = 64, reps = 64;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    std::vector<float> buf(size_t(3 * n * n), 0.01f);
    float *a = buf.data(), *b = a + n * n, *c = b + n * n;
    for (int r = 0; r < reps; ++r) {
      sgemm(lib, false, true, n, n, n, 0.125f, a, n, b, n, 0.f, c, n);
      sgemm(lib, false, false, n, n, n, 1.f, c, n, b, n, 1.f, a, n);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct TileChoice {
  TileGemm lib = TileGemm::openblas;
  double openblas_over_onednn = 0;  // measured time ratio (0: forced or one thread, not timed)
  bool agreed = false;              // replaced by rank 0's (set_tile_gemm_library)
  bool kept = false;                // the resumed checkpoint's (set_tile_gemm_library)
};

// ORIGAMI_TILE_GEMM: nullopt for auto.
std::optional<TileGemm> forced_tiles() {
  const std::string s = env_choice("ORIGAMI_TILE_GEMM", {"auto", "openblas", "onednn"});
  if (s == "auto") return std::nullopt;
  return s == "openblas" ? TileGemm::openblas : TileGemm::onednn;
}

// The timed ratio (OpenBLAS's time over oneDNN's) from which the tiles take oneDNN. It sits apart from
// where the hosts measured fall, so that fresh runs of one command on one host take one library (the
// two sum in different orders): Zen 4 about 0.85 (OpenBLAS's small-matrix kernels win), Zen 3 1.17–1.39
// (44 starts; in the model the two within noise of each other), Zen 5 1.59, Emerald Rapids 3.7–5.3.
// (It was 1.3, inside Zen 3's spread: 12 of 30 fresh starts there took the other library.)
constexpr double kOnednnTilesFrom = 1.1;

TileChoice choose_tiles() {
  if (const auto forced = forced_tiles()) return {*forced};
  if (omp_get_max_threads() == 1) return {TileGemm::onednn};  // no tiles inside active regions (gemm<float>)
  double t[2] = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int round = 0; round < 6; ++round)  // alternated, best of each; round 0 also warms the JIT kernels
    for (TileGemm lib : {TileGemm::openblas, TileGemm::onednn})
      if (round > 0) t[int(lib)] = std::min(t[int(lib)], time_tiles(lib));
      else time_tiles(lib);
  const double ratio = t[0] / t[1];
  return {ratio > kOnednnTilesFrom ? TileGemm::onednn : TileGemm::openblas, ratio};
}

TileChoice& tile_choice() {
  static TileChoice choice = choose_tiles();  // thread-safe: a second thread waits for the first
  return choice;
}

thread_local int64_t tiles_on[2] = {0, 0};
}  // namespace

TileGemm tile_gemm_library() { return tile_choice().lib; }
void check_tile_gemm_env() { forced_tiles(); }
void set_tile_gemm_library(TileGemm lib, ChoiceFrom from) {
  TileChoice& c = tile_choice();
  c.agreed = c.agreed || (from == ChoiceFrom::rank0 && lib != c.lib);
  c.kept = c.kept || from == ChoiceFrom::checkpoint;
  c.lib = lib;
}
bool tile_gemm_forced() { return forced_tiles().has_value(); }
std::optional<TileGemm> tile_gemm_to_keep() {
  if (omp_get_max_threads() == 1) return std::nullopt;
  return tile_choice().lib;
}
int64_t tiles_run(TileGemm lib) { return tiles_on[int(lib)]; }

std::string describe_tile_gemm() {
  const TileChoice& c = tile_choice();
  const char* name = c.lib == TileGemm::onednn ? "oneDNN" : "OpenBLAS";
  if (omp_get_max_threads() == 1) return "attention tiles: oneDNN (one thread: the layers' path)";
  if (c.openblas_over_onednn == 0) return cat("attention tiles: ", name, " (forced by ORIGAMI_TILE_GEMM)");
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.2f", c.openblas_over_onednn);
  return cat("attention tiles: ", name, " (timed: OpenBLAS at ", ratio, "x oneDNN's time here",
             c.kept ? "; the checkpoint's choice" : c.agreed ? "; rank 0's choice" : "", ")");
}

template <typename T>
void scale_matrix(int64_t M, int64_t N, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
}
template void scale_matrix<float>(int64_t, int64_t, float, float*, int64_t);
template void scale_matrix<double>(int64_t, int64_t, double, double*, int64_t);

template <typename T>
void fill_rows(int64_t M, int64_t N, const T* row, T* C, int64_t ldc) {
  over_rows(M, M * N >= (int64_t(1) << 16), [&](int64_t r) { std::copy(row, row + N, C + r * ldc); });
}
template void fill_rows<float>(int64_t, int64_t, const float*, float*, int64_t);
template void fill_rows<double>(int64_t, int64_t, const double*, double*, int64_t);

template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_matrix(M, N, beta, C, ldc);
  // A per-thread tile (attention) on the library timed faster for tiles; a whole GEMM, and a tile of
  // a team of one (not in an active region: --threads 1), on oneDNN, whatever the timing.
  if (omp_in_parallel()) {
    const TileGemm lib = tile_gemm_library();
    ++tiles_on[int(lib)];
    return sgemm(lib, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  sgemm(TileGemm::onednn, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_matrix(M, N, beta, C, ldc);
  cblas_dgemm(CblasRowMajor, op(ta), op(tb), int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb),
              beta, C, int(ldc));
}

void set_num_threads(int n) {
  omp_set_num_threads(n);  // our loops and oneDNN (OpenMP build)
  openblas_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

namespace {
constexpr unsigned kFlushBits = 0x8040;  // MXCSR: FTZ (bit 15) and DAZ (bit 6)
}

void flush_denormals() { _mm_setcsr(_mm_getcsr() | kFlushBits); }

bool flushing_denormals() { return (_mm_getcsr() & kFlushBits) == kFlushBits; }

void warm_up_gemm() {
  tile_choice();
  constexpr int64_t n = 512, tile = 64;
  std::vector<float> a(size_t(n * n), 1.f), b(size_t(n * n), 1.f), c(size_t(n * n));
  gemm<float>(false, true, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
#pragma omp parallel
  {
    std::vector<float> t(size_t(3 * tile * tile), 1.f);
    gemm<float>(false, true, tile, tile, tile, 1.f, t.data(), tile, t.data() + tile * tile, tile, 0.f,
                t.data() + 2 * tile * tile, tile);
  }
}

}  // namespace origami
