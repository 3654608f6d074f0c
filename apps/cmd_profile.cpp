// origami profile: measures this machine for the planner and writes a cluster.json (plan/cluster.h).
//
// Under mpirun every rank takes part, as in a training run on the same ranks:
//   GEMMs       each shape is timed on every rank at once (each with its share of the cores), the
//               rate per rank the slowest rank's; shapes are the model's layer GEMMs (--config) at
//               one row and at --micro-batch rows, or squares and slabs from 128 to 2048; in fp32,
//               and in bf16 as training's matmul runs them (the weight's bf16 copy kept, the other
//               operand rounded at the call, fp32 accumulation): the file's "bf16" rates. Each shape
//               is timed in cache (the curve) and cold, its operands from memory as in a training
//               step (the difference: the rate operands stream at, gemm_streaming_gb_s, and for the
//               weight gradients, which add into C, gemm_streaming_accumulating_gb_s)
//   attention   the attention core's forward + backward on one window (--seq-len, the model's heads),
//               its rate by the causal FLOP convention (6·T²·H·D per window)
//   collectives all-reduce, all-gather, reduce-scatter and all-to-all over all ranks, and a
//               send/receive between ranks 0 and 1, from 4 KiB to --max-mb; per-step latency and
//               bandwidth from the smallest and largest messages of seconds = steps·latency +
//               bytes/bandwidth (bytes as Comm counts them), and each size's own bandwidth (its
//               "bandwidth_by_size"); the all-reduce's is the file's intra-node link, the others'
//               its "collectives"
//   bandwidth   a triad over arrays beyond the caches, every rank at once (element-wise work, AdamW)
//   first touch writing into pages returned to the system (ZeRO-2's gradient buffer), every rank at once
//   overlap     how much of a posted all-reduce completes while the rank runs GEMMs
// The device's peak is the best GEMM rate measured; its memory what the node has available, shared
// by its ranks. One node of `world` devices.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/matmul.h"
#include "model/config.h"
#include "plan/cluster.h"
#include "train/measure.h"
#include "train/trainer.h"

namespace origami {
namespace {

constexpr double kMaxMessageMb = 65536;  // --max-mb: the largest message a collective is timed with
constexpr int64_t kMaxProfileSeqLen = 131072;      // --seq-len
constexpr int64_t kMaxProfileMicroBatch = 65536;   // --micro-batch

// seconds = steps·latency + bytes/bandwidth from the points (bytes, seconds), smallest first: the
// latency from the smallest message (its transfer time removed at the bandwidth of the largest),
// the bandwidth from the largest with its latency removed; and each point's own bandwidth, its
// latency removed, by its bytes per step (messages that stay in the caches move faster).
struct Fit {
  double latency = 0, bandwidth = 0;  // per step, bytes/s
  std::vector<std::pair<double, double>> by_size;  // (bytes per step, bytes/s)
  LinkTier link() const { return {bandwidth, latency, by_size}; }
};
Fit fit(const std::vector<std::pair<double, double>>& pts, int steps) {
  const auto [b0, t0] = pts.front();
  const auto [b1, t1] = pts.back();
  double bandwidth = b1 / t1, latency = 0;
  for (int i = 0; i < 3; ++i) {  // a few rounds of the two coupled estimates
    latency = std::max(t0 - b0 / bandwidth, 0.0) / steps;
    bandwidth = b1 / std::max(t1 - steps * latency, t1 * 0.05);
  }
  Fit f{std::max(latency, 1e-9), bandwidth, {}};
  for (const auto& [b, t] : pts) f.by_size.emplace_back(b / steps, b / std::max(t - steps * latency, t * 0.05));
  return f;
}

// The options of `origami profile`, read and checked on every rank.
struct ProfileCommand {
  std::string out, name;
  std::optional<ModelConfig> cfg;  // --config: its layer GEMMs and heads are measured
  int64_t micro_batch = 0, seq_len = 0;
  double seconds = 0, max_mb = 0;
  int threads = 0;
};

// What one rank holds at once — the largest GEMM's operands with their cold copies, or (with more than
// one rank) the collectives' two --max-mb buffers — against this node's memory: an error now, not an
// allocation failing on one rank after minutes of timing. (Each rank against the whole node: ranks
// sharing it can still need more together.)
void check_profile_memory(const ProfileCommand& cmd, int ranks) {
  const std::vector<GemmShape> shapes =
      cmd.cfg ? model_gemm_shapes(*cmd.cfg, cmd.micro_batch, cmd.seq_len) : default_gemm_shapes();
  double gemm = 0;
  for (const GemmShape& s : shapes)
    for (const Precision p : {Precision::fp32, Precision::bf16})
      gemm = std::max(gemm, double(cold_copies(s, p)) * double(gemm_call_bytes(s, p)));
  const double collectives = ranks > 1 ? 2 * cmd.max_mb * 1024 * 1024 : 0;
  const AvailableMemory avail = available_memory();
  ORIGAMI_CHECK(std::max(gemm, collectives) <= double(avail.bytes), "profile would hold ",
                format_bytes(std::max(gemm, collectives)), " on a rank (",
                gemm >= collectives ? "the largest GEMM at --micro-batch x --seq-len rows, with its copies"
                                    : "two buffers of --max-mb for the collectives",
                "), more than the ", format_bytes(double(avail.bytes)), " available (", avail.source, ")");
}

// nullopt when --help was asked for (the help text is then already printed).
std::optional<ProfileCommand> parse_profile_options(int argc, char** argv, Comm& world) {
  Args a("profile",
         "Measure this machine for the planner (GEMM rates over the model's shapes, the attention core,\n"
         "collectives over the job's ranks) and write a cluster.json. Run it under mpirun with the ranks\n"
         "and threads a training run would use.");
  a.option("out", "FILE", "cluster.json to write")
      .option("config", "FILE", "model config.json whose layer GEMMs are measured (default: squares from 128 to 2048 "
              "and slabs of a 1024 x 4096 weight at 256 to 4096 rows)")
      .option("micro-batch", "B", "rows per micro-batch of the measured shapes (also timed at 1 row)", "4")
      .option("seq-len", "T", "tokens per row (GEMM rows B x T; the attention window)", "1024")
      .option("threads", "N", "threads per rank (0: all cores)", "0")
      .option("seconds", "S", "time per measurement and rank (large GEMMs take longer: each shape is timed in 3 trials "
              "of at least 3 calls, hot and cold, per precision; the default shapes reach 34 GFLOP a call)", "0.5")
      .option("max-mb", "M", "largest collective message (MiB)", "64")
      .option("name", "TEXT", "the cluster's name in the file", "this machine (origami profile)");
  bool parsed = false;
  ProfileCommand cmd;
  check_on_every_rank(world, "profile", [&] {
    if (!(parsed = a.parse(argc, argv))) return;
    ORIGAMI_CHECK(a.has("out"), "--out FILE is required (see 'origami profile --help')");
    cmd.micro_batch = a.integer("micro-batch"), cmd.seq_len = a.integer("seq-len");
    ORIGAMI_CHECK(cmd.micro_batch > 0 && cmd.seq_len > 0, "--micro-batch and --seq-len must be "
                  "positive, got ", cmd.micro_batch, " and ", cmd.seq_len);
    cmd.seconds = a.number("seconds"), cmd.max_mb = a.number("max-mb");
    ORIGAMI_CHECK(cmd.seconds > 0, "--seconds must be positive, got ", cmd.seconds);
    ORIGAMI_CHECK(cmd.max_mb >= 0.004 && cmd.max_mb <= kMaxMessageMb, "--max-mb must be in [0.004, ", kMaxMessageMb,
                  "] (4 KiB to 64 GiB), got ", cmd.max_mb);
    cmd.threads = threads_option(a);
    check_tile_gemm_env();  // (read at the first GEMM, minutes in)
    check_bf16_gemm_env();
    if (a.has("config")) cmd.cfg = load_model_config(a.str("config"));
    ORIGAMI_CHECK(!a.given("micro-batch") || cmd.cfg, "--micro-batch sizes the model's GEMM shapes: give --config too "
                  "(without one the shapes are fixed squares and slabs)");
    // (not the model's positions: the GEMMs and the attention core do not depend on them)
    ORIGAMI_CHECK(cmd.seq_len <= kMaxProfileSeqLen && cmd.micro_batch <= kMaxProfileMicroBatch, "--seq-len must be at "
                  "most ", kMaxProfileSeqLen, " (the attention timed is quadratic in it) and --micro-batch at most ",
                  kMaxProfileMicroBatch, ", got ", cmd.seq_len, " and ", cmd.micro_batch);
    check_profile_memory(cmd, world.size());
    cmd.out = a.str("out");
    if (world.rank() == 0) require_writable_file(cmd.out, "--out");  // (rank 0 writes it, after minutes of timing)
    cmd.name = a.str("name");
    try {  // (it goes into the JSON file, written after minutes of timing)
      (void)nlohmann::json(cmd.name).dump();
    } catch (const nlohmann::json::exception&) {
      fail("--name must be UTF-8 text, got bytes that are not");
    }
  });
  if (!parsed) return std::nullopt;
  return cmd;
}

// GEMMs in precision p: (FLOPs, rate) per shape in cache, equal FLOPs merged, into r's curve and peak;
// each shape timed cold as well, the difference fitted as the rate its operands stream at (over the
// shapes small enough to differ: a call whose operands alone fill 128 MiB reads memory in both).
void measure_gemms(Comm& world, const ProfileCommand& cmd, Precision p, ComputeRates& r) {
  const bool rank0 = world.rank() == 0;
  // The model's shapes at one row and at --micro-batch rows: a planner's layouts range between them
  // (the curve is flat beyond its ends).
  std::vector<GemmShape> shapes = cmd.cfg ? model_gemm_shapes(*cmd.cfg, 1, cmd.seq_len) : default_gemm_shapes();
  if (cmd.cfg && cmd.micro_batch > 1)
    for (const GemmShape& s : model_gemm_shapes(*cmd.cfg, cmd.micro_batch, cmd.seq_len)) shapes.push_back(s);
  std::map<double, std::vector<double>> rates;
  std::vector<StreamedCall> streamed[2];  // calls that write C, that add into it (dW)
  const double element = p == Precision::bf16 ? 2 : 4;  // bytes, as the planner counts a GEMM's operands
  if (rank0) std::printf("%s GEMMs, %d rank%s x %d threads at once (per rank; in cache, then cold):\n",
                         precision_name(p), world.size(), world.size() > 1 ? "s" : "", num_threads());
  for (const GemmShape& s : shapes) {
    const double t = time_gemm(world, s, p, cmd.seconds), cold = time_gemm(world, s, p, cmd.seconds, true);
    rates[s.flops()].push_back(s.flops() / t);
    if (cold_copies(s, p) > 1) streamed[s.ta].push_back({element * s.elements(), cold, t});  // (else cold is hot)
    if (rank0) std::printf("  %6lld x %6lld x %6lld%s  %8.2f  %8.2f GFLOP/s\n", (long long)s.M, (long long)s.N,
                           (long long)s.K, s.ta ? " (Aᵀ)" : s.tb ? " (Bᵀ)" : "     ", s.flops() / t / 1e9,
                           s.flops() / cold / 1e9);
  }
  for (const auto& [flops, rs] : rates) {
    double sum = 0;
    for (double x : rs) sum += x;
    r.gemm.emplace_back(flops, sum / double(rs.size()));
    r.peak_flops = std::max(r.peak_flops, *std::max_element(rs.begin(), rs.end()));
  }
  r.gemm_streaming = fit_streaming_rate(streamed[0]);
  r.gemm_streaming_accumulating = fit_streaming_rate(streamed[1]);
  char into_dw[64] = "";  // (none measured without weight-gradient shapes)
  if (r.gemm_streaming_accumulating > 0)
    std::snprintf(into_dw, sizeof into_dw, " (%.2f GB/s into weight gradients)", r.gemm_streaming_accumulating / 1e9);
  if (rank0) std::printf("  operands stream at %.2f GB/s beyond the in-cache rates%s\n", r.gemm_streaming / 1e9, into_dw);
}

// Attention: one window of T, the model's heads (or 8 of 64), in precision p. Returns its FLOP/s.
double measure_attention(Comm& world, const ProfileCommand& cmd, Precision p) {
  const int64_t T = cmd.seq_len;
  const int64_t H = cmd.cfg ? cmd.cfg->num_heads : 8, KV = cmd.cfg ? cmd.cfg->num_kv_heads : 8,
                D = cmd.cfg ? cmd.cfg->head_dim : 64;
  const double t = time_attention(world, T, H, KV, D, 0, p, cmd.seconds);
  const double flops = 6.0 * double(T) * double(T) * double(H * D) / t;
  if (world.rank() == 0)
    std::printf("attention T %lld, %lld heads of %lld, %s: %.2f GFLOP/s per rank\n", (long long)T, (long long)H,
                (long long)D, precision_name(p), flops / 1e9);
  return flops;
}

// Memory bandwidth: a triad a = b + s·c over arrays far larger than the caches, on every rank at
// once with its threads (element-wise layers and AdamW stream memory this way).
void measure_memory_bandwidth(Comm& world, double seconds, Cluster& c) {
  const size_t n = size_t(16) << 20;  // 64 MiB per array
  std::vector<float> x(n, 0.f), y(n, 1.f), z(n, 2.f);
  const double t = timed(world, seconds, 2, [&] {
    float* __restrict xs = x.data();
    const float* __restrict ys = y.data();
    const float* __restrict zs = z.data();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) xs[i] = ys[i] + 0.5f * zs[i];
  });
  c.memory_bandwidth = 3.0 * 4.0 * double(n) / t;
  if (world.rank() == 0)
    std::printf("memory bandwidth (triad, every rank at once): %.2f GB/s per rank\n", c.memory_bandwidth / 1e9);
}

// Writing into pages returned to the system (ZeRO-2 refills its gradient buffer so every
// micro-batch): a 64 MiB range released and written again, every rank at once.
void measure_first_touch(Comm& world, double seconds, Cluster& c) {
  const int64_t bytes = int64_t(64) << 20;
  ReleasablePages pages(bytes, "the first-touch measurement");
  const double t = timed(world, seconds, 2, [&] {
    pages.release(0, bytes);
    std::memset(pages.data(), 1, size_t(bytes));
  });
  c.first_touch = double(bytes) / t;
  if (world.rank() == 0)
    std::printf("first touch (fresh pages written, every rank at once): %.2f GB/s per rank\n", c.first_touch / 1e9);
}

struct Collective {
  const char* name;
  int steps;  // latency-bound message steps of the ring algorithm
};

// One collective over all ranks (send_recv: between ranks 0 and 1), timed on messages from 4 KiB
// (1024 floats) up to all of `in`, and its fit.
Fit measure_collective(Comm& world, const Collective& k, double seconds, std::vector<float>& in,
                       std::vector<float>& out) {
  const int n = world.size();
  const int64_t max_floats = int64_t(in.size());
  std::vector<std::pair<double, double>> pts;
  for (int64_t floats = 1024; floats <= max_floats; floats *= 4) {
    const int64_t per = floats / n * n;  // divisible by the ranks (all-gather, reduce-scatter, all-to-all)
    world.reset_bytes();
    int calls = 0;
    const std::string name = k.name;
    const double t = timed_best(world, seconds / 8, 3, [&] {
      ++calls;
      if (name == "all_reduce") world.all_reduce(in.data(), per, DType::f32);
      else if (name == "all_gather") world.all_gather(out.data(), in.data(), per / n, DType::f32);
      else if (name == "reduce_scatter") world.reduce_scatter(out.data(), in.data(), per / n, DType::f32);
      else if (name == "all_to_all") world.all_to_all(out.data(), in.data(), per / n, DType::f32);
      else if (world.rank() == 0) world.send(in.data(), per, DType::f32, 1, 5);
      else if (world.rank() == 1) world.recv(out.data(), per, DType::f32, 0, 5);
    });
    const double bytes = world.all_reduce_value(world.bytes_sent() / calls, ReduceOp::max);
    pts.emplace_back(bytes, t);
  }
  return fit(pts, k.steps);
}

// Collectives over all ranks (and a send/receive between ranks 0 and 1); more than one rank.
void measure_collectives(Comm& world, const ProfileCommand& cmd, Cluster& c) {
  const int n = world.size();
  const int64_t max_floats = int64_t(cmd.max_mb * 1024 * 1024 / 4);
  std::vector<float> in(static_cast<size_t>(max_floats), 1.f), out(static_cast<size_t>(max_floats));
  const Collective kinds[] = {{"all_reduce", 2 * (n - 1)}, {"all_gather", n - 1}, {"reduce_scatter", n - 1},
                              {"all_to_all", n - 1}, {"send_recv", 1}};
  const bool rank0 = world.rank() == 0;
  if (rank0) std::printf("collectives over %d ranks (bandwidth as Comm counts bytes; latency per message step):\n", n);
  for (const Collective& k : kinds) {
    const Fit f = measure_collective(world, k, cmd.seconds, in, out);
    if (rank0) std::printf("  %-15s %8.2f GB/s  %7.2f us per step\n", k.name, f.bandwidth / 1e9, f.latency * 1e6);
    if (std::string(k.name) == "all_reduce") c.intra = f.link();
    else c.collectives[k.name] = f.link();
  }
}

// Overlap: GEMMs alone (tg), an all-reduce alone (tc), and the GEMMs with that all-reduce posted
// before them, tested between them as DataParallel does, and completed after (tb). The part of the
// transfer that hid: (tg + tc − tb) / tc. More than one rank.
void measure_overlap(Comm& world, double seconds, Cluster& c) {
  const int64_t n = 512, floats = int64_t(8) << 20;  // 32 MiB: a few of --bucket-mb's buckets
  std::vector<float> A(size_t(n * n), 0.5f), Bm(size_t(n * n), 0.25f), C(size_t(n * n)), buf(size_t(floats), 1.f);
  const int gemms = 64;
  auto compute = [&](Request* pending) {
    for (int i = 0; i < gemms; ++i) {
      gemm<float>(false, true, n, n, n, 1.f, A.data(), n, Bm.data(), n, 0.f, C.data(), n);
      if (pending) pending->test();
    }
  };
  const double tg = timed(world, seconds, 2, [&] { compute(nullptr); });
  const double tc = timed(world, seconds, 2, [&] { world.all_reduce(buf.data(), floats, DType::f32); });
  const double tb = timed(world, seconds, 2, [&] {
    Request r = world.iall_reduce(buf.data(), floats, DType::f32, ReduceOp::sum);
    compute(&r);
    r.wait();
  });
  c.comm_overlap = std::clamp((tg + tc - tb) / tc, 0.0, 1.0);
  world.reset_bytes();
  if (world.rank() == 0)
    std::printf("overlap: GEMMs %.1f ms, all-reduce of 32 MiB %.1f ms, both %.1f ms: %.0f%% of the transfer hides\n",
                tg * 1e3, tc * 1e3, tb * 1e3, 100 * c.comm_overlap);
}

// The node's memory (`avail`, taken before the timing's buffers held any), shared by its ranks, and
// where every figure of the file comes from.
void describe_node(const Comm& world, const AvailableMemory& avail, Cluster& c) {
  c.memory_bytes = double(avail.bytes) / world.size();
  c.source = cat("measured by 'origami profile' on ", world.size(), " rank", world.size() > 1 ? "s" : "", " x ",
                 num_threads(), " threads: GEMM rates per rank with every rank running (peak: the best of them), the "
                 "attention core, memory bandwidth (triad), each collective's bandwidth and latency (the all-reduce's "
                 "the link), and how much of an all-reduce hides behind GEMMs; bf16: the GEMMs as its matmul runs them, "
                 "the attention core with its bf16 products; memory: what the node had available (",
                 avail.source, ") shared by the ranks");
}

int run_profile(Comm& world, const ProfileCommand& cmd) {
  const AvailableMemory avail = available_memory();
  ORIGAMI_CHECK(avail.bytes > 0, "no memory is available to this process (", avail.source, "): a cluster file "
                "of 0 bytes a device would plan nothing; free some and profile again");
  use_threads(cmd.threads, "profile", world.rank() == 0);
  warm_up_gemm();
  Cluster c;
  c.name = cmd.name;
  c.nodes = 1;
  c.devices_per_node = world.size();
  c.threads_per_rank = num_threads();
  measure_gemms(world, cmd, Precision::fp32, c);
  c.attention_flops = measure_attention(world, cmd, Precision::fp32);
  // bf16: the GEMMs as its matmul runs them, the attention core with its bf16 products (DESIGN.md,
  // "Mixed precision").
  c.bf16 = ComputeRates{};
  measure_gemms(world, cmd, Precision::bf16, *c.bf16);
  c.bf16->attention_flops = measure_attention(world, cmd, Precision::bf16);
  measure_memory_bandwidth(world, cmd.seconds, c);
  measure_first_touch(world, cmd.seconds, c);
  if (world.size() > 1) {  // (one rank: no link to measure, and the file has none)
    measure_collectives(world, cmd, c);
    measure_overlap(world, cmd.seconds, c);
  }
  c.inter = c.intra;
  describe_node(world, avail, c);
  if (world.rank() == 0) {
    write_file_atomically(cmd.out, c.to_json().dump(2) + "\n");
    std::printf("peak %.2f GFLOP/s per rank (best GEMM); wrote %s\n", c.peak_flops / 1e9, cmd.out.c_str());
  }
  return 0;
}

}  // namespace

// As train's: mistakes in the options are reported once and every rank exits 1; an error on one rank
// while measuring (an allocation, a node's environment) prints that rank's message and aborts the job
// with 2, so no rank is left waiting in a collective.
int cmd_profile(int argc, char** argv) {
  CommRuntime runtime(&argc, &argv);
  Comm& world = runtime.world();
  if (world.rank() != 0 && !std::freopen("/dev/null", "w", stdout))
    std::fprintf(stderr, "rank %d: cannot silence stdout\n", world.rank());
  const std::optional<ProfileCommand> cmd = parse_profile_options(argc, argv, world);
  try {
    return cmd ? run_profile(world, *cmd) : 0;
  } catch (const std::exception& e) {
    if (!runtime.distributed()) throw;
    abort_for_rank_error("profile", world, e);
  }
}

}  // namespace origami
