#include "train/memory_plan.h"

#include <algorithm>

#include "core/memory.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"

namespace origami {

namespace {

constexpr const char* kNames[MemoryParts::kCount] = {"weights",   "gradients",  "optimizer state", "activations",
                                                     "workspace", "checkpoint", "runtime"};

int64_t* parts_of(MemoryParts& m) { return &m.weights; }

// Buffers the checkpoint save in trainer.cpp allocates on this rank, at its peak (the third of the
// three gathered flat buffers — weights, exp_avg, exp_avg_sq): every rank flattens the moments of
// its buffer (2·P); each stage's TP rank 0 of DP replica 0 gathers its stage's tensors (a stage
// Params and the gathered buffer, S each, plus one received TP shard P when TP > 1); rank 0 also
// holds the whole model (G), the gathered results (two G, and G being built) and one received stage.
int64_t checkpoint_bytes(int64_t P, int64_t S, int64_t G, int64_t largest_other_stage, int tp, int pp,
                         bool stage_root, bool rank0) {
  int64_t floats = 2 * P;
  if (stage_root) floats += 2 * S + (tp > 1 ? P : 0);
  if (rank0) floats += G + 2 * G + G + (pp > 1 ? largest_other_stage : 0);
  return 4 * floats;
}

}  // namespace

const char* MemoryParts::name(int i) { return kNames[i]; }
int64_t& MemoryParts::operator[](int i) { return parts_of(*this)[i]; }
int64_t MemoryParts::operator[](int i) const { return parts_of(const_cast<MemoryParts&>(*this))[i]; }

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

MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank, int64_t runtime) {
  const MeshShape mesh(world_size, o.layout_dims(world_size), o.mesh_order);
  const int tp = mesh.degree("tp"), dp = mesh.degree("dp"), pp = mesh.degree("pp");
  const int tp_rank = mesh.coord(rank, "tp"), dp_rank = mesh.coord(rank, "dp"), stage = mesh.coord(rank, "pp");
  const std::vector<LayerRange> virtual_stages = partition_layers(int(cfg.num_layers), pp, o.vpp, o.pp_layers);
  const ModelPart part = ModelPart::of_stage(virtual_stages, pp, stage);
  const std::vector<ParamSpec> table = make_param_table(cfg, part);
  const BufferPlan plan =
      plan_buffer(table, {tp, tp_rank, dp, int64_t(o.bucket_mb * 1024 * 1024 / sizeof(float))});
  MemoryParts m;
  m.runtime = runtime;

  // Parameters and gradients; ZeRO's reduce-scatter output (and ZeRO-2's accumulator) of shard size.
  const std::vector<Range> shards = bucket_shards(plan.buckets, dp, dp_rank);
  int64_t shard_floats = 0, owned = 0;
  for (size_t b = 0; b < shards.size(); ++b) {
    shard_floats += shards[b].end - shards[b].begin;
    const int64_t data_end = plan.buckets[b].begin + plan.bucket_data[b];  // padding is not optimised
    owned += std::max<int64_t>(0, std::min(shards[b].end, data_end) - shards[b].begin);
  }
  if (o.zero == 0) {
    owned = 0;
    for (int64_t d : plan.bucket_data) owned += d;
  }
  m.weights = 4 * plan.size;
  m.grads = 4 * plan.size + (o.zero >= 1 ? 4 * shard_floats : 0) + (o.zero == 2 ? 4 * shard_floats : 0);
  m.optimizer = 2 * 4 * owned;

  // Activations: the stage's schedule keeps slots of its chunks' layers (the pipeline's computed peak).
  const Recompute recompute = parse_recompute(o.recompute);
  const ActivationShape shape{o.micro_batch, o.seq_len, tp, o.sequence_parallel && tp > 1, recompute};
  std::vector<int64_t> chunk_bytes;
  for (const LayerRange& r : part.chunks) chunk_bytes.push_back(slot_bytes(cfg, shape, r.end - r.begin));
  const int micro = int(o.micro_batches(world_size));
  m.activations = schedule_activation_peak(make_schedule(o.schedule_kind(), pp, stage, micro, o.vpp), chunk_bytes) +
                  recompute_bytes(cfg, shape);

  // Workspace: the model's work buffers; pipeline messages of [Nl, C] (a received input, the next
  // receive and a backward send in flight); the step's token windows (int32).
  const int64_t Nl = (shape.sp ? o.micro_batch * o.seq_len / tp : o.micro_batch * o.seq_len);
  m.workspace = workspace_bytes(cfg, shape, part) + (pp > 1 ? 3 * 4 * Nl * cfg.hidden : 0) +
                4 * int64_t(micro) * o.micro_batch * (o.seq_len + 1);

  if (!o.save.empty()) {
    int64_t stage_floats = 0, global_floats = 0, largest_other = 0;
    for (const ParamSpec& p : table) stage_floats += p.numel();
    for (int s = 0; s < pp; ++s) {
      int64_t n = 0;
      for (const ParamSpec& p : make_param_table(cfg, ModelPart::of_stage(virtual_stages, pp, s))) n += p.numel();
      if (s > 0) largest_other = std::max(largest_other, n);
    }
    for (const ParamSpec& p : make_param_table(cfg)) global_floats += p.numel();
    m.checkpoint = checkpoint_bytes(plan.size, stage_floats, global_floats, largest_other, tp, pp,
                                    dp_rank == 0 && tp_rank == 0, rank == 0);
  }
  return m;
}

}  // namespace origami
