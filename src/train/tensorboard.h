// TensorBoard event files for `origami train --tensorboard DIR` (rank 0): the scalars of every
// metrics row (train/metrics.h), so a run can be watched and compared in TensorBoard.
//
// The format is TensorFlow's TFRecord of `Event` protobufs, encoded here directly: a record is
//   uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data
// (little-endian; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8), and the few Event fields written
// are encoded by hand (wire format: tag = field << 3 | wire type):
//   Event      { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//                SessionLog session_log = 7; }
//   Summary    { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//   SessionLog { SessionStatus status = 1; }   (START = 1)
// Five fields do not justify protoc and libprotobuf as build dependencies. CRC-32C comes from a
// 256-entry table: a few hundred bytes a step need no SSE4.2, and the table runs on every CPU.
//
// A file starts with the file_version event "brain.Event:2". A resumed run appends to the newest
// event file of DIR, after cutting off a record a killed run left incomplete, and first writes a
// SessionLog START at its first step: TensorBoard then drops what the earlier run wrote from that
// step on (steps after its last checkpoint), as it does for TensorFlow's own restarts.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

// CRC-32C (Castagnoli) of n bytes, and TFRecord's masked form of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// One TFRecord holding `data`.
std::string tf_record(const std::string& data);
// The length of the complete, intact records at the start of `bytes` (a killed run's last record may
// be cut short).
size_t intact_records(const std::string& bytes);

// The encoded Event of a step's scalars (tag, value).
std::string scalar_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);

// The scalars of a metrics row, in TensorBoard tags: train/loss, train/lm_loss, train/lr,
// train/grad_norm, train/update_skipped (1 on a skipped step), val/loss (a step that evaluated),
// perf/tokens_per_s, perf/step_ms, perf/gflops, perf/save_blocked_s (when a save blocked),
// memory/rss_peak_bytes, memory/predicted_bytes (the first row); MoE: train/aux_loss, train/z_loss,
// moe/expert_imbalance, moe/expert_sync_imbalance.
std::vector<std::pair<std::string, float>> tensorboard_scalars(const nlohmann::json& row);

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;
  // Creates DIR if needed. The run continues after `start_step`: above 0 it appends to DIR's newest
  // event file, at 0 it starts a new one; either way a START event at start_step + 1 hides what DIR's
  // files hold from there on. Error naming DIR or the file when they cannot be written.
  TensorBoardWriter(const std::string& dir, int64_t start_step);
  explicit operator bool() const { return bool(out_); }
  const std::string& path() const { return path_; }
  // The scalars of one metrics row as one event at its step; flushed.
  void write(const nlohmann::json& row);

 private:
  void append(const std::string& event);
  std::string path_;
  std::unique_ptr<std::ofstream> out_;
};

}  // namespace origami
