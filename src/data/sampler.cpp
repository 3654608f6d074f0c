#include "data/sampler.h"

#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace origami {

SampleOrder parse_sample_order(std::string_view name) {
  if (name == "sequential") return SampleOrder::sequential;
  if (name == "shuffled") return SampleOrder::shuffled;
  fail("data order '", name, "' is not known (use sequential or shuffled)");
}

const char* sample_order_name(SampleOrder order) {
  return order == SampleOrder::sequential ? "sequential" : "shuffled";
}

// Fisher-Yates: for k = n-1 .. 1 swap element k with a uniform j in [0, k]; draw k uses counter
// index k, so the permutation is a pure function of (seed, key, n).
void shuffle_indices(std::vector<int64_t>& out, int64_t n, uint64_t seed, uint64_t key) {
  out.resize(size_t(n));
  std::iota(out.begin(), out.end(), int64_t(0));
  for (int64_t k = n - 1; k > 0; --k) {
    int64_t j = int64_t(uniform01(seed, key, uint64_t(k)) * double(k + 1));
    if (j > k) j = k;  // guards rounding at u close to 1
    std::swap(out[size_t(k)], out[size_t(j)]);
  }
}

WindowSampler::WindowSampler(const IndexedDataset& dataset, int64_t seq_len, SampleOrder order, uint64_t seed)
    : dataset_(dataset), seq_len_(seq_len), num_windows_(0), order_(order), seed_(seed) {
  ORIGAMI_CHECK(seq_len >= 1, "sequence length must be >= 1, got ", seq_len);
  uint64_t n = dataset.num_tokens();
  ORIGAMI_CHECK(n >= uint64_t(seq_len) + 1, dataset.prefix(), ": ", n,
                " tokens is too short for one training window of sequence length ", seq_len, " (needs ",
                seq_len + 1, " tokens: inputs plus the shifted target)");
  num_windows_ = int64_t((n - 1) / uint64_t(seq_len));
}

int64_t WindowSampler::window_index(int64_t i) {
  ORIGAMI_CHECK(i >= 0, "sample index must be >= 0, got ", i);
  int64_t epoch = i / num_windows_, within = i % num_windows_;
  if (order_ == SampleOrder::sequential) return within;
  if (epoch != cached_epoch_) {
    shuffle_indices(permutation_, num_windows_, seed_, hash_name("data.shuffle") ^ splitmix64(uint64_t(epoch)));
    cached_epoch_ = epoch;
  }
  return permutation_[size_t(within)];
}

void WindowSampler::window(int64_t i, int32_t* out_T_plus_1) {
  int64_t w = window_index(i);
  dataset_.read_tokens(uint64_t(w) * uint64_t(seq_len_), uint64_t(seq_len_) + 1, out_T_plus_1);
}

int64_t WindowSampler::bytes() const {
  return order_ == SampleOrder::shuffled ? num_windows_ * int64_t(sizeof(int64_t)) : 0;
}

}  // namespace origami
