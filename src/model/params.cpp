#include "model/params.h"

#include <charconv>
#include <cmath>
#include <algorithm>
#include <numeric>

#include "core/checked.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/parallel.h"

namespace origami {

int64_t ParamSpec::numel() const {
  Size n = 1;
  for (int64_t d : shape) n *= d;
  return n.get();
}

// The split dimension on one TP rank (padded first where the split pads).
static int64_t local_dim(const ParamSpec& p, int tp) {
  tp = p.split.ways(tp);
  int64_t n = p.shape[size_t(p.split.dim)];
  if (p.split.pad) n = ((Size(n) + tp - 1) / tp * tp).get();
  ORIGAMI_ASSERT(n % (int64_t(tp) * p.split.parts) == 0);
  return n / tp;
}

std::vector<int64_t> ParamSpec::local_shape(int tp) const {
  std::vector<int64_t> s = shape;
  if (split.dim >= 0) s[size_t(split.dim)] = local_dim(*this, tp);
  return s;
}

// Without building local_shape: the planner sums it over every tensor of every layout.
int64_t ParamSpec::local_numel(int tp) const {
  Size n = 1;
  for (size_t d = 0; d < shape.size(); ++d) n *= int(d) == split.dim ? local_dim(*this, tp) : shape[d];
  return n.get();
}

// Tensor-parallel splits (Megatron): column-parallel weights (QKV, MLP up / gate|up, expert w1 and w3) are
// split along their output features, row-parallel ones (attention output, MLP down, expert w2) along their
// input features; embeddings and the LM head along the (padded) vocabulary. Norms, row-parallel biases,
// positions and the router are replicated; norms take partial gradients under sequence parallelism, the
// router always (each TP rank routes its own share of the tokens). Routed experts are split over the MoE
// mesh's expert-tensor-parallel group the same way (see split_experts).
std::vector<ParamSpec> make_param_table(const ModelConfig& c) {
  std::vector<ParamSpec> t;
  t.reserve(size_t(4 + c.num_layers * (12 + 3 * c.num_experts)));
  const TpSplit replicated, norm{-1, 1, false, true}, vocab{0, 1, true, false}, router{-1, 1, false, false, true};
  auto add = [&](std::string name, std::vector<int64_t> shape, Init init, TpSplit split, int expert = -1) {
    t.push_back({std::move(name), std::move(shape), init, split, false, expert});
  };
  // Hugging Face Linear [out, in]: column-parallel splits dim 0, row-parallel dim 1; Conv1D [in, out] the reverse.
  const TpSplit out_in_col{0}, out_in_row{1};
  const int64_t C = c.hidden, V = c.vocab_size, F = c.ffn, D = c.head_dim;
  const int64_t H = c.num_heads, KV = c.num_kv_heads;
  if (c.is_gpt2()) {
    add("wte.weight", {V, C}, Init::normal, vocab);
    add("wpe.weight", {c.max_positions, C}, Init::normal, replicated);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::string p = "h." + std::to_string(l) + ".";
      add(p + "ln_1.weight", {C}, Init::ones, norm);
      add(p + "ln_1.bias", {C}, Init::zeros, norm);
      add(p + "attn.c_attn.weight", {C, 3 * C}, Init::normal, {1, 3});  // q|k|v blocks, each split
      add(p + "attn.c_attn.bias", {3 * C}, Init::zeros, {0, 3});
      add(p + "attn.c_proj.weight", {C, C}, Init::scaled_normal, {0});
      add(p + "attn.c_proj.bias", {C}, Init::zeros, replicated);  // added after the TP reduction
      add(p + "ln_2.weight", {C}, Init::ones, norm);
      add(p + "ln_2.bias", {C}, Init::zeros, norm);
      add(p + "mlp.c_fc.weight", {C, F}, Init::normal, {1});
      add(p + "mlp.c_fc.bias", {F}, Init::zeros, {0});
      add(p + "mlp.c_proj.weight", {F, C}, Init::scaled_normal, {0});
      add(p + "mlp.c_proj.bias", {C}, Init::zeros, replicated);
    }
    add("ln_f.weight", {C}, Init::ones, norm);
    add("ln_f.bias", {C}, Init::zeros, norm);
    return t;
  }
  add("model.embed_tokens.weight", {V, C}, Init::normal, vocab);
  const bool qwen = c.type == ModelType::qwen2_moe;
  const int64_t Fe = c.expert_ffn, Fs = c.shared_ffn;
  // gate|up|down of a SwiGLU MLP (the routed experts' as w1|w3|w2 in mixtral).
  auto swiglu = [&](const std::string& m, int64_t f, const char* const (&names)[3], int expert) {
    add(m + names[0] + ".weight", {f, C}, Init::normal, out_in_col, expert);
    add(m + names[1] + ".weight", {f, C}, Init::normal, out_in_col, expert);
    add(m + names[2] + ".weight", {C, f}, Init::scaled_normal, out_in_row, expert);
  };
  static const char* const hf[3] = {"gate_proj", "up_proj", "down_proj"}, *const mixtral[3] = {"w1", "w3", "w2"};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {C}, Init::ones, norm);
    add(p + "self_attn.q_proj.weight", {H * D, C}, Init::normal, out_in_col);
    add(p + "self_attn.k_proj.weight", {KV * D, C}, Init::normal, out_in_col);
    add(p + "self_attn.v_proj.weight", {KV * D, C}, Init::normal, out_in_col);
    if (c.qkv_bias) {  // q|k|v biases contiguous too: one [Sl] vector per TP rank
      add(p + "self_attn.q_proj.bias", {H * D}, Init::zeros, out_in_col);
      add(p + "self_attn.k_proj.bias", {KV * D}, Init::zeros, out_in_col);
      add(p + "self_attn.v_proj.bias", {KV * D}, Init::zeros, out_in_col);
    }
    add(p + "self_attn.o_proj.weight", {C, H * D}, Init::scaled_normal, out_in_row);
    add(p + "post_attention_layernorm.weight", {C}, Init::ones, norm);
    if (c.is_moe_layer(l)) {
      const std::string m = p + (qwen ? "mlp." : "block_sparse_moe.");
      add(m + "gate.weight", {c.num_experts, C}, Init::normal, router);
      for (int64_t e = 0; e < c.num_experts; ++e)
        swiglu(m + "experts." + std::to_string(e) + ".", Fe, qwen ? hf : mixtral, int(e));
      if (Fs > 0) {  // the shared expert: a dense MLP on the attention mesh's TP, scaled by its gate
        swiglu(m + "shared_expert.", Fs, hf, -1);
        add(m + "shared_expert_gate.weight", {1, C}, Init::normal, norm);
      }
    } else {
      swiglu(p + "mlp.", F, hf, -1);
    }
  }
  add("model.norm.weight", {C}, Init::ones, norm);
  if (!c.tied_embeddings) add("lm_head.weight", {V, C}, Init::normal, vocab);
  return t;
}

SplitTable split_experts(std::vector<ParamSpec> table, int64_t num_experts, int ep, int ep_rank) {
  ORIGAMI_ASSERT(ep >= 1 && num_experts % ep == 0);
  const int64_t per = num_experts / ep, first = int64_t(ep_rank) * per;
  SplitTable out;
  if (num_experts == 0) {  // dense: the whole table (no copy; deep models' tables are large)
    out.dense = std::move(table);
    return out;
  }
  for (ParamSpec& p : table) {
    if (p.expert < 0) out.dense.push_back(std::move(p));
    else if (p.expert >= first && p.expert < first + per) out.experts.push_back(std::move(p));
  }
  return out;
}

bool ModelPart::holds_layer(int64_t l) const {
  for (const LayerRange& r : chunks)
    if (l >= r.begin && l < r.end) return true;
  return false;
}

ModelPart ModelPart::of_stage(const std::vector<LayerRange>& virtual_stages, int stages, int stage,
                              bool vocab_parallel) {
  ModelPart part{{}, stage == 0, stage == stages - 1, vocab_parallel ? stages : 1, vocab_parallel ? stage : 0};
  for (size_t v = size_t(stage); v < virtual_stages.size(); v += size_t(stages)) part.chunks.push_back(virtual_stages[v]);
  return part;
}

int64_t ModelPart::num_layers() const {
  int64_t n = 0;
  for (const LayerRange& r : chunks) n += r.end - r.begin;
  return n;
}

std::vector<ParamSpec> make_param_table(const ModelConfig& c, const ModelPart& part) {
  const std::string layer_prefix = c.is_gpt2() ? "h." : "model.layers.";
  const std::string embedding = c.is_gpt2() ? "wte.weight" : "model.embed_tokens.weight";
  const bool tied = c.is_gpt2() || c.tied_embeddings, vocab = part.vocab_parallel();
  const bool shared = tied && part.embedding != part.head && !vocab;
  std::vector<ParamSpec> out = make_param_table(c);
  size_t kept = 0;  // compacted in place: a model of 10^5 layers has ~10^6 tensors
  for (ParamSpec& p : out) {
    bool keep;
    const bool vocab_rows = p.name == embedding || p.name == "lm_head.weight";
    if (p.name.rfind(layer_prefix, 0) == 0) keep = part.holds_layer(std::stol(p.name.substr(layer_prefix.size())));
    else if (vocab && vocab_rows) keep = true;  // every stage's slice
    else if (p.name == embedding) keep = part.embedding || (part.head && tied);
    else if (p.name == "wpe.weight") keep = part.embedding;
    else keep = part.head;  // final norm, untied lm_head
    if (!keep) continue;
    p.pp_shared = shared && p.name == embedding;
    if (vocab && vocab_rows) p.split.pp = part.vocab_stages, p.split.pp_rank = part.vocab_stage;
    if (&out[kept] != &p) out[kept] = std::move(p);  // (a self-move would empty the shape vector)
    ++kept;
  }
  out.resize(kept);
  return out;
}

int64_t num_parameters(const ModelConfig& cfg) {
  Size n = 0;
  for (const ParamSpec& p : make_param_table(cfg)) n += p.numel();
  return n.get();
}

int64_t param_unit(const std::string& name) {
  for (const std::string_view prefix : {"h.", "model.layers."})  // gpt2, the others
    if (name.starts_with(prefix)) {
      int64_t layer = -1;  // (parsed in place: the planner asks for every tensor of millions of layouts)
      std::from_chars(name.data() + prefix.size(), name.data() + name.size(), layer);
      ORIGAMI_ASSERT(layer >= 0);
      return layer;
    }
  for (const char* embedding : {"wte.", "wpe.", "model.embed_tokens."})
    if (name.starts_with(embedding)) return kEmbeddingUnit;
  return kHeadUnit;
}

bool gemm_weight(const ParamSpec& p) {
  return p.decays() && p.split.dim >= 0 && param_unit(p.name) != kEmbeddingUnit;
}

namespace {
// The block the model reads a tensor in with its neighbours (Model's contiguity asserts): a layer's
// q|k|v weights (and biases), an MLP's gate|up, a layer's routed experts [w1|w3|w2] x E; else the
// tensor alone. No bucket boundary falls inside one, where a bucket's padding would part them.
std::string fused_block(const std::string& name) {
  if (const size_t at = name.find("experts."); at != std::string::npos) return name.substr(0, at + 8);
  for (const char* part : {"q_proj.", "k_proj.", "v_proj."})
    if (const size_t at = name.find(part); at != std::string::npos) return name.substr(0, at) + "qkv." + name.substr(at + 7);
  for (const char* part : {"gate_proj.", "up_proj."})
    if (const size_t at = name.find(part); at != std::string::npos) return name.substr(0, at) + "gate|up";
  return name;
}
}  // namespace

BufferPlan plan_buffer(const std::vector<ParamSpec>& table, const ParamLayout& layout) {
  ORIGAMI_ASSERT(layout.tp >= 1 && layout.dp >= 1 && layout.tp_rank >= 0 && layout.tp_rank < layout.tp);
  // The order tensors are laid out in: the table's, but under copy_buckets each unit's (a run of the
  // table) with its GEMM weights moved after its other tensors.
  std::vector<int64_t> unit(table.size());
  std::vector<uint8_t> copy(table.size());
  for (size_t i = 0; i < table.size(); ++i)  // each tensor's unit and kind, found once
    unit[i] = param_unit(table[i].name), copy[i] = layout.copy_buckets && gemm_weight(table[i]);
  std::vector<size_t> order(table.size());
  std::iota(order.begin(), order.end(), size_t(0));
  for (size_t a = 0, b = 0; a < order.size() && layout.copy_buckets; a = b) {
    while (b < order.size() && unit[b] == unit[a]) ++b;
    std::stable_partition(order.begin() + long(a), order.begin() + long(b), [&](size_t i) { return !copy[i]; });
  }
  // Buckets from the end: a bucket closes once it holds bucket_floats (never splitting a tensor or a
  // fused block); a pp_shared tensor is a bucket of its own; under unit_buckets a bucket holds one
  // unit's, under copy_buckets one kind's.
  std::vector<size_t> first_of_bucket;  // position in `order` where each bucket starts, last bucket first
  Size filled = 0;
  std::vector<uint8_t> block_starts(order.size(), 1);  // order[k] is the first tensor of its fused_block
  std::string block, block_before;
  for (size_t k = 0; k < order.size(); ++k, block_before = std::move(block))
    block = fused_block(table[order[k]].name), block_starts[k] = k == 0 || block != block_before;
  for (size_t k = order.size(); k-- > 0;) {
    const ParamSpec& p = table[order[k]];
    const size_t i = order[k], next = k + 1 < order.size() ? order[k + 1] : i;
    const bool new_group = (layout.unit_buckets && unit[i] != unit[next]) || copy[i] != copy[next];
    if ((p.pp_shared || new_group) && filled > 0) first_of_bucket.push_back(k + 1), filled = 0;
    filled += p.local_numel(layout.tp);
    if (k == 0 || p.pp_shared || (layout.bucket_floats > 0 && filled >= layout.bucket_floats && block_starts[k])) {
      first_of_bucket.push_back(k);
      filled = 0;
    }
  }
  // Offsets from the start, with each bucket padded at its end to a multiple of dp.
  BufferPlan plan;
  plan.offsets.assign(table.size(), 0);
  Size off = 0;  // checked: the sum over a model's tensors
  for (size_t b = first_of_bucket.size(); b-- > 0;) {
    const size_t end = b == 0 ? order.size() : first_of_bucket[b - 1];
    const Size begin = off;
    for (size_t k = first_of_bucket[b]; k < end; ++k)
      plan.offsets[order[k]] = off.get(), off += table[order[k]].local_numel(layout.tp);
    plan.bucket_data.push_back((off - begin).get());
    plan.bucket_unit.push_back(unit[order[first_of_bucket[b]]]);
    plan.bucket_copy.push_back(copy[order[first_of_bucket[b]]]);
    off = begin + (off - begin + layout.dp - 1) / layout.dp * layout.dp;
    plan.buckets.push_back(Range{begin.get(), off.get()});
  }
  // Built first bucket first; listed in the order gradients become final (last bucket first).
  std::reverse(plan.buckets.begin(), plan.buckets.end());
  std::reverse(plan.bucket_data.begin(), plan.bucket_data.end());
  std::reverse(plan.bucket_unit.begin(), plan.bucket_unit.end());
  std::reverse(plan.bucket_copy.begin(), plan.bucket_copy.end());
  plan.size = off.get();
  return plan;
}

void Params::unread_after_copy(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  unread_ = std::move(ranges);
}

void Params::keep_bf16_copy() {
  low_ = ReleasablePages(2 * size_, "the bf16 copy of the weights");
  if (!held_.empty()) {
    for (const Range& r : held_) refresh_bf16_copy(r);
    return;
  }
  for (const Range& b : buckets_) {
    refresh_bf16_copy(b);
    auto r = std::lower_bound(unread_.begin(), unread_.end(), b.begin, [](const Range& x, int64_t at) { return x.begin < at; });
    for (; r != unread_.end() && r->begin < b.end; ++r) data_.release(r->begin * int64_t(sizeof(float)), r->end * int64_t(sizeof(float)));
  }
}

void Params::refresh_bf16_copy(Range r) {
  if (low_.data() != nullptr) round_to_bf16(static_cast<bf16*>(low_.data()) + r.begin, data() + r.begin, r.end - r.begin);
}

void Params::release_values(Range r, Range copy) {
  data_.release(r.begin * int64_t(sizeof(float)), r.end * int64_t(sizeof(float)));
  if (low_.data() != nullptr) low_.release(copy.begin * 2, copy.end * 2);
}

Params::Params(std::vector<ParamSpec> table, ParamLayout layout) : table_(std::move(table)), layout_(layout) {
  for (size_t i = 0; i < table_.size(); ++i) by_name_[table_[i].name] = i;
  BufferPlan plan = plan_buffer(table_, layout_);
  offsets_ = std::move(plan.offsets);
  buckets_ = std::move(plan.buckets);
  bucket_copy_ = std::move(plan.bucket_copy);
  size_ = plan.size;
  data_ = ReleasablePages(int64_t(plan.size) * int64_t(sizeof(float)), "the parameters");
  grad_ = ReleasablePages(int64_t(plan.size) * int64_t(sizeof(float)), "the gradients");
}

std::vector<Segment> Params::segments(const std::vector<Range>& ranges) const {
  std::vector<Segment> out;
  for (const Range& r : ranges)
    for (size_t i = 0; i < table_.size(); ++i) {
      const int64_t b = std::max(r.begin, offsets_[i]), e = std::min(r.end, offsets_[i] + local_numel(i));
      if (b < e) out.push_back({b, e, i});
    }
  std::sort(out.begin(), out.end(), [](const Segment& a, const Segment& b) { return a.begin < b.begin; });
  return out;
}

int64_t Params::index(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : int64_t(it->second);
}

float* Params::value(const std::string& name) {
  int64_t i = index(name);
  ORIGAMI_CHECK(i >= 0, "internal error: no parameter named '", name, "'");
  return data() + offsets_[size_t(i)];
}

float* Params::grad(const std::string& name) {
  int64_t i = index(name);
  ORIGAMI_CHECK(i >= 0, "internal error: no parameter named '", name, "'");
  return grad() + offsets_[size_t(i)];
}

void Params::init(uint64_t seed, int64_t num_layers, double std_dev) {
  const double std_normal = std_dev, std_scaled = std_dev / std::sqrt(2.0 * double(num_layers));
  std::vector<std::vector<Range>> held(table_.size());  // each tensor's held elements, local offsets
  for (const Segment& seg : held_segments())
    held[seg.param].push_back({seg.begin - offsets_[seg.param], seg.end - offsets_[seg.param]});
  for (size_t i = 0; i < table_.size(); ++i) {
    const ParamSpec& p = table_[i];
    float* w = data() + offsets_[i];
    const uint64_t key = hash_name(p.name);
    const double s = p.init == Init::normal ? std_normal : std_scaled;
    p.for_each_run(layout_.tp, layout_.tp_rank, [&](int64_t local, int64_t global, int64_t n) {
      for (const Range& h : held[i]) {  // the run's part this rank holds: [b, e) of the local tensor
        const int64_t b = std::max(local, h.begin), e = std::min(local + n, h.end), g = global + (b - local);
        if (b >= e) continue;
        switch (p.init) {
          case Init::zeros: std::fill(w + b, w + e, 0.f); break;
          case Init::ones: std::fill(w + b, w + e, 1.f); break;
          case Init::normal:
          case Init::scaled_normal:
#pragma omp parallel for schedule(static)
            for (int64_t j = 0; j < e - b; ++j) w[b + j] = float(s * normal01(seed, key, uint64_t(g + j)));
            break;
        }
      }
    });
  }
}

void Params::zero_grad() {
  float* g = grad();
#pragma omp parallel
  {
    const Share mine = my_share(size_);
    zero_streaming(g + mine.begin, mine.end - mine.begin);
  }
}

}  // namespace origami
