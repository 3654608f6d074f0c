#include "train/memory_plan.h"

#include <algorithm>

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
    "a smaller --micro-batch or --seq-len needs less (the LM head works in chunks of the vocabulary)",
    "an asynchronous save copies this rank's shards first: drop --async-save",
    "the process itself is that large before the run allocates"};

}  // namespace

const char* MemoryParts::name(int i) { return kNames[i]; }
const char* MemoryParts::advice(int i) { return kAdvice[i]; }

int64_t MemoryParts::total() const {
  int64_t t = 0;
  for (int i = 0; i < kCount; ++i) t += (*this)[i];
  return t;
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

MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& options, int world_size, int rank, int64_t runtime,
                        int64_t sampler) {
  const TrainOptions o = options.resolved(world_size);
  const MeshShape mesh(world_size, o.layout_dims(world_size), o.mesh_order);
  // Dense gradients and ZeRO shards span DP x CP (the trainer's dp-cp group).
  const std::vector<int> grad_group = mesh.group(rank, "dp-cp");
  const int tp = mesh.degree("tp"), dp = int(grad_group.size()), pp = mesh.degree("pp");
  const int tp_rank = mesh.coord(rank, "tp"), stage = mesh.coord(rank, "pp");
  const int dp_rank = int(std::find(grad_group.begin(), grad_group.end(), rank) - grad_group.begin());
  const std::vector<LayerRange> virtual_stages = partition_layers(int(cfg.num_layers), pp, o.vpp, o.pp_layers);
  const ModelPart part = ModelPart::of_stage(virtual_stages, pp, stage);
  std::vector<ParamSpec> table = make_param_table(cfg, part);
  const int ep = mesh.degree("ep"), etp = mesh.degree("etp"), edp = mesh.degree("edp");
  const int ep_rank = mesh.coord(rank, "ep"), etp_rank = mesh.coord(rank, "etp"), edp_rank = mesh.coord(rank, "edp");
  // The table is large for deep models (the memory check must answer within a second): moved, not copied.
  const SplitTable sets = split_experts(std::move(table), cfg.num_experts, ep, ep_rank);
  MemoryParts m;
  m.runtime = runtime;

  // Per parameter set (dense tensors over TP and DP, this rank's experts over ETP and EDP): parameters
  // and gradients; ZeRO's reduce-scatter output (and ZeRO-2's accumulator) of shard size; the
  // optimizer state of the elements it updates: every tensor element (ZeRO 0) or its shard of each
  // bucket without the padding.
  int64_t shard_floats = 0;  // both sets: this rank's bucket shards
  auto add_set = [&](const std::vector<ParamSpec>& t, int tp_size, int tp_r, int dp_size, int dp_r) {
    const BufferPlan plan = plan_buffer(t, o.param_layout(tp_size, tp_r, dp_size));
    const std::vector<Range> shards = bucket_shards(plan.buckets, dp_size, dp_r);
    int64_t shard = 0, all_data = 0, shard_data = 0;
    for (size_t b = 0; b < shards.size(); ++b) {
      const int64_t data_end = plan.buckets[b].begin + plan.bucket_data[b];
      shard += shards[b].end - shards[b].begin;
      all_data += plan.bucket_data[b];
      shard_data += std::max<int64_t>(0, std::min(shards[b].end, data_end) - shards[b].begin);
    }
    m.weights += 4 * plan.size;
    m.grads += 4 * plan.size + (o.zero >= 1 ? 4 * shard : 0) + (o.zero == 2 ? 4 * shard : 0);
    m.optimizer += 2 * 4 * (o.zero == 0 ? all_data : shard_data);
    shard_floats += shard;
  };
  add_set(sets.dense, tp, tp_rank, dp, dp_rank);
  add_set(sets.experts, etp, etp_rank, edp, edp_rank);

  // Activations: the stage's schedule keeps slots of its chunks' layers (the pipeline's computed peak).
  const ActivationShape shape = o.activation_shape(tp);
  std::vector<int64_t> chunk_bytes;
  for (const LayerRange& r : part.chunks) chunk_bytes.push_back(slot_bytes(cfg, shape, r));
  const int micro = int(o.micro_batches(world_size));
  m.activations = schedule_activation_peak(make_schedule(o.schedule_kind(), pp, stage, micro, o.vpp), chunk_bytes) +
                  recompute_bytes(cfg, shape);

  // Workspace: the model's work buffers, pipeline messages of [Nl, C], the step's token windows
  // (int32) and the sampler's order.
  const int64_t Nl = shape.local_tokens();
  m.workspace = workspace_bytes(cfg, shape, part) + Pipeline::buffer_bytes(pp, Nl * cfg.hidden) +
                4 * int64_t(micro) * o.micro_batch * (o.seq_len + 1) + sampler;

  // A synchronous save writes this rank's pieces straight from its buffers; an asynchronous one first
  // copies them (weights and both moments of its bucket shards) to a host buffer.
  if (!o.save.empty() && o.async_save) m.checkpoint = 3 * 4 * shard_floats;
  return m;
}

}  // namespace origami
