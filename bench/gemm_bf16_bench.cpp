// gemm_bf16_bench: origami's bf16 GEMM paths (src/kernels/cpu/gemm_bf16.h) against its fp32 GEMM on
// GPT-2's layer and LM-head weights at several token counts.
//
//   ninja -C build gemm_bf16_bench
//   OMP_NUM_THREADS=2 taskset -c 0,1 build/gemm_bf16_bench [--tokens 256,512,1024,2048] [--ops fwd,dx,dw]
//       [--seconds 0.3] [--rounds 3] [--cpu-time]
//   ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ... the same, with oneDNN's bf16 matmul kept off AMX
//
// For each weight [in, out] (768x2304 qkv, 768x768 attention projection, 768x3072 fc, 3072x768 fc
// projection; the LM head's [50304, 768]) and T tokens, the layer's GEMM as model/layers call it: fwd
// y[T,out] = x·W, dx = dy·Wᵀ, dw: dW += xᵀ·dy. Per shape, alternately: gemm<float> on fp32 copies of
// the inputs; gemm_bf16 forced onto oneDNN; gemm_bf16 forced onto the
// portable path; and gemm_bf16 left to its timed choice (which path it took). Each is the best
// single-call rate (2·M·N·K FLOP per call) over about --seconds after a warm-up call; with --rounds,
// the median over rounds. Prints the startup line (describe_bf16_gemm) and a markdown table.
// --cpu-time times calls by the process's CPU time instead of the wall clock: on a shared machine,
// with OMP_NUM_THREADS=1, the time another process holds the core does not count (with more threads
// it would count their spin-waiting, so it is refused).
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"

using namespace origami;

namespace {

struct Shape {
  std::string what;  // "768x2304 fwd T=256"
  bool ta, tb;
  int64_t M, N, K;
  float beta;
};

std::vector<Shape> shapes(const std::vector<int64_t>& tokens, const std::vector<std::string>& ops) {
  struct Weight {
    const char* name;
    int64_t in, out;
    bool out_in;  // stored [out, in] (the LM head), else [in, out]
  };
  const Weight weights[] = {{"768x2304", 768, 2304, false}, {"768x768", 768, 768, false},
                            {"768x3072", 768, 3072, false}, {"3072x768", 3072, 768, false},
                            {"LM head 768x50304", 768, 50304, true}};
  std::vector<Shape> out;
  for (const auto& op : ops)
    for (const auto& w : weights)
      for (int64_t T : tokens) {
        const std::string what = std::string(w.name) + " " + op + " T=" + std::to_string(T);
        if (op == "fwd") out.push_back({what, false, w.out_in, T, w.out, w.in, 0.f});
        else if (op == "dx") out.push_back({what, false, !w.out_in, T, w.in, w.out, 0.f});
        else if (w.out_in) out.push_back({what, true, false, w.out, w.in, T, 1.f});  // dW[out,in] += dyᵀ·x
        else out.push_back({what, true, false, w.in, w.out, T, 1.f});                // dW[in,out] += xᵀ·dy
      }
  return out;
}

bool cpu_time = false;  // --cpu-time

double now() {
  if (!cpu_time) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

double best_rate(const std::function<void()>& call, double flop, double seconds) {
  call();  // warm-up: page faults, primitive creation, the timed choice
  double best = 0, total = 0;
  for (int calls = 0; total < seconds || calls < 3; ++calls) {
    const double t0 = now();
    call();
    const double s = now() - t0;
    total += s;
    best = std::max(best, flop / s / 1e9);
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p <= s.size();) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

struct Rates {
  std::vector<double> fp32, onednn, portable, automatic;
  bool auto_onednn = false;
};

// One round over one shape: the four rates, alternately.
void measure(const Shape& s, double seconds, Rates& r) {
  const int64_t ar = s.ta ? s.K : s.M, ac = s.ta ? s.M : s.K, br = s.tb ? s.N : s.K, bc = s.tb ? s.K : s.N;
  std::vector<float> a32(size_t(ar * ac)), b32(size_t(br * bc)), c(size_t(s.M * s.N));
  for (size_t i = 0; i < a32.size(); ++i) a32[i] = float((i * 7919) % 1000) * 1e-3f - 0.5f;
  for (size_t i = 0; i < b32.size(); ++i) b32[i] = float((i * 104729) % 1000) * 1e-3f - 0.5f;
  std::vector<bf16> a16(a32.size()), b16(b32.size());
  to_bf16(a16.data(), a32.data(), int64_t(a32.size()));
  to_bf16(b16.data(), b32.data(), int64_t(b32.size()));
  to_float(a32.data(), a16.data(), int64_t(a32.size()));  // fp32 GEMM on the same values
  to_float(b32.data(), b16.data(), int64_t(b32.size()));
  const double flop = 2.0 * double(s.M) * double(s.N) * double(s.K);
  auto bf16_call = [&] { gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, 1.f, {a16.data(), ac}, {b16.data(), bc}, s.beta, c.data(), s.N); };
  r.fp32.push_back(best_rate(
      [&] { gemm<float>(s.ta, s.tb, s.M, s.N, s.K, 1.f, a32.data(), ac, b32.data(), bc, s.beta, c.data(), s.N); }, flop,
      seconds));
  set_bf16_gemm_mode(Bf16GemmMode::onednn);
  r.onednn.push_back(best_rate(bf16_call, flop, seconds));
  if (last_bf16_gemm_path() != Bf16GemmPath::onednn) r.onednn.back() = 0;  // oneDNN has no bf16 matmul here
  set_bf16_gemm_mode(Bf16GemmMode::portable);
  r.portable.push_back(best_rate(bf16_call, flop, seconds));
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  r.automatic.push_back(best_rate(bf16_call, flop, seconds));
  r.auto_onednn = last_bf16_gemm_path() == Bf16GemmPath::onednn;
}

}  // namespace

int main(int argc, char** argv) {
  origami::flush_denormals();  // as origami runs its kernels (kernels/cpu/gemm.h)
  std::vector<int64_t> tokens = {256, 512, 1024, 2048};
  std::vector<std::string> ops = {"fwd"};
  double seconds = 0.3;
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) {
      tokens.clear();
      for (const auto& t : split(argv[++i])) tokens.push_back(std::atoll(t.c_str()));
    } else if (a == "--ops" && i + 1 < argc) ops = split(argv[++i]);
    else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (a == "--cpu-time") cpu_time = true;
    else {
      std::fprintf(stderr, "usage: gemm_bf16_bench [--tokens 256,...] [--ops fwd,dx,dw] [--seconds S] [--rounds R] [--cpu-time]\n");
      return 2;
    }
  }
  if (cpu_time && num_threads() != 1) {
    std::fprintf(stderr, "gemm_bf16_bench: --cpu-time needs OMP_NUM_THREADS=1\n");
    return 2;
  }
  for (const auto& op : ops)
    if (op != "fwd" && op != "dx" && op != "dw") {
      std::fprintf(stderr, "gemm_bf16_bench: --ops: '%s' is not fwd, dx or dw\n", op.c_str());
      return 2;
    }
  std::printf("%s; %d threads; ONEDNN_MAX_CPU_ISA=%s; %s time\n", describe_bf16_gemm().c_str(), num_threads(),
              std::getenv("ONEDNN_MAX_CPU_ISA") ? std::getenv("ONEDNN_MAX_CPU_ISA") : "(unset)", cpu_time ? "CPU" : "wall");
  const std::vector<Shape> all = shapes(tokens, ops);
  std::map<std::string, Rates> rates;
  for (int round = 0; round < rounds; ++round)
    for (const auto& s : all) measure(s, seconds, rates[s.what]);
  std::printf("\n| shape | M×N×K | fp32 GFLOP/s | bf16 oneDNN GFLOP/s (× fp32) | bf16 portable GFLOP/s (cost over fp32) | timed choice |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const auto& s : all) {
    const Rates& r = rates[s.what];
    const double f = median(r.fp32), o = median(r.onednn), p = median(r.portable);
    std::printf("| %s | %ldx%ldx%ld | %.1f | %.1f (%.2f×) | %.1f (%+.1f%%) | %s |\n", s.what.c_str(), long(s.M),
                long(s.N), long(s.K), f, o, o / f, p, (f / p - 1) * 100, r.auto_onednn ? "oneDNN" : "portable");
  }
  return 0;
}
