#include "train/memory_plan.h"

#include <algorithm>
#include <map>

#include "core/checked.h"
#include "core/memory.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/pipeline.h"
#include "parallel/schedule.h"

namespace origami {

namespace {

constexpr const char* kNames[MemoryParts::kCount] = {"weights",   "gradients",  "optimizer state", "activations",
                                                     "workspace", "checkpoint", "runtime"};
constexpr const char* kAdvice[MemoryParts::kCount] = {
    "TP or PP over more ranks, or ZeRO (--zero 1 shards the optimizer state, --zero 2 the gradients too), need "
    "less per rank",
    "TP or PP over more ranks, or --zero 2 (sharded gradients), need less per rank",
    "TP or PP over more ranks, or ZeRO (--zero 1 shards the optimizer state), need less per rank",
    "a smaller --micro-batch, --recompute selective|full, TP with --sequence-parallel or PP need less",
    "a smaller --micro-batch or --seq-len needs less (the LM head works in chunks of the vocabulary); under DP, "
    "MPI keeps a copy of the gradient buckets in flight",
    "an asynchronous save copies this rank's shards first: drop --async-save",
    "the process itself is that large before the run allocates"};

}  // namespace

const char* MemoryParts::name(int i) { return kNames[i]; }
const char* MemoryParts::advice(int i) { return kAdvice[i]; }

int64_t MemoryParts::total() const {
  Size t = 0;
  for (int i = 0; i < kCount; ++i) t += (*this)[i];
  return t.get();
}

int MemoryParts::largest() const {
  int best = 0;
  for (int i = 1; i < kCount; ++i)
    if ((*this)[i] > (*this)[best]) best = i;
  return best;
}

std::string MemoryParts::describe() const {
  std::string s;
  for (int i = 0; i < kCount; ++i)
    if ((*this)[i] > 0) s += cat(s.empty() ? "" : ", ", kNames[i], " ", format_bytes(double((*this)[i])));
  return s;
}

nlohmann::json MemoryParts::as_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (int i = 0; i < kCount; ++i) j[kNames[i]] = (*this)[i];
  j["total"] = total();
  return j;
}

namespace {
// The gather figures of one buffer over a group of `group` ranks (BufferFigures): its copy buckets
// (ZeRO ≥ 1 under bf16) and ZeRO-3's units, head gather and most held at once; `bf16`: the run
// keeps bf16 copies.
void gathered_figures(BufferFigures& f, const std::vector<ParamSpec>& table, const BufferPlan& plan,
                      const std::vector<Range>& shards, int group, bool bf16) {
  // The head's gather: its own buckets and, with a tied embedding, the bucket holding the embedding.
  const bool tied = std::any_of(table.begin(), table.end(), [](const ParamSpec& p) { return param_unit(p.name) == kHeadUnit; }) &&
                    std::none_of(table.begin(), table.end(), [](const ParamSpec& p) { return p.name == "lm_head.weight"; });
  for (size_t b = 0; b < shards.size(); ++b) {
    const int64_t length = plan.buckets[b].end - plan.buckets[b].begin, copy = plan.bucket_copy[b] ? length : 0;
    f.unit_floats[plan.bucket_unit[b]] += length;
    f.unit_copy[plan.bucket_unit[b]] += copy;
    if (copy > 0) f.shard_copy += shards[b].end - shards[b].begin, f.copy += copy;
    bool head = plan.bucket_unit[b] == kHeadUnit;
    for (size_t i = 0; i < table.size() && tied && !head; ++i)
      head = (table[i].name == "wte.weight" || table[i].name == "model.embed_tokens.weight") &&
             plan.offsets[i] >= plan.buckets[b].begin && plan.offsets[i] < plan.buckets[b].end;
    if (head) f.head_gather += length, f.head_gather_copy += copy;
  }
  // Bytes a gathered unit of `floats`, `copy` of them in copy buckets, holds beyond the shards.
  auto held = [&](int64_t floats, int64_t copy) {
    const Size values = Size(floats - copy), others = values * (group - 1) / group;
    return (4 * others + (bf16 ? 2 * values : Size(0)) + 2 * (Size(copy) * (group - 1) / group)).get();
  };
  // Units in forward order: the embedding, then the layers (map order: kHeadUnit < kEmbeddingUnit < 0).
  int64_t previous = 0;
  for (const auto& [unit, floats] : f.unit_floats) {
    if (unit == kHeadUnit) continue;
    const int64_t bytes = held(floats, f.unit_copy[unit]);
    f.gathered_held = std::max(f.gathered_held, previous + bytes), previous = bytes;
  }
  f.gathered_held = std::max(f.gathered_held, held(f.head_gather, f.head_gather_copy));
}

// ZeRO >= 2's most gradient floats held in whole buckets (beside the shards), from a replay of backward:
// each unit's pass writes its gradients (the pages of every bucket it overlaps), then announces them
// (Model calls grads_ready at the unit's first offset), which starts each bucket beginning at or
// above it in list order, each start completing the one in flight (DataParallel::start_bucket).
// Where buckets hold several layers that is two buckets, one reducing and one being written; where a
// layer spans several buckets, the whole layer and the bucket still reducing.
int64_t gradient_buckets_held(const std::vector<ParamSpec>& table, const BufferPlan& plan) {
  std::map<int64_t, int64_t> unit_begin;  // unit -> its first offset (a unit is one contiguous range)
  for (size_t i = 0; i < table.size(); ++i) {
    const auto [it, first] = unit_begin.emplace(param_unit(table[i].name), plan.offsets[i]);
    if (!first) it->second = std::min(it->second, plan.offsets[i]);
  }
  std::vector<int64_t> begins;  // backward's order: from the end of the buffer
  for (const auto& [unit, begin] : unit_begin) begins.push_back(begin);
  std::sort(begins.rbegin(), begins.rend());
  const std::vector<Range>& buckets = plan.buckets;  // listed from the end of the buffer
  std::vector<int64_t> upto(buckets.size() + 1, 0);  // lengths of buckets [0, b)
  for (size_t b = 0; b < buckets.size(); ++b) upto[b + 1] = upto[b] + (buckets[b].end - buckets[b].begin);
  size_t idle = 0, written = 0;  // buckets [0, idle) started; [idle, written) written, not started
  int64_t in_flight = 0, most = 0;
  for (const int64_t begin : begins) {
    while (written < buckets.size() && buckets[written].end > begin) ++written;
    most = std::max(most, in_flight + upto[written] - upto[idle]);
    for (; idle < buckets.size() && buckets[idle].begin >= begin; ++idle)
      in_flight = buckets[idle].end - buckets[idle].begin;
  }
  return most;
}

RankBuffers buffers_of(const TrainOptions& options, int world_size, int rank, const SplitTable& tables,
                       const std::vector<LayerRange>& chunks);
}  // namespace

std::string size_inputs(const ModelConfig& c, const TrainOptions* o) {
  std::string s = cat("hidden_size ", c.hidden, ", intermediate_size ", c.ffn, ", num_hidden_layers ", c.num_layers,
                      ", num_attention_heads ", c.num_heads, ", vocab_size ", c.vocab_size);
  if (c.is_moe())
    s += cat(", experts ", c.num_experts, " of FFN size ", c.expert_ffn, ", top-k ", c.top_k,
             c.shared_ffn > 0 ? cat(", shared expert FFN size ", c.shared_ffn) : "");
  if (o) s += cat(", --micro-batch ", o->micro_batch, ", --seq-len ", o->seq_len);
  return s;
}

int64_t checked_num_parameters(const ModelConfig& cfg) {
  return size_error("the model's parameter count", size_inputs(cfg), [&] { return num_parameters(cfg); });
}

RankBuffers rank_buffers(const ModelConfig& cfg, const TrainOptions& options, int world_size, int rank) {
  const TrainOptions o = options.resolved(world_size);
  const MeshShape mesh(world_size, o.layout_dims(world_size), o.mesh_order);
  const std::vector<LayerRange> virtual_stages = partition_layers(int(cfg.num_layers), mesh.degree("pp"), o.vpp, o.pp_layers);
  const ModelPart part = ModelPart::of_stage(virtual_stages, mesh.degree("pp"), mesh.coord(rank, "pp"), o.vocab_parallel);
  // The table is large for deep models (the memory check must answer within a second): moved, not copied.
  return size_error("the parameter buffer", size_inputs(cfg), [&] {
    return buffers_of(o, world_size, rank,
                      split_experts(make_param_table(cfg, part), cfg.num_experts, mesh.degree("ep"), mesh.coord(rank, "ep")),
                      part.chunks);
  });
}

namespace {

RankBuffers buffers_of(const TrainOptions& options, int world_size, int rank, const SplitTable& tables,
                       const std::vector<LayerRange>& chunks) {
  const TrainOptions o = options.resolved(world_size);
  const MeshShape mesh(world_size, o.layout_dims(world_size), o.mesh_order);
  // Dense gradients and ZeRO shards span DP x CP (the trainer's dp-cp group).
  const std::vector<int> grad_group = mesh.group(rank, "dp-cp");
  const int tp = mesh.degree("tp"), dp = int(grad_group.size());
  const int dp_rank = int(std::find(grad_group.begin(), grad_group.end(), rank) - grad_group.begin());
  RankBuffers out;
  // Per parameter set: the buffer (plan_buffer), this rank's shard of each bucket (bucket_shards).
  auto figures = [&](const std::vector<ParamSpec>& table, int tp_size, int tp_rank, int dp_size, int dp_r, bool dense) {
    const BufferPlan plan = plan_buffer(table, o.param_layout(tp_size, tp_rank, dp_size, !dense));
    const std::vector<Range> shards = bucket_shards(plan.buckets, dp_size, dp_r);
    BufferFigures f;
    f.size = plan.size;
    for (size_t b = 0; b < shards.size(); ++b) {
      const int64_t data_end = plan.buckets[b].begin + plan.bucket_data[b];
      const int64_t length = plan.buckets[b].end - plan.buckets[b].begin;
      f.buckets += length;
      f.largest = std::max(f.largest, length);
      f.data += plan.bucket_data[b];
      f.shard += shards[b].end - shards[b].begin;
      const int64_t shard_data = std::max<int64_t>(0, std::min(shards[b].end, data_end) - shards[b].begin);
      f.shard_data += shard_data;
      f.unit_data[plan.bucket_unit[b]] += plan.bucket_data[b];
      f.unit_shard_data[plan.bucket_unit[b]] += shard_data;
    }
    f.largest_pair = gradient_buckets_held(table, plan);
    for (const std::vector<char>& written : pass_buckets(table, plan.offsets, tp_size, plan.buckets, chunks)) {
      f.pass_buckets.push_back(0);
      for (size_t b = 0; b < written.size(); ++b)
        if (written[b]) f.pass_buckets.back() += plan.buckets[b].end - plan.buckets[b].begin;
    }
    gathered_figures(f, table, plan, shards, dp_size, parse_precision(o.precision) == Precision::bf16);
    for (const auto& [unit, floats] : f.unit_floats) f.largest_unit = std::max(f.largest_unit, floats);
    if (!dense) return f;
    // The dense set: the TP-partial elements of the whole buffer and of this rank's shards (what
    // DataParallel updates under ZeRO 0 and 1-2), and the buckets of the tied embedding.
    // A tensor lies in one bucket (plan_buffer never splits one): found by its offset, buckets
    // being listed from the end of the buffer.
    auto bucket_of = [&](int64_t offset) {
      const auto it = std::lower_bound(plan.buckets.begin(), plan.buckets.end(), offset,
                                       [](const Range& b, int64_t x) { return b.begin > x; });
      return size_t(it - plan.buckets.begin());
    };
    for (size_t i = 0; i < table.size(); ++i) {
      const ParamSpec& s = table[i];
      const bool partial = s.split.token_partial || s.split.seq_partial;
      if (!s.pp_shared && !partial) continue;
      const size_t b = bucket_of(plan.offsets[i]);
      if (s.pp_shared) out.shared_buckets.push_back(plan.buckets[b].end - plan.buckets[b].begin);
      if (!partial) continue;
      int64_t* count = s.split.token_partial ? out.token_partial : out.seq_only_partial;
      const int64_t begin = plan.offsets[i], end = begin + s.local_numel(tp_size);
      count[0] += end - begin;
      count[1] += std::max<int64_t>(0, std::min(end, shards[b].end) - std::max(begin, shards[b].begin));
    }
    return f;
  };
  out.dense = figures(tables.dense, tp, mesh.coord(rank, "tp"), dp, dp_rank, true);
  if (!tables.experts.empty())
    out.experts = figures(tables.experts, mesh.degree("etp"), mesh.coord(rank, "etp"), mesh.degree("edp"),
                          mesh.coord(rank, "edp"), false);
  return out;
}

}  // namespace

RankBuffers rank_buffers(const TrainOptions& o, int world_size, int rank, const SplitTable& tables,
                         const std::vector<LayerRange>& chunks) {
  return size_error("the parameter buffer of this layout", "the sum of its tensors' elements",
                    [&] { return buffers_of(o, world_size, rank, tables, chunks); });
}

int64_t pipeline_message_buffers(const TrainOptions& o, int pp, int stage, int micro, bool vocab) {
  if (pp <= 1) return 0;
  const int stride = o.schedule_kind() == ScheduleKind::interleaved ? pp : 1;  // (its counts: multiples of pp)
  int64_t most = 0;
  for (int m = o.documents() ? stride : micro; m <= micro; m += stride)
    most = std::max(most, Pipeline::buffer_bytes(stage_actions(o.schedule_kind(), pp, stage, m, o.vpp, vocab), pp, 1) / 4);
  return most;
}

MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank, int64_t runtime,
                        int64_t sampler) {
  return rank_memory(cfg, o, world_size, rank, rank_buffers(cfg, o, world_size, rank), runtime, sampler);
}

namespace {

MemoryParts memory_of(const ModelConfig& cfg, const TrainOptions& options, int world_size, int rank,
                      const RankBuffers& buffers, int64_t runtime, int64_t sampler) {
  const TrainOptions o = options.resolved(world_size);
  const MeshShape mesh(world_size, o.layout_dims(world_size), o.mesh_order);
  const int tp = mesh.degree("tp"), pp = mesh.degree("pp"), stage = mesh.coord(rank, "pp");
  const std::vector<LayerRange> virtual_stages = partition_layers(int(cfg.num_layers), pp, o.vpp, o.pp_layers);
  const ModelPart part = ModelPart::of_stage(virtual_stages, pp, stage, o.vocab_parallel);
  MemoryParts m;
  m.runtime = runtime;

  // Per parameter set (dense tensors over TP and DP, this rank's experts over ETP and EDP): parameters;
  // gradients: the whole buffer (ZeRO 0 and 1; the reduce-scatter is in place), or under ZeRO ≥ 2 the
  // shards and, of two consecutive buckets (one reducing, one being written), the rest (DataParallel);
  // the optimizer state of the elements it updates: every tensor element (ZeRO 0) or its shard of each
  // bucket without the padding. --grad-reduce-dtype bf16 adds, where the group has several ranks, the
  // buffer rounded for the reduction (ZeRO-2: the bucket reducing).
  Size weights = 0, grads = 0, optimizer = 0;  // checked (core/checked.h), as every sum below
  const bool bf16 = parse_precision(o.precision) == Precision::bf16;
  const bool bf16_wire = o.grad_reduce_wire() == DType::bf16;
  const int dp_cp = mesh.degree("dp") * mesh.degree("cp"), edp = mesh.degree("edp");  // the two gradient groups
  for (const auto& [figures, group, experts] : {std::tuple{&buffers.dense, dp_cp, false}, std::tuple{&buffers.experts, edp, true}}) {
    const BufferFigures& f = *figures;  // (a pointer: the figures' unit maps are not copied per layout)
    // ZeRO 0-2 hold every value (ZeRO 1/2 under bf16: of the GEMM weights the shards only, whose
    // copy they gather) and under bf16 the whole copy.
    // ZeRO-3 holds the shards of the values (and under bf16 of its copy buckets' copy) and two units
    // gathered (one in use, one prefetched; BufferFigures::gathered_held). FSSDP's experts: the shards
    // and a staging area of the largest MoE layer's experts, values (under bf16 only their copy) and
    // gradients; with --fssdp-keep the values' area spans every layer's experts.
    const int zero = o.zero_of(experts);
    const bool sparse = experts && o.fssdp();
    if (zero < 3) {  // ZeRO 1/2 under bf16 keep the fp32 values of their copy buckets' shards only
      const Size released = zero > 0 && group > 1 ? Size(f.copy) - f.shard_copy : Size(0);
      weights += 4 * (Size(f.size) - released) + (bf16 ? 2 * Size(f.size) : Size(0));  // bf16: the GEMMs' copy
    } else if (!sparse) {
      weights += 4 * Size(f.shard) + 2 * Size(f.shard_copy) + Size(f.gathered_held);
    } else {
      const Size gathered = o.fssdp_keep ? Size(f.size) : Size(f.largest_unit);
      weights += 4 * (Size(f.shard) + (bf16 ? Size(0) : gathered)) + (bf16 ? 2 * gathered : Size(0));
    }
    const Size in_flight = sparse ? Size(f.largest_unit) : Size(f.largest_pair) * (group - 1) / group;
    grads += 4 * (zero >= 2 ? Size(f.shard) + in_flight : Size(f.size));
    if (bf16_wire && group > 1 && !sparse) grads += 2 * Size(zero >= 2 ? f.largest : f.size);
    optimizer += 2 * 4 * Size(zero == 0 ? f.data : f.shard_data);
  }
  m.weights = weights.get(), m.grads = grads.get(), m.optimizer = optimizer.get();

  // Activations: the stage's schedule keeps slots of its chunks' layers (the pipeline's computed peak).
  const ActivationShape shape = o.activation_shape(tp);
  std::vector<int64_t> chunk_bytes;
  for (const LayerRange& r : part.chunks) chunk_bytes.push_back(slot_bytes(cfg, shape, r));
  const int micro = int(o.micro_batches(world_size));
  m.activations = (schedule_activation_peak(make_schedule(o.schedule_kind(), pp, stage, micro, o.vpp), chunk_bytes,
                                            slot_classes(cfg, part.chunks)) +
                   Size(recompute_bytes(cfg, shape))).get();

  // Workspace: the model's work buffers, pipeline messages of [Nl, C] (and vocabulary parallelism's
  // buffers: Pipeline::vocab_bytes), the step's token windows
  // (int32) and the sampler's order; and the MPI library's scratch for the gradient reductions in
  // flight: a non-blocking all-reduce or reduce-scatter keeps a copy of its bucket until it completes,
  // and DataParallel posts every bucket of the last backward pass as it goes, ZeRO-2 one at a time
  // (Open MPI's libnbc; measured: the peak of rank 0 of a DP pair grows by the gradient buffer). Its
  // algorithms put the copies on some ranks only (on 4 ranks: ranks 0 and 2, rank 0 twice under ZeRO),
  // so this counts one copy on every rank: the neediest within a few percent on 2 ranks, others high.
  // The copy is in the reduction's element type.
  const int64_t Nl = shape.local_tokens();
  // FSSDP's exchanges are blocking: the scratch of the runs they convert on the way (DataParallel::
  // sparse_exchange): sends in bf16 (values gathered as bf16, gradients reduced as bf16), and a
  // reduction's received gradients, before they are added, in the wire type; each at most the other
  // ranks' shares of one layer's experts.
  auto posted = [&](const BufferFigures& f, bool experts) { return Size(o.zero_of(experts) >= 2 ? f.largest : f.buckets); };
  const int64_t exchange_bytes = (bf16 || bf16_wire ? 2 : 0) + dtype_bytes(o.grad_reduce_wire());
  const Size exchanges =
      o.fssdp() && edp > 1 ? exchange_bytes * Size(buffers.experts.largest_unit) * (edp - 1) / edp : Size(0);
  const Size scratch = dtype_bytes(o.grad_reduce_wire()) * ((dp_cp > 1 ? posted(buffers.dense, false) : Size(0)) +
                                                            (edp > 1 && !o.fssdp() ? posted(buffers.experts, true) : Size(0))) +
                       exchanges;
  const Size vocab =
      part.vocab_parallel()
          ? Size(Pipeline::vocab_bytes(stage_actions(o.schedule_kind(), pp, stage, micro, o.vpp, true), pp, stage, o.vpp,
                                       (Size(Nl) * cfg.hidden).get(), (Size(shape.B) * shape.T * cfg.hidden).get()))
          : Size(0);
  // The step's token rows: T + 1 int32s, or under document batching inputs and targets (row_stride).
  const Size row_ints = o.documents() ? 2 * Size(o.seq_len) : Size(o.seq_len) + 1;
  // RoPE's cos and sin tables: doubles for seq_len positions × head_dim / 2 frequencies (model/layers/rope.h)
  const Size rope = cfg.is_gpt2() ? Size(0) : 16 * Size(o.seq_len) * (cfg.head_dim / 2);
  const Size messages = 4 * Size(Nl) * cfg.hidden * pipeline_message_buffers(o, pp, stage, micro, part.vocab_parallel());
  m.workspace = (workspace_bytes(cfg, shape, part) + messages +
                 vocab + 4 * Size(micro) * o.micro_batch * row_ints + sampler + scratch + rope).get();

  // A synchronous save writes this rank's pieces straight from its buffers; an asynchronous one first
  // copies them (weights and both moments of its bucket shards) to a host buffer.
  if (!o.save.empty() && o.async_save) m.checkpoint = (3 * 4 * (Size(buffers.dense.shard) + buffers.experts.shard)).get();
  (void)m.total();  // (each part fits in 64 bits; here their sum must too, or the error names the inputs)
  return m;
}

}  // namespace

MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank,
                        const RankBuffers& buffers, int64_t runtime, int64_t sampler) {
  return size_error("the memory of this run", [&] { return size_inputs(cfg, &o); },
                    [&] { return memory_of(cfg, o, world_size, rank, buffers, runtime, sampler); });
}

}  // namespace origami
