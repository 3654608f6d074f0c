#include "train/plan.h"

#include "train/memory_plan.h"

namespace origami {

Plan make_plan(const ModelConfig& cfg, const TrainOptions& opts, int world_size) {
  const TrainOptions o = opts.resolved(world_size);
  o.validate(cfg, world_size);
  checked_num_parameters(cfg);  // every later size is computed in checked arithmetic too
  return {.options = o,
          .default_global_batch = opts.global_batch == 0,
          .model = o.with_routing(cfg),
          .mesh = MeshShape(world_size, o.layout_dims(world_size), o.mesh_order),
          .virtual_stages = partition_layers(int(cfg.num_layers), o.pp, o.vpp, o.pp_layers),
          .schedule = o.schedule_kind(),
          .micro_batches = o.micro_batches(world_size),
          .recompute = parse_recompute(o.recompute),
          .cp_comm = parse_cp_comm(o.cp_comm),
          .cp_a2a = o.cp_a2a(),
          .precision = parse_precision(o.precision)};
}

ModelPart Plan::part(int stage) const {
  return ModelPart::of_stage(virtual_stages, mesh.degree("pp"), stage, options.vocab_parallel);
}

Plan make_resumed_plan(const ModelConfig& cfg, const TrainOptions& o, int world, std::string* note) {
  std::string why;
  const TrainOptions resumed = with_checkpoint_step_size(o, &why);
  if (note) *note = why;
  try {
    return make_plan(cfg, resumed, world);
  } catch (const Error& e) {
    // The options' own mistake when they break the same rule with their default size too.
    bool own = why.empty();
    if (!own) try {
        (void)make_plan(cfg, o, world);
      } catch (const Error& d) {
        own = std::string(d.what()) == e.what();
      }
    if (own) throw;
    fail(e.what(), "; ", why);
  }
}

}  // namespace origami
