// Training windows over an indexed dataset.
//
// All documents' tokens (each already ending in eod) are read as one stream. Window w covers
// stream tokens [w*T, w*T + T + 1): T inputs and, shifted by one, their T targets; consecutive
// windows share one token. num_windows = floor((num_tokens - 1) / T), so the last partial window
// is dropped; a dataset shorter than T + 1 tokens is an Error naming it.
//
// Sample index i (any i >= 0) belongs to epoch e = i / num_windows and reads window
//   sequential:  i mod num_windows
//   shuffled:    perm_e[i mod num_windows], perm_e a Fisher-Yates permutation of the windows drawn
//                with origami's counter RNG (core/rng.h) under key (seed, "data.shuffle", epoch);
//                it depends only on (seed, epoch, num_windows), so a run is reproducible and any
//                rank can compute any sample without talking to the others.
//
// The trainer's rule: at step s, row r (0 <= r < G) of the global batch of G rows reads sample
// index s*G + r. How rows are then split over data-parallel ranks and micro-batches is the
// trainer's business; the rows, and so the loss curve, do not depend on the layout.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include "data/indexed_dataset.h"

namespace origami {

enum class SampleOrder { sequential, shuffled };

// "sequential" or "shuffled"; anything else is an Error naming the value.
SampleOrder parse_sample_order(std::string_view name);
const char* sample_order_name(SampleOrder order);

// out = a permutation of 0..n−1 drawn with the counter RNG under (seed, key): the same on every rank.
void shuffle_indices(std::vector<int64_t>& out, int64_t n, uint64_t seed, uint64_t key);

class WindowSampler {
 public:
  // Keeps a reference to `dataset`, which must outlive the sampler.
  WindowSampler(const IndexedDataset& dataset, int64_t seq_len, SampleOrder order, uint64_t seed);

  int64_t seq_len() const { return seq_len_; }
  int64_t num_windows() const { return num_windows_; }
  // Memory the sampler takes once sampling (the shuffled order's permutation of the windows).
  int64_t bytes() const;
  SampleOrder order() const { return order_; }

  // The window that sample index i reads (see the top of this file). Not thread-safe: a shuffled
  // sampler caches the permutation of the last epoch it touched.
  int64_t window_index(int64_t i);
  // Writes the T + 1 tokens of sample i to out_T_plus_1.
  void window(int64_t i, int32_t* out_T_plus_1);

 private:
  const IndexedDataset& dataset_;
  int64_t seq_len_, num_windows_;
  SampleOrder order_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> permutation_;  // of cached_epoch_
};

}  // namespace origami
