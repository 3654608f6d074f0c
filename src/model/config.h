// Model configuration read from a Hugging Face config.json (model_type gpt2, llama, mixtral).
// Every field that changes the model's math is either implemented or rejected by name;
// bookkeeping fields (architectures, torch_dtype, token ids, ...) are accepted and kept so the
// config can be written back unchanged next to a checkpoint.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace origami {

enum class ModelType { gpt2, llama, mixtral };

struct ModelConfig {
  ModelType type = ModelType::gpt2;
  int64_t vocab_size = 0;
  int64_t hidden = 0;         // C
  int64_t num_layers = 0;     // L
  int64_t num_heads = 0;      // H
  int64_t num_kv_heads = 0;   // KV (== H for gpt2)
  int64_t head_dim = 0;       // D
  int64_t ffn = 0;            // F: MLP (or per-expert) inner size
  int64_t max_positions = 0;  // longest sequence (gpt2: n_positions, llama: max_position_embeddings)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tied_embeddings = true;
  // Mixture of experts (mixtral).
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // K
  double aux_loss_coef = 0;  // router_aux_loss_coef
  double z_loss_coef = 0;    // router_z_loss_coef (origami extension; HF ignores it)
  nlohmann::json raw;        // the file as read

  bool is_moe() const { return num_experts > 0; }
  bool is_gpt2() const { return type == ModelType::gpt2; }
  std::string model_type() const;
};

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
