#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/io.h"

namespace origami {

std::string ModelConfig::model_type() const {
  switch (type) {
    case ModelType::gpt2: return "gpt2";
    case ModelType::llama: return "llama";
    case ModelType::mixtral: return "mixtral";
    case ModelType::qwen2_moe: return "qwen2_moe";
  }
  return "?";
}

RouterScore parse_router_score(const std::string& s) {
  if (s == "softmax") return RouterScore::softmax;
  if (s == "sigmoid") return RouterScore::sigmoid;
  fail("--moe-router-score must be softmax or sigmoid, got '", s, "'");
}

AuxLoss parse_aux_loss(const std::string& s) {
  if (s == "none") return AuxLoss::none;
  if (s == "micro") return AuxLoss::micro;
  if (s == "seq") return AuxLoss::seq;
  if (s == "global") return AuxLoss::global;
  fail("--moe-aux-loss must be none, micro, seq or global, got '", s, "'");
}

DropPolicy parse_drop_policy(const std::string& s) {
  if (s == "probs") return DropPolicy::probs;
  if (s == "position") return DropPolicy::position;
  fail("--moe-drop-policy must be probs or position, got '", s, "'");
}

bool parse_attention_mask(const std::string& s) {
  if (s == "causal" || s == "document") return s == "document";
  fail("--attention-mask '", s, "' is not one of causal, document");
}

const char* aux_loss_name(AuxLoss a) {
  switch (a) {
    case AuxLoss::none: return "none";
    case AuxLoss::micro: return "micro";
    case AuxLoss::seq: return "seq";
    case AuxLoss::global: return "global";
  }
  return "?";
}

int64_t MoeRouting::capacity(int64_t N, int64_t K, int64_t E) const {
  if (capacity_factor <= 0) return 0;
  // ceil in exact arithmetic where factor·N·K/E is an integer (1e-9 absorbs the rounding of the product)
  return std::max<int64_t>(1, int64_t(std::ceil(capacity_factor * double(N * K) / double(E) - 1e-9)));
}

bool ModelConfig::is_moe_layer(int64_t l) const {
  return is_moe() && (l + 1) % sparse_step == 0 && std::find(dense_layers.begin(), dense_layers.end(), l) == dense_layers.end();
}

// In O(mlp_only_layers), not O(layers): the planner asks for every stage of every layout.
int64_t ModelConfig::num_moe_layers(int64_t begin, int64_t end) const {
  if (!is_moe() || end <= begin) return 0;
  int64_t n = end / sparse_step - begin / sparse_step;  // l in [begin, end) with (l + 1) % step == 0
  std::vector<int64_t> dense(dense_layers);
  std::sort(dense.begin(), dense.end());
  dense.erase(std::unique(dense.begin(), dense.end()), dense.end());
  for (int64_t l : dense) n -= l >= begin && l < end && (l + 1) % sparse_step == 0;
  return n;
}

// Without walking the layers (Model sizes its buffers with it per layer): layer 0 is dense whenever
// sparse_step > 1, and mlp_only_layers holds only valid layer indices.
bool ModelConfig::has_dense_layers() const { return !is_moe() || sparse_step > 1 || !dense_layers.empty(); }

namespace {

// Fields that never change the math of training or inference.
const std::set<std::string> kBookkeeping = {
    "architectures", "torch_dtype", "transformers_version", "_name_or_path", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "id2label",
    "label2id", "task_specific_params", "output_router_logits", "tokenizer_class", "prefix",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "n_ctx", "pretraining_tp", "problem_type", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward", "bad_words_ids",
    "decoder_start_token_id", "finetuning_task", "max_length", "min_length", "do_sample",
    "num_beams", "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "early_stopping", "num_return_sequences", "sep_token_id",
    "cross_attention_hidden_size", "use_bfloat16", "pruned_heads", "is_encoder_decoder",
    "typical_p", "encoder_no_repeat_ngram_size", "diversity_penalty", "num_beam_groups",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "tf_legacy_loss", "mlp_bias_init", "use_return_dict", "attn_implementation",
};

class Reader {
 public:
  Reader(const nlohmann::json& j, std::string source) : j_(j), source_(std::move(source)) {}

  const nlohmann::json* find(const std::string& key) {
    used_.insert(key);
    auto it = j_.find(key);
    return (it == j_.end() || it->is_null()) ? nullptr : &*it;
  }
  int64_t integer(const std::string& key, int64_t dflt, bool required = false) {
    const nlohmann::json* v = find(key);
    if (!v) {
      ORIGAMI_CHECK(!required, source_, ": missing required field '", key, "'");
      return dflt;
    }
    ORIGAMI_CHECK(v->is_number_integer(), source_, ": field '", key, "' must be an integer, got ", v->dump());
    int64_t x = v->get<int64_t>();
    ORIGAMI_CHECK(x > 0, source_, ": field '", key, "' must be positive, got ", x);
    return x;
  }
  double number(const std::string& key, double dflt) {
    const nlohmann::json* v = find(key);
    if (!v) return dflt;
    ORIGAMI_CHECK(v->is_number(), source_, ": field '", key, "' must be a number, got ", v->dump());
    return v->get<double>();
  }
  bool boolean(const std::string& key, bool dflt) {
    const nlohmann::json* v = find(key);
    if (!v) return dflt;
    ORIGAMI_CHECK(v->is_boolean(), source_, ": field '", key, "' must be true or false, got ", v->dump());
    return v->get<bool>();
  }
  std::string string(const std::string& key, const std::string& dflt) {
    const nlohmann::json* v = find(key);
    if (!v) return dflt;
    ORIGAMI_CHECK(v->is_string(), source_, ": field '", key, "' must be a string, got ", v->dump());
    return v->get<std::string>();
  }
  // A math field origami does not implement: allowed only at its neutral value.
  void require_zero(const std::string& key, const char* why) {
    const nlohmann::json* v = find(key);
    if (v && !(v->is_number() && v->get<double>() == 0.0))
      fail(source_, ": field '", key, "' = ", v->dump(), " is not supported (", why, "); set it to 0");
  }
  void require_value(const std::string& key, const std::string& want, const char* why) {
    const nlohmann::json* v = find(key);
    if (v && !(v->is_string() && v->get<std::string>() == want))
      fail(source_, ": field '", key, "' = ", v->dump(), " is not supported (", why, "); only \"", want, "\" is");
  }
  void require_false(const std::string& key, const char* why) {
    const nlohmann::json* v = find(key);
    if (v && !(v->is_boolean() && !v->get<bool>()))
      fail(source_, ": field '", key, "' = ", v->dump(), " is not supported (", why, ")");
  }
  // Fields neither read nor known as bookkeeping: reported, not silently dropped.
  void warn_unknown() {
    for (auto& [key, val] : j_.items())
      if (!used_.count(key) && !kBookkeeping.count(key))
        std::fprintf(stderr, "warning: %s: field '%s' is not used by origami\n", source_.c_str(), key.c_str());
  }

 private:
  const nlohmann::json& j_;
  std::string source_;
  std::set<std::string> used_;
};

void parse_gpt2(Reader& r, ModelConfig& c, const std::string& src) {
  c.vocab_size = r.integer("vocab_size", 50257);
  c.hidden = r.integer("n_embd", 768);
  c.num_layers = r.integer("n_layer", 12);
  c.num_heads = r.integer("n_head", 12);
  c.num_kv_heads = c.num_heads;
  c.max_positions = r.integer("n_positions", 1024);
  c.ffn = r.integer("n_inner", 4 * c.hidden);
  c.norm_eps = r.number("layer_norm_epsilon", 1e-5);
  c.tied_embeddings = r.boolean("tie_word_embeddings", true);
  ORIGAMI_CHECK(c.tied_embeddings, src, ": gpt2 with tie_word_embeddings=false is not supported");
  r.require_value("activation_function", "gelu_new", "the MLP is GELU with the tanh approximation");
  for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
    r.require_zero(k, "dropout is not implemented");
  if (!r.boolean("scale_attn_weights", true))
    fail(src, ": field 'scale_attn_weights' = false is not supported");
  r.require_false("scale_attn_by_inverse_layer_idx", "per-layer attention scaling");
  r.require_false("reorder_and_upcast_attn", "mixed-precision attention reordering");
}

void parse_llama_like(Reader& r, ModelConfig& c, const std::string& src) {
  c.vocab_size = r.integer("vocab_size", 32000);
  c.hidden = r.integer("hidden_size", 4096);
  c.num_layers = r.integer("num_hidden_layers", 32);
  c.num_heads = r.integer("num_attention_heads", 32);
  c.num_kv_heads = r.integer("num_key_value_heads", c.num_heads);
  c.ffn = r.integer("intermediate_size", c.type == ModelType::mixtral ? 14336 : c.type == ModelType::qwen2_moe ? 5632 : 11008);
  c.max_positions = r.integer("max_position_embeddings", 2048);
  c.norm_eps = r.number("rms_norm_eps", 1e-6);
  c.rope_theta = r.number("rope_theta", 10000.0);
  c.tied_embeddings = r.boolean("tie_word_embeddings", false);
  if (const nlohmann::json* hd = r.find("head_dim")) {
    ORIGAMI_CHECK(hd->is_number_integer() && hd->get<int64_t>() > 0, src, ": field 'head_dim' must be a positive integer");
    c.head_dim = hd->get<int64_t>();
  }
  r.require_value("hidden_act", "silu", "the MLP is SwiGLU");
  r.require_zero("attention_dropout", "dropout is not implemented");
  if (c.type != ModelType::qwen2_moe) {  // qwen2_moe always has q/k/v biases (and no such fields)
    r.require_false("attention_bias", "projection biases are not implemented for llama/mixtral");
    r.require_false("mlp_bias", "projection biases are not implemented for llama/mixtral");
  }
  if (const nlohmann::json* v = r.find("rope_scaling"))
    fail(src, ": field 'rope_scaling' = ", v->dump(), " is not supported (only plain RoPE is); remove it or set it to null");
  if (c.type == ModelType::mixtral) {
    c.num_experts = r.integer("num_local_experts", 8);
    c.expert_ffn = c.ffn;
  }
  if (c.type == ModelType::qwen2_moe) {
    c.qkv_bias = true;
    c.num_experts = r.integer("num_experts", 60);
    c.expert_ffn = r.integer("moe_intermediate_size", 1408);
    c.shared_ffn = r.integer("shared_expert_intermediate_size", 5632);
    c.routing.norm_topk = r.boolean("norm_topk_prob", false);
    c.sparse_step = r.integer("decoder_sparse_step", 1);
    if (const nlohmann::json* v = r.find("mlp_only_layers")) {
      ORIGAMI_CHECK(v->is_array(), src, ": field 'mlp_only_layers' must be a list of layer indices, got ", v->dump());
      for (const nlohmann::json& l : *v) {
        ORIGAMI_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < c.num_layers, src,
                      ": field 'mlp_only_layers' holds ", l.dump(), ", not a layer index in [0, ", c.num_layers, ")");
        c.dense_layers.push_back(l.get<int64_t>());
      }
    }
    r.require_false("use_sliding_window", "sliding-window attention is not implemented");
    r.find("sliding_window"), r.find("max_window_layers");  // used only with use_sliding_window
  }
  if (c.is_moe()) {
    c.top_k = r.integer("num_experts_per_tok", 2);
    c.routing.aux_coef = r.number("router_aux_loss_coef", 0.001);
    c.routing.z_coef = r.number("router_z_loss_coef", 0.0);
    ORIGAMI_CHECK(c.top_k <= c.num_experts, src, ": num_experts_per_tok (", c.top_k,
                  ") must not exceed the number of experts (", c.num_experts, ")");
    ORIGAMI_CHECK(c.routing.aux_coef >= 0 && c.routing.z_coef >= 0, src, ": router loss coefficients must be >= 0");
    r.require_zero("router_jitter_noise", "router jitter is not implemented");
  }
  if (c.type == ModelType::mixtral) {
    // A sliding window at least as long as any sequence changes nothing.
    if (const nlohmann::json* v = r.find("sliding_window"))
      ORIGAMI_CHECK(v->is_number_integer() && v->get<int64_t>() >= c.max_positions, src,
                    ": field 'sliding_window' = ", v->dump(),
                    " is not supported (sliding-window attention is not implemented); set it to null");
  } else if (c.type == ModelType::llama) {
    if (const nlohmann::json* v = r.find("sliding_window"))
      fail(src, ": field 'sliding_window' = ", v->dump(), " is not supported for llama");
  }
}

}  // namespace

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& src) {
  ORIGAMI_CHECK(j.is_object(), src, ": a model config must be a JSON object");
  Reader r(j, src);
  ModelConfig c;
  c.raw = j;
  std::string mt = r.string("model_type", "");
  ORIGAMI_CHECK(!mt.empty(), src, ": missing 'model_type' (gpt2, llama, mixtral or qwen2_moe)");
  if (mt == "gpt2") c.type = ModelType::gpt2;
  else if (mt == "llama") c.type = ModelType::llama;
  else if (mt == "mixtral") c.type = ModelType::mixtral;
  else if (mt == "qwen2_moe") c.type = ModelType::qwen2_moe;
  else fail(src, ": model_type '", mt, "' is not supported (gpt2, llama, mixtral, qwen2_moe)");
  if (c.is_gpt2()) parse_gpt2(r, c, src);
  else parse_llama_like(r, c, src);
  if (c.head_dim == 0) {
    ORIGAMI_CHECK(c.hidden % c.num_heads == 0, src, ": the number of attention heads (", c.num_heads,
                  ") must divide the hidden size (", c.hidden, ")");
    c.head_dim = c.hidden / c.num_heads;
  }
  ORIGAMI_CHECK(c.num_heads % c.num_kv_heads == 0, src, ": num_key_value_heads (", c.num_kv_heads,
                ") must divide num_attention_heads (", c.num_heads, ")");
  ORIGAMI_CHECK(c.rope_theta > 0, src, ": rope_theta must be positive");
  ORIGAMI_CHECK(c.norm_eps > 0, src, ": the norm epsilon must be positive");
  if (!c.is_gpt2()) ORIGAMI_CHECK(c.head_dim % 2 == 0, src, ": RoPE needs an even head_dim, got ", c.head_dim);
  r.warn_unknown();
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  return parse_model_config(read_json_file(path, "model config"), path);
}

void save_model_config(const ModelConfig& cfg, const std::string& path) {
  write_file_atomically(path, cfg.raw.dump(2) + "\n");
}

}  // namespace origami
