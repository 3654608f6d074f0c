// Model configuration read from a Hugging Face config.json (model_type gpt2, llama, mixtral, qwen2_moe).
// Every field that changes the model's math is either implemented or rejected by name;
// bookkeeping fields (architectures, torch_dtype, token ids, ...) are accepted and kept so the
// config can be written back unchanged next to a checkpoint.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

enum class RouterScore { softmax, sigmoid };
enum class AuxLoss { none, micro, seq, global };
enum class DropPolicy { probs, position };
// Parse a flag's value; an Error names the flag, the value and the choices.
RouterScore parse_router_score(const std::string& s);
AuxLoss parse_aux_loss(const std::string& s);
DropPolicy parse_drop_policy(const std::string& s);
const char* aux_loss_name(AuxLoss a);
// --attention-mask: "causal" (false) or "document" (true); else an Error naming the value.
bool parse_attention_mask(const std::string& s);

// How MoE layers route (model/layers/moe.h): the model config's fields (score, norm_topk, the
// coefficients) and the run's choices (flags).
struct MoeRouting {
  RouterScore score = RouterScore::softmax;
  bool norm_topk = true;           // renormalise the chosen K weights (always, with sigmoid scores)
  AuxLoss aux = AuxLoss::micro;
  double aux_coef = 0, z_coef = 0;
  double capacity_factor = 0;      // 0: dropless
  DropPolicy drop = DropPolicy::probs;
  bool pad = false;                // pad every expert to its capacity (fixed shapes)
  double bias_rate = 0;            // aux-loss-free balancing: the bias update rate (0: off)
  bool renormalise() const { return norm_topk || score == RouterScore::sigmoid; }
  // Rows each expert keeps, of the N·K assignments of N tokens: ceil(factor·N·K/E); 0: dropless.
  int64_t capacity(int64_t N, int64_t K, int64_t E) const;
};


enum class ModelType { gpt2, llama, mixtral, qwen2_moe };

// The largest model dimensions a config may give, checked as it is read, before anything is sized
// from them (a larger value is "FILE: field 'NAME': expected an integer in [1, LIMIT], got VALUE").
// Each is far beyond any published model (Llama-3.1 405B: hidden 16384, 126 layers, 128 heads, FFN
// 53248, vocabulary 128256, 131072 positions; DeepSeek-V3: 256 experts of which 8 are chosen).
// They keep every dimension and every product of a few of them well inside 64 bits; the sizes,
// byte counts and FLOP counts computed from them are still computed in checked arithmetic.
struct ModelLimits {
  static constexpr int64_t layers = 10'000;            // also bounds qwen2_moe's decoder_sparse_step
  static constexpr int64_t hidden = int64_t(1) << 20;  // the hidden size, and an explicit head_dim
  static constexpr int64_t heads = int64_t(1) << 16;   // attention heads; key/value heads at most these
  static constexpr int64_t ffn = int64_t(1) << 24;     // every MLP's inner size: dense, expert, shared expert
  static constexpr int64_t vocab = int64_t(1) << 24;
  static constexpr int64_t experts = int64_t(1) << 16;  // experts per MoE layer; top-k at most these
  static constexpr int64_t positions = int64_t(1) << 24;
  // Tensors of the whole model, bounded as layers x (16 + 3 x experts): 10^4 dense layers or 32
  // layers of 2^14 experts; the largest published MoE (61 layers of 256 experts) has 4.8e4.
  static constexpr int64_t tensors = int64_t(1) << 21;
};

// Document batching: the target of a padding position (ModelConfig::packed_sequences).
inline constexpr int32_t kPaddingTarget = -2;

struct ModelConfig {
  ModelType type = ModelType::gpt2;
  int64_t vocab_size = 0;
  int64_t hidden = 0;         // C
  int64_t num_layers = 0;     // L
  int64_t num_heads = 0;      // H
  int64_t num_kv_heads = 0;   // KV (== H for gpt2)
  int64_t head_dim = 0;       // D
  int64_t ffn = 0;            // F: dense MLP inner size (gpt2, llama, qwen2_moe's dense layers)
  int64_t max_positions = 0;  // longest sequence (gpt2: n_positions, llama: max_position_embeddings)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double init_std = 0.02;     // initializer_range: the standard deviation of the normal initialisation
  bool tied_embeddings = true;
  bool qkv_bias = false;       // q/k/v projection biases (gpt2's c_attn bias, qwen2_moe)
  // Mixture of experts (mixtral, qwen2_moe).
  int64_t num_experts = 0;    // E
  int64_t top_k = 0;          // K
  int64_t expert_ffn = 0;     // F of each routed expert (mixtral intermediate_size, qwen2_moe moe_intermediate_size)
  int64_t shared_ffn = 0;     // qwen2_moe: the shared expert's inner size (0: no shared expert)
  int64_t sparse_step = 1;    // qwen2_moe decoder_sparse_step: layer l is MoE when (l+1) % step == 0 ...
  std::vector<int64_t> dense_layers;  // ... and l is not in mlp_only_layers
  MoeRouting routing;         // norm_topk (qwen2_moe norm_topk_prob), aux_coef (router_aux_loss_coef),
                              // z_coef (router_z_loss_coef, an origami extension HF ignores)
  // Document masking (the run's --attention-mask document): the end-of-document token id. Inside a
  // window the token after each one starts a new document; a token attends only to earlier tokens of
  // its own document and position ids restart at 0 for each (Megatron's reset_attention_mask +
  // reset_position_ids). −1: causal attention over the whole window.
  int32_t document_eod = -1;
  // Document batching (the run's --batching documents, data/documents.h): every row is [2, T], the T
  // input tokens then their T targets, −1 where a position predicts nothing (a sequence's last) and
  // kPaddingTarget on the padding. Whole sequences are packed back to back with the padding after them:
  // a sequence ends at each position without a target, so a token attends only to its own sequence and
  // position ids restart at 0 for each. Padding routes to no expert and counts in no router loss.
  bool packed_sequences = false;
  nlohmann::json raw;         // the file as read

  bool is_moe() const { return num_experts > 0; }
  bool masks_documents() const { return document_eod >= 0 || packed_sequences; }
  int64_t row_stride(int64_t T) const { return packed_sequences ? 2 * T : T + 1; }  // a row's int32s
  bool is_moe_layer(int64_t l) const;
  int64_t num_moe_layers(int64_t begin, int64_t end) const;  // MoE layers among [begin, end)
  bool has_dense_layers() const;                               // llama-style MLP layers (gpt2's included)
  bool is_gpt2() const { return type == ModelType::gpt2; }
  std::string model_type() const;
  // The fields of the file that describe the model (raw less the bookkeeping that never changes the
  // math): what a plan records of the model it laid out.
  nlohmann::json math_fields() const { return model_math_fields(raw); }
  // The same of a config file's JSON object as it is (one not parsed: a checkpoint's config.json).
  static nlohmann::json model_math_fields(const nlohmann::json& raw);
};

// A math field that changes the model's values but neither its shapes nor its cost (initialisation,
// norm epsilons, RoPE's base, loss coefficients, the top-k weights' normalisation): a plan laid out
// for one config fits another that differs only in these.
bool plan_neutral_field(const std::string& key);

// Layers [begin, end) of a model part (a pipeline stage's chunk).
struct LayerRange {
  int begin, end;
  bool operator==(const LayerRange&) const = default;
};

// Parses and validates; `source` names the file in error messages.
ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_model_config(const std::string& path);
void save_model_config(const ModelConfig& cfg, const std::string& path);

}  // namespace origami
