// sgemm_peak: measured single-precision GEMM rates of the BLAS libraries on this machine — the
// denominator of "achieved FLOP/s as a fraction of measured SGEMM peak" (DESIGN.md, Performance) —
// and the data for choosing the BLAS (bench/README.md, "Choosing the BLAS").
//
//   g++ -O2 -march=native -std=c++17 -pthread bench/sgemm_peak.cpp -ldl -o bench/runs/sgemm_peak
//   OMP_NUM_THREADS=2 taskset -c 0,1 bench/runs/sgemm_peak [--threads 2] [--blas openblas,onednn,blis]
//       [--sizes 512,1024,2048x768x256,...] [--seconds 1.0] [--bf16]
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
// With --bf16 it also measures the bf16 matmul rate on the same sizes: oneDNN's matmul primitive,
// bf16 A and B, fp32 C (what origami's gemm_bf16 calls, src/kernels/cpu/gemm_bf16.h), one primitive
// per size created before its warm-up call, through the C API from the same dlopen'ed libdnnl.so.2
// (its header, libdnnl-dev, is needed at build time for the types; without it --bf16 reports why).
// oneDNN picks AMX, AVX512-BF16 or emulation by the CPU; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 caps it
// (on an AMX host: the AVX512-BF16 rate), and below AVX-512 oneDNN 2.6 has no bf16 matmul. The bf16
// peak (best size) is reported apart from the SGEMM peak, with the implementation oneDNN chose.
//
// It also measures the core's FP32 FMA ceiling, the most any kernel could reach: each of --threads
// threads runs 12 independent chains of fused multiply-adds on registers only (no loads, no
// stores; 512-bit where the CPU has AVX-512F, else 256-bit), best of 5 runs of ~0.2 s. On
// Zen 4 this is 2 FMA pipes x 8 floats x 2 FLOP per cycle per core at either width. Where the CPU
// has AVX512-BF16, the same for its dot product (bf16_dot_gflops; 0 elsewhere).
// Prints one JSON object on stdout.
#include <dlfcn.h>
#include <immintrin.h>
#if __has_include(<oneapi/dnnl/dnnl.h>)
#include <oneapi/dnnl/dnnl.h>  // types only: the functions come from dlsym
#define SGEMM_PEAK_DNNL_HEADER 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
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

// The AVX512-BF16 dot product's ceiling, as fma_chains measures FMA's: 12 independent chains of
// VDPBF16PS on registers only, each instruction 32 bf16 products added pairwise into 16 fp32 lanes
// (64 FLOP). Compiled for that ISA whatever -march says, run only where the CPU has it. Its ratio to
// fma_ceiling bounds what any AVX512-BF16 GEMM (oneDNN's brg:avx512_core_bf16) can gain over fp32
// here: about 2 where the instruction issues as often as an FMA (Zen 4), 1 or less where it does not.
__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_chains(long iters) {
  __m512 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm512_set1_ps(1.0f + 0.01f * float(k));
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = _mm512_dpbf16_ps(a[k], x, x);
  }
  for (int k = 1; k < 12; ++k) a[0] = _mm512_add_ps(a[0], a[k]);
  return _mm512_reduce_add_ps(a[0]);
}

// GFLOP/s of `threads` threads each running `chains` (best of 5), `flop` per iteration of a thread.
double chains_ceiling(int threads, float (*chains)(long), double flop) {
  const long iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> sink(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { sink[size_t(t)] = chains(iters); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, flop * double(iters) * threads / s / 1e9);
    if (sink[0] == 12345.f) std::printf(" ");
  }
  return best;
}

double fma_ceiling(int threads) { return chains_ceiling(threads, fma_chains, 2.0 * 12 * kLanes); }

// 0 where the CPU has no AVX512-BF16.
double bf16_dot_ceiling(int threads) {
  return __builtin_cpu_supports("avx512bf16") ? chains_ceiling(threads, bf16_dot_chains, 64.0 * 12) : 0;
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

// oneDNN's bf16 matmul, C = A·B with A and B bf16 (as raw uint16_t) and C fp32, row-major, beta 0.
struct Bf16Matmul {
  std::function<void(int m, int n, int k, const uint16_t* A, const uint16_t* B, float* C)> run;
  // Creates the size's primitive (untimed); returns the implementation oneDNN chose for it.
  std::function<std::string(int m, int n, int k)> prepare;
};

#ifdef SGEMM_PEAK_DNNL_HEADER
// The C API functions, looked up in the dlopen'ed library (decltype gives their types).
struct DnnlApi {
#define SGEMM_PEAK_DNNL_FUNCTIONS(X)                                                                      \
  X(dnnl_engine_create) X(dnnl_stream_create) X(dnnl_stream_wait) X(dnnl_memory_desc_init_by_strides) \
  X(dnnl_matmul_desc_init) X(dnnl_primitive_desc_create) X(dnnl_primitive_desc_query)                  \
  X(dnnl_primitive_desc_destroy) X(dnnl_primitive_create) X(dnnl_primitive_execute) X(dnnl_memory_create) \
  X(dnnl_memory_destroy)
#define SGEMM_PEAK_DNNL_MEMBER(f) decltype(&::f) f = nullptr;
  SGEMM_PEAK_DNNL_FUNCTIONS(SGEMM_PEAK_DNNL_MEMBER)
};

// Everything one size needs: the primitive and the descriptors its memory objects are made from.
struct DnnlMatmul {
  dnnl_primitive_t primitive = nullptr;
  dnnl_memory_desc_t a, b, c;
};

// Creates the m x n x k matmul (row-major, dense); returns false where oneDNN has none for bf16.
bool create_matmul(const DnnlApi& api, dnnl_engine_t engine, int m, int n, int k, DnnlMatmul& out, std::string& impl) {
  const dnnl_dims_t a_dims = {m, k}, a_strides = {k, 1}, b_dims = {k, n}, b_strides = {n, 1}, c_dims = {m, n};
  api.dnnl_memory_desc_init_by_strides(&out.a, 2, a_dims, dnnl_bf16, a_strides);
  api.dnnl_memory_desc_init_by_strides(&out.b, 2, b_dims, dnnl_bf16, b_strides);
  api.dnnl_memory_desc_init_by_strides(&out.c, 2, c_dims, dnnl_f32, b_strides);
  dnnl_matmul_desc_t desc;
  dnnl_primitive_desc_t pd = nullptr;
  if (api.dnnl_matmul_desc_init(&desc, &out.a, &out.b, nullptr, &out.c) != dnnl_success ||
      api.dnnl_primitive_desc_create(&pd, &desc, nullptr, engine, nullptr) != dnnl_success)
    return false;
  const char* name = nullptr;
  api.dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
  impl = name ? name : "?";
  const bool ok = api.dnnl_primitive_create(&out.primitive, pd) == dnnl_success;
  api.dnnl_primitive_desc_destroy(pd);
  return ok;
}
#endif

// Loads oneDNN's bf16 matmul; false (with the reason in `why`) when the library, its header at build
// time, or a bf16 matmul on this CPU is missing. Primitives live until the program ends.
bool load_bf16_matmul(Bf16Matmul& out, std::string& why) {
#ifndef SGEMM_PEAK_DNNL_HEADER
  (void)out;
  return why = "built without oneDNN's header (apt-get install libdnnl-dev)", false;
#else
  void* h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) return why = dlerror(), false;
  auto api = std::make_shared<DnnlApi>();
#define SGEMM_PEAK_DNNL_LOOKUP(f)                                \
  api->f = reinterpret_cast<decltype(&::f)>(dlsym(h, #f));       \
  if (!api->f) return why = "no " #f, false;
  SGEMM_PEAK_DNNL_FUNCTIONS(SGEMM_PEAK_DNNL_LOOKUP)
  dnnl_engine_t engine = nullptr;
  dnnl_stream_t stream = nullptr;
  if (api->dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success ||
      api->dnnl_stream_create(&stream, engine, dnnl_stream_default_flags) != dnnl_success)
    return why = "no oneDNN CPU engine", false;
  DnnlMatmul probe;
  std::string impl;
  if (!create_matmul(*api, engine, 64, 64, 64, probe, impl))
    return why = "oneDNN creates no bf16 matmul on this CPU (below AVX-512, or ONEDNN_MAX_CPU_ISA)", false;
  auto matmuls = std::make_shared<std::map<std::string, DnnlMatmul>>();
  auto key = [](int m, int n, int k) { return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k); };
  out.prepare = [=](int m, int n, int k) {
    DnnlMatmul mm;
    std::string name;
    if (!create_matmul(*api, engine, m, n, k, mm, name)) {
      std::fprintf(stderr, "sgemm_peak: oneDNN creates no bf16 matmul for %s\n", key(m, n, k).c_str());
      std::exit(1);
    }
    (*matmuls)[key(m, n, k)] = mm;
    return name;
  };
  out.run = [=](int m, int n, int k, const uint16_t* A, const uint16_t* B, float* C) {
    const DnnlMatmul& mm = matmuls->at(key(m, n, k));
    dnnl_memory_t a = nullptr, b = nullptr, c = nullptr;
    api->dnnl_memory_create(&a, &mm.a, engine, const_cast<uint16_t*>(A));
    api->dnnl_memory_create(&b, &mm.b, engine, const_cast<uint16_t*>(B));
    api->dnnl_memory_create(&c, &mm.c, engine, C);
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    api->dnnl_primitive_execute(mm.primitive, stream, 3, args);
    api->dnnl_stream_wait(stream);
    for (dnnl_memory_t mem : {a, b, c}) api->dnnl_memory_destroy(mem);
  };
  return true;
#endif
}

// The best single-call rate of `call` (one warm-up call first), repeated for about `seconds` and at
// least 3 times.
double best_call_rate(const std::function<void()>& call, double flop, double seconds) {
  using clock = std::chrono::steady_clock;
  call();  // warm-up: page faults, thread start, JIT
  double best = 0, total = 0;
  for (int calls = 0; total < seconds || calls < 3; ++calls) {
    auto t0 = clock::now();
    call();
    double s = std::chrono::duration<double>(clock::now() - t0).count();
    total += s;
    best = std::max(best, flop / s / 1e9);
  }
  return best;
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

// Prints "bf16": {"lib": "onednn", "sizes": {...}, "impl": {...}, "peak_gflops": x, "peak_n": "..."},
// (with the trailing comma and space) for the bf16 rates and implementations by size.
void print_bf16_json(const std::vector<Shape>& shapes, std::map<std::string, double>& rate,
                     std::map<std::string, std::string>& impl) {
  double peak = 0;
  std::string peak_n;
  std::printf("\"bf16\": {\"lib\": \"onednn\", \"sizes\": {");
  for (size_t si = 0; si < shapes.size(); ++si) {
    const double r = rate[shapes[si].name];
    std::printf("%s\"%s\": %.1f", si ? ", " : "", shapes[si].name.c_str(), r);
    if (r > peak) peak = r, peak_n = shapes[si].name;
  }
  std::printf("}, \"impl\": {");
  for (size_t si = 0; si < shapes.size(); ++si)
    std::printf("%s\"%s\": \"%s\"", si ? ", " : "", shapes[si].name.c_str(), impl[shapes[si].name].c_str());
  std::printf("}, \"peak_gflops\": %.1f, \"peak_n\": \"%s\"}, ", peak, peak_n.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  bool per_thread = false;
  double seconds = 1.0;
  std::vector<std::string> sizes = {"1024", "2048", "3072"}, libs = {"openblas", "onednn", "blis"};
  bool libs_given = false, with_bf16 = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (a == "--sizes" && i + 1 < argc) sizes = split(argv[++i]);
    else if (a == "--blas" && i + 1 < argc) libs = split(argv[++i]), libs_given = true;
    else if (a == "--per-thread") per_thread = true;
    else if (a == "--bf16") with_bf16 = true;
    else {
      std::fprintf(stderr, "usage: sgemm_peak [--threads N] [--blas openblas,onednn,blis] [--sizes n|MxNxK,...] [--seconds S] [--per-thread] [--bf16]\n");
      return 2;
    }
  }
  if (with_bf16 && per_thread) {
    std::fprintf(stderr, "sgemm_peak: --bf16 measures whole-machine calls, not --per-thread\n");
    return 2;
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
  Bf16Matmul bf16;
  std::string bf16_missing;  // why --bf16 measured nothing
  if (with_bf16 && !load_bf16_matmul(bf16, bf16_missing)) with_bf16 = false;
  std::map<std::string, double> bf16_rate;       // size -> GFLOP/s
  std::map<std::string, std::string> bf16_impl;  // size -> oneDNN's implementation
  using clock = std::chrono::steady_clock;
  std::map<std::string, std::map<std::string, double>> rate;  // library -> size -> GFLOP/s
  for (const auto& [m, n, k, name] : shapes) {
    std::vector<float> A(size_t(m) * k), B(size_t(k) * n), C(size_t(m) * n);
    for (size_t i = 0; i < A.size(); ++i) A[i] = float((i * 7919) % 1000) * 1e-3f - 0.5f;
    for (size_t i = 0; i < B.size(); ++i) B[i] = float((i * 104729) % 1000) * 1e-3f - 0.5f;
    const double flop = 2.0 * m * double(n) * k;
    for (const auto& lib : blas) {
      double best = 0;
      if (per_thread) {  // `threads` threads, each calling on its own C for ~seconds: total rate
        lib.sgemm(m, n, k, A.data(), B.data(), C.data());  // warm-up: page faults, thread start, JIT
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
        best = best_call_rate([&] { lib.sgemm(m, n, k, A.data(), B.data(), C.data()); }, flop, seconds);
      }
      rate[lib.name][name] = best;
    }
    if (with_bf16) {  // the same inputs' top halves as bf16 (the values do not matter for speed)
      std::vector<uint16_t> A16(A.size()), B16(B.size());
      for (size_t i = 0; i < A.size(); ++i) std::memcpy(&A16[i], reinterpret_cast<const char*>(&A[i]) + 2, 2);
      for (size_t i = 0; i < B.size(); ++i) std::memcpy(&B16[i], reinterpret_cast<const char*>(&B[i]) + 2, 2);
      bf16_impl[name] = bf16.prepare(m, n, k);
      bf16_rate[name] = best_call_rate([&] { bf16.run(m, n, k, A16.data(), B16.data(), C.data()); }, flop, seconds);
    }
  }
  // {"threads": 2, "blas": {"openblas": {"sizes": {...}, "peak_gflops": x}, ...}, "peak_gflops": x,
  //  "peak_blas": "...", "peak_n": "...", "missing": [...], "fma_gflops": x, "bf16_dot_gflops": x}; with --bf16 also
  //  "bf16": {"lib": "onednn", "sizes": {...}, "impl": {...}, "peak_gflops": x, "peak_n": "..."}, or
  //  "bf16": null and "bf16_missing": "why".
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
  std::printf("}, \"peak_gflops\": %.1f, \"peak_blas\": \"%s\", \"peak_n\": \"%s\", \"missing\": [%s], ",
              peak, peak_blas.c_str(), peak_n.c_str(), missing.c_str());
  if (with_bf16) print_bf16_json(shapes, bf16_rate, bf16_impl);
  else if (!bf16_missing.empty()) std::printf("\"bf16\": null, \"bf16_missing\": \"%s\", ", bf16_missing.c_str());
  std::printf("\"fma_gflops\": %.1f, \"bf16_dot_gflops\": %.1f}\n", fma_ceiling(threads), bf16_dot_ceiling(threads));
  return 0;
}
