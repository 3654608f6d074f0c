#include "ckpt/checkpoint.h"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/checksum.h"
#include "core/error.h"
#include "core/files.h"
#include "core/progress.h"
#include "core/io.h"
#include "data/tokenizer.h"

namespace origami {

namespace fs = std::filesystem;

const char* state_kind_name(StateKind k) {
  switch (k) {
    case StateKind::weight: return "weight";
    case StateKind::exp_avg: return "exp_avg";
    case StateKind::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

std::vector<ShardRun> shard_runs(const ParamSpec& spec, int tp, int tp_rank, int64_t begin, int64_t end) {
  std::vector<ShardRun> out;
  spec.for_each_run(tp, tp_rank, [&](int64_t local, int64_t global, int64_t n) {
    const int64_t a = std::max(local, begin), b = std::min(local + n, end);
    if (a < b) out.push_back({a - begin, global + (a - local), b - a});
  });
  return out;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

namespace {

// Tensors Hugging Face files may hold that are not parameters: GPT-2's attention masks, RoPE's
// inverse frequencies (older llama-family conversions save the buffer), a tied lm_head.
bool ignorable(const ModelConfig& cfg, const std::string& name) {
  if (cfg.is_gpt2()) return name.ends_with("attn.bias") || name.ends_with("attn.masked_bias") || name == "lm_head.weight";
  return name.ends_with("rotary_emb.inv_freq") || (cfg.tied_embeddings && name == "lm_head.weight");
}

std::string canonical_name(const ModelConfig& cfg, const std::string& name) {
  const std::string prefix = "transformer.";
  if (cfg.is_gpt2() && name.rfind(prefix, 0) == 0) return name.substr(prefix.size());
  return name;
}

bool is_step_dir(const fs::path& p) { return fs::exists(p / "metadata.json"); }

}  // namespace

std::map<int64_t, std::string> committed_steps(const std::string& dir) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    long long n = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "step-%lld%c", &n, &tail) == 1 && is_step_dir(it->path())) out[n] = it->path().string();
  }
  ORIGAMI_CHECK(!ec, "cannot list checkpoint directory '", dir, "': ", ec.message());
  return out;
}

namespace {

// What `path` names, resolved to a file or a directory holding the checkpoint's files; `fallback`, where
// given, says why a --save directory's newest step was taken instead of the one its latest names.
fs::path resolve(const std::string& path, std::string* fallback = nullptr) {
  const fs::path p(path);
  ORIGAMI_CHECK(fs::exists(p), "checkpoint '", path, "' does not exist");
  // (a rank's file of a sharded step holds some pieces of some tensors: not a checkpoint of its own)
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  ORIGAMI_CHECK(!fs::is_regular_file(p) || !is_step_dir(dir), "'", path, "' is a file of the sharded checkpoint '",
                dir.string(), "', not a checkpoint of its own: give that directory");
  if (fs::is_regular_file(p) || is_step_dir(p)) return p;
  ORIGAMI_CHECK(fs::is_directory(p), "checkpoint '", path, "' is neither a file nor a directory");
  std::string latest;
  if (fs::exists(p / "latest")) {
    latest = read_file_bytes((p / "latest").string());
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
    if (is_step_dir(p / latest)) return p / latest;
    // `latest` names a step removed by hand: fall back to the newest committed step.
  }
  const auto steps = committed_steps(p.string());
  if (!steps.empty() && fallback && fs::exists(p / "latest"))
    *fallback = cat("its latest names '", latest, "', which is not a committed step (no ", latest,
                    "/metadata.json): opening the newest committed step, ", fs::path(steps.rbegin()->second).filename().string());
  if (!steps.empty()) return fs::path(steps.rbegin()->second);
  if (fs::exists(p / "model.safetensors") || fs::exists(p / "model.safetensors.index.json")) return p;
  if (fs::exists(p / "latest"))
    fail("'", path, "' holds no checkpoint: its latest names '", latest, "', which is not a committed step (no ",
         latest, "/metadata.json), and no other step-N is");
  fail("'", path, "' holds no checkpoint: no latest, no step-N/metadata.json, no model.safetensors and no "
       "model.safetensors.index.json");
}

void copy_elements(const SafetensorsFile& f, const TensorInfo& t, int64_t at, int64_t n, float* dst) {
  const std::byte* p = f.bytes(t).data();
  if (t.dtype == "F32") {
    std::memcpy(dst, p + 4 * at, size_t(n) * 4);
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    const bool bf = t.dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * (at + i), 2);
      dst[i] = bf ? bf16_to_f32(h) : f16_to_f32(h);
    }
  } else if (t.dtype == "F64") {
    for (int64_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, p + 8 * (at + i), 8);
      dst[i] = float(v);
    }
  } else {
    fail("'", f.path(), "': tensor '", t.name, "' has dtype ", t.dtype, ", which cannot be read as float (F32, F16, "
         "BF16 or F64)");
  }
}

}  // namespace

std::string Checkpoint::resolved(const std::string& path) { return resolve(path).string(); }

bool Checkpoint::committed_in(const std::string& dir) {
  return fs::is_directory(dir) && (fs::exists(fs::path(dir) / "latest") || !committed_steps(dir).empty());
}

bool Checkpoint::is_checkpoint(const std::string& path) {
  const fs::path p(path);
  return fs::is_regular_file(p) || is_step_dir(p) || fs::exists(p / "model.safetensors") ||
         fs::exists(p / "model.safetensors.index.json");
}

std::string Checkpoint::config_of(const std::string& path) {
  const fs::path p = resolve(path);
  return fs::is_directory(p) && fs::exists(p / "config.json") ? (p / "config.json").string() : "";
}

nlohmann::json Checkpoint::trainer_state_of(const std::string& path) {
  const fs::path state = resolve(path) / "trainer_state.json";
  return fs::is_regular_file(state) ? read_json_file(state.string(), "trainer state") : nlohmann::json();
}

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ck;
  const fs::path p = resolve(path, &ck.fallback_);
  ck.path_ = p.string();
  if (fs::is_regular_file(p)) {
    ck.add_file_tensors(ck.path_, "", StateKind::weight);
    return ck;
  }
  const std::string state_path = (p / "trainer_state.json").string();
  const bool has_state = fs::exists(state_path);
  if (!is_step_dir(p)) {  // single-file origami checkpoint or Hugging Face directory
    if (fs::exists(p / "model.safetensors.index.json")) ck.read_index((p / "model.safetensors.index.json").string());
    else ck.add_file_tensors((p / "model.safetensors").string(), "", StateKind::weight);
    if (fs::exists(p / "optimizer.safetensors")) {
      ck.add_file_tensors((p / "optimizer.safetensors").string(), "exp_avg.", StateKind::exp_avg);
      ck.add_file_tensors((p / "optimizer.safetensors").string(), "exp_avg_sq.", StateKind::exp_avg_sq);
      ck.has_optimizer_ = has_state;
    }
    if (has_state) ck.read_trainer_state(state_path);
    return ck;
  }
  ck.read_metadata((p / "metadata.json").string());
  ck.has_optimizer_ = true;
  ORIGAMI_CHECK(has_state, "checkpoint '", ck.path_, "' has no trainer_state.json");
  ck.read_trainer_state(state_path);
  return ck;
}

// A checkpoint with optimizer state is origami's own: a run resumes from its step, AdamW's step count
// and the routers' biases, and compares its options; `generate` takes the trained sequence length from
// them. A Hugging Face directory may hold the Trainer's file of that name, of which only a "step" (that
// `ckpt info` shows) and origami's options are read.
void Checkpoint::read_trainer_state(const std::string& state_path) {
  trainer_state_ = read_json_file(state_path, "trainer state");
  const JsonField st(trainer_state_, state_path);
  st["options"]["seq_len"].integer_or(0, 1, JsonField::kNoLimit);  // the run's options: generate's context
  if (!has_optimizer_) {
    state_.step = st["step"].integer_or(0, 0, JsonField::kNoLimit);
    return;
  }
  state_.step = st["step"].integer(0, JsonField::kNoLimit);
  state_.adam_steps = st["adam_steps"].integer(0, JsonField::kNoLimit);
  state_.skipped_steps = st["skipped_steps"].integer_or(0, 0, state_.step);
  state_.last_update = st["last_update"].integer_or(state_.step, 0, state_.step);
  if (st["recent_losses"].present())
    st["recent_losses"].for_each_element([&](const JsonField& loss) { state_.recent_losses.push_back(loss.number()); });
  // One row per layer, each of the same length (the experts).
  const NumberRange a_float = NumberRange::between(-FLT_MAX, FLT_MAX);
  if (st["router_bias"].present())
    st["router_bias"].for_each_element([&](const JsonField& row) {
      const size_t n = state_.router_bias.empty() ? row.array() : row.array(state_.router_bias[0].size(),
                                                                            state_.router_bias[0].size());
      std::vector<float>& biases = state_.router_bias.emplace_back();
      biases.reserve(n);
      row.for_each_element([&](const JsonField& b) { biases.push_back(float(b.number(a_float))); });
    });
  if (st["data_sizes"].present())
    st["data_sizes"].for_each_element([&](const JsonField& d) {
      state_.data_sizes.emplace_back(d["tokens"].integer(0, JsonField::kNoLimit), d["documents"].integer(0, JsonField::kNoLimit));
    });
  if (st["step_sizes"].present()) {  // [[first step, size], ...]
    std::vector<StepSizes::Stretch> stretches;
    st["step_sizes"].for_each_element([&](const JsonField& r) {
      r.array(2, 2);
      stretches.emplace_back(r[0].integer(0, state_.step), r[1].integer(1, JsonField::kNoLimit));
    });
    state_.step_sizes.emplace(std::move(stretches), state_path.c_str());
  }
  // (other keys are left alone: choices a later version may keep, which this one does not make)
  const JsonField kernels = st["kernels"];
  if (kernels.present()) kernels.object();
  const auto kept = [&](const char* key, const TrainerState::Names& values) {
    return kernels[key].present() ? std::optional<int>(int(kernels[key].one_of({values[0], values[1]}))) : std::nullopt;
  };
  state_.attention_tiles = kept("attention_tiles", TrainerState::kAttentionTiles);
  state_.bf16_tiles = kept("bf16_tiles", TrainerState::kBf16Tiles);
  state_.bf16_small_gemms = kept("bf16_small_gemms", TrainerState::kBf16SmallGemms);
  if (kernels.present() && kernels["bf16_gemms"].present())  // [[{trans, mnk, ld, alpha, beta, path}, ...], ...]
    kernels["bf16_gemms"].for_each_element([&](const JsonField& rank) {
      std::vector<KeptBf16Gemm>& list = state_.bf16_gemms.emplace_back();
      rank.for_each_element([&](const JsonField& g) {
        g.only_keys({"trans", "mnk", "ld", "alpha", "beta", "path", "bias"});
        const size_t t = g["trans"].one_of({"nn", "nt", "tn", "tt"});
        g["mnk"].array(3, 3);
        g["ld"].array(3, 3);
        const std::vector<int64_t> mnk = g["mnk"].integers(1, JsonField::kNoLimit), ld = g["ld"].integers(1, JsonField::kNoLimit);
        const auto& paths = TrainerState::kBf16GemmPaths;
        list.push_back({t >= 2, t % 2 == 1, mnk[0], mnk[1], mnk[2], ld[0], ld[1], ld[2], float(g["alpha"].number()),
                        float(g["beta"].number()), KeptBf16Path(g["path"].one_of({paths[0], paths[1], paths[2]})),
                        g["bias"].boolean_or(false)});
      });
    });
}

// trainer_state.json's options[key], or null where the checkpoint has none.
const nlohmann::json* Checkpoint::trained(const std::string& key) const {
  if (!trainer_state_.is_object() || !trainer_state_.contains("options")) return nullptr;
  const nlohmann::json& o = trainer_state_["options"];
  return o.is_object() && o.contains(key) ? &o[key] : nullptr;
}

std::string Checkpoint::trained_option(const std::string& key, const std::string& fallback) const {
  const nlohmann::json* v = trained(key);
  return v && v->is_string() ? v->get<std::string>() : fallback;
}

int64_t Checkpoint::trained_integer(const std::string& key, int64_t fallback) const {
  const nlohmann::json* v = trained(key);
  return v && v->is_number_integer() ? v->get<int64_t>() : fallback;
}

void Checkpoint::read_index(const std::string& index_path) {
  const nlohmann::json idx = read_json_file(index_path, "safetensors index");
  std::set<std::string> shards;
  JsonField(idx, index_path)["weight_map"].for_each_member(
      [&](const std::string&, const JsonField& file) { shards.insert(file.string()); });
  const fs::path dir = fs::path(index_path).parent_path();
  for (const std::string& s : shards) add_file_tensors((dir / s).string(), "", StateKind::weight);
}

// metadata.json, as checkpoint_writer.cpp writes it; `ckpt info` prints its layout, files and tensors.
void Checkpoint::read_metadata(const std::string& meta_path) {
  metadata_ = read_json_file(meta_path, "checkpoint metadata");
  const JsonField m(metadata_, meta_path);
  ORIGAMI_CHECK(m["format"].string_or("") == "origami-checkpoint", "'", meta_path,
                "' is not an origami checkpoint's metadata");
  const JsonField layout = m["layout"];
  layout.object();
  layout["world"].integer_or(0, 1, INT_MAX);
  layout["description"].string_or("");
  const fs::path dir = fs::path(meta_path).parent_path();
  m["files"].for_each_element([&](const JsonField& f) {
    files_.push_back({(dir / f["name"].string()).string(), f["bytes"].integer(0, JsonField::kNoLimit),
                      f["checksum"].string(), nullptr});
  });
  m["tensors"].for_each_member([&](const std::string& name, const JsonField& t) {
    Entry e;
    e.shape = t["shape"].integers(0, JsonField::kNoLimit);
    ORIGAMI_CHECK(t["dtype"].string() == "F32", "'", meta_path, "': tensor '", name, "' has dtype ", t["dtype"].got(),
                  " (F32 expected)");
    const JsonField split = t["split"];
    e.split.dim = int(split["dim"].integer(-1, int64_t(e.shape.size()) - 1));  // -1: replicated
    e.split.parts = int(split["parts"].integer(1, INT_MAX));
    e.split.pad = split["pad"].boolean();
    tensors_[name] = std::move(e);
  });
  m["pieces"].for_each_element([&](const JsonField& piece) { read_piece(piece); });
}

// A piece: [kind, tensor, file, tp, tp_rank, begin, end], elements [begin, end) of TP rank tp_rank's
// shard of the tensor split over tp ranks, stored in the file as "kind/tensor".
void Checkpoint::read_piece(const JsonField& pc) {
  pc.array(7, 7);
  const size_t kind = pc[0].one_of({state_kind_name(StateKind::weight), state_kind_name(StateKind::exp_avg),
                                    state_kind_name(StateKind::exp_avg_sq)});
  const std::string& name = pc[1].string();
  auto tensor = tensors_.find(name);
  if (tensor == tensors_.end()) pc[1].fail_expected("the name of one of the metadata's tensors");
  Piece piece;
  piece.file = size_t(pc[2].integer(0, int64_t(files_.size()) - 1));
  piece.key = cat(pc[0].string(), "/", name);
  piece.tp = int(pc[3].integer(1, INT_MAX));
  piece.tp_rank = int(pc[4].integer(0, piece.tp - 1));
  // The split rule must cut the tensor's (padded) dimension into tp x parts equal blocks, as its
  // writer's layout did (ParamSpec::local_shape relies on it).
  const TpSplit& split = tensor->second.split;
  if (split.dim >= 0 && size_t(split.dim) < tensor->second.shape.size()) {
    const int64_t tp = piece.tp, n = tensor->second.shape[size_t(split.dim)];
    const int64_t blocks = split.pad ? n / tp + (n % tp != 0) : n % tp == 0 ? n / tp : 1;  // per rank (no overflow)
    if ((!split.pad && n % tp != 0) || blocks % split.parts != 0)
      pc[3].fail_expected(cat("a TP degree whose ", split.parts, " part(s) divide dimension ", split.dim, " (", n,
                              ") of tensor '", name, "'"));
  }
  piece.begin = pc[5].integer(0, JsonField::kNoLimit);
  piece.end = pc[6].integer(piece.begin, JsonField::kNoLimit);
  tensor->second.pieces[kind].push_back(std::move(piece));
}

void Checkpoint::add_file_tensors(const std::string& file_path, const std::string& prefix, StateKind kind) {
  size_t at = files_.size();
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i].path == file_path) at = i;
  if (at == files_.size()) {
    files_.push_back({file_path, -1, "", std::make_unique<SafetensorsFile>(SafetensorsFile::open(file_path))});
  }
  for (const TensorInfo& t : files_[at].mapped->tensors()) {
    if (t.name.rfind(prefix, 0) != 0) continue;
    const std::string name = t.name.substr(prefix.size());
    Entry& e = tensors_[name];
    ORIGAMI_CHECK(e.pieces[int(kind)].empty(), "'", file_path, "': tensor '", t.name, "' appears twice");
    if (kind == StateKind::weight) e.shape = t.shape;
    e.pieces[int(kind)].push_back({at, t.name, 1, 0, 0, t.numel()});
  }
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Checkpoint::weight_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [name, e] : tensors_)
    if (!e.pieces[int(StateKind::weight)].empty()) out.emplace_back(name, e.shape);
  return out;
}

std::string Checkpoint::config_path() const {
  const fs::path p(path_);
  return fs::is_directory(p) && fs::exists(p / "config.json") ? (p / "config.json").string() : "";
}

std::string Checkpoint::tokenizer_path() const {
  const fs::path p(path_);
  return fs::is_directory(p) && fs::exists(p / "tokenizer.json") ? (p / "tokenizer.json").string() : "";
}

const SafetensorsFile& Checkpoint::file(size_t i) {
  File& f = files_[i];
  if (!f.mapped) {
    std::error_code ec;
    const auto size = fs::file_size(f.path, ec);
    ORIGAMI_CHECK(!ec, "checkpoint '", path_, "': shard file '", f.path, "' ",
                  ec == std::errc::no_such_file_or_directory ? std::string("is missing") : "cannot be read: " + ec.message());
    ORIGAMI_CHECK(f.bytes < 0 || int64_t(size) == f.bytes, "checkpoint '", path_, "': shard file '", f.path,
                  "' has ", size, " bytes but the metadata says ", f.bytes, " (truncated or replaced)");
    f.mapped = std::make_unique<SafetensorsFile>(SafetensorsFile::open(f.path));
  }
  return *f.mapped;
}

void Checkpoint::bind(const ModelConfig& cfg) {
  std::set<std::string> names;
  for (const ParamSpec& p : make_param_table(cfg)) names.insert(p.name);
  // Every tensor stored is a parameter of this model (by its canonical name), or a buffer Hugging Face
  // files may carry besides the parameters (gpt2's attention masks, a tied lm_head).
  std::map<std::string, Entry> canon;
  for (auto& [name, e] : tensors_) {
    const std::string c = sharded() ? name : canonical_name(cfg, name);
    if (names.count(c)) canon[c] = std::move(e);
    else ORIGAMI_CHECK(!sharded() && ignorable(cfg, c), "checkpoint '", path_, "': tensor '", name,
                       "' is not a parameter of this ", cfg.model_type(), " model (check that the checkpoint matches the config)");
  }
  tensors_ = std::move(canon);
  for (const ParamSpec& p : make_param_table(cfg)) {
    auto it = tensors_.find(p.name);
    ORIGAMI_CHECK(it != tensors_.end() && !it->second.pieces[0].empty(), "checkpoint '", path_, "': tensor '", p.name,
                  "' (shape ", shape_str(p.shape), ") is missing");
    ORIGAMI_CHECK(it->second.shape == p.shape, "checkpoint '", path_, "': tensor '", p.name, "' has shape ",
                  shape_str(it->second.shape), " but the config needs ", shape_str(p.shape));
    for (int k = 1; k < kStateKinds && has_optimizer_; ++k)
      ORIGAMI_CHECK(!it->second.pieces[k].empty(), "checkpoint '", path_, "': the optimizer state '",
                    state_kind_name(StateKind(k)), "' of tensor '", p.name, "' is missing");
  }
}

void Checkpoint::read(StateKind kind, const ParamSpec& spec, int tp, int tp_rank, int64_t begin, int64_t end, float* dst) {
  progress_alive();  // (origami launch's watchdog: reading a large checkpoint is not a hang)
  auto it = tensors_.find(spec.name);
  ORIGAMI_ASSERT(it != tensors_.end());  // bind() checked
  const Entry& e = it->second;
  const std::vector<ShardRun> want = shard_runs(spec, tp, tp_rank, begin, end);
  int64_t needed = 0, copied = 0;
  for (const ShardRun& r : want) needed += r.n;
  ParamSpec saved = spec;  // the pieces' split rule: the one that wrote them
  saved.split = e.split;
  for (const Piece& pc : e.pieces[int(kind)]) {
    const std::vector<ShardRun> have = shard_runs(saved, pc.tp, pc.tp_rank, pc.begin, pc.end);
    // Both run lists ascend in global offset: walk them together and note every overlap
    // (position in the piece, in dst, length); a file none overlaps is never opened.
    struct Copy {
      int64_t from, to, n;  // elements of the piece, of dst
    };
    std::vector<Copy> overlaps;
    for (size_t i = 0, j = 0; i < want.size() && j < have.size();) {
      const ShardRun &w = want[i], &h = have[j];
      const int64_t a = std::max(w.global, h.global), b = std::min(w.global + w.n, h.global + h.n);
      if (a < b) overlaps.push_back({h.local + (a - h.global), w.local + (a - w.global), b - a});
      if (w.global + w.n <= h.global + h.n) ++i;
      else ++j;
    }
    if (overlaps.empty()) continue;
    const SafetensorsFile& f = file(pc.file);
    const TensorInfo* t = f.find(pc.key);
    ORIGAMI_CHECK(t != nullptr && t->numel() == pc.end - pc.begin, "checkpoint '", path_, "': shard file '", f.path(),
                  "' has no tensor '", pc.key, "' of ", pc.end - pc.begin, " elements");
    for (const Copy& o : overlaps) {
      copy_elements(f, *t, o.from, o.n, dst + o.to);
      copied += o.n;
    }
  }
  ORIGAMI_CHECK(copied == needed, "checkpoint '", path_, "': the pieces of ", state_kind_name(kind), " '", spec.name,
                "' cover ", copied, " of the ", needed, " elements this rank needs (a shard is missing from the metadata)");
}

void Checkpoint::read_weights(Params& params) {
  const ParamLayout& lay = params.layout();
  for (const Segment& seg : params.held_segments()) {  // (ZeRO-3, FSSDP: the shards only)
    const int64_t at = params.offset(seg.param);
    read(StateKind::weight, params.table()[seg.param], lay.tp, lay.tp_rank, seg.begin - at, seg.end - at,
         params.data() + seg.begin);
  }
}

void Checkpoint::verify_checksums(int rank, int world) {
  for (size_t i = size_t(rank); i < files_.size(); i += size_t(world)) {
    if (files_[i].checksum.empty()) continue;
    file(i);  // present, with the recorded size
    const std::string sum = file_checksum(files_[i].path);
    ORIGAMI_CHECK(sum == files_[i].checksum, "checkpoint '", path_, "': shard file '", files_[i].path,
                  "' is damaged: its checksum is ", sum, " but the metadata says ", files_[i].checksum);
  }
}

void Checkpoint::warn_fallback(const std::string& given, const char* command) const {
  if (!fallback_.empty())
    std::fprintf(stderr, "origami %s: warning: '%s': %s\n", command, given.c_str(), fallback_.c_str());
}

void Checkpoint::check_files() {
  for (size_t i = 0; i < files_.size(); ++i) file(i);
}

ExportDtype parse_export_dtype(const std::string& s) {
  if (s == "fp32") return ExportDtype::fp32;
  if (s == "bf16") return ExportDtype::bf16;
  fail("--dtype must be 'fp32' or 'bf16', got '", s, "'");
}

int export_checkpoint(Checkpoint& ck, const ModelConfig& cfg, const std::string& out, int64_t max_shard_bytes,
                      bool optimizer, ExportDtype dtype) {
  ORIGAMI_CHECK(!optimizer || ck.has_optimizer(), "checkpoint '", ck.path(), "' has no optimizer state to export");
  const bool bf16 = dtype == ExportDtype::bf16;
  ORIGAMI_CHECK(!(optimizer && bf16), "--optimizer writes a checkpoint to resume, whose weights stay fp32: "
                "export it without --dtype bf16");
  const int64_t elem_bytes = bf16 ? 2 : 4;
  // Not into a checkpoint (a step or the --save root): its config.json and tokenizer would be replaced.
  ORIGAMI_CHECK(!fs::exists(fs::path(out) / "metadata.json") && !Checkpoint::committed_in(out), "'", out,
                "' is a checkpoint (",
                fs::exists(fs::path(out) / "metadata.json") ? "a step of one" : "a --save directory",
                "): export into a new directory");
  // Nor where weights or optimizer state are already there (an earlier export, sharded or not) would mix with these
  // (a resume would take one export's weights with the other's moments and step): refused.
  for (const char* f : {"model.safetensors", "model.safetensors.index.json", "optimizer.safetensors", "trainer_state.json"})
    ORIGAMI_CHECK(!fs::exists(fs::path(out) / f), "'", out, "' already holds ",
                  std::string_view(f).starts_with("model") ? "model weights" : "training state", " (", f,
                  "): export into a new directory");
  fs::create_directories(out);
  const std::vector<ParamSpec> table = make_param_table(cfg);
  // Shards of whole tensors in table order, each at most max_shard_bytes (a larger tensor alone).
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    const int64_t b = elem_bytes * table[i].numel();
    if (!shards.back().empty() && in_shard + b > max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(i);
    in_shard += b;
  }
  const size_t n = shards.size();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  int64_t total = 0;
  for (size_t s = 0; s < n; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, n);
    const std::string file = n == 1 ? "model.safetensors" : name;
    std::vector<std::vector<float>> bufs;
    std::vector<TensorWrite> writes;
    for (size_t i : shards[s]) {
      bufs.emplace_back(size_t(table[i].numel()));
      ck.read(StateKind::weight, table[i], 1, 0, 0, table[i].numel(), bufs.back().data());
      writes.push_back({table[i].name, table[i].shape, bufs.back().data(), bf16 ? "BF16" : "F32"});
      weight_map[table[i].name] = file;
      total += elem_bytes * table[i].numel();
    }
    write_safetensors(out + "/" + file, writes, {{"format", "pt"}});
  }
  if (n > 1)
    write_file_atomically(out + "/model.safetensors.index.json",
                          nlohmann::ordered_json({{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}).dump(2) + "\n");
  nlohmann::json hf_config = cfg.raw;
  // What from_pretrained(torch_dtype="auto") builds; transformers >= 4.56 names it "dtype" and takes that
  // key first, so a config that carries one (a recent Hub file's) has it set to the same value.
  hf_config["torch_dtype"] = bf16 ? "bfloat16" : "float32";
  if (hf_config.contains("dtype")) hf_config["dtype"] = hf_config["torch_dtype"];
  write_file_atomically(out + "/config.json", hf_config.dump(2) + "\n");
  if (const std::string tok = ck.tokenizer_path(); !tok.empty()) {
    const HfExportTokenizer files = tokenizer_files_for_hf_export(tok);
    write_file_atomically(out + "/tokenizer.json", files.tokenizer_json);
    if (!files.tokenizer_config.empty()) write_file_atomically(out + "/tokenizer_config.json", files.tokenizer_config);
  }
  if (optimizer) {
    std::vector<std::vector<float>> bufs;
    std::vector<TensorWrite> writes;
    for (StateKind k : {StateKind::exp_avg, StateKind::exp_avg_sq})
      for (const ParamSpec& p : table) {
        bufs.emplace_back(size_t(p.numel()));
        ck.read(k, p, 1, 0, 0, p.numel(), bufs.back().data());
        writes.push_back({std::string(state_kind_name(k)) + "." + p.name, p.shape, bufs.back().data()});
      }
    write_safetensors(out + "/optimizer.safetensors", writes);
    write_file_atomically(out + "/trainer_state.json", ck.trainer_state().dump(2) + "\n");
  }
  return int(n);
}

}  // namespace origami
