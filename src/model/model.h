// Model assembly: the decoder stack of gpt2 / llama / mixtral over one micro-batch, forward and
// backward, on the flat parameter and gradient buffers of `Params`.
//
// Legend: B batch rows, T positions, N = B·T tokens, C hidden, L layers, H heads, KV kv heads,
// D head dim, S = (H + 2·KV)·D packed qkv width, F MLP inner size, V vocabulary, E experts, K top-k.
// A training window row holds T+1 tokens: inputs are tokens[0..T), targets tokens[1..T].
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/layers/moe.h"
#include "model/layers/rope.h"
#include "model/params.h"

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
  Model(const ModelConfig& cfg, Params& params);

  // Forward over tokens_B(T+1); with `backward`, gradients of loss_scale·loss are accumulated
  // (+=) into params.grad(). logits_BTV, if given, receives the logits.
  Losses forward_backward(const int32_t* tokens, int64_t B, int64_t T, float loss_scale, bool backward,
                          float* logits_BTV = nullptr);

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

  ModelConfig cfg_;
  Params& params_;
  std::vector<LayerOffsets> layers_;
  int64_t wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_ = -1;
  RopeTable rope_;
  std::shared_ptr<Activations> act_;
  std::vector<MoeCache<float>> moe_;
  std::vector<float> head_scratch_;
};

}  // namespace origami
