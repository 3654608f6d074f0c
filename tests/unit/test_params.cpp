// The parameter buffer's layout (model/params.h, plan_buffer): ZeRO-3's unit-aligned buckets, and under
// bf16 its copy buckets — each unit's GEMM weights (gathered as their bf16 copy alone) apart from the
// tensors the layers read in fp32, with every tensor still laid out once and fused weights adjacent.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/params.h"

using namespace origami;

namespace {

ModelConfig config(const std::string& name) {
  return load_model_config(std::string(ORIGAMI_SOURCE_DIR) + "/tests/parallel/configs/" + name + ".json");
}

struct Case {
  std::string model;
  int tp, dp;
};
std::string name(const Case& c) { return c.model + "_tp" + std::to_string(c.tp) + "_dp" + std::to_string(c.dp); }
void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

class CopyBuckets : public ::testing::TestWithParam<Case> {};

// The bucket holding buffer offset `at`.
size_t bucket_at(const BufferPlan& plan, int64_t at) {
  for (size_t b = 0; b < plan.buckets.size(); ++b)
    if (plan.buckets[b].begin <= at && at < plan.buckets[b].end) return b;
  ADD_FAILURE() << "offset " << at << " in no bucket";
  return 0;
}

TEST_P(CopyBuckets, SplitEachUnitByKindAndLayEveryTensorOutOnce) {
  const Case& c = GetParam();
  const ModelConfig cfg = config(c.model);
  const std::vector<ParamSpec> table = make_param_table(cfg);
  const ParamLayout units{c.tp, 0, c.dp, 0, true, false}, copies{c.tp, 0, c.dp, 0, true, true};
  const BufferPlan plain = plan_buffer(table, units), plan = plan_buffer(table, copies);

  // Every tensor once, none overlapping, in a bucket of its own unit and kind.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t i = 0; i < table.size(); ++i) {
    const int64_t n = table[i].local_numel(c.tp), at = plan.offsets[i];
    spans.push_back({at, at + n});
    const size_t b = bucket_at(plan, at);
    EXPECT_LE(at + n, plan.buckets[b].begin + plan.bucket_data[b]) << table[i].name << " leaves its bucket";
    EXPECT_EQ(plan.bucket_unit[b], param_unit(table[i].name)) << table[i].name;
    EXPECT_EQ(plan.bucket_copy[b] != 0, gemm_weight(table[i])) << table[i].name;
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) EXPECT_LE(spans[k - 1].second, spans[k].first);
  EXPECT_EQ(plan.bucket_copy.size(), plan.buckets.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) EXPECT_EQ((plan.buckets[b].end - plan.buckets[b].begin) % c.dp, 0);

  // Without a bucket size, two buckets a unit at most (one a kind), and the same data as without the split.
  std::map<int64_t, int> per_unit;
  for (int64_t u : plan.bucket_unit) ++per_unit[u];
  for (const auto& [unit, count] : per_unit) EXPECT_LE(count, 2) << "unit " << unit;
  int64_t data = 0, plain_data = 0;
  for (int64_t d : plan.bucket_data) data += d;
  for (int64_t d : plain.bucket_data) plain_data += d;
  EXPECT_EQ(data, plain_data);
  EXPECT_GT(std::count(plan.bucket_copy.begin(), plan.bucket_copy.end(), 1), 0);
  EXPECT_TRUE(std::all_of(plain.bucket_copy.begin(), plain.bucket_copy.end(), [](uint8_t k) { return k == 0; }));

  // Fused GEMM weights stay adjacent (q|k|v, gate|up: Model reads each as one matrix).
  auto at = [&](const std::string& name) {
    for (size_t i = 0; i < table.size(); ++i)
      if (table[i].name == name) return std::pair{plan.offsets[i], table[i].local_numel(c.tp)};
    ADD_FAILURE() << "no tensor " << name;
    return std::pair<int64_t, int64_t>{0, 0};
  };
  if (!cfg.is_gpt2()) {
    const std::string p = "model.layers.0.";
    const auto q = at(p + "self_attn.q_proj.weight"), k = at(p + "self_attn.k_proj.weight");
    const auto v = at(p + "self_attn.v_proj.weight");
    EXPECT_EQ(q.first + q.second, k.first);
    EXPECT_EQ(k.first + k.second, v.first);
    if (!cfg.is_moe_layer(0)) {
      const auto gate = at(p + "mlp.gate_proj.weight"), up = at(p + "mlp.up_proj.weight");
      EXPECT_EQ(gate.first + gate.second, up.first);
    }
  }
}

// ZeRO 1/2 under bf16: copy buckets without unit buckets, by size. Still no bucket mixes the kinds,
// and each unit's tensors stay one contiguous range of the buffer, as the gradient-ready hook
// (grads_ready(offset) after each layer's backward) needs.
TEST_P(CopyBuckets, BySizeKeepEachUnitContiguousAndEachBucketOneKind) {
  const Case& c = GetParam();
  const std::vector<ParamSpec> table = make_param_table(config(c.model));
  const BufferPlan plan = plan_buffer(table, {c.tp, 0, c.dp, 1000, false, true});
  std::map<int64_t, std::pair<int64_t, int64_t>> span;  // unit -> [lowest offset, highest end)
  int64_t floats = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    const int64_t at = plan.offsets[i], end = at + table[i].local_numel(c.tp), u = param_unit(table[i].name);
    const size_t b = bucket_at(plan, at);
    EXPECT_LE(end, plan.buckets[b].begin + plan.bucket_data[b]) << table[i].name << " leaves its bucket";
    EXPECT_EQ(plan.bucket_copy[b] != 0, gemm_weight(table[i])) << table[i].name;
    auto [it, fresh] = span.emplace(u, std::pair{at, end});
    if (!fresh) it->second = {std::min(it->second.first, at), std::max(it->second.second, end)};
    floats += end - at;
  }
  int64_t spanned = 0;  // the units' ranges do not overlap, so each holds only its own tensors
  for (const auto& [u, r] : span) spanned += r.second - r.first;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& [u, r] : span) ranges.push_back(r);
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) EXPECT_LE(ranges[k - 1].second, ranges[k].first);
  EXPECT_GE(spanned, floats);
}

// Which tensors are GEMM weights: the layers' projections and an untied LM head; not the embeddings,
// norms, biases, the router or the shared expert's gate.
TEST(GemmWeight, NamesTheTensorsReadOnlyThroughTheirCopy) {
  std::vector<std::string> gemm, other;
  for (const char* model : {"gpt2_tiny", "qwen2_moe_8e"})
    for (const ParamSpec& p : make_param_table(config(model))) (gemm_weight(p) ? gemm : other).push_back(p.name);
  for (const char* name : {"h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight",
                           "h.0.mlp.c_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
                           "model.layers.0.mlp.shared_expert.down_proj.weight", "lm_head.weight"})
    EXPECT_NE(std::find(gemm.begin(), gemm.end(), name), gemm.end()) << name;
  for (const char* name : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.bias",
                           "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                           "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.q_proj.bias",
                           "model.layers.0.input_layernorm.weight", "model.norm.weight"})
    EXPECT_NE(std::find(other.begin(), other.end(), name), other.end()) << name;
}

INSTANTIATE_TEST_SUITE_P(Models, CopyBuckets,
                         ::testing::Values(Case{"gpt2_tiny", 1, 2}, Case{"llama_tiny", 2, 2}, Case{"qwen2_moe_8e", 1, 4},
                                           Case{"mixtral_8e", 2, 3}),
                         [](const auto& info) { return name(info.param); });

}  // namespace

// Vocabulary parallelism: every stage's table holds its slice of the embedding and the untied head
// (first stage: the position embedding too; last: the final norm), not marked pp_shared; the slices
// of TP x PP ranks cover every element of the global tensors exactly once, the first stage's slice
// first (checkpoint pieces name them as shards of tp·pp), each ceil(V / (tp·pp)) rows long.
TEST(VocabParallelTable, SlicesCoverTheVocabularyOnce) {
  for (const char* model : {"gpt2_tiny", "llama_tiny"}) {
    const ModelConfig cfg = config(model);
    const std::string wte = cfg.is_gpt2() ? "wte.weight" : "model.embed_tokens.weight";
    const std::vector<LayerRange> stages{{0, 1}, {1, 2}, {2, 3}};
    for (int tp : {1, 2}) {
      std::map<std::string, std::vector<int>> seen;  // tensor → how often each global element is held
      for (int s = 0; s < 3; ++s) {
        const ModelPart part = ModelPart::of_stage(stages, 3, s, true);
        ASSERT_TRUE(part.vocab_parallel());
        const std::vector<ParamSpec> table = make_param_table(cfg, part);
        auto find = [&](const std::string& n) {
          return std::find_if(table.begin(), table.end(), [&](const ParamSpec& p) { return p.name == n; });
        };
        EXPECT_EQ(find("wpe.weight") != table.end(), cfg.is_gpt2() && s == 0) << model << " stage " << s;
        EXPECT_EQ(find(cfg.is_gpt2() ? "ln_f.weight" : "model.norm.weight") != table.end(), s == 2);
        EXPECT_EQ(table.front().name, wte) << "the slice comes first: its gradients are final last";
        for (const ParamSpec& p : table) {
          EXPECT_FALSE(p.pp_shared) << p.name;
          if (p.name != wte && p.name != "lm_head.weight") continue;
          const int64_t rows = (p.shape[0] + 3 * tp - 1) / (3 * tp);
          for (int r = 0; r < tp; ++r) {
            EXPECT_EQ(p.local_numel(tp), rows * p.shape[1]);
            std::vector<int>& count = seen[p.name];
            count.resize(size_t(p.numel()));
            int64_t first = -1;
            p.for_each_run(tp, r, [&](int64_t, int64_t global, int64_t n) {
              if (first < 0) first = global;
              for (int64_t i = 0; i < n; ++i) ++count[size_t(global + i)];
            });
            EXPECT_EQ(first, (s * tp + r) * rows * p.shape[1]) << p.name << " stage " << s << " tp rank " << r;
          }
        }
      }
      EXPECT_EQ(seen.size(), cfg.is_gpt2() || cfg.tied_embeddings ? 1u : 2u);
      for (const auto& [n, count] : seen)
        EXPECT_EQ(std::count(count.begin(), count.end(), 1), int64_t(count.size())) << n << " tp " << tp;
    }
  }
}

// Interleaved stages share one activation pool across chunks of the same shape (Model's free slots,
// schedule_activation_peak's pools): an even split is one class; a chunk of other length or other
// MoE layers is a class of its own.
TEST(SlotClasses, ChunksOfOneShapeShareAPool) {
  ModelConfig cfg = config("mixtral_tiny");
  EXPECT_EQ(slot_classes(cfg, {{0, 1}, {2, 3}}), (std::vector<int>{0, 0}));
  EXPECT_EQ(slot_classes(cfg, {{0, 1}, {1, 3}, {3, 4}}), (std::vector<int>{0, 1, 0}));
  cfg.sparse_step = 2;  // layers 1 and 3 MoE: [0, 2) and [2, 4) alike, [1, 3) not
  EXPECT_EQ(slot_classes(cfg, {{0, 2}, {2, 4}, {1, 3}}), (std::vector<int>{0, 0, 1}));
}

// A fresh run's weights scale with the config's initializer_range: the same draws (seed, name, index)
// times σ, and the residual projections' σ/√(2L) with them; norms' ones and biases' zeros stay.
TEST(ParamsInit, StandardDeviationFromTheConfig) {
  const ModelConfig cfg = config("gpt2_tiny");
  Params wide(make_param_table(cfg)), narrow(make_param_table(cfg));
  wide.init(3, cfg.num_layers, 0.02);
  narrow.init(3, cfg.num_layers, 0.005);
  int64_t drawn = 0;
  for (int64_t i = 0; i < wide.size(); ++i) {
    const float w = wide.data()[i];
    const bool constant = w == 0.f || w == 1.f;  // (a draw times 0.02 is never exactly 0 or 1)
    ASSERT_FLOAT_EQ(narrow.data()[i], constant ? w : float(0.25 * double(w))) << "element " << i;
    drawn += !constant;
  }
  EXPECT_GT(drawn, wide.size() / 2);
}
