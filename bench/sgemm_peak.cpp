// sgemm_peak: measured single-precision GEMM rates of the BLAS libraries on this machine — the
// denominator of "achieved FLOP/s as a fraction of measured SGEMM peak" (DESIGN.md, Performance) —
// and the data for choosing the BLAS (bench/README.md, "Choosing the BLAS").
//
//   g++ -O2 -march=native -std=c++17 -pthread bench/sgemm_peak.cpp -ldl -o bench/runs/sgemm_peak
//   OMP_NUM_THREADS=2 taskset -c 0,1 bench/runs/sgemm_peak [--threads 2] [--blas openblas,onednn,blis]
//       [--sizes 512,1024,2048x768x256,...] [--seconds 1.0]
// (bench/side_by_side.py builds it there and runs it with --sizes 512,768,1024,1536,2048.)
//
// Libraries, each loaded with dlopen (so one binary measures all, and a missing one is reported,
// not a build error); all OpenMP builds, as origami links them:
//   openblas  /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0, cblas_sgemm
//             (the OpenMP build by path: Debian's alternatives usually select the pthread one)
//   onednn    libdnnl.so.2, dnnl_sgemm (row-major)                    apt-get install libdnnl-dev
//   blis      /usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4, cblas_sgemm   apt-get install libblis-dev
// --blas defaults to every library that loads. origami itself uses oneDNN for its layer GEMMs and
// OpenBLAS for per-thread tiles and double precision (src/kernels/cpu/gemm.h).
//
// For each size — n for a square, or MxNxK — C = A·B (row-major, no transposes, beta = 0) is
// repeated for about --seconds after one warm-up call; the best single-call rate (2·M·N·K FLOP per
// call) is the size's rate. Libraries alternate size by size. The peak is the best rate over sizes
// and libraries. With --per-thread, each library runs single-threaded and --threads threads call
// it at once, each on its own C (how attention calls its 64x64 tiles from inside a parallel
// region); the rate is all threads' FLOPs over the wall time.
//
// It also measures the core's FP32 FMA ceiling, the most any kernel could reach: each of --threads
// threads runs 12 independent chains of fused multiply-adds on registers only (no loads, no
// stores; 512-bit where the CPU has AVX-512F, else 256-bit), best of 5 runs of ~0.2 s. On
// Zen 4 this is 2 FMA pipes x 8 floats x 2 FLOP per cycle per core at either width.
// Prints one JSON object on stdout.
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

// 12 independent FMA chains of `iters` steps each, on the widest vector the build targets
// (compiled with -march=native); returns a value so nothing is optimised away.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "sgemm_peak needs -march=native on a CPU with FMA"
#endif

float fma_chains(long iters) {
  Vec a[12];
  for (int k = 0; k < 12; ++k) a[k] = vset(1.0f + 0.01f * float(k));
  const Vec m = vset(0.9999f), c = vset(1e-7f);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = vfma(a[k], m, c);  // unrolled: a[] stays in registers
  }
  for (int k = 1; k < 12; ++k) a[0] = vfma(a[0], m, a[k]);
  float out[kLanes];
  std::memcpy(out, &a[0], sizeof(out));
  return out[0];
}

// GFLOP/s of `threads` threads each running fma_chains (best of 5).
double fma_ceiling(int threads) {
  const long iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> sink(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { sink[size_t(t)] = fma_chains(iters); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * 12 * kLanes * double(iters) * threads / s / 1e9);
    if (sink[0] == 12345.f) std::printf(" ");
  }
  return best;
}

// One library's row-major C = A·B (no transposes, alpha 1, beta 0); load_blas sets its threads.
struct Blas {
  std::string name;
  std::function<void(int m, int n, int k, const float* A, const float* B, float* C)> sgemm;
};

// Loads `name`; returns false (with the reason in `why`) when its library is not installed.
bool load_blas(const std::string& name, int threads, Blas& out, std::string& why) {
  const char* path = name == "openblas" ? "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0"
                     : name == "onednn" ? "libdnnl.so.2"
                     : name == "blis"   ? "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4"
                                        : nullptr;
  if (!path) {
    std::fprintf(stderr, "sgemm_peak: --blas %s: not one of openblas, onednn, blis\n", name.c_str());
    std::exit(2);
  }
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return why = dlerror(), false;
  out.name = name;
  if (name == "onednn") {
    using Fn = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                       float, float*, int64_t);
    auto f = reinterpret_cast<Fn>(dlsym(h, "dnnl_sgemm"));
    if (!f) return why = "no dnnl_sgemm", false;
    out.sgemm = [f](int m, int n, int k, const float* A, const float* B, float* C) {
      f('N', 'N', m, n, k, 1.f, A, k, B, n, 0.f, C, n);
    };
    return true;
  }
  // cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), CBLAS enums as ints.
  using Fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
  auto f = reinterpret_cast<Fn>(dlsym(h, "cblas_sgemm"));
  if (!f) return why = "no cblas_sgemm", false;
  if (name == "openblas") {
    auto set = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
    if (set) set(threads);
  } else {
    auto set = reinterpret_cast<void (*)(long)>(dlsym(h, "bli_thread_set_num_threads"));
    if (set) set(threads);
  }
  constexpr int kRowMajor = 101, kNoTrans = 111;
  out.sgemm = [f](int m, int n, int k, const float* A, const float* B, float* C) {
    f(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.f, A, k, B, n, 0.f, C, n);
  };
  return true;
}

struct Shape {
  int m, n, k;
  std::string name;  // "n" for a square, "MxNxK" otherwise
};

// "1024" is a square; "512x1024x256" is M x N x K.
Shape parse_shape(const std::string& s) {
  int m = 0, n = 0, k = 0;
  char x1 = 0, x2 = 0;
  if (std::sscanf(s.c_str(), "%d%c%d%c%d", &m, &x1, &n, &x2, &k) == 5 && x1 == 'x' && x2 == 'x' && m > 0 && n > 0 && k > 0)
    return {m, n, k, s};
  if (std::sscanf(s.c_str(), "%d", &m) == 1 && m > 0 && std::to_string(m) == s) return {m, m, m, s};
  std::fprintf(stderr, "sgemm_peak: size '%s' is neither n nor MxNxK (positive integers)\n", s.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p < s.size();) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  bool per_thread = false;
  double seconds = 1.0;
  std::vector<std::string> sizes = {"1024", "2048", "3072"}, libs = {"openblas", "onednn", "blis"};
  bool libs_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (a == "--sizes" && i + 1 < argc) sizes = split(argv[++i]);
    else if (a == "--blas" && i + 1 < argc) libs = split(argv[++i]), libs_given = true;
    else if (a == "--per-thread") per_thread = true;
    else {
      std::fprintf(stderr, "usage: sgemm_peak [--threads N] [--blas openblas,onednn,blis] [--sizes n|MxNxK,...] [--seconds S] [--per-thread]\n");
      return 2;
    }
  }
  std::vector<Shape> shapes;
  for (const auto& s : sizes) shapes.push_back(parse_shape(s));
  // Threads per call: oneDNN (and OpenBLAS/BLIS through OpenMP) read OMP_NUM_THREADS when libgomp
  // loads, i.e. at the first dlopen below.
  const int call_threads = per_thread ? 1 : threads;
  setenv("OMP_NUM_THREADS", std::to_string(call_threads).c_str(), 1);
  std::vector<Blas> blas;
  std::string missing;
  for (const auto& name : libs) {
    Blas b;
    std::string why;
    if (load_blas(name, call_threads, b, why)) blas.push_back(b);
    else if (libs_given) {  // asked for by name: an error
      std::fprintf(stderr, "sgemm_peak: cannot load %s: %s\n", name.c_str(), why.c_str());
      return 1;
    } else missing += (missing.empty() ? "\"" : ", \"") + name + "\"";
  }
  using clock = std::chrono::steady_clock;
  std::map<std::string, std::map<std::string, double>> rate;  // library -> size -> GFLOP/s
  for (const auto& [m, n, k, name] : shapes) {
    std::vector<float> A(size_t(m) * k), B(size_t(k) * n), C(size_t(m) * n);
    for (size_t i = 0; i < A.size(); ++i) A[i] = float((i * 7919) % 1000) * 1e-3f - 0.5f;
    for (size_t i = 0; i < B.size(); ++i) B[i] = float((i * 104729) % 1000) * 1e-3f - 0.5f;
    const double flop = 2.0 * m * double(n) * k;
    for (const auto& lib : blas) {
      lib.sgemm(m, n, k, A.data(), B.data(), C.data());  // warm-up: page faults, thread start, JIT
      double best = 0;
      if (per_thread) {  // `threads` threads, each calling on its own C for ~seconds: total rate
        std::vector<long> calls(size_t(threads), 0);
        std::vector<std::thread> pool;
        auto t0 = clock::now();
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            std::vector<float> Ct(C.size());
            lib.sgemm(m, n, k, A.data(), B.data(), Ct.data());  // this thread's warm-up (JIT, buffers)
            for (auto s = clock::now(); std::chrono::duration<double>(clock::now() - s).count() < seconds;)
              lib.sgemm(m, n, k, A.data(), B.data(), Ct.data()), ++calls[size_t(t)];
          });
        for (auto& th : pool) th.join();
        long total_calls = 0;
        for (long c : calls) total_calls += c;
        best = flop * double(total_calls) / std::chrono::duration<double>(clock::now() - t0).count() / 1e9;
      } else {
        double total = 0;
        int calls = 0;
        while (total < seconds || calls < 3) {
          auto t0 = clock::now();
          lib.sgemm(m, n, k, A.data(), B.data(), C.data());
          double s = std::chrono::duration<double>(clock::now() - t0).count();
          total += s, ++calls;
          best = std::max(best, flop / s / 1e9);
        }
      }
      rate[lib.name][name] = best;
    }
  }
  // {"threads": 2, "blas": {"openblas": {"sizes": {...}, "peak_gflops": x}, ...}, "peak_gflops": x,
  //  "peak_blas": "...", "peak_n": "...", "missing": [...], "fma_gflops": x}
  double peak = 0;
  std::string peak_blas, peak_n;
  std::printf("{\"threads\": %d, \"per_thread\": %s, \"blas\": {", threads, per_thread ? "true" : "false");
  for (size_t li = 0; li < blas.size(); ++li) {
    double lib_peak = 0;
    std::printf("%s\"%s\": {\"sizes\": {", li ? ", " : "", blas[li].name.c_str());
    for (size_t si = 0; si < shapes.size(); ++si) {
      const double r = rate[blas[li].name][shapes[si].name];
      std::printf("%s\"%s\": %.1f", si ? ", " : "", shapes[si].name.c_str(), r);
      lib_peak = std::max(lib_peak, r);
      if (r > peak) peak = r, peak_blas = blas[li].name, peak_n = shapes[si].name;
    }
    std::printf("}, \"peak_gflops\": %.1f}", lib_peak);
  }
  std::printf("}, \"peak_gflops\": %.1f, \"peak_blas\": \"%s\", \"peak_n\": \"%s\", \"missing\": [%s], "
              "\"fma_gflops\": %.1f}\n",
              peak, peak_blas.c_str(), peak_n.c_str(), missing.c_str(), fma_ceiling(threads));
  return 0;
}
