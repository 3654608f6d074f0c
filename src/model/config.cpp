#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/io.h"
#include "core/json_fields.h"

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
  fail("--moe-router-score '", s, "' is not one of softmax, sigmoid");
}

AuxLoss parse_aux_loss(const std::string& s) {
  if (s == "none") return AuxLoss::none;
  if (s == "micro") return AuxLoss::micro;
  if (s == "seq") return AuxLoss::seq;
  if (s == "global") return AuxLoss::global;
  fail("--moe-aux-loss '", s, "' is not one of none, micro, seq, global");
}

DropPolicy parse_drop_policy(const std::string& s) {
  if (s == "probs") return DropPolicy::probs;
  if (s == "position") return DropPolicy::position;
  fail("--moe-drop-policy '", s, "' is not one of probs, position");
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
  // Megatron's get_capacity to the bit: ceil((N·K / E) · F) in doubles, so a factor of 1.1 over 50
  // assignments an expert keeps 56 (the product is 55.00000000000001), as a Megatron run would.
  // At most N, the most an expert can be sent (a token picks an expert once): a larger factor drops
  // nothing more and would only pad (and, as a double, could overflow the integer).
  const double cap = std::ceil(double(N * K) / double(E) * capacity_factor);
  return std::max<int64_t>(1, cap >= double(N) ? N : int64_t(cap));
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
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
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
    "begin_suppress_tokens", "tf_legacy_loss", "mlp_bias_init", "use_return_dict", "attn_implementation", "dtype",
};

// The config's fields, read as JsonFields (core/json_fields.h). It remembers which were read, so
// that fields neither read nor known as bookkeeping are reported.
class Reader {
 public:
  Reader(const nlohmann::json& j, const std::string& source) : root_(j, source) {}

  JsonField operator[](const std::string& key) {
    used_.insert(key);
    return root_[key];
  }
  const std::string& source() const { return root_.file(); }

  // A math field origami does not implement: allowed only at its neutral value.
  void require_zero(const std::string& key, const char* why) {
    const JsonField f = (*this)[key];
    if (f.present() && !(f.json().is_number() && f.json().get<double>() == 0.0))
      fail(source(), ": field '", key, "' = ", f.got(), " is not supported (", why, "); set it to 0");
  }
  void require_value(const std::string& key, const std::string& want, const char* why) {
    const JsonField f = (*this)[key];
    if (f.present() && !(f.json().is_string() && f.json().get<std::string>() == want))
      fail(source(), ": field '", key, "' = ", f.got(), " is not supported (", why, "); only \"", want, "\" is");
  }
  void require_false(const std::string& key, const char* why) {
    const JsonField f = (*this)[key];
    if (f.present() && !(f.json().is_boolean() && !f.json().get<bool>()))
      fail(source(), ": field '", key, "' = ", f.got(), " is not supported (", why, ")");
  }
  // Fields neither read nor known as bookkeeping: reported, not silently dropped.
  void warn_unknown() {
    root_.for_each_member([&](const std::string& key, const JsonField&) {
      if (!used_.count(key) && !kBookkeeping.count(key))
        std::fprintf(stderr, "warning: %s: field '%s' is not used by origami\n", source().c_str(), key.c_str());
    });
  }

 private:
  JsonField root_;
  std::set<std::string> used_;
};

// A model dimension with its default: a positive integer up to its limit (ModelLimits, or another
// field: `bound` names it). The default is held to the limit too: a field left out must not take a
// value the file's other fields rule out (2 experts a token of 1 expert).
int64_t dimension(Reader& r, const std::string& key, int64_t dflt, int64_t limit, const char* bound = nullptr) {
  const JsonField f = r[key];
  ORIGAMI_CHECK(f.present() || dflt <= limit, r.source(), ": field '", key, "' is not given, and its default, ", dflt,
                ", exceeds ", bound ? cat(bound, " (", limit, ")") : cat("the limit ", limit), ": give it");
  return f.integer_or(dflt, 1, limit);
}

void parse_gpt2(Reader& r, ModelConfig& c, const std::string& src) {
  c.vocab_size = dimension(r, "vocab_size", 50257, ModelLimits::vocab);
  c.hidden = dimension(r, "n_embd", 768, ModelLimits::hidden);
  c.num_layers = dimension(r, "n_layer", 12, ModelLimits::layers);
  c.num_heads = dimension(r, "n_head", 12, ModelLimits::heads);
  c.num_kv_heads = c.num_heads;
  c.max_positions = dimension(r, "n_positions", 1024, ModelLimits::positions);
  c.ffn = dimension(r, "n_inner", 4 * c.hidden, ModelLimits::ffn);
  c.norm_eps = r["layer_norm_epsilon"].number_or(1e-5, NumberRange::positive());
  c.tied_embeddings = r["tie_word_embeddings"].boolean_or(true);
  ORIGAMI_CHECK(c.tied_embeddings, src, ": gpt2 with tie_word_embeddings=false is not supported");
  r.require_value("activation_function", "gelu_new", "the MLP is GELU with the tanh approximation");
  for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
    r.require_zero(k, "dropout is not implemented");
  if (!r["scale_attn_weights"].boolean_or(true))
    fail(src, ": field 'scale_attn_weights' = false is not supported");
  r.require_false("scale_attn_by_inverse_layer_idx", "per-layer attention scaling");
  r.require_false("reorder_and_upcast_attn", "mixed-precision attention reordering");
}

// A field a config leaves out takes its Hugging Face default for the model type (LlamaConfig,
// MixtralConfig, Qwen2MoeConfig), so that the exported config means the same model to transformers.
struct LlamaLikeDefaults {
  int64_t vocab, hidden, layers, heads, kv_heads, ffn, positions;  // kv_heads 0: as many as the heads
  double norm_eps, rope_theta;
};

LlamaLikeDefaults llama_like_defaults(ModelType t) {
  if (t == ModelType::mixtral) return {32000, 4096, 32, 32, 8, 14336, 131072, 1e-5, 1e6};
  if (t == ModelType::qwen2_moe) return {151936, 2048, 24, 16, 16, 5632, 32768, 1e-6, 10000.0};
  return {32000, 4096, 32, 32, 0, 11008, 2048, 1e-6, 10000.0};
}

void parse_llama_like(Reader& r, ModelConfig& c, const std::string& src) {
  const LlamaLikeDefaults d = llama_like_defaults(c.type);
  c.vocab_size = dimension(r, "vocab_size", d.vocab, ModelLimits::vocab);
  c.hidden = dimension(r, "hidden_size", d.hidden, ModelLimits::hidden);
  c.num_layers = dimension(r, "num_hidden_layers", d.layers, ModelLimits::layers);
  c.num_heads = dimension(r, "num_attention_heads", d.heads, ModelLimits::heads);
  c.num_kv_heads = dimension(r, "num_key_value_heads", d.kv_heads > 0 ? d.kv_heads : c.num_heads, c.num_heads,
                             "num_attention_heads");
  c.ffn = dimension(r, "intermediate_size", d.ffn, ModelLimits::ffn);
  c.max_positions = dimension(r, "max_position_embeddings", d.positions, ModelLimits::positions);
  c.norm_eps = r["rms_norm_eps"].number_or(d.norm_eps, NumberRange::positive());
  c.rope_theta = r["rope_theta"].number_or(d.rope_theta, NumberRange::positive());
  c.tied_embeddings = r["tie_word_embeddings"].boolean_or(false);
  c.head_dim = r["head_dim"].integer_or(0, 1, ModelLimits::hidden);
  r.require_value("hidden_act", "silu", "the MLP is SwiGLU");
  r.require_zero("attention_dropout", "dropout is not implemented");
  if (c.type != ModelType::qwen2_moe) {  // qwen2_moe always has q/k/v biases (and no such fields)
    r.require_false("attention_bias", "projection biases are not implemented for llama/mixtral");
    r.require_false("mlp_bias", "projection biases are not implemented for llama/mixtral");
  }
  if (const JsonField v = r["rope_scaling"]; v.present())
    fail(src, ": field 'rope_scaling' = ", v.got(), " is not supported (only plain RoPE is); remove it or set it to null");
  if (c.type == ModelType::mixtral) {
    c.num_experts = dimension(r, "num_local_experts", 8, ModelLimits::experts);
    c.expert_ffn = c.ffn;
  }
  if (c.type == ModelType::qwen2_moe) {
    c.qkv_bias = true;
    c.num_experts = dimension(r, "num_experts", 60, ModelLimits::experts);
    c.expert_ffn = dimension(r, "moe_intermediate_size", 1408, ModelLimits::ffn);
    c.shared_ffn = dimension(r, "shared_expert_intermediate_size", 5632, ModelLimits::ffn);
    c.routing.norm_topk = r["norm_topk_prob"].boolean_or(false);
    c.sparse_step = dimension(r, "decoder_sparse_step", 1, ModelLimits::layers);
    if (const JsonField v = r["mlp_only_layers"]; v.present()) c.dense_layers = v.integers(0, c.num_layers - 1);
    r.require_false("use_sliding_window", "sliding-window attention is not implemented");
    r["sliding_window"], r["max_window_layers"];  // used only with use_sliding_window
  }
  if (c.is_moe()) {
    // Hugging Face's defaults: Mixtral routes each token to 2 experts, Qwen2-MoE to 4
    c.top_k = dimension(r, "num_experts_per_tok", c.type == ModelType::qwen2_moe ? 4 : 2, c.num_experts,
                        "the number of experts");
    c.routing.aux_coef = r["router_aux_loss_coef"].number_or(0.001, NumberRange::at_least(0));
    c.routing.z_coef = r["router_z_loss_coef"].number_or(0.0, NumberRange::at_least(0));
    r.require_zero("router_jitter_noise", "router jitter is not implemented");
  }
  if (c.type == ModelType::mixtral) {
    // A sliding window at least as long as any sequence changes nothing.
    if (const JsonField v = r["sliding_window"]; v.present())
      ORIGAMI_CHECK(v.json().is_number_integer() && v.json().get<int64_t>() >= c.max_positions, src,
                    ": field 'sliding_window' = ", v.got(),
                    " is not supported (sliding-window attention is not implemented); set it to null");
  } else if (c.type == ModelType::llama) {
    if (const JsonField v = r["sliding_window"]; v.present())
      fail(src, ": field 'sliding_window' = ", v.got(), " is not supported for llama");
  }
}

}  // namespace

nlohmann::json ModelConfig::model_math_fields(const nlohmann::json& raw) {
  nlohmann::json out = nlohmann::json::object();
  if (!raw.is_object()) return out;
  for (const auto& [key, value] : raw.items())
    if ((!kBookkeeping.count(key) || key == "model_type") && !value.is_null()) out[key] = value;  // (null: absent)
  return out;
}

bool plan_neutral_field(const std::string& key) {
  static const std::set<std::string> neutral = {"initializer_range",    "layer_norm_epsilon",  "rms_norm_eps",
                                                "rope_theta",           "router_aux_loss_coef", "router_z_loss_coef",
                                                "norm_topk_prob"};
  return neutral.count(key) > 0;
}

namespace {

// eos_token_id is bookkeeping, but --attention-mask document may take the end-of-document token
// from it (TrainOptions): absent, null, an integer or a list of integers, each a 32-bit id.
void check_eos_token_id(Reader& r) {
  const JsonField f = r["eos_token_id"];
  if (f.present() && f.json().is_array()) f.integers(INT32_MIN, INT32_MAX);
  else if (f.present()) f.integer(INT32_MIN, INT32_MAX);
}

// The values the fields a llama-like config left out took, written into the config it keeps (what a
// checkpoint saves and an export writes): they then mean the same model to a reader with other defaults.
void record_defaults(ModelConfig& c) {
  if (c.is_gpt2()) return;
  auto put = [&](const char* key, const nlohmann::json& value) {
    if (!c.raw.contains(key) || c.raw[key].is_null()) c.raw[key] = value;
  };
  put("num_key_value_heads", c.num_kv_heads);
  put("rms_norm_eps", c.norm_eps);
  put("rope_theta", c.rope_theta);
  put("max_position_embeddings", c.max_positions);
  if (c.is_moe()) put("num_experts_per_tok", c.top_k);
}

}  // namespace

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& src) {
  ORIGAMI_CHECK(j.is_object(), src, ": a model config must be a JSON object");
  Reader r(j, src);
  ModelConfig c;
  c.raw = j;
  c.type = ModelType(r["model_type"].one_of({"gpt2", "llama", "mixtral", "qwen2_moe"}));  // ModelType's order
  if (c.is_gpt2()) parse_gpt2(r, c, src);
  else parse_llama_like(r, c, src);
  check_eos_token_id(r);
  // Hugging Face's default for every model type; a fresh run's weights are drawn with it (Params::init).
  c.init_std = r["initializer_range"].number_or(0.02, NumberRange::between(1e-12, 1e3));
  if (c.head_dim == 0) {
    ORIGAMI_CHECK(c.hidden % c.num_heads == 0, src, ": the number of attention heads (", c.num_heads,
                  ") must divide the hidden size (", c.hidden, ")");
    c.head_dim = c.hidden / c.num_heads;
  }
  ORIGAMI_CHECK(c.num_heads % c.num_kv_heads == 0, src, ": num_key_value_heads (", c.num_kv_heads,
                ") must divide num_attention_heads (", c.num_heads, ")");
  if (!c.is_gpt2()) ORIGAMI_CHECK(c.head_dim % 2 == 0, src, ": RoPE needs an even head_dim, got ", c.head_dim);
  // Every tensor is an entry of the parameter table (model/params.h), built whole before a run: at
  // most 16 per layer besides the experts' 3 each (an upper bound for every model type).
  const int64_t tensors = c.num_layers * (16 + 3 * c.num_experts);  // within 10^4 x 2^18: no overflow
  ORIGAMI_CHECK(tensors <= ModelLimits::tensors, src, ": num_hidden_layers ", c.num_layers,
                c.is_moe() ? cat(" x (16 + 3 x ", c.num_experts, " experts)") : std::string(" x 16"), " = ", tensors,
                " tensors is more than origami's parameter table holds (", ModelLimits::tensors, ")");
  r.warn_unknown();
  record_defaults(c);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  return parse_model_config(read_json_file(path, "model config"), path);
}

void save_model_config(const ModelConfig& cfg, const std::string& path) {
  write_file_atomically(path, cfg.raw.dump(2) + "\n");
}

}  // namespace origami
