// attention_bench: the attention core's forward + backward on one window of T positions, causal
// against document-masked windows of 1, 8, 64 ... equal documents (DESIGN.md, "Document masking"):
// the tiles the mask empties are skipped, so a window of many short documents costs less.
//
//   ninja -C build attention_bench
//   build/attention_bench [--seq 4096] [--heads 8] [--kv-heads 8] [--head-dim 64] [--batch 1]
//                         [--docs 1,8,64] [--rounds 5] [--threads 0 (all cores)] [--precision fp32[,bf16]]
//
// --precision bf16 runs the core as `train --precision bf16` does (layers/attention.h: bf16 products,
// fp32 softmax), its tiles on the path bf16_tiles() chose (printed; ORIGAMI_BF16_GEMM=portable forces
// fp32 tiles), on fp32 tiles with q|k|v rounded in place beforehand as a layer does. With both
// (fp32,bf16) each round times both, alternately, and each bf16 row also gives its time relative to
// fp32's on the same window (round by round: a machine whose speed drifts between rounds moves both).
// Each round times, alternately, the causal window and each document count (forward, then
// backward, on the same random q|k|v in fp32). Printed: per row the median of the rounds' times
// (min and max beside it), the score tiles computed (forward, per call), and the time and tiles
// relative to causal.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "model/layers/attention.h"

using namespace origami;

namespace {

struct Options {
  int64_t T = 4096, H = 8, KV = 8, D = 64, B = 1;
  std::vector<int64_t> docs = {1, 8, 64};
  int rounds = 5, threads = 0;
  std::vector<Precision> precisions = {Precision::fp32};
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "attention_bench: %s\nusage: attention_bench [--seq T] [--heads H] [--kv-heads KV] "
               "[--head-dim D] [--batch B] [--docs N,N,...] [--rounds R] [--threads N] [--precision fp32[,bf16]]\n", why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") usage("the attention core, causal against document-masked windows");
    if (i + 1 >= argc) usage(("missing value for " + k).c_str());
    const std::string v = argv[++i];
    auto num = [&] {
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      if (*end || n < 0) usage((k + " needs a non-negative integer, got '" + v + "'").c_str());
      return int64_t(n);
    };
    if (k == "--seq") o.T = num();
    else if (k == "--heads") o.H = num();
    else if (k == "--kv-heads") o.KV = num();
    else if (k == "--head-dim") o.D = num();
    else if (k == "--batch") o.B = num();
    else if (k == "--rounds") o.rounds = int(num());
    else if (k == "--threads") o.threads = int(num());
    else if (k == "--precision") {
      o.precisions.clear();
      std::stringstream ss(v);
      for (std::string f; std::getline(ss, f, ',');) {
        if (f != "fp32" && f != "bf16") usage(("--precision takes fp32 and bf16, got '" + f + "'").c_str());
        o.precisions.push_back(parse_precision(f));
      }
    } else if (k == "--docs") {
      o.docs.clear();
      std::stringstream ss(v);
      for (std::string f; std::getline(ss, f, ',');) o.docs.push_back(std::atoll(f.c_str()));
    } else usage(("unknown option " + k).c_str());
  }
  if (o.T < 1 || o.H < 1 || o.KV < 1 || o.H % o.KV || o.D < 1 || o.B < 1 || o.rounds < 1)
    usage("sizes must be positive and --heads a multiple of --kv-heads");
  for (int64_t n : o.docs)
    if (n < 1 || n > o.T) usage("each --docs count must be in [1, --seq]");
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  origami::flush_denormals();  // as origami runs its kernels (kernels/cpu/gemm.h)
  const Options o = parse(argc, argv);
  if (o.threads > 0) set_num_threads(o.threads);
  const int64_t S = (o.H + 2 * o.KV) * o.D, HD = o.H * o.D, N = o.B * o.T;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> qkv(size_t(N * S)), dout(size_t(N * HD)), out(size_t(N * HD)), lse(size_t(o.B * o.H * o.T)),
      dqkv(size_t(N * S));
  for (float& x : qkv) x = u(rng);
  for (float& x : dout) x = u(rng);
  // bf16 on fp32 tiles: q|k|v rounded in place once, as a layer gives them (Model::cp_shape).
  std::vector<float> qkv_rounded = qkv;
  round_in_place(qkv_rounded.data(), nullptr, int64_t(qkv_rounded.size()));
  // Row 0 is causal (no mask); then one row per document count: equal documents (the last takes the rest).
  std::vector<std::vector<int32_t>> masks(o.docs.size());
  for (size_t r = 0; r < o.docs.size(); ++r) {
    const int64_t len = o.T / o.docs[r];
    for (int64_t b = 0; b < o.B; ++b)
      for (int64_t t = 0; t < o.T; ++t) masks[r].push_back(int32_t(std::min(t / len, o.docs[r] - 1)));
  }
  // Row (precision p, window w) is p · windows + w; window 0 is causal.
  const size_t windows = 1 + o.docs.size(), rows = o.precisions.size() * windows;
  std::vector<std::vector<double>> times(rows);
  std::vector<int64_t> tiles(rows);
  for (int round = 0; round <= o.rounds; ++round)  // round 0 warms up
    for (size_t r = 0; r < rows; ++r) {
      const Precision p = o.precisions[r / windows];
      const int32_t* doc = r % windows == 0 ? nullptr : masks[r % windows - 1].data();
      const auto t0 = std::chrono::steady_clock::now();
      const bool in_place = qkv_rounded_in_place(p);
      const float* x = in_place ? qkv_rounded.data() : qkv.data();
      tiles[r] = attention_forward(out.data(), lse.data(), x, o.B, o.T, o.H, o.KV, o.D, doc, p, in_place);
      attention_backward(dqkv.data(), dout.data(), x, out.data(), lse.data(), o.B, o.T, o.H, o.KV, o.D, doc, p,
                         in_place);
      if (round > 0) times[r].push_back(seconds_since(t0) * 1e3);
    }
  auto median = [](std::vector<double> t) {  // (of an even count, the mean of the middle two)
    std::sort(t.begin(), t.end());
    const size_t n = t.size();
    return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
  };
  std::printf("attention forward + backward: B %lld, T %lld, %lld heads (%lld kv), head dim %lld, %d threads, "
              "median of %d rounds\n%s\n", (long long)o.B, (long long)o.T, (long long)o.H, (long long)o.KV,
              (long long)o.D, num_threads(), o.rounds, describe_tile_gemm().c_str());
  const bool both = o.precisions.size() > 1;  // rows relative to the first precision's
  if (std::find(o.precisions.begin(), o.precisions.end(), Precision::bf16) != o.precisions.end())
    std::printf("%s\n", describe_bf16_tiles().c_str());
  std::printf("\n| precision | window | ms (min-max) | score tiles | time vs causal | tiles vs causal |%s\n"
              "|---|---|---|---|---|---|%s\n", both ? " time vs the first precision |" : "", both ? "---|" : "");
  for (size_t r = 0; r < rows; ++r) {
    const Precision p = o.precisions[r / windows];
    const size_t w = r % windows, causal = r - w;
    const std::string name = w == 0 ? "causal" : std::to_string(o.docs[w - 1]) + " document" + (o.docs[w - 1] > 1 ? "s" : "");
    const double med = median(times[r]);
    std::printf("| %s | %s | %.1f (%.1f-%.1f) | %lld | %.3f | %.3f |", precision_name(p), name.c_str(), med,
                *std::min_element(times[r].begin(), times[r].end()), *std::max_element(times[r].begin(), times[r].end()),
                (long long)tiles[r], med / median(times[causal]), double(tiles[r]) / double(tiles[causal]));
    if (both) {  // the median of the round-by-round ratios against the first precision's row
      std::vector<double> ratio;
      for (size_t i = 0; i < times[r].size(); ++i) ratio.push_back(times[r][i] / times[w][i]);
      std::printf(" %.3f |", median(ratio));
    }
    std::printf("\n");
  }
  return 0;
}
