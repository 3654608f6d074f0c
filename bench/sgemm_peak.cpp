// sgemm_peak: measured single-precision GEMM peak of the OpenBLAS that origami links
// (/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0), the denominator of "achieved
// FLOP/s as a fraction of measured SGEMM peak" (DESIGN.md, Performance).
//
//   g++ -O2 -std=c++17 -I/usr/include/x86_64-linux-gnu/openblas-pthread bench/sgemm_peak.cpp \
//       /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 -o bench/runs/sgemm_peak
//   OMP_NUM_THREADS=2 taskset -c 0,1 bench/runs/sgemm_peak [--threads 2] [--sizes 1024,2048,3072] [--seconds 1.0]
// (bench/side_by_side.py builds it there and runs it with --sizes 512,768,1024,1536,2048.)
//
// For each square size n, C = A·B (row-major, no transposes, beta = 0) is repeated for about
// --seconds after one warm-up call; the best single-call rate (2n³ FLOP per call) is the
// size's rate, and the peak is the best over sizes. Prints one JSON object on stdout.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int);

int main(int argc, char** argv) {
  int threads = 2;
  double seconds = 1.0;
  std::vector<int> sizes = {1024, 2048, 3072};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (a == "--sizes" && i + 1 < argc) {
      sizes.clear();
      std::string s = argv[++i];
      for (size_t p = 0; p < s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        sizes.push_back(std::atoi(s.substr(p, q - p).c_str()));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr, "usage: sgemm_peak [--threads N] [--sizes n1,n2,...] [--seconds S]\n");
      return 2;
    }
  }
  openblas_set_num_threads(threads);
  using clock = std::chrono::steady_clock;
  std::printf("{\"threads\": %d, \"sizes\": {", threads);
  double peak = 0;
  int peak_n = 0;
  for (size_t si = 0; si < sizes.size(); ++si) {
    const int n = sizes[si];
    std::vector<float> A(size_t(n) * n), B(size_t(n) * n), C(size_t(n) * n);
    for (size_t i = 0; i < A.size(); ++i) A[i] = float((i * 7919) % 1000) * 1e-3f - 0.5f, B[i] = float((i * 104729) % 1000) * 1e-3f - 0.5f;
    auto gemm = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
    };
    gemm();  // warm-up: page faults, thread start
    const double flop = 2.0 * n * double(n) * n;
    double best = 0, total = 0;
    int calls = 0;
    while (total < seconds || calls < 3) {
      auto t0 = clock::now();
      gemm();
      double s = std::chrono::duration<double>(clock::now() - t0).count();
      total += s, ++calls;
      best = std::max(best, flop / s / 1e9);
    }
    std::printf("%s\"%d\": %.1f", si ? ", " : "", n, best);
    if (best > peak) peak = best, peak_n = n;
  }
  std::printf("}, \"peak_gflops\": %.1f, \"peak_n\": %d}\n", peak, peak_n);
  return 0;
}
