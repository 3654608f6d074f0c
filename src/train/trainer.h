// The training loop on one process: micro-batches with gradient accumulation, clipping, AdamW,
// learning-rate schedule, one human line and one JSON metrics object per step, periodic and final
// checkpoints, and a clean stop (checkpoint saved) on SIGINT/SIGTERM.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "train/optimizer.h"

namespace origami {

struct TrainOptions {
  std::string data;            // dataset prefix (PREFIX.bin / PREFIX.idx)
  std::string init_from;       // safetensors file, or checkpoint directory (resumes optimizer and step)
  int64_t steps = 100;         // total optimizer steps
  int64_t micro_batch = 4;     // B: rows per forward/backward
  int64_t global_batch = 4;    // G: rows per optimizer step (G / B micro-batches)
  int64_t seq_len = 128;       // T
  LrConfig lr;
  AdamWConfig adam;
  double grad_clip = 1.0;      // 0 disables clipping
  uint64_t seed = 1234;
  std::string data_order = "sequential";
  std::string metrics;         // JSONL path, optional
  std::string save;            // checkpoint directory, optional
  int64_t save_every = 0;      // 0: only at the end
  int threads = 0;             // 0: all cores
  bool quiet = false;          // no per-step lines (progress only)
  nlohmann::json as_json() const;
  void validate(const ModelConfig& cfg) const;  // Error naming the value and the rule
};

// Returns the process exit code (0, or 130 when stopped by a signal after saving).
int run_training(const ModelConfig& cfg, const TrainOptions& opts);

}  // namespace origami
