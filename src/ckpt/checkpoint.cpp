#include "ckpt/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "ckpt/safetensors.h"
#include "core/error.h"
#include "core/files.h"
#include "core/io.h"

namespace origami {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Tensors Hugging Face GPT-2 files may hold that are not parameters.
bool ignorable(const ModelConfig& cfg, const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (cfg.is_gpt2()) return ends_with("attn.bias") || ends_with("attn.masked_bias") || name == "lm_head.weight";
  return cfg.tied_embeddings && name == "lm_head.weight";
}

std::string canonical_name(const ModelConfig& cfg, const std::string& name) {
  const std::string prefix = "transformer.";
  if (cfg.is_gpt2() && name.rfind(prefix, 0) == 0) return name.substr(prefix.size());
  return name;
}

std::vector<TensorWrite> param_tensors(const Params& params, const float* base, const std::string& prefix) {
  std::vector<TensorWrite> out;
  for (size_t i = 0; i < params.table().size(); ++i) {
    const ParamSpec& p = params.table()[i];
    out.push_back({prefix + p.name, p.shape, base + params.offset(i)});
  }
  return out;
}

}  // namespace

namespace {

// Reads one global tensor and copies this rank's shard of it into dst (the tensor's place in a flat buffer).
void read_shard(const SafetensorsFile& f, const TensorInfo& t, const ParamSpec& p, const ParamLayout& lay, float* dst,
                std::vector<float>& tmp) {
  if (p.split.dim < 0 || lay.tp == 1) {
    f.read_f32(t, dst);
    return;
  }
  tmp.resize(size_t(p.numel()));
  f.read_f32(t, tmp.data());
  p.for_each_run(lay.tp, lay.tp_rank, [&](int64_t local, int64_t global, int64_t n) {
    std::copy_n(tmp.data() + global, n, dst + local);
  });
}

}  // namespace

void load_weights(const std::string& path, const ModelConfig& cfg, Params& params) {
  SafetensorsFile f = SafetensorsFile::open(path);
  std::set<std::string> loaded, model_names;
  for (const ParamSpec& p : make_param_table(cfg)) model_names.insert(p.name);
  std::vector<float> tmp;
  for (const TensorInfo& t : f.tensors()) {
    const std::string name = canonical_name(cfg, t.name);
    const int64_t i = params.index(name);
    if (i < 0) {
      if (ignorable(cfg, name) || model_names.count(name)) continue;  // another pipeline stage's
      fail("'", path, "': tensor '", t.name, "' is not a parameter of this ", cfg.model_type(),
           " model (check that the file matches the config)");
    }
    const ParamSpec& p = params.table()[size_t(i)];
    ORIGAMI_CHECK(t.shape == p.shape, "'", path, "': tensor '", t.name, "' has shape ", shape_str(t.shape),
                  " but the config needs ", shape_str(p.shape));
    read_shard(f, t, p, params.layout(), params.data() + params.offset(size_t(i)), tmp);
    loaded.insert(name);
  }
  for (const ParamSpec& p : params.table())
    ORIGAMI_CHECK(loaded.count(p.name), "'", path, "': tensor '", p.name, "' (shape ", shape_str(p.shape),
                  ") is missing");
}

bool is_checkpoint_dir(const std::string& init_from) {
  return !init_from.empty() && std::filesystem::is_directory(init_from);
}

std::string weights_file(const std::string& init_from) {
  return is_checkpoint_dir(init_from) ? init_from + "/model.safetensors" : init_from;
}

std::string checkpoint_config(const std::string& init_from) {
  return is_checkpoint_dir(init_from) ? init_from + "/config.json" : "";
}

void save_weights(const std::string& path, const Params& params) {
  write_safetensors(path, param_tensors(params, params.data(), ""), {{"format", "pt"}});
}

void save_checkpoint(const std::string& dir, const ModelConfig& cfg, const Params& global, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& state, const std::string& tokenizer_path) {
  ORIGAMI_ASSERT(global.layout().tp == 1);
  make_dirs(dir);
  save_weights(dir + "/model.safetensors", global);
  save_model_config(cfg, dir + "/config.json");
  auto tensors = param_tensors(global, exp_avg, "exp_avg.");
  auto sq = param_tensors(global, exp_avg_sq, "exp_avg_sq.");
  tensors.insert(tensors.end(), sq.begin(), sq.end());
  write_safetensors(dir + "/optimizer.safetensors", tensors);
  if (!tokenizer_path.empty()) write_file_atomically(dir + "/tokenizer.json", read_file_bytes(tokenizer_path));
  nlohmann::json js = {{"step", state.step}, {"adam_steps", state.adam_steps}, {"options", state.options}};
  if (!state.router_bias.empty()) js["router_bias"] = state.router_bias;
  write_file_atomically(dir + "/trainer_state.json", js.dump(2) + "\n");
}

TrainerState load_optimizer_state(const std::string& dir, const Params& params, float* m_flat, float* v_flat) {
  const std::string opt_path = dir + "/optimizer.safetensors";
  SafetensorsFile f = SafetensorsFile::open(opt_path);
  std::vector<float> tmp;
  for (size_t i = 0; i < params.table().size(); ++i) {
    const ParamSpec& p = params.table()[i];
    for (auto [prefix, buf] : {std::pair{"exp_avg.", m_flat}, std::pair{"exp_avg_sq.", v_flat}}) {
      const TensorInfo& t = f.at(prefix + p.name);
      ORIGAMI_CHECK(t.shape == p.shape, "'", opt_path, "': tensor '", t.name, "' has shape ", shape_str(t.shape),
                    " but the model needs ", shape_str(p.shape));
      read_shard(f, t, p, params.layout(), buf + params.offset(i), tmp);
    }
  }
  nlohmann::json js = read_json_file(dir + "/trainer_state.json", "trainer state");
  TrainerState st;
  ORIGAMI_CHECK(js.contains("step") && js["step"].is_number_integer() && js.contains("adam_steps"),
                "'", dir, "/trainer_state.json': needs integer 'step' and 'adam_steps'");
  st.step = js["step"].get<int64_t>();
  st.adam_steps = js["adam_steps"].get<int64_t>();
  if (js.contains("options")) st.options = js["options"];
  if (js.contains("router_bias")) st.router_bias = js["router_bias"].get<std::vector<std::vector<float>>>();
  return st;
}

int64_t save_buffer_bytes(int64_t P, int64_t S, int64_t G, int64_t other_stage, int tp, int pp, bool stage_root,
                          bool rank0) {
  // At the peak (the third gather): every rank holds exp_avg and exp_avg_sq flattened (2·P); a stage
  // root its stage's Params and the gathered buffer (2·S) and, under TP, one received shard (P);
  // rank 0 the whole model's Params, two gathered results and the one being built (4·G) and, under
  // PP, one received stage.
  int64_t floats = 2 * P;
  if (stage_root) floats += 2 * S + (tp > 1 ? P : 0);
  if (rank0) floats += 4 * G + (pp > 1 ? other_stage : 0);
  return 4 * floats;
}

std::vector<float> gather_tp_shards(Comm& tp, const Params& params, const float* flat, const Params* global_ptr) {
  const int64_t n = params.size();
  if (tp.rank() != 0) {
    tp.send(flat, n, DType::f32, 0, 0);
    return {};
  }
  ORIGAMI_ASSERT(global_ptr != nullptr);
  const Params& global = *global_ptr;
  std::vector<float> out(size_t(global.size()), 0.f), shard;
  for (int r = 0; r < tp.size(); ++r) {
    const float* src = flat;
    if (r > 0) {
      shard.resize(size_t(n));
      tp.recv(shard.data(), n, DType::f32, r, 0);
      src = shard.data();
    }
    for (size_t i = 0; i < params.table().size(); ++i) {
      const ParamSpec& p = params.table()[i];
      if (p.split.dim < 0 && r > 0) continue;  // replicated: rank 0's copy
      p.for_each_run(tp.size(), r, [&](int64_t local, int64_t g, int64_t len) {
        std::copy_n(src + params.offset(i) + local, len, out.data() + global.offset(i) + g);
      });
    }
  }
  return out;
}

std::vector<float> gather_pp_stages(Comm& pp, const std::vector<float>& stage_buf,
                                    const std::vector<std::vector<ParamSpec>>& tables, const Params* global) {
  if (pp.rank() != 0) {
    pp.send(stage_buf.data(), int64_t(stage_buf.size()), DType::f32, 0, 0);
    return {};
  }
  ORIGAMI_ASSERT(global != nullptr);
  std::vector<float> out(size_t(global->size()), 0.f), buf;
  std::set<std::string> placed;
  for (int s = 0; s < pp.size(); ++s) {
    int64_t n = 0;  // the one-rank layout of a stage's table: tensors back to back, in table order
    for (const ParamSpec& p : tables[size_t(s)]) n += p.numel();
    if (s > 0) {
      buf.resize(size_t(n));
      pp.recv(buf.data(), n, DType::f32, s, 0);
    }
    const float* src = s == 0 ? stage_buf.data() : buf.data();
    ORIGAMI_ASSERT(s > 0 || int64_t(stage_buf.size()) == n);
    int64_t at = 0;
    for (const ParamSpec& p : tables[size_t(s)]) {
      if (placed.insert(p.name).second)
        std::copy_n(src + at, p.numel(), out.data() + global->offset(size_t(global->index(p.name))));
      at += p.numel();
    }
  }
  // Every tensor of the result came from some rank (no expert or stage silently missing).
  ORIGAMI_ASSERT(placed.size() == global->table().size());
  return out;
}

}  // namespace origami
