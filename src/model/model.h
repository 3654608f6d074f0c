// Model assembly: the decoder stack of gpt2 / llama / mixtral over one micro-batch, forward and
// backward, on the flat parameter and gradient buffers of `Params`.
//
// Legend: B batch rows, T positions, N = B·T tokens, C hidden, L layers, H heads, KV kv heads,
// D head dim, S = (H + 2·KV)·D packed qkv width, F MLP inner size, V vocabulary, E experts, K top-k.
// A training window row holds T+1 tokens: inputs are tokens[0..T), targets tokens[1..T].
//
// Under tensor parallelism (size t) the model runs on this rank's shards: H/t heads, KV/t kv heads,
// F/t MLP (and per-expert) features, Vp/t vocabulary rows (Vp = V padded to a multiple of t), and
// with sequence parallelism Nl = N/t tokens outside TP regions. Sizes below with an "l" suffix are
// local. The communication is the TensorParallel region calls in forward_backward, nothing else.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/layers/moe.h"
#include "model/layers/rope.h"
#include "model/params.h"
#include "parallel/tensor_parallel.h"

namespace origami {

struct Losses {
  double loss = 0, lm_loss = 0, aux_loss = 0, z_loss = 0;
};

// Floats of activation memory one micro-batch keeps for backward (planner and allocation share it).
int64_t activation_floats(const ModelConfig& cfg, int64_t B, int64_t T);

// Model FLOPs per token of a training step (forward + backward), convention:
// 6·(parameters in matmuls a token passes through: attention, MLP or its K active experts,
// router, LM head) + 6·L·T·H·D for causal attention scores and values (half of the 12·L·T·H·D
// full-attention count).
double train_flops_per_token(const ModelConfig& cfg, int64_t T);

class Model {
 public:
  // params: this rank's shards (laid out with the same TP size as `tp`).
  Model(const ModelConfig& cfg, Params& params, TensorParallel tp = {});

  // Forward over tokens_B(T+1); with `backward`, gradients of loss_scale·loss are accumulated
  // (+=) into params.grad(). logits_BTV, if given, receives the logits (this rank's vocabulary shard).
  // Losses are those of the whole micro-batch, the same on every TP rank.
  Losses forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                          float* logits_BTV = nullptr);

  // Called during backward with an offset X each time the gradients of every parameter at buffer
  // offsets ≥ X are final for this call (decreasing X, ending with 0): lets data parallelism start
  // reducing gradient buckets while backward goes on.
  void on_grads_ready(std::function<void(int64_t)> fn) { grads_ready_ = std::move(fn); }

  // Tokens routed to each expert per MoE layer in the last call ([L][E]; empty for dense models).
  std::vector<std::vector<int64_t>> expert_counts() const;
  const ModelConfig& config() const { return cfg_; }

 private:
  struct LayerOffsets {  // offsets into the parameter/gradient buffers; -1 when absent
    int64_t ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, o_w = -1, o_b = -1, ln2_w = -1, ln2_b = -1;
    int64_t fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1, router = -1, experts = -1;
  };
  struct Activations;

  void ensure_activations(int64_t B, int64_t T);
  float* w(int64_t off) { return off < 0 ? nullptr : params_.data() + off; }
  float* g(int64_t off) { return off < 0 ? nullptr : params_.grad() + off; }

  void grads_ready(int64_t offset) {
    if (grads_ready_) grads_ready_(offset);
  }

  ModelConfig cfg_;
  Params& params_;
  TensorParallel tp_;
  int64_t Hl_, KVl_, Fl_, Vl_, vocab_begin_, vocab_valid_;  // this TP rank's shard sizes
  std::vector<LayerOffsets> layers_;
  std::vector<int64_t> layer_begin_;  // lowest buffer offset of each layer's parameters
  int64_t wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_ = -1, head_begin_ = -1;
  std::function<void(int64_t)> grads_ready_;
  RopeTable rope_;
  std::shared_ptr<Activations> act_;
  std::vector<MoeCache<float>> moe_;  // per layer
  MoeScratch<float> moe_scratch_;      // shared by the layers' backward
  std::vector<float> head_scratch_;
};

}  // namespace origami
