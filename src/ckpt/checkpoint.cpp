#include "ckpt/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/checksum.h"
#include "core/error.h"
#include "core/files.h"
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

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Tensors Hugging Face GPT-2 files may hold that are not parameters.
bool ignorable(const ModelConfig& cfg, const std::string& name) {
  if (cfg.is_gpt2()) return name.ends_with("attn.bias") || name.ends_with("attn.masked_bias") || name == "lm_head.weight";
  return cfg.tied_embeddings && name == "lm_head.weight";
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

// What `path` names, resolved to a file or a directory holding the checkpoint's files.
fs::path resolve(const std::string& path) {
  const fs::path p(path);
  ORIGAMI_CHECK(fs::exists(p), "checkpoint '", path, "' does not exist");
  if (fs::is_regular_file(p) || is_step_dir(p)) return p;
  ORIGAMI_CHECK(fs::is_directory(p), "checkpoint '", path, "' is neither a file nor a directory");
  if (fs::exists(p / "latest")) {
    std::string name = read_file_bytes((p / "latest").string());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (is_step_dir(p / name)) return p / name;
    // `latest` names a step removed by hand: fall back to the newest committed step.
  }
  const auto steps = committed_steps(p.string());
  if (!steps.empty()) return fs::path(steps.rbegin()->second);
  if (fs::exists(p / "model.safetensors") || fs::exists(p / "model.safetensors.index.json")) return p;
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

bool Checkpoint::committed_in(const std::string& dir) {
  return fs::is_directory(dir) && (fs::exists(fs::path(dir) / "latest") || !committed_steps(dir).empty());
}

std::string Checkpoint::config_of(const std::string& path) {
  const fs::path p = resolve(path);
  return fs::is_directory(p) && fs::exists(p / "config.json") ? (p / "config.json").string() : "";
}

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ck;
  const fs::path p = resolve(path);
  ck.path_ = p.string();
  if (fs::is_regular_file(p)) {
    ck.add_file_tensors(ck.path_, "", StateKind::weight);
    return ck;
  }
  if (fs::exists(p / "trainer_state.json"))
    ck.trainer_state_ = read_json_file((p / "trainer_state.json").string(), "trainer state");
  if (!is_step_dir(p)) {  // single-file origami checkpoint or Hugging Face directory
    if (fs::exists(p / "model.safetensors.index.json")) {
      const nlohmann::json idx = read_json_file((p / "model.safetensors.index.json").string(), "safetensors index");
      ORIGAMI_CHECK(idx.contains("weight_map") && idx["weight_map"].is_object(), "'", (p / "model.safetensors.index.json").string(),
                    "': no weight_map object");
      std::set<std::string> shards;
      for (const auto& [name, file] : idx["weight_map"].items()) shards.insert(file.get<std::string>());
      for (const std::string& s : shards) ck.add_file_tensors((p / s).string(), "", StateKind::weight);
    } else {
      ck.add_file_tensors((p / "model.safetensors").string(), "", StateKind::weight);
    }
    if (fs::exists(p / "optimizer.safetensors")) {
      ck.add_file_tensors((p / "optimizer.safetensors").string(), "exp_avg.", StateKind::exp_avg);
      ck.add_file_tensors((p / "optimizer.safetensors").string(), "exp_avg_sq.", StateKind::exp_avg_sq);
      ck.has_optimizer_ = !ck.trainer_state_.is_null();
    }
    return ck;
  }
  const std::string meta_path = (p / "metadata.json").string();
  ck.metadata_ = read_json_file(meta_path, "checkpoint metadata");
  try {
    const nlohmann::json& m = ck.metadata_;
    ORIGAMI_CHECK(m.value("format", "") == "origami-checkpoint", "'", meta_path, "' is not an origami checkpoint's metadata");
    for (const auto& f : m.at("files"))
      ck.files_.push_back({(p / f.at("name").get<std::string>()).string(), f.at("bytes").get<int64_t>(),
                           f.at("checksum").get<std::string>(), nullptr});
    for (const auto& [name, t] : m.at("tensors").items()) {
      Entry e;
      e.shape = t.at("shape").get<std::vector<int64_t>>();
      ORIGAMI_CHECK(t.at("dtype") == "F32", "'", meta_path, "': tensor '", name, "' has dtype ", t.at("dtype").dump(), " (F32 expected)");
      const auto& sp = t.at("split");
      e.split.dim = sp.at("dim").get<int>();
      e.split.parts = sp.at("parts").get<int>();
      e.split.pad = sp.at("pad").get<bool>();
      ORIGAMI_CHECK(e.split.parts >= 1 && e.split.dim < int(e.shape.size()), "'", meta_path, "': tensor '", name,
                    "' has a bad split rule ", sp.dump());
      ck.tensors_[name] = std::move(e);
    }
    for (const auto& pc : m.at("pieces")) {  // [kind, tensor, file, tp, tp_rank, begin, end]
      const std::string kind = pc.at(0).get<std::string>(), name = pc.at(1).get<std::string>();
      int k = 0;
      while (k < kStateKinds && kind != state_kind_name(StateKind(k))) ++k;
      const int tp = pc.at(3).get<int>(), tp_rank = pc.at(4).get<int>();
      const int64_t begin = pc.at(5).get<int64_t>(), end = pc.at(6).get<int64_t>();
      ORIGAMI_CHECK(k < kStateKinds && ck.tensors_.count(name) && pc.at(2).get<size_t>() < ck.files_.size() && tp >= 1 &&
                        tp_rank >= 0 && tp_rank < tp && begin >= 0 && begin <= end,
                    "'", meta_path, "': bad piece ", pc.dump());
      ck.tensors_[name].pieces[k].push_back({pc.at(2).get<size_t>(), kind + "/" + name, pc.at(3).get<int>(),
                                             pc.at(4).get<int>(), pc.at(5).get<int64_t>(), pc.at(6).get<int64_t>()});
    }
  } catch (const nlohmann::json::exception& e) {
    fail("'", meta_path, "' is malformed: ", e.what());
  }
  ck.has_optimizer_ = true;
  ORIGAMI_CHECK(!ck.trainer_state_.is_null(), "checkpoint '", ck.path_, "' has no trainer_state.json");
  return ck;
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
  for (size_t i = 0; i < params.table().size(); ++i)
    read(StateKind::weight, params.table()[i], lay.tp, lay.tp_rank, 0, params.local_numel(i),
         params.data() + params.offset(i));
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

int export_checkpoint(Checkpoint& ck, const ModelConfig& cfg, const std::string& out, int64_t max_shard_bytes,
                      bool optimizer) {
  ORIGAMI_CHECK(!optimizer || ck.has_optimizer(), "checkpoint '", ck.path(), "' has no optimizer state to export");
  // Weights already there (an earlier export, sharded or not) would mix with these: refused.
  for (const char* f : {"model.safetensors", "model.safetensors.index.json"})
    ORIGAMI_CHECK(!fs::exists(fs::path(out) / f), "'", out, "' already holds model weights (", f,
                  "): export into a new directory");
  fs::create_directories(out);
  const std::vector<ParamSpec> table = make_param_table(cfg);
  // Shards of whole tensors in table order, each at most max_shard_bytes (a larger tensor alone).
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    const int64_t b = 4 * table[i].numel();
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
      writes.push_back({table[i].name, table[i].shape, bufs.back().data()});
      weight_map[table[i].name] = file;
      total += 4 * table[i].numel();
    }
    write_safetensors(out + "/" + file, writes, {{"format", "pt"}});
  }
  if (n > 1)
    write_file_atomically(out + "/model.safetensors.index.json",
                          nlohmann::ordered_json({{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}).dump(2) + "\n");
  save_model_config(cfg, out + "/config.json");
  if (const std::string tok = ck.tokenizer_path(); !tok.empty())
    write_file_atomically(out + "/tokenizer.json", tokenizer_file_for_hf_export(tok));
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
