#include "train/comm_volume.h"

#include <algorithm>
#include <numeric>

#include "model/model.h"
#include "model/params.h"
#include "parallel/context_parallel.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"

namespace origami {

namespace {

// One parameter set's data-parallel traffic over a group of `group` ranks (data_parallel.h): ZeRO 0
// all-reduces every bucket once a step, ZeRO 1 reduce-scatters them once and all-gathers the
// parameters, ZeRO 2 and 3 reduce-scatter after each backward pass (`micro` per chunk) the buckets
// that pass writes (BufferFigures::pass_buckets); ZeRO 3 gathers `gathered` bytes of parameters in
// the step instead (unit_gathers). Gradients travel as `wire` (--grad-reduce-dtype), the parameters
// ZeRO-1/2 gather as fp32 but for the copy buckets' bf16 copy (ParamLayout::copy_buckets).
double gradient_bytes(const BufferFigures& buffer, int group, int zero, int64_t micro, DType wire,
                      double gathered_bytes) {
  const double padded = double(buffer.buckets), g = double(group > 1 ? dtype_bytes(wire) : 4);
  if (zero == 0) return all_reduce_bytes(group, g * padded);
  // each rank its shard of the buckets reduced
  double reduced = scatter_gather_bytes(group, g * padded / group);
  if (zero >= 2) {
    reduced = 0;
    for (int64_t floats : buffer.pass_buckets) reduced += double(micro) * scatter_gather_bytes(group, g * double(floats) / group);
  }
  const double gathered =
      zero == 3 ? scatter_gather_bytes(group, gathered_bytes / group) : zero_gather_bytes(buffer, group, zero);
  return reduced + gathered;
}

}  // namespace

double zero_gather_bytes(const BufferFigures& buffer, int group, int zero) {
  if (group == 1 || zero == 0 || zero == 3) return 0;
  const double copy = double(buffer.copy);  // ZeRO 1/2 under bf16: those buckets gather their bf16 copy
  return scatter_gather_bytes(group, (4 * double(buffer.buckets) - 2 * copy) / group);
}

namespace {

// ZeRO-3: the bytes one stage gathers in a step (Model::on_weights): per micro-batch and chunk, each
// layer's unit in forward and again in backward, the embedding's in forward (chunk 0), the head's
// (with the tied embedding) in backward (the last chunk); fp32 values, bf16 for copy buckets
// (ParamLayout::copy_buckets). `experts`: the experts' buffer (layers only).
double unit_gathers(const BufferFigures& f, const ModelPart& part, int64_t micro, bool experts) {
  auto bytes = [](int64_t floats, int64_t copy) { return 4.0 * double(floats - copy) + 2.0 * double(copy); };
  auto unit = [&](int64_t u) {
    const auto it = f.unit_floats.find(u);
    return it == f.unit_floats.end() ? 0.0 : bytes(it->second, f.unit_copy.at(u));
  };
  double per_micro = 0;
  for (size_t c = 0; c < part.chunks.size(); ++c) {
    for (int64_t l = part.chunks[c].begin; l < part.chunks[c].end; ++l) per_micro += 2 * unit(l);
    if (experts) continue;
    if (c == 0 && part.embedding) per_micro += unit(kEmbeddingUnit);
    if (c + 1 == part.chunks.size() && part.head) per_micro += bytes(f.head_gather, f.head_gather_copy);
  }
  return double(micro) * per_micro;
}

// FSSDP: the experts' traffic over EDP (n ranks) in a step, when every rank's rows reach every one of
// its El local experts in every MoE layer (exact then; otherwise an upper bound): per layer and
// micro-batch, each gather (forward, the recomputed forward, backward) and the reduction exchange
// the needs (El int32 to every peer); each gather sends every peer this rank's shard of the layer
// (`gathered` bytes per element: bf16 under --precision bf16) — under `keep` only the step's first;
// the reduction sends the owners the rest of the layer (`wire` bytes).
double sparse_expert_bytes(const ModelConfig& cfg, const BufferFigures& f, const ModelPart& part, int64_t micro,
                           int forwards, int n, int64_t El, double gathered, double wire, bool keep) {
  if (n == 1) return 0;
  double step = 0;
  for (const LayerRange& r : part.chunks)
    for (int64_t l = r.begin; l < r.end; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      const double data = double(f.unit_data.at(l)), shard = double(f.unit_shard_data.at(l));
      const double gathers = keep ? 1 : double(micro * (forwards + 1));
      step += double(micro * (forwards + 2) * (n - 1)) * 4 * double(El) + gathers * double(n - 1) * gathered * shard +
              double(micro) * wire * (data - shard);
    }
  return step;
}

// Pipeline, per micro-batch: a [Nl, C] message to the next virtual stage after each forward (none
// from the last) and to the previous one after each backward (none from the first). Vocabulary
// parallelism over the pipeline group (Model::vocab_embed, vocab_head, vocab_embed_backward; [N, C]
// rows, gathered under SP): the partial embeddings all-reduced; the final norm's output broadcast from
// the last stage, the statistics all-gathered (3 floats per row), the input gradients all-reduced; the
// embedding's gradient broadcast from the first stage.
double pipeline_bytes(const ModelPart& part, int p, int v, int stage, double N, double Nl, int64_t C, int64_t micro) {
  const int64_t sends = 2 * int64_t(v) - (stage == p - 1 ? 1 : 0) - (stage == 0 ? 1 : 0);
  double bytes = double(sends) * 4 * Nl * double(C);
  if (part.vocab_parallel()) {
    const double rows = 4 * N * double(C);
    bytes += 2 * all_reduce_bytes(p, rows) + scatter_gather_bytes(p, 12 * N) + (stage == p - 1 ? rows : 0) +
             (stage == 0 ? rows : 0);
  }
  return double(micro) * bytes;
}

// A step's micro-batches as the MoE layers see them: B rows each, N tokens on this rank, each MoE
// layer's forward run `forwards` times (2 under full recomputation), at CP degrees `degree_micro`.
struct MoeStep {
  int64_t B, micro;
  int forwards;
  double N, imbalance;
  const std::vector<std::pair<int, int64_t>>& degree_micro;  // (CP degree, micro-batches)
};

// The router's counts, per MoE layer and forward (micro-batch aux loss: E counts over the tokens'
// group TP × CP; per-sequence: B·E; global: E over that group and E over DP, except in the
// recomputed forward, which reuses them), and the dispatcher: each forward's row-count exchange
// (all-to-all of E/EP counts over EP, all-gather over ETP), then the rows to the experts and back,
// forward and backward.
void add_moe_bytes(std::map<std::string, double>& out, const ModelConfig& cfg, const ModelPart& part, const MeshDims& m,
                   const MoeStep& st) {
  auto add = [&](const std::string& key, double bytes) {
    if (bytes > 0) out[key] += bytes;
  };
  const int t = m.tp, c = m.cp;
  const int64_t E = cfg.num_experts, C = cfg.hidden, El = E / m.ep;
  int64_t moe_layers = 0;
  for (const LayerRange& r : part.chunks) moe_layers += cfg.num_moe_layers(r.begin, r.end);
  const double passes = double(st.micro * moe_layers);  // MoE layer passes a step (each forward and backward)
  const AuxLoss aux = cfg.routing.aux;
  // (Under document batching `seq` counts the micro-batch's sequences × E over TP and the micro-batch's
  // CP subgroup of d ranks, the sequences known only per step: B·E here, an estimate.)
  const double counts = aux == AuxLoss::none ? 0 : aux == AuxLoss::seq ? double(st.B * E) : double(E);
  const int counted = aux == AuxLoss::global ? 1 : st.forwards;
  for (const auto& [d, count] : st.degree_micro)
    add(c > 1 ? "tp-cp" : "tp", double(count * moe_layers) * counted * all_reduce_bytes(t * d, 8 * counts));
  if (aux == AuxLoss::global) add("dp", passes * all_reduce_bytes(m.dp, 8 * double(E)));
  // Rows this rank routes (its share of the TP group's tokens, K each) and, evenly spread, the part
  // of them that leaves for other EP ranks; an ETP peer's rows go to its ETP − 1 peers.
  // With a capacity, at most E·cap rows; padded to it, exactly E·cap whatever the routing.
  double rows = st.N / double(t) * double(cfg.top_k) * (m.ep > 1 ? st.imbalance : 1.0);  // one EP rank: no skew
  if (const int64_t cap = cfg.routing.capacity(int64_t(st.N) / t, cfg.top_k, E); cap > 0)
    rows = cfg.routing.pad ? double(E * cap) : std::min(rows, double(E * cap));
  const double to_ep = rows * double(m.ep - 1) / m.ep * double(C) * 4, to_etp = scatter_gather_bytes(m.etp, rows * double(C) * 4);
  const double exchanges = passes * (st.forwards + 1) * 2;  // to the experts and back, per pass
  // (and once a step, the metrics' max over EP of each forward call's rows: Model::expert_busiest_rows)
  add("ep", passes * st.forwards * double(m.ep - 1) * double(El) * 8 + exchanges * to_ep + all_reduce_bytes(m.ep, 8 * passes));
  // Each ETP peer gathers the others' [EP][El] received counts.
  add("etp", passes * st.forwards * scatter_gather_bytes(m.etp, 8 * double(m.ep * El)) + exchanges * to_etp);
}

}  // namespace

std::map<std::string, double> step_comm_bytes(const ModelConfig& cfg, const TrainOptions& o, int world, int rank,
                                              double imbalance) {
  o.validate(cfg, world);
  return step_comm_bytes(cfg, o, world, rank, rank_buffers(cfg, o, world, rank), imbalance);
}

std::map<std::string, double> step_comm_bytes(const ModelConfig& cfg, const TrainOptions& o, int world, int rank,
                                              const RankBuffers& buffers, double imbalance) {
  const MeshShape shape(world, o.layout_dims(world), o.mesh_order);
  const MeshDims& m = shape.dims();
  const int t = m.tp, c = m.cp, p = m.pp, v = o.vpp, stage = shape.coord(rank, "pp");
  const bool sp = o.sequence_parallel && t > 1;
  const int64_t B = o.micro_batch, micro = o.micro_batches(world), C = cfg.hidden, E = cfg.num_experts;
  const double N = double(B * o.seq_len / c);  // this rank's tokens of a micro-batch
  const Recompute rc = parse_recompute(o.recompute);
  const int forwards = rc == Recompute::full ? 2 : 1;  // a layer's forward runs again before its backward
  const ModelPart part =
      ModelPart::of_stage(partition_layers(int(cfg.num_layers), p, v, o.pp_layers), p, stage, o.vocab_parallel);
  std::map<std::string, double> out;
  auto add = [&](const std::string& key, double bytes) {
    if (bytes > 0) out[key] += bytes;
  };

  // Tensor parallelism, per micro-batch: each region exit (an all-reduce of [N, C], or under SP a
  // reduce-scatter and its all-gather: the same bytes) forward and its adjoint backward; under SP
  // backward gathers the kept norm outputs again. MoE layers split tokens, not features: their
  // shares are gathered (not under SP, where a share is the rank's own shard).
  const double region = all_reduce_bytes(t, 4 * N * C), gather = scatter_gather_bytes(t, 4 * N * C / t);
  double tp = 0;
  for (const LayerRange& r : part.chunks)
    for (int64_t l = r.begin; l < r.end; ++l) {
      if (!cfg.is_moe_layer(l)) {
        tp += forwards * 2 * region + 2 * region + (sp ? 2 * gather : 0);
        continue;
      }
      const double shares = sp ? 0 : gather;  // forward outputs, backward input gradients
      tp += forwards * (region + shares) + region + shares + (sp ? gather : 0);
      if (cfg.shared_ffn > 0) tp += forwards * region + region + (sp ? gather : 0);  // the shared expert's MLP
    }
  if (part.embedding) tp += region;  // vocab-parallel lookup: partial embeddings summed
  if (part.head) tp += region;  // LM head input gradient
  if (part.head || part.vocab_parallel()) tp += double(t - 1) * 3 * N * 4;  // cross-entropy statistics
  double total_tp = double(micro) * tp;

  // Gradients: the dense buffer over DP × CP, the experts' over EDP; TP-partial gradients over TP.
  const int grad_group = m.dp * c;
  add(c > 1 ? "dp-cp" : "dp", gradient_bytes(buffers.dense, grad_group, o.zero, micro, o.grad_reduce_wire(),
                                              unit_gathers(buffers.dense, part, micro, false)));
  total_tp += all_reduce_bytes(t, 4 * double(buffers.tp_partial(o.zero, t, o.sequence_parallel)));
  add("tp", total_tp);
  if (buffers.experts.size > 0 && o.fssdp())
    add("edp", sparse_expert_bytes(cfg, buffers.experts, part, micro, forwards, m.edp, cfg.num_experts / m.ep,
                                   parse_precision(o.precision) == Precision::bf16 ? 2 : 4,
                                   double(dtype_bytes(o.grad_reduce_wire())), o.fssdp_keep));
  else if (buffers.experts.size > 0)
    add("edp", gradient_bytes(buffers.experts, m.edp, o.zero, micro, o.grad_reduce_wire(),
                              unit_gathers(buffers.experts, part, micro, true)));
  // The tied embedding's bucket (its DP shard under ZeRO) summed over the first and last stage.
  if (p > 1 && (stage == 0 || stage == p - 1))
    for (int64_t bucket : buffers.shared_buckets)
      add("embedding", all_reduce_bytes(2, 4 * double(bucket) / (o.zero > 0 ? grad_group : 1)));

  // Context parallelism: each attention core's exchanges, forward (again before backward under any
  // recomputation) and backward.
  // Under a CP degree per sequence, rank 0's micro-batches at degree d exchange over its d ranks (the
  // same local shape, all-to-all groups of gcd(A, d)).
  std::vector<std::pair<int, int64_t>> degree_micro = o.step_degree_micro_batches;  // (CP degree, micro-batches)
  if (degree_micro.empty()) degree_micro = {{c, micro}};
  if (c > 1) {
    for (const auto& [d, count] : degree_micro) {
      const CpShape s{B, o.seq_len / c, cfg.num_heads / t, cfg.num_kv_heads / t, cfg.head_dim, d, std::gcd(o.cp_a2a(), d)};
      if (d > 1)
        add("cp", double(count) * double(part.num_layers()) *
                      double((rc == Recompute::none ? 1 : 2) * s.forward_bytes() + s.backward_bytes()));
    }
  }

  if (p > 1) add("pp", pipeline_bytes(part, p, v, stage, N, sp ? N / t : N, C, micro));

  if (cfg.is_moe()) add_moe_bytes(out, cfg, part, m, {B, micro, forwards, N, imbalance, degree_micro});

  // The world: the gradient norm's all-reduce (2 doubles) and the step's metrics (5 figures, the
  // expert counts, dropped assignments and near ties, every rank's expert rows and busiest rows, every rank's CP pairs, under
  // ZeRO-3 or FSSDP every rank's gathered and reduced bytes, under FSSDP its expert gathers, 7 per stage
  // (8 under vocabulary parallelism: its passes' time),
  // under document batching every rank's busy time).
  const double figures = 5 + double(cfg.is_moe() ? cfg.num_layers * E + 2 * cfg.num_layers + 2.0 * world : 0) +
                         (c > 1 ? world : 0) + (o.zero == 3 || o.fssdp() ? 2.0 * world : 0) +
                         (o.fssdp() ? world : 0) + (part.vocab_parallel() ? 8.0 : 7.0) * p + (o.documents() ? world : 0);
  add("world", all_reduce_bytes(world, 16) + all_reduce_bytes(world, 8 * figures));
  return out;
}

}  // namespace origami
