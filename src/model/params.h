// Parameters: one table of {Hugging Face name, shape, init} generated from the config, one
// contiguous float buffer carved from it, and a gradient buffer of the same layout.
// Layers find their weights by name through the table — offsets are never hand-numbered.
//
// The table orders tensors so that weights used by one fused GEMM sit next to each other:
// llama q_proj|k_proj|v_proj form one [(H+2KV)·D, C] matrix, gate_proj|up_proj one [2F, C],
// and each expert's w1|w3 one [2F, C].
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/config.h"

namespace origami {

enum class Init { normal, scaled_normal, zeros, ones };

struct ParamSpec {
  std::string name;            // Hugging Face name (gpt2: without the "transformer." prefix)
  std::vector<int64_t> shape;  // Hugging Face layout (gpt2 Conv1D: [in, out]; Linear: [out, in])
  Init init = Init::normal;
  int64_t numel() const;
  bool decays() const { return shape.size() >= 2; }  // AdamW weight decay on matrices only
};

std::vector<ParamSpec> make_param_table(const ModelConfig& cfg);

class Params {
 public:
  explicit Params(std::vector<ParamSpec> table);

  const std::vector<ParamSpec>& table() const { return table_; }
  int64_t size() const { return int64_t(data_.size()); }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  float* grad() { return grad_.data(); }
  const float* grad() const { return grad_.data(); }
  int64_t offset(size_t i) const { return offsets_[i]; }
  // Index of a parameter by name, or -1.
  int64_t index(const std::string& name) const;
  float* value(const std::string& name);  // throws if absent (internal error)
  float* grad(const std::string& name);

  // Deterministic init: element j of parameter `name` depends only on (seed, name, j).
  // normal: N(0, 0.02²); scaled_normal: N(0, (0.02/√(2L))²) (GPT-2 residual projections).
  void init(uint64_t seed, int64_t num_layers);
  void zero_grad();

 private:
  std::vector<ParamSpec> table_;
  std::vector<int64_t> offsets_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<float> data_, grad_;
};

}  // namespace origami
