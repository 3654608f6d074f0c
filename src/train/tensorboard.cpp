#include "train/tensorboard.h"

#include <array>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "core/timer.h"

namespace origami {

namespace {

// The reflected CRC-32C table (polynomial 0x82f63b78).
constexpr std::array<uint32_t, 256> kCrcTable = [] {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}();

template <typename T>
void put_le(std::string& out, T v) {  // little-endian bytes of an integer or an IEEE float
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 is little-endian, as the formats are
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

// Protobuf wire format: varints, keys (field << 3 | wire type) and length-delimited fields.
void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += char((v & 0x7f) | 0x80);
  out += char(v);
}
void put_key(std::string& out, int field, int wire) { put_varint(out, uint64_t(field << 3 | wire)); }
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event's wall_time (1, double) and step (2, int64).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_le(e, wall_time);
  put_key(e, 2, 0);
  put_varint(e, uint64_t(step));
  return e;
}

// DIR's newest event file (names carry the creation time, so the greatest name), "" when none.
std::string newest_event_file(const std::string& dir) {
  std::string newest;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.rfind("events.out.tfevents.", 0) == 0 && name > newest) newest = name;
  }
  return newest.empty() ? "" : (std::filesystem::path(dir) / newest).string();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) c = kCrcTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tf_record(const std::string& data) {
  std::string r;
  put_le(r, uint64_t(data.size()));
  put_le(r, masked_crc32c(r.data(), 8));
  r += data;
  put_le(r, masked_crc32c(data.data(), data.size()));
  return r;
}

size_t intact_records(const std::string& bytes) {
  size_t at = 0;
  while (bytes.size() - at >= 12) {
    const size_t left = bytes.size() - at;
    uint64_t n = 0;
    uint32_t crc = 0;
    std::memcpy(&n, bytes.data() + at, 8);
    std::memcpy(&crc, bytes.data() + at + 8, 4);
    if (crc != masked_crc32c(bytes.data() + at, 8) || n > left - 12 || left - 12 - n < 4) break;
    std::memcpy(&crc, bytes.data() + at + 12 + n, 4);
    if (crc != masked_crc32c(bytes.data() + at + 12, size_t(n))) break;
    at += 16 + size_t(n);
  }
  return at;
}

std::string scalar_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_key(value, 2, 5);
    put_le(value, v);
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::vector<std::pair<std::string, float>> tensorboard_scalars(const nlohmann::json& row) {
  // (metrics key, tag); a key the row lacks is left out.
  static const std::pair<const char*, const char*> kTags[] = {
      {"loss", "train/loss"},          {"lm_loss", "train/lm_loss"},       {"lr", "train/lr"},
      {"grad_norm", "train/grad_norm"}, {"val_loss", "val/loss"},          {"tokens_per_s", "perf/tokens_per_s"},
      {"ms", "perf/step_ms"},          {"gflops", "perf/gflops"},          {"save_blocked_s", "perf/save_blocked_s"},
      {"rss_peak_bytes", "memory/rss_peak_bytes"}, {"expert_imbalance", "moe/expert_imbalance"},
      {"expert_sync_imbalance", "moe/expert_sync_imbalance"}};
  std::vector<std::pair<std::string, float>> out;
  for (const auto& [key, tag] : kTags)
    if (row.contains(key) && row[key].is_number()) out.emplace_back(tag, row[key].get<float>());
  if (row.contains("expert_imbalance")) {  // MoE: the router's loss parts
    out.emplace_back("train/aux_loss", row["aux_loss"].get<float>());
    out.emplace_back("train/z_loss", row["z_loss"].get<float>());
  }
  out.emplace_back("train/update_skipped", row.contains("skipped") ? 1.f : 0.f);
  if (row.contains("memory_bytes")) out.emplace_back("memory/predicted_bytes", row["memory_bytes"]["total"].get<float>());
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t start_step) {
  size_t kept = 0;  // bytes of intact records in the file appended to
  try {
    std::filesystem::create_directories(dir);
    if (start_step > 0) path_ = newest_event_file(dir);
    if (!path_.empty()) {  // keep the intact records only: a record cut short by a kill would hide all after it
      const std::string bytes = read_file_bytes(path_);
      kept = intact_records(bytes);
      if (kept < bytes.size()) std::filesystem::resize_file(path_, kept);
    }
  } catch (const std::filesystem::filesystem_error& e) {
    fail("--tensorboard ", dir, ": ", filesystem_words(e));
  }
  if (path_.empty()) {
    const std::string host = host_name();
    path_ = (std::filesystem::path(dir) / cat("events.out.tfevents.", int64_t(unix_time_s()), ".", host)).string();
  }
  out_ = std::make_unique<std::ofstream>(path_, std::ios::binary | (kept > 0 ? std::ios::app : std::ios::trunc));
  ORIGAMI_CHECK(*out_, "--tensorboard: cannot write '", path_, "'");
  if (kept == 0) {  // a file starts with its version (without it TensorBoard ignores the START below)
    std::string version = event_head(unix_time_s(), 0);
    put_bytes(version, 3, "brain.Event:2");
    append(version);
  }
  // SessionLog{status: START} at the run's first step: TensorBoard drops what any file of DIR holds
  // from that step on — the steps a resumed run replays, or all of an earlier attempt restarted from
  // step 0 — as the metrics file drops them.
  std::string log;
  put_key(log, 1, 0);
  put_varint(log, 1);
  std::string start = event_head(unix_time_s(), start_step + 1);
  put_bytes(start, 7, log);
  append(start);
}

void TensorBoardWriter::write(const nlohmann::json& row) {
  append(scalar_event(unix_time_s(), row.at("step").get<int64_t>(), tensorboard_scalars(row)));
}

void TensorBoardWriter::append(const std::string& event) {
  *out_ << tf_record(event);
  out_->flush();
  ORIGAMI_CHECK(*out_, "--tensorboard: writing '", path_, "' failed");
}

}  // namespace origami
