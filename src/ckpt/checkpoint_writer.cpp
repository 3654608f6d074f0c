#include "ckpt/checkpoint_writer.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "core/timer.h"
#include "parallel/data_parallel.h"

namespace origami {

namespace fs = std::filesystem;

void add_owned_pieces(const Params& params, const AdamW& opt, int replicas, int replica, bool first_stage_copy,
                      std::vector<SavePiece>& out) {
  const ParamLayout& lay = params.layout();
  for (const Segment& seg : params.segments(bucket_shards(params.buckets(), replicas, replica))) {
    const ParamSpec& spec = params.table()[seg.param];
    if (spec.split.dim < 0 && lay.tp_rank != 0) continue;  // TP replica: TP rank 0 writes it
    if (spec.pp_shared && !first_stage_copy) continue;      // the first stage's copy is written
    const int64_t at = params.offset(seg.param), begin = seg.begin - at, end = seg.end - at;
    // A piece names its shard as one of split.ways(tp) (vocabulary parallelism: of TP × PP).
    const int tp = spec.split.ways(lay.tp), tp_rank = spec.split.way(lay.tp, lay.tp_rank);
    out.push_back({StateKind::weight, &spec, tp, tp_rank, begin, end, params.data() + seg.begin});
    // The optimizer's segment holding these elements (ZeRO: the same shard; else the whole tensor).
    const int64_t s = opt.segment_of(seg.begin);
    ORIGAMI_ASSERT(s >= 0 && opt.segments()[size_t(s)].end >= seg.end);
    const int64_t skip = seg.begin - opt.segments()[size_t(s)].begin;
    out.push_back({StateKind::exp_avg, &spec, tp, tp_rank, begin, end, opt.exp_avg(size_t(s)) + skip});
    out.push_back({StateKind::exp_avg_sq, &spec, tp, tp_rank, begin, end, opt.exp_avg_sq(size_t(s)) + skip});
  }
}

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rank 0 receives every rank's string (in rank order); the others an empty vector.
std::vector<std::string> gather_strings(Comm& world, const std::string& mine) {
  const int64_t len = int64_t(mine.size());
  std::vector<int32_t> words(size_t((len + 3) / 4), 0);
  std::memcpy(words.data(), mine.data(), mine.size());
  if (world.rank() != 0) {
    world.send(&len, 1, DType::i64, 0, 7);
    world.send(words.data(), int64_t(words.size()), DType::i32, 0, 7);
    return {};
  }
  std::vector<std::string> out{mine};
  for (int r = 1; r < world.size(); ++r) {
    int64_t n = 0;
    world.recv(&n, 1, DType::i64, r, 7);
    std::vector<int32_t> w(size_t((n + 3) / 4));
    world.recv(w.data(), int64_t(w.size()), DType::i32, r, 7);
    out.emplace_back(reinterpret_cast<const char*>(w.data()), size_t(n));
  }
  return out;
}

}  // namespace

CheckpointWriter::CheckpointWriter(Comm& world, std::string command, std::string dir, int keep_last, bool async,
                                   std::vector<ParamSpec> model_table)
    : world_(world), command_(std::move(command)), dir_(std::move(dir)), keep_last_(keep_last), async_(async),
      model_table_(std::move(model_table)) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", world_.rank());
  file_name_ = name;
  // What DIR/latest names already (an earlier run's), for the message of a failed save.
  std::ifstream latest(dir_ + "/latest");
  long long n = 0;
  if (std::string name; latest >> name && std::sscanf(name.c_str(), "step-%lld", &n) == 1) last_committed_ = n;
  // The directory made and written into now, not at the first save after the steps before it.
  check_on_every_rank(world_, command_, [&] {
    if (world_.rank() != 0) return;
    std::error_code ec;
    fs::create_directories(dir_, ec);
    ORIGAMI_CHECK(!ec && fs::is_directory(dir_), "cannot create checkpoint directory '", dir_, "': ",
                  ec ? ec.message() : "a file of that name is in the way");
    const std::string probe = dir_ + "/.write-test";
    std::ofstream f(probe);
    const bool wrote = static_cast<bool>(f << "origami\n" << std::flush);
    f.close();
    fs::remove(probe, ec);
    ORIGAMI_CHECK(wrote, "cannot write into checkpoint directory '", dir_, "'");
  });
}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();  // an uncommitted save stays a temporary directory
}

void CheckpointWriter::reserve(int64_t floats) {
  allocating("the asynchronous checkpoint's host copy", 4 * floats, [&] { host_.assign(size_t(floats), 0.f); });
}

std::string CheckpointWriter::tmp_dir(int64_t step) const { return cat(dir_, "/.step-", step, ".tmp"); }

void restore_replaced_steps(const std::string& dir) {
  std::error_code ec;
  const std::string_view suffix = ".replaced";  // replace_dir's (not --keep-last's .step-N.old, maybe half removed)
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (!n.starts_with(".step-") || !n.ends_with(suffix)) continue;
    const std::string step = n.substr(1, n.size() - 1 - suffix.size());  // "step-N"
    const fs::path target = fs::path(dir) / step, fresh = fs::path(dir) / ("." + step + ".tmp");
    if (fs::exists(target)) continue;
    rename_file(fs::exists(fresh / "metadata.json") ? fresh.string() : it->path().string(), target.string());
  }
}

double CheckpointWriter::save(int64_t step, const std::vector<SavePiece>& pieces,
                              const std::map<std::string, std::string>& files, const nlohmann::json& layout) {
  Timer blocked;
  finish();
  // A fresh temporary directory, before any rank writes; a step a crashed replacement left out of sight
  // is put back, then a crashed save's temporary directory and a half-removed or replaced old step
  // (.step-N.tmp, .step-N.old, .step-N.replaced: never committed or no longer named) go.
  check_on_every_rank(world_, command_, [&] {
    if (world_.rank() != 0) return;
    std::error_code ec;
    fs::create_directories(dir_, ec);
    ORIGAMI_CHECK(!ec, "cannot create checkpoint directory '", dir_, "': ", ec.message());
    restore_replaced_steps(dir_);
    for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      std::error_code rm;
      if (n.starts_with(".step-") && (n.ends_with(".tmp") || n.ends_with(".old") || n.ends_with(".replaced")))
        fs::remove_all(it->path(), rm);
    }
    fs::create_directories(tmp_dir(step), ec);
    ORIGAMI_CHECK(!ec, "cannot create '", tmp_dir(step), "': ", ec.message());
  });
  pending_step_ = step;
  started_at_ = now_s();
  files_ = files;
  layout_ = layout;
  pieces_json_ = nlohmann::json::array();
  // Asynchronous: each piece's place in the host copy, filled by all threads.
  std::vector<int64_t> at(pieces.size() + 1, 0);
  for (size_t i = 0; i < pieces.size(); ++i) at[i + 1] = at[i] + (pieces[i].end - pieces[i].begin);
  if (async_ && int64_t(host_.size()) < at.back()) reserve(at.back());
  if (async_) {
#pragma omp parallel for schedule(dynamic)
    for (size_t i = 0; i < pieces.size(); ++i) std::copy_n(pieces[i].data, at[i + 1] - at[i], host_.data() + at[i]);
  }
  std::vector<TensorWrite> writes;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const SavePiece& p = pieces[i];
    const int64_t n = p.end - p.begin;
    writes.push_back({cat(state_kind_name(p.kind), "/", p.spec->name), {n}, async_ ? host_.data() + at[i] : p.data});
    pieces_json_.push_back({state_kind_name(p.kind), p.spec->name, p.tp, p.tp_rank, p.begin, p.end});
  }
  written_ = false;
  error_.clear();
  auto write = [this, writes = std::move(writes), path = tmp_dir(step) + "/" + file_name_] {
    try {
      result_ = write_safetensors(path, writes, {{"format", "origami"}});
    } catch (const std::exception& e) {  // Error, or anything else: reported by commit(), never std::terminate
      error_ = e.what();
    }
    written_ = true;
  };
  if (async_) {
    thread_ = std::thread(std::move(write));
  } else {
    write();
    commit();
  }
  return blocked.ms() / 1000.0;
}

void CheckpointWriter::poll() {
  if (!pending()) return;
  const int32_t all_written = world_.all_reduce_value<int32_t>(written_ ? 1 : 0, ReduceOp::sum);
  if (all_written == world_.size()) commit();
}

void CheckpointWriter::finish() {
  if (pending()) commit();  // joins the writing thread first
}

void CheckpointWriter::commit() {
  if (thread_.joinable()) thread_.join();
  const int64_t step = pending_step_;
  pending_step_ = -1;
  const nlohmann::json mine = {{"file", file_name_}, {"bytes", result_.bytes}, {"checksum", result_.checksum},
                               {"pieces", pieces_json_}};
  const std::vector<std::string> all = gather_strings(world_, mine.dump());
  const std::string tmp = tmp_dir(step), final_dir = cat(dir_, "/step-", step);
  int64_t saved_bytes = 0;  // every rank's file (rank 0)
  // A rank that could not write (a full disk): the temporary directory goes, and every rank stops
  // with that rank's message.
  if (world_.all_reduce_value<int32_t>(error_.empty() ? 0 : 1) > 0 && world_.rank() == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
  }
  check_on_every_rank(world_, command_, [&] {
    if (!error_.empty())
      fail("cannot save checkpoint step ", step, ": ", error_,
           last_committed_ >= 0 ? cat("; ", dir_, "/step-", last_committed_, " is intact") : std::string());
  });
  check_on_every_rank(world_, command_, [&] {
    if (world_.rank() != 0) return;
    try {
      nlohmann::ordered_json meta = {{"format", "origami-checkpoint"}, {"version", 1}, {"step", step},
                                     {"layout", layout_}};
      nlohmann::ordered_json tensors = nlohmann::ordered_json::object(), pieces = nlohmann::ordered_json::array(),
                             files = nlohmann::ordered_json::array();
      // Every tensor of the model, for each kind, is covered by the pieces exactly: their global runs,
      // sorted, neither overlap nor leave a gap (no expert or stage can go missing).
      std::map<std::pair<std::string, std::string>, std::vector<std::pair<int64_t, int64_t>>> runs;
      std::map<std::string, const ParamSpec*> specs;
      saved_bytes = 0;
      for (const ParamSpec& p : model_table_) specs[p.name] = &p;
      for (size_t r = 0; r < all.size(); ++r) {
        const nlohmann::json j = nlohmann::json::parse(all[r]);
        files.push_back({{"name", j["file"]}, {"rank", r}, {"bytes", j["bytes"]}, {"checksum", j["checksum"]}});
        saved_bytes += j["bytes"].get<int64_t>();
        for (const auto& p : j["pieces"]) {  // [kind, name, tp, tp_rank, begin, end]
          const std::string kind = p[0], name = p[1];
          ORIGAMI_CHECK(specs.count(name), "internal error: checkpoint step ", step, ": rank ", r, " wrote '", name,
                        "', which is not a tensor of the model");
          for (const ShardRun& run : shard_runs(*specs[name], p[2], p[3], p[4], p[5]))
            runs[{kind, name}].push_back({run.global, run.n});
          pieces.push_back({kind, name, r, p[2], p[3], p[4], p[5]});
        }
      }
      for (const ParamSpec& spec : model_table_) {
        tensors[spec.name] = {{"shape", spec.shape}, {"dtype", "F32"},
                              {"split", {{"dim", spec.split.dim}, {"parts", spec.split.parts}, {"pad", spec.split.pad}}}};
        for (int k = 0; k < kStateKinds; ++k) {
          auto& list = runs[{state_kind_name(StateKind(k)), spec.name}];
          std::sort(list.begin(), list.end());
          int64_t at = 0;
          for (const auto& [g, n] : list) at = g == at ? at + n : -1;
          ORIGAMI_CHECK(at == spec.numel(), "internal error: checkpoint step ", step, ": the pieces of ",
                        state_kind_name(StateKind(k)), " '", spec.name, "' do not cover its ", spec.numel(),
                        " elements exactly once");
        }
      }
      meta["tensors"] = tensors;
      meta["files"] = files;
      meta["pieces"] = pieces;
      for (const auto& [name, bytes] : files_) write_file_atomically(tmp + "/" + name, bytes);
      write_file_atomically(tmp + "/metadata.json", meta.dump(1) + "\n");  // last: its presence marks a whole step
      sync_dir(tmp);
      // Commit: one rename makes the step visible (the same step saved again, by a rerun: replace_dir,
      // atomic where the file system can exchange names), then `latest` names it.
      if (fs::exists(final_dir)) {
        replace_dir(tmp, final_dir);
      } else {
        std::error_code ec;
        fs::rename(tmp, final_dir, ec);
        ORIGAMI_CHECK(!ec, "cannot rename '", tmp, "' to '", final_dir, "': ", ec.message());
      }
      sync_dir(dir_);
      write_file_atomically(dir_ + "/latest", cat("step-", step, "\n"));
    } catch (const std::exception& e) {
      std::error_code ec;
      // After the commit's rename (tmp moved to step-N: replace_dir's own sync may fail after it) what
      // failed is a sync or `latest`: the step is in place, neither known durable nor named by `latest`.
      const bool renamed = !fs::exists(tmp, ec) && fs::exists(final_dir, ec);
      fs::remove_all(tmp, ec);
      if (renamed)
        fail("checkpoint step ", step, " is in '", final_dir, "', but its commit did not finish (", e.what(),
             "): a crash may lose it, and ", dir_, "/latest may still name an earlier step");
      fail("cannot save checkpoint step ", step, " in '", dir_, "': ", e.what(),
           last_committed_ >= 0 ? cat("; ", dir_, "/step-", last_committed_, " is intact") : std::string());
    }
  });
  // Older checkpoints go only now that a newer one is committed: the keep_last_ newest steps up to
  // this one are kept (higher steps, left by another run, are not this run's to remove). A step is
  // first renamed out of sight, so a crash never leaves a partial step-N; a failure is a warning.
  if (keep_last_ > 0 && world_.rank() == 0) {
    try {
      int kept = 0;
      const auto steps = committed_steps(dir_);
      for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
        if (it->first > step || kept++ < keep_last_) continue;
        const std::string old = cat(dir_, "/.step-", it->first, ".old");
        std::error_code ec;
        fs::rename(it->second, old, ec);
        if (!ec) fs::remove_all(old, ec);
        if (ec) std::fprintf(stderr, "origami %s: warning: cannot remove old checkpoint '%s': %s\n", command_.c_str(),
                             it->second.c_str(), ec.message().c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "origami %s: warning: --keep-last: %s\n", command_.c_str(), e.what());
    }
  }
  last_committed_ = step;
  if (world_.rank() == 0) {
    std::printf("saved checkpoint %s (%.1f MB in %d file%s, %.2f s)\n", final_dir.c_str(), double(saved_bytes) / 1e6,
                world_.size(), world_.size() == 1 ? "" : "s", now_s() - started_at_);
    std::fflush(stdout);
  }
}

}  // namespace origami
