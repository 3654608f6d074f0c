// Parameters: one table of {Hugging Face name, global shape, tensor-parallel split, init}
// generated from the config, one contiguous float buffer per rank carved from it (this rank's
// shard of every tensor), and a gradient buffer of the same layout.
// Layers find their weights by name through the table — offsets are never hand-numbered.
//
// The table orders tensors so that weights used by one fused GEMM sit next to each other:
// llama q_proj|k_proj|v_proj form one [(H+2KV)·D, C] matrix, gate_proj|up_proj one [2F, C],
// and each expert's w1|w3 one [2F, C] — on every TP rank, for its shard.
//
// The buffer is also cut into data-parallel buckets: contiguous ranges, formed from the end of
// the table (backward produces the last layers' gradients first), each padded with zeros to a
// multiple of the DP size so it can be reduce-scattered in equal shards.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/memory.h"
#include "kernels/cpu/bf16.h"
#include "model/config.h"

namespace origami {

enum class Init { normal, scaled_normal, zeros, ones };

// How a tensor is split over the tensor-parallel group (Megatron's column-, row- and vocab-parallel).
struct TpSplit {
  int dim = -1;              // dimension split across TP ranks; -1: replicated on every TP rank
  int parts = 1;             // that dimension is `parts` equal blocks (gpt2 c_attn: q|k|v), each split across TP
  bool pad = false;          // the dimension (vocabulary) is padded to a multiple of TP with zero rows
  bool seq_partial = false;  // replicated, and with sequence parallelism its gradient is a partial sum over
                             // the sequence shards (norm weights): reduced over TP before the optimizer
  bool token_partial = false;  // replicated, and each TP rank computes it on its own share of the tokens
                               // whatever SP says (the MoE router): reduced over TP before the optimizer
  // Vocabulary parallelism: the dimension is split over TP × `pp` pipeline stages, this stage holding
  // block pp_rank·tp + tp_rank of tp·pp (the stage's TP ranks share one contiguous slice). Every
  // function below that takes (tp, tp_rank) applies it: a shard is then one of tp·pp.
  int pp = 1, pp_rank = 0;
  int ways(int tp) const { return tp * pp; }
  int way(int tp, int tp_rank) const { return pp_rank * tp + tp_rank; }
};

struct ParamSpec {
  std::string name;            // Hugging Face name (gpt2: without the "transformer." prefix)
  std::vector<int64_t> shape;  // global, Hugging Face layout (gpt2 Conv1D: [in, out]; Linear: [out, in])
  Init init = Init::normal;
  TpSplit split;
  // The tied embedding held by both the first and the last pipeline stage (embedding and LM head):
  // a data-parallel bucket of its own on both, so its DP shards line up and can be summed across
  // the two stages (the embedding group).
  bool pp_shared = false;
  // A routed expert's tensor: its global expert index (else -1). Such tensors live in a buffer of
  // their own, laid out over the MoE mesh (split over ETP, held by one EP rank, reduced over EDP).
  int expert = -1;
  int64_t numel() const;       // global elements
  bool decays() const { return shape.size() >= 2; }  // AdamW weight decay on matrices only
  std::vector<int64_t> local_shape(int tp) const;    // this shard's shape (padded dimension included)
  int64_t local_numel(int tp) const;
  // Calls fn(local_offset, global_offset, length) for the contiguous runs that map TP rank `tp_rank`'s
  // shard onto the global tensor (row-major offsets; padding rows are in no run). Under vocabulary
  // parallelism (split.pp > 1) the shard is block split.way(tp, tp_rank) of split.ways(tp).
  template <typename Fn> void for_each_run(int tp, int tp_rank, Fn&& fn) const;
};

// The part of the model one pipeline stage holds: the layers of each of its chunks (in chunk order),
// whether its chunk 0 starts with the embedding (it is the first virtual stage) and whether its last
// chunk ends with the final norm and LM head (the last virtual stage). Without pipeline parallelism:
// one chunk with every layer and both ends. Under vocabulary parallelism (vocab_stages > 1) every
// stage also holds its slice of the embedding and of an untied LM head (TpSplit::pp); `embedding` and
// `head` still say where the position embedding and the final norm are.
struct ModelPart {
  std::vector<LayerRange> chunks;
  bool embedding = true, head = true;
  int vocab_stages = 1, vocab_stage = 0;
  static ModelPart whole(int64_t num_layers) { return {{{0, int(num_layers)}}, true, true}; }
  // Stage `stage` of `stages` over the virtual stages of partition_layers (chunk c of the stage is
  // virtual stage c·stages + stage); with vocab_parallel, the vocabulary split over the stages too.
  static ModelPart of_stage(const std::vector<LayerRange>& virtual_stages, int stages, int stage,
                            bool vocab_parallel = false);
  bool vocab_parallel() const { return vocab_stages > 1; }
  bool holds_layer(int64_t l) const;
  int64_t num_layers() const;
};

// The whole model's tensors, in buffer order: embedding(s), layers, final norm, LM head.
std::vector<ParamSpec> make_param_table(const ModelConfig& cfg);
// The tensors of one pipeline stage, in the same order. A tied embedding (gpt2, tie_word_embeddings)
// is on the first stage for the lookup and on the last for the LM head, marked pp_shared when those
// are different stages.
std::vector<ParamSpec> make_param_table(const ModelConfig& cfg, const ModelPart& part);
int64_t num_parameters(const ModelConfig& cfg);  // global count, whatever the layout

// A stage's table cut in two for MoE parallel folding: `dense` (everything but routed experts, laid out
// over the attention mesh) and `experts` (the tensors of this EP rank's experts, [ep_rank·E/ep,
// (ep_rank+1)·E/ep), laid out over the MoE mesh). Both keep the table's order and global names.
struct SplitTable {
  std::vector<ParamSpec> dense, experts;
};
SplitTable split_experts(std::vector<ParamSpec> table, int64_t num_experts, int ep, int ep_rank);

// The per-rank layout of the buffers.
struct ParamLayout {
  int tp = 1, tp_rank = 0;
  int dp = 1;                 // buckets are padded to a multiple of this
  int64_t bucket_floats = 0;  // target bucket size; 0: one bucket
  bool unit_buckets = false;  // ZeRO-3: a bucket also closes where param_unit changes, so that the
                              // model's units (a layer, the embedding, the head) own whole buckets
  bool copy_buckets = false;  // ZeRO ≥ 1 under bf16: within each unit the tensors read in fp32 are laid
                              // out first and its GEMM weights (gemm_weight) after them, each kind in
                              // table order and in buckets of its own, so a bucket of GEMM weights can
                              // be gathered as its bf16 copy alone
};

// The unit of the model a tensor belongs to, the granularity at which ZeRO-3 gathers parameters:
// its layer index, kEmbeddingUnit (the token and position embeddings) or kHeadUnit (the final norm and
// an untied LM head).
constexpr int64_t kEmbeddingUnit = -1, kHeadUnit = -2;
int64_t param_unit(const std::string& name);

// Whether the layers read a tensor only as a GEMM weight (Model::mw, the routed experts), so that under
// bf16 nothing but its bf16 copy is read: the TP-split matrices outside the embedding unit. Not the
// embeddings (looked up in fp32; a tied one is also the LM head's weight), the norms and biases, nor
// the replicated matrices (the router and the shared expert's gate: fp32 GEMMs).
bool gemm_weight(const ParamSpec& p);

// ZeRO-3: how the model uses a unit's parameters (Model::on_weights): it may need them soon
// (prefetch: a gather may start), needs them now (need: gathered and kept until done), is done.
enum class WeightUse { prefetch, need, done };

struct Range {
  int64_t begin, end;  // [begin, end) of the flat buffer
};

// FSSDP (--expert-sharding fssdp): how an MoE layer uses its experts (Model::on_experts). After
// routing it needs the experts its rows reach (gather, in forward and again in backward); after the
// experts' backward their gradients go to their owners (reduce).
enum class ExpertUse { gather, reduce };

// Where a gathered layer's experts are while it uses them: values (fp32; null under bf16, whose GEMMs
// read only the copy), their bf16 copy (null in fp32) and the gradients its backward accumulates
// into, each laid out as the layer's blocks are in the experts' buffer (block j at j·block).
struct ExpertPlace {
  float* values = nullptr;
  const bf16* low = nullptr;
  float* grads = nullptr;
};

// One MoE layer's experts in the experts' buffer: `count` blocks of `block` floats from `begin`
// (local expert j at begin + j·block).
struct ExpertBlocks {
  int64_t begin = 0, block = 0, count = 0;
  Range of(int64_t j) const { return {begin + j * block, begin + (j + 1) * block}; }
};

// Where each tensor and each data-parallel bucket lies in one rank's buffer: exactly what Params
// allocates, computed without allocating (the memory check before a run and the planner use it).
struct BufferPlan {
  std::vector<int64_t> offsets;      // per table entry
  std::vector<Range> buckets;        // in the order their gradients become final (last tensors first)
  std::vector<int64_t> bucket_data;  // floats of tensors in each bucket; the rest of it is padding
  std::vector<int64_t> bucket_unit;  // param_unit of each bucket's first tensor (under unit_buckets,
                                     // of all its tensors)
  std::vector<uint8_t> bucket_copy;  // under copy_buckets: 1 where the bucket holds GEMM weights only
  int64_t size = 0;                  // floats in the buffer, padding included
};
BufferPlan plan_buffer(const std::vector<ParamSpec>& table, const ParamLayout& layout);

// The part of one parameter tensor inside a range: buffer [begin, end), tensor index `param`.
struct Segment {
  int64_t begin, end;
  size_t param;
};

class Params {
 public:
  explicit Params(std::vector<ParamSpec> table, ParamLayout layout = {});

  const std::vector<ParamSpec>& table() const { return table_; }
  const ParamLayout& layout() const { return layout_; }
  // Buckets in the order their gradients become final (last parameters first); each one's length
  // is a multiple of the layout's dp.
  const std::vector<Range>& buckets() const { return buckets_; }
  // Whether bucket b holds GEMM weights only (ParamLayout::copy_buckets; else always false).
  bool copy_bucket(size_t b) const { return bucket_copy_[b] != 0; }
  // The parameter segments covered by `ranges` (bucket padding excluded), in buffer order.
  std::vector<Segment> segments(const std::vector<Range>& ranges) const;
  int64_t size() const { return size_; }
  float* data() { return static_cast<float*>(data_.data()); }
  const float* data() const { return static_cast<const float*>(data_.data()); }
  float* grad() { return static_cast<float*>(grad_.data()); }
  const float* grad() const { return static_cast<const float*>(grad_.data()); }
  int64_t offset(size_t i) const { return offsets_[i]; }
  const std::vector<int64_t>& offsets() const { return offsets_; }  // per table entry
  int64_t local_numel(size_t i) const { return table_[i].local_numel(layout_.tp); }
  // Index of a parameter by name, or -1.
  int64_t index(const std::string& name) const;
  float* value(const std::string& name);  // throws if absent (internal error)
  float* grad(const std::string& name);

  // Deterministic init: element j of parameter `name` depends only on (seed, name, j), j the index
  // in the global tensor — never on the layout.
  // normal: N(0, σ²); scaled_normal: N(0, (σ/√(2L))²) (GPT-2 residual projections); σ is the
  // config's initializer_range (ModelConfig::init_std, 0.02 by default).
  void init(uint64_t seed, int64_t num_layers, double std_dev);
  void zero_grad();
  // ZeRO-3 and FSSDP keep only their shards of the values: from hold_only(shards) on, init(),
  // keep_bf16_copy() and a checkpoint's read_weights fill those ranges alone, so that a rank never
  // holds its whole stage (the rest reads as zeros until a gather fills it).
  void hold_only(std::vector<Range> ranges) { held_ = std::move(ranges); }
  // ZeRO 1/2 in mixed precision: values the rank never reads once their bf16 copy is made (the copy
  // buckets' outside its shards, which DataParallel frees each step). keep_bf16_copy() frees them
  // bucket by bucket as it copies, so an init's or a load's whole buffer and the whole copy are never
  // resident together (the memory check counts neither).
  void unread_after_copy(std::vector<Range> ranges);
  // The segments the rank holds values of: those of hold_only's ranges, else every parameter's.
  std::vector<Segment> held_segments() const { return segments(held_.empty() ? std::vector<Range>{{0, size_}} : held_); }
  // Mixed precision: a bf16 copy of the values (the GEMMs' weights), kept from keep_bf16_copy() on (made
  // then from the values) and kept equal to them by whoever changes them: AdamW writes the copy of
  // what it updates (its copy ranges), ZeRO's gathers call refresh_bf16_copy() on the ranges they
  // fill. bf16_copy() is null while none is kept.
  void keep_bf16_copy();
  void refresh_bf16_copy() { refresh_bf16_copy({0, size_}); }
  void refresh_bf16_copy(Range r);
  const bf16* bf16_copy() const { return static_cast<const bf16*>(low_.data()); }
  bf16* bf16_copy() { return static_cast<bf16*>(low_.data()); }  // ZeRO-3 gathers copy buckets into it
  // ZeRO-3: zeroes the values of r, and the bf16 copy of `copy`, returning their pages.
  void release_values(Range r, Range copy);

  // Zeroes the gradient buffer, or its elements [r.begin, r.end), by returning their pages to the
  // operating system: memory is used again only where gradients are next written (ZeRO-2 keeps only
  // its shard and the buckets in flight resident).
  void release_grad() { grad_.release(0, grad_.bytes()); }
  void release_grad(Range r) { grad_.release(r.begin * int64_t(sizeof(float)), r.end * int64_t(sizeof(float))); }

 private:
  std::vector<ParamSpec> table_;
  ParamLayout layout_;
  std::vector<int64_t> offsets_;
  std::vector<Range> buckets_;
  std::vector<uint8_t> bucket_copy_;
  std::unordered_map<std::string, size_t> by_name_;
  int64_t size_ = 0;
  ReleasablePages data_;
  ReleasablePages low_;  // the bf16 copy (mixed precision), else none
  ReleasablePages grad_;
  std::vector<Range> held_;  // hold_only's ranges (empty: everything)
  std::vector<Range> unread_;  // unread_after_copy's ranges, by their beginning
};

template <typename Fn>
void ParamSpec::for_each_run(int tp, int tp_rank, Fn&& fn) const {
  if (split.dim < 0) {
    fn(int64_t(0), int64_t(0), numel());
    return;
  }
  tp_rank = split.way(tp, tp_rank), tp = split.ways(tp);
  // View the tensor as [outer, rows, inner] around the split dimension; rows (padded to local·tp) are
  // `parts` blocks, and this rank holds rows [p·rows/parts + r·lp, + lp) of each block p.
  const std::vector<int64_t> local = local_shape(tp / split.pp);
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < split.dim; ++d) outer *= shape[size_t(d)];
  for (size_t d = size_t(split.dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t rows = shape[size_t(split.dim)], local_rows = local[size_t(split.dim)];
  const int64_t lp = local_rows / split.parts, gp = local_rows * tp / split.parts;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t p = 0; p < split.parts; ++p) {
      const int64_t g0 = p * gp + int64_t(tp_rank) * lp;                 // first global row of the run
      const int64_t n = std::max<int64_t>(0, std::min(lp, rows - g0));  // rows past `rows` are padding
      if (n > 0) fn((o * local_rows + p * lp) * inner, (o * rows + g0) * inner, n * inner);
    }
}

}  // namespace origami
