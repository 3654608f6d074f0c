// Model assembly: the decoder stack of gpt2 / llama / mixtral, forward and backward, on the flat
// parameter and gradient buffers of `Params`.
//
// Legend: B batch rows, T positions, N = B·T tokens, C hidden, L layers, H heads, KV kv heads,
// D head dim, S = (H + 2·KV)·D packed qkv width, F MLP inner size, V vocabulary, E experts, K top-k.
// A training window row holds T+1 tokens: inputs are tokens[0..T), targets tokens[1..T]. Under
// document batching (ModelConfig::packed_sequences) a row is [2, T]: T inputs, then their T targets.
//
// Under tensor parallelism (size t) the model runs on this rank's shards: H/t heads, KV/t kv heads,
// F/t MLP features, Vp/t vocabulary rows (Vp = V padded to a multiple of t), and with sequence
// parallelism Nl = N/t tokens outside TP regions. Sizes below with an "l" suffix are local.
//
// MoE layers are split by tokens, not features (MoE parallel folding): each TP rank routes its own
// share of the tokens (its sequence shard, N/t), and the routed experts live on the MoE mesh — their
// tensors in a buffer of their own (ExpertShard), their layout known only to the TokenDispatcher.
// The communication is the TensorParallel calls and the dispatcher's, nothing else.
//
// Under pipeline parallelism a Model holds one stage's ModelPart: chunks of layers, plus the
// embedding on the first stage and the final norm + LM head on the last. Each (micro-batch, chunk)
// forward keeps its activations in a slot until that pair's backward (the pipeline schedule decides
// how many are in flight). The LM head and loss run at the start of the last chunk's backward (its
// backward is fused into its forward), so every gradient is written during backward.
//
// Under context parallelism (size c) each rank holds B rows of T/c positions: chunks r and 2c−1−r of
// every sequence (parallel/context_parallel.h). The model's T below is that local length; the token
// windows it is given are whole (every CP rank reads the same ones) and it takes its positions' inputs
// and targets from them. Only the attention core talks to the other CP ranks.
//
// Activation recomputation (Korthikanti et al. 2022): `selective` keeps no attention output and
// log-sum-exp and recomputes the attention core from the kept q|k|v in backward; `full` keeps only
// each layer's input and reruns the layer's forward (TP communication included) before its backward.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layers/attention.h"
#include "model/layers/moe.h"
#include "model/layers/rope.h"
#include "model/params.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"
#include "parallel/token_dispatcher.h"

namespace origami {

struct Losses {
  double loss = 0, lm_loss = 0, aux_loss = 0, z_loss = 0;
  Losses& operator+=(const Losses& o) {
    loss += o.loss, lm_loss += o.lm_loss, aux_loss += o.aux_loss, z_loss += o.z_loss;
    return *this;
  }
};

enum class Recompute { none, selective, full };
Recompute parse_recompute(const std::string& s);  // "none" | "selective" | "full"; else an Error naming it
const char* recompute_name(Recompute r);

// Activation memory, computed (the planner's formulas; the model measures its real buffers and
// tests check the two agree). A slot is what one (micro-batch, chunk) forward keeps for backward:
//   every layer's input and the chunk's output   (layers+1)·Nl·C
//   per layer (none, selective)                  after-attention residual Nl·C, both norm outputs
//                                                2·Nl·C (SP: sequence shards, gathered again in
//                                                backward; in bf16 2-byte values where only GEMMs
//                                                read them: the first norm's, and the second's
//                                                without MoE layers), norm statistics (2 or 4)·Nl,
//                                                q|k|v N·Sl, MLP activations (dense; in bf16 the
//                                                up projection's output and the down projection's
//                                                input as 2-byte values) or the MoE cache
//   per layer (none only)                        the attention core's: output N·Hl·D, log-sum-exp
//                                                B·Hl·T, under CP all-to-all also the head-sharded
//                                                q|k|v and output (CpShape::core_floats)
// plus, with recomputation, one layer's recomputed buffers (full: everything per layer above;
// selective: the attention output and log-sum-exp).
// T is a rank's local positions (the sequence length / CP).
struct ActivationShape {
  int64_t B = 0, T = 0;
  int tp = 1;
  bool sp = false;
  Recompute recompute = Recompute::none;
  int etp = 1, ep = 1;  // MoE mesh: the expert-side buffers are sized for the dispatcher's worst case
  int cp = 1, cp_a2a = 1;  // context parallelism: CP size and all-to-all group size
  int vocab_pp = 1;  // vocabulary parallelism: the vocabulary split over tp·vocab_pp, every stage runs the LM head
  Precision precision = Precision::fp32;  // of the layer GEMMs: bf16 adds the rounding scratch to the workspace
                                          // and keeps the dense MLPs' activations in bf16
  int threads = 1;  // of the rank: in bf16 each holds the attention core's scratch (attention_scratch_bytes);
                    // from options, --threads 0 (all cores) counts as 1 where the count is not known (a plan
                    // for other machines); the memory check sets the count it runs with
  bool cp_levels = false;  // a CP degree per sequence: each subgroup degree's ContextParallel has buffers too
  int64_t local_tokens() const { return sp ? B * T / tp : B * T; }  // Nl, outside TP regions
};
int64_t slot_bytes(const ModelConfig& cfg, const ActivationShape& a, LayerRange layers);
// Which chunks' activation slots are interchangeable (one pool): chunks of as many layers with MoE
// layers at the same places share a class, numbered from 0 in chunk order. An interleaved stage's
// chunks of an even split are one class, so a slot a backward frees serves the next forward of any
// chunk, and the stage holds what the schedule has in flight at once (schedule_activation_peak).
std::vector<int> slot_classes(const ModelConfig& cfg, const std::vector<LayerRange>& chunks);
int64_t recompute_bytes(const ModelConfig& cfg, const ActivationShape& a);
// Work buffers of a stage's model for a batch (not kept across calls: backward gradients of the
// activations, the LM head's logits chunk, MoE backward buffers, SP region buffers), allocated once
// by Model::set_batch (and TensorParallel's region buffer); in bf16 also the matmul seam's rounding
// scratch and gemm_bf16's (kernels/cpu/matmul.h), which grow to the largest call and stay, and the
// attention core's per-thread scratch while it runs.
int64_t workspace_bytes(const ModelConfig& cfg, const ActivationShape& a, const ModelPart& part);

// Model FLOPs per token of a training step (forward + backward), convention:
// 6·(parameters in matmuls a token passes through: attention, MLP or its K active experts,
// router, LM head) + 6·L·T·H·D for causal attention scores and values (half of the 12·L·T·H·D
// full-attention count).
double train_flops_per_token(const ModelConfig& cfg, int64_t T);

// The routed experts a rank holds: their tensors (split_experts' `experts` table, laid out over ETP)
// and the dispatcher over the MoE mesh. Default: no buffer of their own (the experts are in the
// model's one buffer, all local).
struct ExpertShard {
  Params* params = nullptr;
  TokenDispatcher dispatcher;
};

class Model {
 public:
  // params: this stage's tensors (make_param_table(cfg, part), or split_experts' `dense` table when
  // `experts` has a buffer), this rank's TP shards of them.
  Model(const ModelConfig& cfg, Params& params, TensorParallel tp = {}, ModelPart part = {},
        Recompute recompute = Recompute::none, ExpertShard experts = {}, ContextParallel cp = {});
  ~Model();

  // The whole model (one chunk, both ends) on one micro-batch: forward over tokens_B(T+1), then with
  // `backward` the gradients of loss_scale·loss accumulated (+=) into params.grad(). logits_BTV, if
  // given, receives the logits (this rank's vocabulary shard). Losses are those of the micro-batch.
  Losses forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                          float* logits_BTV = nullptr);

  // ---- Incremental decoding (origami generate: one rank, the whole model) ----
  // A KV cache: every layer keeps the keys and values (after RoPE) of up to `capacity` positions, so
  // that a new token runs the layers over itself alone and attends to the cached positions. Its
  // position ids continue the cache's (under document masking they restart after the end-of-document
  // token, and a token attends to its own document only).
  void start_decoding(int64_t capacity);
  // Appends `n` tokens at the cache's next positions (n > 1: a prompt) and writes the last one's
  // logits [V] to `logits`.
  void decode(const int32_t* tokens, int64_t n, float* logits);
  int64_t decoded() const;  // positions the cache holds
  void clear_decoding();    // the next decode starts at position 0

  // ---- Pipeline interface: one chunk of one micro-batch at a time ----
  // Sizes for the following calls: B windows of T positions (the whole sequence; under CP the rank
  // holds T/CP of them). Allocates the recomputation and work buffers.
  void set_batch(int64_t B, int64_t T);
  // Forward of `chunk` for micro-batch `mb`: from the embedding of tokens (chunk 0 of the first
  // stage) or from `input` [Nl, C] (received from the previous virtual stage). Keeps a slot.
  // Returns the router losses of the chunk's MoE layers (lm_loss comes from backward).
  Losses forward(int mb, int chunk, const int32_t* tokens, const float* input);
  // The chunk's output [Nl, C] (to send to the next virtual stage); valid until its backward.
  const float* output(int mb, int chunk) const;
  // Backward of (mb, chunk) from d_output [Nl, C] (null on the head chunk, which computes the LM head
  // and loss here, scaled by loss_scale; logits_BTV, if given, receives its logits); releases the slot.
  // Returns the LM loss on the head chunk.
  Losses backward(int mb, int chunk, const int32_t* tokens, const float* d_output, float loss_scale,
                  float* logits_BTV = nullptr);
  // ∂/∂(input) [Nl, C] of the last backward (to send to the previous virtual stage); valid until the
  // next backward. Under vocabulary parallelism, after the backward of chunk 0 of the first stage:
  // ∂/∂(the embedding rows) [N, C] (vocab_embed_backward's input).
  const float* input_grad() const { return input_grad_; }

  // ---- Vocabulary parallelism (ModelPart::vocab_parallel; Yeung et al. 2024) ----
  // Every stage holds a slice of the embedding's and of the LM head's vocabulary rows (one of TP × PP);
  // what the slices compute is summed over the pipeline group set here. The pipeline runs each call on
  // every stage of the group at matching points of their schedules (they are collectives over it):
  void set_vocab_group(Comm& pp) { vocab_ = &pp; }
  // Micro-batch mb's embedding: each rank looks up its rows, the partial sums are all-reduced over the
  // group, and on the first stage the TP region exit leaves the forward's input [Nl, C] in x0 (the
  // input of its forward of (mb, 0)); other stages pass null.
  void vocab_embed(int mb, const int32_t* tokens, float* x0);
  // Micro-batch mb's output pass: the last stage's final norm of top ([Nl, C], its head chunk's output;
  // null elsewhere) is broadcast over the group, every rank computes its slice's logits and the softmax
  // statistics are combined over TP and the group. With `backward`, the input gradients of the slices
  // are all-reduced over the group and the last stage writes ∂(loss_scale·lm_loss)/∂top [Nl, C] to
  // d_top (its head chunk's backward input). Returns the LM loss on the last stage, zeros elsewhere.
  Losses vocab_head(int mb, const int32_t* tokens, const float* top, float* d_top, float loss_scale, bool backward);
  // ∂/∂(embedding rows) [N, C] of micro-batch mb, d_x0 on the first stage (its input_grad() after the
  // backward of (mb, 0); null elsewhere), broadcast from it to every stage, accumulated into each slice.
  void vocab_embed_backward(int mb, const int32_t* tokens, float* d_x0);
  // Evaluation: forward of (mb, chunk) as forward() does, keeping nothing — its slot is released at
  // once; the head chunk also computes the LM loss (no gradient; logits_BTV, if given, receives its
  // logits), any other chunk copies its output [Nl, C] to output_copy (to send to the next virtual
  // stage). Returns the LM loss on the head chunk and the chunk's router losses.
  Losses forward_only(int mb, int chunk, const int32_t* tokens, const float* input, float* output_copy,
                      float* logits_BTV = nullptr);

  // Bytes of activations held now (the slots out and those pooled for reuse, and the recomputation
  // buffer), and the most since reset.
  int64_t act_bytes() const { return held_bytes_ + recompute_bytes_; }
  int64_t act_bytes_peak() const { return peak_bytes_; }
  void reset_act_peak() { peak_bytes_ = act_bytes(); }
  ActivationShape activation_shape() const;

  // Called during backward with offsets (X, Xe) each time the gradients of every parameter at
  // offsets ≥ X of the buffer, and ≥ Xe of the experts' buffer, are final for this backward
  // (decreasing; 0 at the embedding): lets data parallelism reduce gradient buckets while backward goes on.
  void on_grads_ready(std::function<void(int64_t, int64_t)> fn) { grads_ready_ = std::move(fn); }
  // Called after every layer's forward and backward: lets the pipeline drive its non-blocking
  // transfers (MPI moves a large message only while the sender and the receiver call into it).
  void on_progress(std::function<void()> fn) { progress_ = std::move(fn); }
  // ZeRO-3: called with each unit's ranges of the buffer and of the experts' buffer (param_unit: a
  // layer, the embedding, the head with the tied embedding it reads) before the model reads them
  // (need), after it has finished with them (done), and a unit ahead (prefetch: the next layer).
  struct WeightUnit {
    std::vector<Range> dense, experts;
  };
  void on_weights(std::function<void(WeightUse, const WeightUnit&)> fn) { weights_ = std::move(fn); }
  // FSSDP: called in each MoE layer with its experts (blocks of the experts' buffer) and which of them
  // this rank's rows reach (need[j] = 1 for local expert j; the same on every call of one layer's
  // forward or backward): gather after routing, in forward and again in backward, returning where the
  // gathered experts are (the layer reads them and accumulates their gradients there); reduce after
  // the experts' backward. Every rank of the experts' group calls it at the same points, whatever its
  // tokens need.
  using ExpertsFn = std::function<ExpertPlace(ExpertUse, const ExpertBlocks&, const std::vector<int32_t>& need)>;
  void on_experts(ExpertsFn fn) { experts_fn_ = std::move(fn); }

  // Tokens this rank routed to each expert per MoE layer ([L][E], global layer index, the router's
  // choices before any capacity drop; zeros for layers on other stages and dense layers; empty for
  // dense models), and the assignments the capacity dropped per layer ([L]), summed over forwards
  // since the last reset; and the expert-side rows its local experts computed (what the dispatcher
  // brought it). The reset also starts a new step for the global-batch balance.
  const std::vector<std::vector<int64_t>>& expert_counts() const { return expert_counts_; }
  const std::vector<int64_t>& expert_dropped() const { return expert_dropped_; }
  const std::vector<int64_t>& expert_near_ties() const { return expert_near_ties_; }  // per layer (kNearTie)
  // Expert-side rows this rank computed since reset_expert_counts.
  int64_t expert_rows() const;
  // Σ over the MoE forward calls since reset_expert_counts of the EP group's most expert-side rows
  // (TokenDispatcher::busiest_rows). Collective over EP.
  int64_t expert_busiest_rows() { return dispatcher_.busiest_rows(expert_call_rows_); }
  // Seconds this rank spent in its MoE layers (forward and backward, exchanges included) since the
  // last reset, and the dispatcher's share of them (DispatchTimes).
  double moe_layer_s() const { return moe_layer_s_; }
  const DispatchTimes& dispatch_times() { return dispatcher_.times(); }
  void reset_expert_counts();  // also the MoE times
  // Aux-loss-free balancing (routing.bias_rate > 0): the per-expert selection bias of every layer
  // ([L][E]; empty when off), and its update after a step from the step's load, [L][E] tokens per
  // expert summed over every rank: b_e += rate·sign(mean load − load_e).
  std::vector<std::vector<float>>& router_bias() { return router_bias_; }
  // A checkpoint's router biases ([layers][experts] of this model, else an Error naming `where`).
  void set_router_bias(std::vector<std::vector<float>> bias, const std::string& where);
  void update_router_bias(const std::vector<std::vector<int64_t>>& load);
  const ModelConfig& config() const { return cfg_; }
  // The precision of the layer GEMMs (kernels/cpu/matmul.h). bf16 makes the parameter buffers keep
  // their bf16 copies (made now from the values, then kept by the update and the gathers: params.h;
  // not the experts' under FSSDP, whose gathers stage bf16 values: call it after on_experts) and
  // the dense MLPs' activations (up-projection output, down-projection input) be kept in bf16.
  // Between steps only (no activations kept).
  void set_precision(Precision p);
  Precision precision() const { return precision_; }
  // The LM loss of each micro-batch is the sum of its targets' cross-entropies over `tokens`; 0 (the
  // default): over its B·T tokens (the mean of a window batch). Document batching sets the step's
  // predicted tokens / micro-batches, so that the step's loss is the mean over every predicted token,
  // and `routed`, the step's tokens / micro-batches, the router losses' denominator (MoeSequences).
  void set_loss_tokens(double tokens, double routed = 0) { loss_tokens_ = tokens, router_tokens_ = routed; }
  ContextParallel& context_parallel() { return cp_; }
  // Document batching under CP (a CP degree per sequence, train/balance.h): the degrees below the CP
  // group's, each over the aligned subgroups of `degree` CP ranks (1: this rank alone). Built once.
  struct CpLevel {
    int degree;
    ContextParallel cp;            // over the subgroup
    std::unique_ptr<Comm> tokens;  // TP × the subgroup: the MoE router's token group at this degree
    std::vector<int64_t> positions;  // [T_]: each local position's place in the subgroup's rows (set_batch)
  };
  void set_cp_levels(std::vector<CpLevel> levels) { levels_ = std::move(levels), B_ = 0; }  // (set_batch redoes)
  // Micro-batch m runs at degree d = degrees[m]: its B rows of d·T/C tokens over the subgroup of d CP
  // ranks holding this rank (every rank holds T/C positions of each). Empty (the default), or d = C:
  // over the whole group.
  void set_cp_degrees(std::vector<int> degrees) { degree_mbs_ = std::move(degrees); }
  // Since the last reset, summed over every degree: the ring's times, (query, key) pairs and forward
  // score tiles, and the bytes sent.
  CpCounters cp_counters() const;
  int64_t attention_tiles() const { return cp_counters().tiles; }
  double cp_bytes_sent() const;
  double level_token_bytes() const;  // sent by the subgroups' MoE token groups (CpLevel::tokens)
  void reset_attention_counters();
  const ModelPart& part() const { return part_; }

 private:
  struct LayerOffsets {  // offsets into the parameter/gradient buffers; -1 when absent
    int64_t ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, o_w = -1, o_b = -1, ln2_w = -1, ln2_b = -1;
    int64_t fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;  // the MLP (MoE layers: the shared expert's)
    int64_t router = -1, experts = -1, shared_gate = -1;
  };
  // This rank's sizes for the current batch (legend at the top; H, KV, F, S, HD local under TP).
  struct Dims {
    int64_t B, T, N, Nl, C, D, H, KV, F, S, HD;
  };
  Dims dims() const;
  struct KvCache;
  std::unique_ptr<KvCache> kv_;  // while decoding (start_decoding)
  void cached_attention(int64_t l, const float* qkv, float* att, float* lse);
  struct Slot;
  struct LayerActs;
  struct Scratch;

  float* w(int64_t off) { return off < 0 ? nullptr : params_.data() + off; }
  // A matrix weight as the GEMMs read it: in the run's precision, with its bf16 copy in bf16.
  Weights<float> mw(int64_t off) const { return at(params_, off); }
  Weights<float> expert_weights(int64_t off) const { return at(experts_, off); }
  Weights<float> at(const Params& p, int64_t off) const {
    return {p.data() + off, p.bf16_copy() ? p.bf16_copy() + off : nullptr, precision_};
  }
  float* g(int64_t off) { return off < 0 ? nullptr : params_.grad() + off; }
  void grads_ready(int64_t offset, int64_t expert_offset) {
    if (grads_ready_) grads_ready_(offset, expert_offset);
  }
  void use_weights(WeightUse use, const WeightUnit& unit) {
    if (weights_) weights_(use, unit);
  }
  ExpertBlocks expert_blocks(int64_t l) const;  // layer l's local experts
  // FSSDP: gathers layer l's local experts that `plan` sends rows to (need: 1 for each, 0 else).
  ExpertPlace gather_reached(int64_t l, const DispatchPlan& plan, std::vector<int32_t>& need);
  Weights<float> placed(const ExpertPlace& at) const { return {at.values, at.low, precision_}; }  // as GEMMs read it
  MoeSizes moe_sizes() const;  // this rank's share of the current batch
  int64_t moe_rows() const;    // the dispatcher's most expert-side rows for it
  void mlp_forward(float* y, Operand<float> ln2, const LayerActs& a, const LayerOffsets& o, int64_t F);
  void mlp_backward(float* d_local, float* d_full, const float* d_y, const LayerActs& a, const LayerOffsets& o,
                    int64_t F);
  void moe_layer_forward(int64_t l, const LayerActs& a, float* out, Losses* losses);
  void moe_layer_backward(int64_t l, const LayerActs& a, float* d_ln, const float* d_res, float loss_scale);
  // Sizes a slot's buffers: `resid_rows` residual-stream rows of [Nl, C], per-layer buffers for
  // `layers` from `first_layer` (−1: one layer's, for any layer: the recomputation buffer), attention
  // output and log-sum-exp for `core_layers` (`bytes` in all, named if it fails).
  void size_slot(Slot& s, int64_t resid_rows, int64_t first_layer, int64_t layers, int64_t core_layers,
                 int64_t bytes) const;
  LayerActs layer_acts(Slot& s, int64_t i);
  void release(int mb, int chunk);  // back to the chunk's free list  // layer i of a slot (recomputed buffers where it keeps none)
  void layer_forward(int64_t l, const LayerActs& a, const float* in, float* out, Losses* losses);
  void layer_backward(int64_t l, const LayerActs& a, const float* in, float* d_res, float loss_scale);
  // Final norm, LM head and loss on the chunk output `top`; with `backward`, leaves ∂/∂top in d_res.
  Losses head(const float* top, const int32_t* tokens, float loss_scale, bool backward, float* logits_out);
  // head's parts: the final norm of top into the scratch's lnf [N, C] (gathered over the sequence
  // under SP); the LM head and loss on it (∂/∂lnf, this rank's partial sum, in the scratch's d_ln);
  // the norm's backward from that sum into d_top [Nl, C].
  void final_norm(const float* top);
  double lm_loss(float loss_scale, bool backward, float* logits_out);
  void final_norm_backward(float* d_top, const float* top);
  bool runs_head(int chunk) const {  // the head chunk computes the LM head in its backward
    return part_.head && !part_.vocab_parallel() && chunk == int(part_.chunks.size()) - 1;
  }
  void embed(float* x0, const int32_t* tokens);
  void embed_backward(const float* d_x0, const int32_t* tokens);
  // The inputs (or with `shift` 1 the targets) of this rank's positions from whole rows (row_stride).
  void gather_tokens(int32_t* out, const int32_t* tokens, int64_t shift) const;
  // Document masking: docs_ and pos_ids_ of the micro-batch's windows (every forward and backward
  // sets them again: micro-batches interleave under pipeline schedules); MoE under document batching
  // also the sequences of the MoE share's tokens (set_sequences).
  void set_documents(const int32_t* tokens);
  void set_sequences(const int32_t* tokens);
  const int32_t* docs() const { return docs_.empty() ? nullptr : docs_.data(); }
  CpShape cp_shape() const {
    CpShape s = cp_now().shape(B_, T_, Hl_, KVl_, cfg_.head_dim);
    s.precision = precision_;
    s.qkv_exact = qkv_rounded_in_place(precision_);  // layer_forward rounds q|k|v then
    return s;
  }
  // The current micro-batch's attention: over the CP group, or a subgroup's (set_cp_degrees).
  ContextParallel& cp_now() { return level_ ? level_->cp : cp_; }
  const ContextParallel& cp_now() const { return level_ ? level_->cp : cp_; }
  int64_t row_cp() const { return level_ ? level_->degree : cp_.size(); }  // the ranks sharing the current rows
  int64_t position(int64_t t) const {  // local t's place in its row
    return (level_ ? level_->positions : positions_)[size_t(t)];
  }
  void select_cp(int mb);
  void norm_forward(float* y, float* mean, float* rstd, const float* x, int64_t w_off, int64_t b_off);
  float* norm_keep(float* kept, bf16* low, float* mean, float* rstd, const float* x, int64_t w_off, int64_t b_off);
  float* norm_gather(float* loc);
  float* norm_read(float* kept, const bf16* low);
  Operand<float> norm_operand(const float* full, const bf16* low) const;
  Operand<float> norm_kept(float* kept, const bf16* low);
  void norm_backward(float* dx, const float* dy, const float* x, const float* mean, const float* rstd,
                     int64_t w_off, int64_t b_off);

  ModelConfig cfg_;
  Params& params_;
  Params& experts_;  // the routed experts' buffer (params_ itself when they have none of their own)
  TokenDispatcher dispatcher_;
  TensorParallel tp_;
  Comm* vocab_ = nullptr;  // vocabulary parallelism: the pipeline group
  const float* input_grad_ = nullptr;
  ContextParallel cp_;
  std::vector<CpLevel> levels_;       // set_cp_levels
  std::vector<int> degree_mbs_;       // set_cp_degrees
  CpLevel* level_ = nullptr;          // the current micro-batch's degree (null: the whole group)
  ModelPart part_;
  Recompute recompute_;
  Precision precision_ = Precision::fp32;
  double loss_tokens_ = 0, router_tokens_ = 0;
  int64_t Hl_, KVl_, Fl_, Vl_, vocab_begin_, vocab_valid_;  // this TP rank's shard sizes
  int64_t B_ = 0, T_ = 0;          // batch rows and this rank's positions per row
  std::vector<int64_t> positions_;  // [T_]: each local position's place in the sequence (over the CP group)
  std::vector<int64_t> pos_ids_;    // [B_, T_]: each token's position id (RoPE, learned positions)
  std::vector<int32_t> docs_;       // document masking: [B_, T_·CP] the document of each position of a window
  std::vector<int32_t> moe_seq_;    // MoE under document batching: [share tokens] each one's sequence (−1: padding)
  MoeSequences moe_docs_;           // ... and what the router reads of them (set_sequences)
  std::vector<LayerOffsets> layers_;  // by global layer index (entries of other stages unused)
  std::vector<int64_t> layer_begin_;  // lowest buffer offset of each layer's parameters
  std::vector<int64_t> expert_begin_;  // the same in the experts' buffer (carried over dense layers)
  int64_t wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_ = -1, head_begin_ = -1;
  std::function<void(int64_t, int64_t)> grads_ready_;
  std::function<void(WeightUse, const WeightUnit&)> weights_;
  ExpertsFn experts_fn_;
  std::vector<WeightUnit> units_;            // by global layer index (ranges of this stage's layers)
  WeightUnit embedding_unit_, head_unit_;    // the head's includes the tied embedding's ranges
  std::function<void()> progress_;
  RopeTable rope_;
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> live_;  // (micro-batch, chunk) → slot
  std::vector<std::vector<std::unique_ptr<Slot>>> free_;       // per slot class: released slots, reused
  std::vector<int> slot_class_;                                // each chunk's (slot_classes)
  std::unique_ptr<Slot> recomputed_;                           // one layer's recomputed buffers
  std::unique_ptr<Scratch> scratch_;                           // backward work buffers
  int64_t held_bytes_ = 0, recompute_bytes_ = 0, peak_bytes_ = 0;
  std::vector<std::vector<int64_t>> expert_counts_;
  std::vector<int64_t> expert_dropped_;
  std::vector<int64_t> expert_near_ties_;
  std::vector<int64_t> expert_call_rows_;  // [MoE forward call]: its expert-side rows on this rank
  double moe_layer_s_ = 0;
  std::vector<std::vector<float>> router_bias_;            // [L][E] (aux-loss-free balancing)
  std::vector<GlobalCounts> global_counts_;                // [L] AuxLoss::global: the step's counts so far
  std::map<std::pair<int64_t, int>, std::vector<double>> global_frac_;  // (layer, micro-batch) → φ used
  int mb_ = 0;                                             // the micro-batch of the current forward/backward
};

}  // namespace origami
