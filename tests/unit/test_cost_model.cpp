// The planner's cost model (plan/cost_model.h): what it keeps between layouts changes nothing, its
// bound never exceeds a prediction (so the search's early stop loses no layout), and its bubble is
// the pipeline schedule's.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/io.h"
#include "parallel/schedule.h"
#include "plan/cost_model.h"
#include "comm/comm.h"
#include "train/comm_volume.h"

using namespace origami;

namespace {

ModelConfig config(const std::string& name) {
  return load_model_config(std::string(ORIGAMI_SOURCE_DIR) + "/tests/parallel/configs/" + name + ".json");
}

// Two nodes of `per_node` devices; `free_links`: communication costs nothing.
Cluster cluster(int per_node, bool free_links) {
  nlohmann::json j = nlohmann::json::parse(R"({"name": "t", "nodes": 2,
    "device": {"memory_gb": 80, "peak_tflops": 0.1, "memory_bandwidth_gb_s": 10, "gemm_efficiency": 0.5,
               "attention_tflops": 0.02},
    "intra_node": {"bandwidth_gb_s": 1, "latency_us": 2}, "inter_node": {"bandwidth_gb_s": 0.1, "latency_us": 20}})");
  j["devices_per_node"] = per_node;
  if (free_links)
    for (const char* tier : {"intra_node", "inter_node"}) j[tier] = {{"bandwidth_gb_s", 1e12}, {"latency_us", 1e-12}};
  return Cluster::from_json(j, "test");
}

// Every layout of `devices` ranks over the axes the search varies, valid or not.
std::vector<TrainOptions> layouts(const ModelConfig& cfg, int devices, int64_t G, int64_t T) {
  std::vector<TrainOptions> out;
  for (int tp : {1, 2})
    for (int cp : {1, 2})
      for (int pp : {1, 2})
        for (int vpp : {1, 2})
          for (int ep : cfg.is_moe() ? std::vector<int>{1, 2, 4} : std::vector<int>{1})
            for (int etp : cfg.is_moe() ? std::vector<int>{1, 2} : std::vector<int>{1})
              for (int zero : {0, 1, 2, 3})
                for (const char* precision : {"fp32", "bf16"})
                for (int64_t mb : {1, 2})
                  for (const char* rc : {"none", "selective", "full"})
                    for (const char* comm : {"p2p", "a2a"})
                      for (bool vocab : {false, true})
                      for (int fssdp : cfg.is_moe() ? std::vector<int>{0, 1, 2} : std::vector<int>{0}) {  // 2: keep
                      if (devices % (tp * cp * pp) != 0 || (vocab && (pp == 1 || zero > 1))) continue;
                      if (std::string(precision) == "bf16" && (mb == 2 || std::string(rc) != "none")) continue;  // (enough)
                      TrainOptions o;
                      o.data = "plan";
                      o.global_batch = G, o.seq_len = T;
                      o.tp = tp, o.cp = cp, o.pp = pp, o.vpp = vpp, o.ep = ep, o.etp = etp, o.zero = zero;
                      o.micro_batch = mb, o.recompute = rc, o.cp_comm = comm, o.sequence_parallel = tp > 1;
                      o.vocab_parallel = vocab, o.precision = precision, o.expert_sharding = fssdp ? "fssdp" : "ep";
                      o.fssdp_keep = fssdp == 2;
                      out.push_back(o);
                    }
  return out;
}

TEST(CostModel, KeptFiguresAndBoundHoldForEveryLayout) {
  for (const char* name : {"llama_tiny", "mixtral_8e"}) {
    const ModelConfig cfg = config(name);
    const int devices = 8;
    CostModel model(cfg, cluster(4, false), devices);
    int accepted = 0;
    for (const TrainOptions& o : layouts(cfg, devices, 16, 32)) {
      Prediction p;
      try {
        p = model.predict(o);
      } catch (const Error&) {
        continue;  // refused by validate(); the search counts it so
      }
      ++accepted;
      const std::string layout = cat(name, " tp", o.tp, " cp", o.cp, " pp", o.pp, " vpp", o.vpp, " ep", o.ep, " etp",
                                     o.etp, " zero", o.zero, " ", o.precision, " mb", o.micro_batch, " ", o.recompute, " ", o.cp_comm,
                                     o.vocab_parallel ? " vocab" : "", " ", o.expert_sharding, o.fssdp_keep ? " keep" : "");
      EXPECT_LE(model.step_bound(o), p.step_s * (1 + 1e-12)) << layout;
      // The same memory and bytes as the runtime's functions give without the model's kept figures.
      const MeshShape mesh(devices, o.layout_dims(devices), o.mesh_order);
      const std::vector<int> firsts = mesh.group(0, "pp");
      ASSERT_EQ(p.stage_memory.size(), firsts.size()) << layout;
      for (size_t s = 0; s < firsts.size(); ++s)
        EXPECT_EQ(p.stage_memory[s].as_json(), rank_memory(cfg, o, devices, firsts[s], 0).as_json()) << layout;
      EXPECT_EQ(p.comm_bytes, step_comm_bytes(cfg, o, devices, 0)) << layout;
    }
    EXPECT_GT(accepted, 100) << name;
  }
}

TEST(CostModel, Bf16GradientReductionHalvesTheGradientBytes) {
  // --grad-reduce-dtype bf16 over DP8: the all-reduce (ZeRO 0) sends exactly half the bytes; with
  // ZeRO the reduce-scatter halves and the parameter all-gather stays fp32. The step is no slower.
  const ModelConfig cfg = config("llama_tiny");
  CostModel model(cfg, cluster(4, false), 8);
  for (int zero : {0, 1, 2}) {
    TrainOptions o;
    o.data = "plan";
    o.global_batch = 16, o.seq_len = 32, o.micro_batch = 1, o.zero = zero;
    const Prediction fp32 = model.predict(o);
    o.grad_reduce_dtype = "bf16";
    const Prediction bf16 = model.predict(o);
    const double full = fp32.comm_bytes.at("dp"), half = bf16.comm_bytes.at("dp");
    if (zero == 0) EXPECT_EQ(2 * half, full);
    else EXPECT_GT(half, full / 2) << "zero " << zero;  // the fp32 parameter gather
    EXPECT_LT(half, full) << "zero " << zero;
    EXPECT_LE(bf16.step_s, fp32.step_s) << "zero " << zero;
    // The bf16 buffers add to the gradients' memory; MPI's copy of the buckets in flight (workspace) halves.
    EXPECT_GT(bf16.memory.grads, fp32.memory.grads) << "zero " << zero;
    EXPECT_LT(bf16.memory.workspace, fp32.memory.workspace) << "zero " << zero;
  }
}

TEST(CostModel, BubbleIsTheSchedulesFillAndDrain) {
  // With communication free, every stage alike (8 layers over 4 stages) and m micro-batches, the
  // replayed schedules idle (p − 1)/v of a micro-batch's forward and backward: 1F1B and GPipe
  // (p − 1)·(f + b), interleaved (p − 1)·(f + b)/v. The bound is then the step's makespan.
  ModelConfig cfg = config("llama_tiny");
  cfg.num_layers = 8;
  const int devices = 4;
  const Cluster free = cluster(4, true);
  for (const char* schedule : {"1f1b", "gpipe", "interleaved"}) {
    CostModel model(cfg, free, devices);
    TrainOptions o;
    o.data = "plan";
    o.pp = 4, o.vpp = std::string(schedule) == "interleaved" ? 2 : 1, o.pp_schedule = schedule;
    o.micro_batch = 1, o.global_batch = 8, o.seq_len = 32;
    const Prediction p = model.predict(o);
    const double m = 8, per_micro = p.compute_s / m;
    EXPECT_NEAR(p.bubble_s, 3.0 / o.vpp * per_micro, 1e-9 * p.step_s) << schedule;
    double after = 0;
    for (const auto& [part, s] : p.exposed_s)
      if (part == "optimizer" || part == "world") after += s;
    EXPECT_NEAR(model.step_bound(o), p.step_s - after, 1e-9 * p.step_s) << schedule;
  }
}

// The closed form the cost model uses for schedules without output passes: with every stage alike,
// the replayed makespan of GPipe, 1F1B and interleaved 1F1B is (m + (p − 1)/v)·(f + b), for any
// backward-to-forward ratio.
TEST(CostModel, UniformStagesReplayToFillDrainAndSteadyState) {
  int checked = 0;
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved})
    for (int p : {2, 3, 4, 8})
      for (int v : {1, 2, 3})
        for (int m : {1, 2, 3, 4, 8, 12, 16, 24}) {
          if ((kind != ScheduleKind::interleaved && v > 1) || (kind == ScheduleKind::interleaved && m % p != 0)) continue;
          std::vector<std::vector<Action>> lists;
          for (int s = 0; s < p; ++s) lists.push_back(make_schedule(kind, p, s, m, v));
          for (double ratio : {1.0, 1.7, 2.0, 2.3, 3.1}) {
            const double replayed = replay_schedules(lists, p, m, v, 1.0 / v, ratio / v).makespan;
            const double closed = (m + double(p - 1) / v) * (1 + ratio);
            EXPECT_NEAR(replayed, closed, 1e-9 * closed) << schedule_kind_name(kind) << " p" << p << " v" << v << " m" << m;
            ++checked;
          }
        }
  EXPECT_GT(checked, 500);
}

// Vocabulary parallelism on a model whose vocabulary dominates (the 4-layer test llama with 16384
// vocabulary rows): at PP4 without it the first and last stages hold the embedding and the head, with
// it every stage a quarter of both, so the stages' memory evens out, the busiest stage's compute
// shrinks and the step is faster; the pipeline bytes are the runtime's count.
TEST(CostModel, VocabParallelBalancesTheStages) {
  ModelConfig cfg = config("llama_tiny");
  cfg.num_layers = 4, cfg.vocab_size = 16384;
  CostModel model(cfg, cluster(4, false), 4);
  TrainOptions o;
  o.data = "plan";
  o.pp = 4, o.micro_batch = 1, o.global_batch = 8, o.seq_len = 32;
  auto spread = [](const Prediction& p) {
    int64_t lo = INT64_MAX, hi = 0;
    for (const MemoryParts& m : p.stage_memory) lo = std::min(lo, m.total()), hi = std::max(hi, m.total());
    return double(hi) / double(lo);
  };
  const Prediction plain = model.predict(o);
  o.vocab_parallel = true;
  const Prediction vocab = model.predict(o);
  EXPECT_GT(spread(plain), 1.5);
  EXPECT_LT(spread(vocab), 1.1);
  EXPECT_LT(vocab.compute_s, plain.compute_s);
  EXPECT_LT(vocab.step_s, plain.step_s);
  EXPECT_EQ(vocab.comm_bytes, step_comm_bytes(cfg, o, 4, 0));
  EXPECT_GT(vocab.comm_bytes.at("pp"), plain.comm_bytes.at("pp"));  // the passes' collectives
}

// Kernel launches and AdamW: with every launch costing 1 ms, the compute's kernel term is the stated
// counts per micro-batch (per layer 6 + 12 for attention, 5 + 8 for a dense MLP; the head 4 + 4);
// AdamW streams 32 bytes per element it updates (34 under bf16: the weight's bf16 copy) and launches
// 3 kernels per tensor. The breakdown adds up to the step.
TEST(CostModel, KernelAndOptimizerTerms) {
  const ModelConfig cfg = config("llama_tiny");
  Cluster c = cluster(4, false);
  c.kernel_overhead = 1e-3;
  CostModel model(cfg, c, 1);
  TrainOptions o;
  o.data = "plan";
  o.global_batch = 4, o.seq_len = 32, o.micro_batch = 1;
  for (const char* precision : {"fp32", "bf16"}) {
    o.precision = precision;
    const Prediction p = model.predict(o);
    const double layers = double(cfg.num_layers);
    EXPECT_NEAR(p.compute_parts.at("kernels"), 4 * (layers * (6 + 12 + 5 + 8) + 8) * 1e-3, 1e-12) << precision;
    const double bytes = std::string(precision) == "bf16" ? 34 : 32;
    EXPECT_NEAR(p.exposed_s.at("optimizer"),
                double(p.memory.optimizer) / 8 * bytes / c.memory_bandwidth + 3 * double(model.num_tensors()) * 1e-3,
                1e-12) << precision;
    double sum = 0;
    for (const auto& [part, seconds] : p.breakdown()) sum += seconds;
    EXPECT_NEAR(sum, p.step_s, 1e-12 * p.step_s) << precision;
    double compute = 0;
    for (const auto& [term, seconds] : p.compute_parts) compute += seconds;
    EXPECT_NEAR(compute, p.compute_s, 1e-12 * p.compute_s) << precision;
  }
}

// bf16 on a CPU (origami's kernels, fp32 activations): the element-wise work and the pipeline messages
// cost what they cost in fp32; on a GPU (a cluster with SMs) they move 2-byte elements, so the
// element-wise work halves and the messages' transfer falls. llama_tiny, 4 micro-batches of 32 tokens.
TEST(CostModel, Bf16ActivationsAreFp32OnACpuAndHalfOnAGpu) {
  const ModelConfig cfg = config("llama_tiny");
  for (const bool gpu : {false, true}) {
    Cluster c = cluster(4, false);
    if (gpu) c.sms = 108;
    CostModel model(cfg, c, 2);
    TrainOptions o;
    o.data = "plan";
    o.global_batch = 4, o.seq_len = 32, o.micro_batch = 1, o.pp = 2;
    const Prediction fp32 = model.predict(o);
    o.precision = "bf16";
    const Prediction bf16 = model.predict(o);
    const double elementwise = bf16.compute_parts.at("elementwise") / fp32.compute_parts.at("elementwise");
    EXPECT_NEAR(elementwise, gpu ? 0.5 : 1.0, 1e-12) << (gpu ? "gpu" : "cpu");
    if (gpu) EXPECT_LT(bf16.exposed_s.at("pp"), fp32.exposed_s.at("pp"));
    else EXPECT_DOUBLE_EQ(bf16.exposed_s.at("pp"), fp32.exposed_s.at("pp"));
    EXPECT_GT(fp32.exposed_s.at("pp"), 0);
  }
}

// The data-parallel reduction hides behind the backward it can overlap: ZeRO-0 and 1 reduce during
// the last micro-batch's backward, ZeRO-2 during every one. With compute-bound GEMMs (a backward
// twice its forward: 2/3 of a micro-batch's compute) and buckets of 64 KiB, the exposed part is the
// whole reduction less min(reduction less its last bucket, the window), on a slow link (the window
// binds) and a fast one (the reduction fits in it but for the last bucket). ZeRO-1/2's parameter
// gather (fp32, the copy buckets' bf16 under --precision bf16) follows, and the last bucket moves as
// the wire type (--grad-reduce-dtype): all-reduced, or reduce-scattered under ZeRO.
TEST(CostModel, GradientReductionHidesBehindTheBackwardItOverlaps) {
  const ModelConfig cfg = config("llama_tiny");
  for (double bandwidth : {1e6, 1e12}) {
    Cluster c = cluster(4, false);
    c.memory_bandwidth = 1e18;  // GEMMs compute-bound, element-wise work free
    c.intra = {bandwidth, 1e-6};
    CostModel model(cfg, c, 2);
    for (int zero : {0, 1, 2})
      for (const char* precision : {"fp32", "bf16"})
        for (const char* wire : {"fp32", "bf16"}) {
          TrainOptions o;
          o.data = "plan";
          o.global_batch = 8, o.seq_len = 32, o.micro_batch = zero == 1 ? 4 : 1, o.zero = zero, o.bucket_mb = 1.0 / 16;
          o.precision = precision, o.grad_reduce_dtype = wire;
          const Prediction p = model.predict(o);
          const double micro = zero == 1 ? 1 : 4, total = p.comm_bytes.at("dp");
          const RankBuffers held = rank_buffers(cfg, o, 2, 0);
          const double gather = zero == 0 ? 0 : (4.0 * double(held.dense.buckets) - 2.0 * double(held.dense.copy)) / 2;
          const double reduce_s = 2 * 1e-6 + (total - gather) / bandwidth;
          const double bucket = o.bucket_mb * 1024 * 1024 * (std::string(wire) == "bf16" ? 0.5 : 1.0);
          const double last = zero == 0 ? all_reduce_bytes(2, bucket) : scatter_gather_bytes(2, bucket / 2);
          const double tail_s = std::min(total - gather, last) / bandwidth;
          const double window = (zero == 2 ? micro : 1.0) * (2.0 / 3) * p.compute_s / micro;
          const double gather_s = zero > 0 ? 1e-6 + gather / bandwidth : 0.0;
          EXPECT_NEAR(p.exposed_s.at("dp"), reduce_s + gather_s - std::min(reduce_s - tail_s, window), 1e-9 * p.step_s)
              << "bandwidth " << bandwidth << " zero " << zero << " " << precision << " wire " << wire;
          if (zero > 0 && std::string(precision) == "bf16") EXPECT_GT(held.dense.copy, 0);  // (the case it tests)
        }
  }
}

// The data-parallel reduction and its last bucket move at one rate, that of messages beyond the caches
// (the largest measured), however small the buckets: with a bandwidth that falls with size and
// gradients that fit in one bucket (llama_tiny, 16 MiB buckets, DP2), the tail is the whole reduction
// less its latency, so only the latency hides, never more than the reduction.
TEST(CostModel, DataParallelReductionsMoveAtTheRateBeyondTheCaches) {
  const ModelConfig cfg = config("llama_tiny");
  Cluster c = cluster(4, false);
  c.intra = {1e9, 1e-6, {{1024, 1e10}, {double(1 << 30), 1e9}}};
  CostModel model(cfg, c, 2);
  TrainOptions o;
  o.data = "plan";
  o.global_batch = 8, o.seq_len = 32, o.micro_batch = 1;
  const Prediction p = model.predict(o);
  const double total = p.comm_bytes.at("dp");
  ASSERT_LT(total, all_reduce_bytes(2, 16.0 * 1024 * 1024));  // one bucket
  const double reduce_s = 2e-6 + total / 1e9;
  EXPECT_NEAR(p.exposed_s.at("dp"), reduce_s - 2e-6, 1e-12);
}

// ZeRO-2 returns its gradient pages outside the shard after each bucket's reduction, so every one of
// the 4 micro-batches writes them afresh (the shard's own pages only the first time): that many bytes
// at the cluster's first-touch rate, added to the step. ZeRO-1 keeps its buffer; a cluster without
// the rate prices nothing.
TEST(CostModel, ZeroTwoWritesItsGradientPagesAfreshEveryMicroBatch) {
  const ModelConfig cfg = config("llama_tiny");
  Cluster c = cluster(4, false);
  CostModel plain(cfg, c, 2);
  c.first_touch = 1e9;
  CostModel model(cfg, c, 2);
  TrainOptions o;
  o.data = "plan";
  o.global_batch = 8, o.seq_len = 32, o.micro_batch = 1, o.zero = 2;
  const Prediction p = model.predict(o), without = plain.predict(o);
  const BufferFigures b = rank_buffers(cfg, o.resolved(2), 2, 0).dense;
  const double micro = 4, floats = micro * double(b.size - b.shard) + double(b.shard);
  EXPECT_GT(b.shard, 0);
  EXPECT_NEAR(p.exposed_s.at("page faults"), 4 * floats / 1e9, 1e-15);
  EXPECT_NEAR(p.step_s - without.step_s, 4 * floats / 1e9, 1e-12);
  EXPECT_EQ(without.exposed_s.count("page faults"), 0u);
  o.zero = 1;
  EXPECT_EQ(model.predict(o).exposed_s.count("page faults"), 0u);
}

}  // namespace

// A linear's weight gradient adds into its C: on a measured curve its operands stream at
// gemm_streaming_accumulating, the forward and input-gradient calls at gemm_streaming. llama_tiny on
// one rank, one micro-batch of 32 tokens, every call at 1 GFLOP/s in cache: setting the accumulating
// rate adds exactly each weight gradient's operand bytes (M·K + K·N + M·N floats, M × N the weight,
// K the rows) times the difference of the two rates' inverses, layers and LM head.
TEST(CostModel, WeightGradientsStreamAtTheAccumulatingRate) {
  const ModelConfig cfg = config("llama_tiny");
  Cluster c = cluster(1, true);
  c.gemm = {{1.0, 1e9}};
  c.gemm_streaming = 1e10;
  TrainOptions o;
  o.data = "plan";
  o.global_batch = 1, o.seq_len = 32, o.micro_batch = 1;
  const double plain = CostModel(cfg, c, 1).predict(o).compute_parts.at("gemm");
  c.gemm_streaming_accumulating = 2e9;
  const double accumulating = CostModel(cfg, c, 1).predict(o).compute_parts.at("gemm");
  const double rows = 32, C = double(cfg.hidden), D = double(cfg.head_dim), F = double(cfg.ffn);
  const double H = double(cfg.num_heads), KV = double(cfg.num_kv_heads), V = double(cfg.vocab_size);
  auto dw_bytes = [&](double in, double out) { return 4 * (out * rows + rows * in + out * in); };
  const double layer = dw_bytes(C, (H + 2 * KV) * D) + dw_bytes(H * D, C) + dw_bytes(C, 2 * F) + dw_bytes(F, C);
  const double bytes = double(cfg.num_layers) * layer + dw_bytes(C, V);
  EXPECT_NEAR(accumulating - plain, bytes * (1 / 2e9 - 1 / 1e10), 1e-9 * accumulating);
}

// origami's SP with several rows a micro-batch copies each gathered or reduce-scattered [N, C]
// activation once more (rows' order to shards' and back): per attention or dense MLP block (and a
// qwen2_moe layer's shared expert) 2 forward and 3 backward, the final norm's 1 and 1, N·C floats
// read and written each, at the memory bandwidth; full recomputation redoes the layers' forward
// copies, not the head's. A CPU cluster prices them; on a GPU cluster (Megatron's sequence-first
// layout) and with one row a micro-batch there are none. TP2 + SP, 2 micro-batches of 2 rows of 32
// tokens (or 4 of one row); the forward and backward parts apart.
TEST(CostModel, SequenceParallelReordersItsActivationsOnACpu) {
  for (const char* name : {"llama_tiny", "qwen2_moe_8e"}) {
    const ModelConfig cfg = config(name);
    const double blocks = 2;  // per layer: attention, and the dense MLP or the shared expert
    for (const char* recompute : {"none", "full"})
      for (const int64_t rows : {1, 2}) {
        TrainOptions o;
        o.data = "plan";
        o.global_batch = 4, o.seq_len = 32, o.tp = 2, o.sequence_parallel = true, o.micro_batch = rows;
        o.recompute = recompute;
        Cluster cpu = cluster(2, false), gpu = cpu;
        gpu.sms = 108;
        CostModel on_cpu(cfg, cpu, 2), on_gpu(cfg, gpu, 2);
        const Prediction a = on_cpu.predict(o), b = on_gpu.predict(o);
        const double extra = a.compute_parts.at("elementwise") - b.compute_parts.at("elementwise");
        const double N = double(rows) * 32, copy = 2 * N * double(cfg.hidden) * 4 / cpu.memory_bandwidth;
        const double micro = double(o.global_batch / rows), layers = double(cfg.num_layers);
        const double fwd = layers * blocks * 2 + 1, bwd = layers * blocks * 3 + 1,
                     again = std::string(recompute) == "full" ? layers * blocks * 2 : 0;
        EXPECT_NEAR(extra, rows > 1 ? micro * (fwd + bwd + again) * copy : 0.0, 1e-12)
            << name << ", recompute " << recompute << ", " << rows << " rows";
      }
  }
}

// The step waits for the slowest stage's gradient reductions, not the first stage's: a 4-layer llama
// (untied: its embedding and head the same size) split 1 + 3 and 3 + 1 over PP2 x DP2 on slow links
// exposes the reduction of its 3-layer stage both ways, which sends more than twice the other's bytes
// (the two differ by the head stage's final norm: 48 weights).
TEST(CostModel, GradientReductionsOfTheSlowestStage) {
  ModelConfig cfg = config("llama_tiny");
  cfg.num_layers = 4;
  Cluster c = cluster(4, false);
  c.intra = {1e6, 1e-6};
  CostModel model(cfg, c, 4);
  std::vector<double> exposed;
  for (const std::vector<int>& split : {std::vector<int>{1, 3}, std::vector<int>{3, 1}}) {
    TrainOptions o;
    o.data = "plan";
    o.global_batch = 8, o.seq_len = 32, o.micro_batch = 1, o.pp = 2, o.pp_layers = split;
    exposed.push_back(model.predict(o).exposed_s.at("dp"));
    if (split[0] == 1)  // rank 2: the second stage's first rank (pp the slowest axis)
      EXPECT_GT(step_comm_bytes(cfg, o, 4, 2).at("dp"), 2 * step_comm_bytes(cfg, o, 4, 0).at("dp"));
  }
  EXPECT_NEAR(exposed[0], exposed[1], 0.005 * exposed[1]);
}

// FSSDP's exchanges block inside each MoE layer of every micro-batch (and so stretch a pipeline's
// bubble like any blocking communication): all-to-alls of the step's `edp` bytes — per layer and
// micro-batch the needs before each gather and the reduction, the gathers and the reduction: 6 calls
// a layer, 8 under full recomputation; under keep only the step's first gather sends anything — and
// their passes over memory at the cluster's bandwidth, per element of the rank's shard S of a layer
// of D elements (DataParallel::gather_experts, reduce_experts): each gather copies S (8 bytes) or, in
// bf16, rounds it for itself and for the peer (6 each); the reduction adds the own piece from fp32
// (12) and the peer's (12, or 10 from a bf16 wire, whose sent piece of D - S is rounded first, 6), and
// clears the staged layer (4 a D element). mixtral_8e (2 MoE layers) under DP2 FSSDP, 2 micro-batches.
TEST(CostModel, FssdpExchangesBlockInEachMoeLayer) {
  const ModelConfig cfg = config("mixtral_8e");
  Cluster c = cluster(4, false);
  c.intra = {1e6, 1e-6};
  CostModel model(cfg, c, 2);
  struct Case {
    const char* recompute;
    const char* precision;
    const char* wire;
    bool keep;
    double calls, gathers, gather_bytes, own_add, peer_add, send_round;  // per layer and micro-batch
  };
  for (const Case& k : {Case{"none", "fp32", "fp32", false, 6, 2, 8, 12, 12, 0},
                        Case{"full", "fp32", "fp32", false, 8, 3, 8, 12, 12, 0},
                        Case{"none", "bf16", "bf16", false, 6, 2, 12, 12, 10, 6},
                        Case{"none", "fp32", "fp32", true, 4.5, 0.5, 8, 12, 12, 0}}) {
    TrainOptions o;
    o.data = "plan";
    o.global_batch = 8, o.seq_len = 32, o.micro_batch = 2, o.expert_sharding = "fssdp", o.recompute = k.recompute;
    o.precision = k.precision, o.grad_reduce_dtype = k.wire, o.fssdp_keep = k.keep;
    const Prediction p = model.predict(o);
    const double micro = 2;
    const BufferFigures held = rank_buffers(cfg, o, 2, 0).experts;
    double staging = 0;
    for (int64_t l : {0, 1}) {
      const double D = double(held.unit_data.at(l)), S = double(held.unit_shard_data.at(l));
      staging += micro * (k.gathers * k.gather_bytes * S + k.own_add * S + k.peer_add * S + k.send_round * (D - S) + 4 * D);
    }
    const double a2a = c.all_to_all_seconds(p.comm_bytes.at("edp") / micro, int(2 * k.calls), 2, 2);
    EXPECT_NEAR(p.exposed_s.at("edp"), micro * a2a + staging / c.memory_bandwidth, 1e-12 * p.step_s)
        << k.recompute << " " << k.precision << " wire " << k.wire << (k.keep ? " keep" : "");
  }
  // A cluster file without a memory bandwidth (its measured GEMM rates instead: a profiled host)
  // leaves the staging passes unpriced, as every streamed term: they had been divided by 1e-9 GB/s,
  // 10^15 s a step, and FSSDP never chosen.
  nlohmann::json measured = read_json_file(std::string(ORIGAMI_SOURCE_DIR) + "/configs/clusters/cpu-2core.json", "cluster");
  measured["device"].erase("memory_bandwidth_gb_s");
  const Cluster profiled = Cluster::from_json(measured, "cpu-2core.json without memory_bandwidth_gb_s");
  CostModel unpriced(cfg, profiled, 2);
  TrainOptions o;
  o.data = "plan";
  o.global_batch = 8, o.seq_len = 32, o.micro_batch = 2, o.expert_sharding = "fssdp", o.recompute = "none";
  o.precision = "fp32", o.grad_reduce_dtype = "fp32";
  const Prediction p = unpriced.predict(o);
  EXPECT_NEAR(p.exposed_s.at("edp"), 2 * profiled.all_to_all_seconds(p.comm_bytes.at("edp") / 2, 12, 2, 2), 1e-12);
  EXPECT_LT(p.step_s, 1.0);
}
