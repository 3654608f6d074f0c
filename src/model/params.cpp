#include "model/params.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"

namespace origami {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamSpec> make_param_table(const ModelConfig& c) {
  std::vector<ParamSpec> t;
  auto add = [&](std::string name, std::vector<int64_t> shape, Init init = Init::normal) {
    t.push_back({std::move(name), std::move(shape), init});
  };
  const int64_t C = c.hidden, V = c.vocab_size, F = c.ffn, D = c.head_dim;
  const int64_t H = c.num_heads, KV = c.num_kv_heads;
  if (c.is_gpt2()) {
    add("wte.weight", {V, C});
    add("wpe.weight", {c.max_positions, C});
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::string p = "h." + std::to_string(l) + ".";
      add(p + "ln_1.weight", {C}, Init::ones);
      add(p + "ln_1.bias", {C}, Init::zeros);
      add(p + "attn.c_attn.weight", {C, 3 * C});
      add(p + "attn.c_attn.bias", {3 * C}, Init::zeros);
      add(p + "attn.c_proj.weight", {C, C}, Init::scaled_normal);
      add(p + "attn.c_proj.bias", {C}, Init::zeros);
      add(p + "ln_2.weight", {C}, Init::ones);
      add(p + "ln_2.bias", {C}, Init::zeros);
      add(p + "mlp.c_fc.weight", {C, F});
      add(p + "mlp.c_fc.bias", {F}, Init::zeros);
      add(p + "mlp.c_proj.weight", {F, C}, Init::scaled_normal);
      add(p + "mlp.c_proj.bias", {C}, Init::zeros);
    }
    add("ln_f.weight", {C}, Init::ones);
    add("ln_f.bias", {C}, Init::zeros);
    return t;
  }
  add("model.embed_tokens.weight", {V, C});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {C}, Init::ones);
    add(p + "self_attn.q_proj.weight", {H * D, C});
    add(p + "self_attn.k_proj.weight", {KV * D, C});
    add(p + "self_attn.v_proj.weight", {KV * D, C});
    add(p + "self_attn.o_proj.weight", {C, H * D}, Init::scaled_normal);
    add(p + "post_attention_layernorm.weight", {C}, Init::ones);
    if (c.is_moe()) {
      std::string m = p + "block_sparse_moe.";
      add(m + "gate.weight", {c.num_experts, C});
      for (int64_t e = 0; e < c.num_experts; ++e) {
        std::string x = m + "experts." + std::to_string(e) + ".";
        add(x + "w1.weight", {F, C});
        add(x + "w3.weight", {F, C});
        add(x + "w2.weight", {C, F}, Init::scaled_normal);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {F, C});
      add(p + "mlp.up_proj.weight", {F, C});
      add(p + "mlp.down_proj.weight", {C, F}, Init::scaled_normal);
    }
  }
  add("model.norm.weight", {C}, Init::ones);
  if (!c.tied_embeddings) add("lm_head.weight", {V, C});
  return t;
}

Params::Params(std::vector<ParamSpec> table) : table_(std::move(table)) {
  int64_t off = 0;
  for (size_t i = 0; i < table_.size(); ++i) {
    offsets_.push_back(off);
    by_name_[table_[i].name] = i;
    off += table_[i].numel();
  }
  data_.assign(size_t(off), 0.f);
  grad_.assign(size_t(off), 0.f);
}

int64_t Params::index(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : int64_t(it->second);
}

float* Params::value(const std::string& name) {
  int64_t i = index(name);
  ORIGAMI_CHECK(i >= 0, "internal error: no parameter named '", name, "'");
  return data_.data() + offsets_[size_t(i)];
}

float* Params::grad(const std::string& name) {
  int64_t i = index(name);
  ORIGAMI_CHECK(i >= 0, "internal error: no parameter named '", name, "'");
  return grad_.data() + offsets_[size_t(i)];
}

void Params::init(uint64_t seed, int64_t num_layers) {
  const double std_normal = 0.02, std_scaled = 0.02 / std::sqrt(2.0 * double(num_layers));
  for (size_t i = 0; i < table_.size(); ++i) {
    const ParamSpec& p = table_[i];
    float* w = data_.data() + offsets_[i];
    const int64_t n = p.numel();
    const uint64_t key = hash_name(p.name);
    switch (p.init) {
      case Init::zeros: std::fill(w, w + n, 0.f); break;
      case Init::ones: std::fill(w, w + n, 1.f); break;
      case Init::normal:
      case Init::scaled_normal: {
        const double s = p.init == Init::normal ? std_normal : std_scaled;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n; ++j) w[j] = float(s * normal01(seed, key, uint64_t(j)));
        break;
      }
    }
  }
}

void Params::zero_grad() { std::memset(grad_.data(), 0, grad_.size() * sizeof(float)); }

}  // namespace origami
