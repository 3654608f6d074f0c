// The run's samples from one dataset or a weighted blend of several (as Megatron's --data-path
// "W1 PREFIX1 W2 PREFIX2 ..."; a bare "PREFIX" is "1 PREFIX").
//
// Rule: with weights w_d normalised to sum 1 and n_d the samples dataset d has given so far, sample i
// of the run (0, 1, ...) goes to the dataset d maximising w_d·(i+1) − n_d (the first on ties) and
// reads that dataset's sample n_d under its own WindowSampler (sequential or shuffled). This is the
// greedy rule of Megatron's blending (megatron/core/datasets/helpers.cpp, build_blending_indices)
// with i+1 where Megatron has max(i, 1), so the sequences differ from Megatron's after a few
// samples; with i+1 every prefix of the run holds within one sample of w_d·(its length) from each
// dataset (Megatron's can drift past one for very uneven weights). The sequence depends on the
// weights alone: every layout, and every resume, reads the same rows. Row r of step s is sample s·G + r.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/indexed_dataset.h"
#include "data/sampler.h"

namespace origami {

struct BlendPart {
  double weight;  // normalised: the parts' weights sum to 1
  std::string prefix;
};

// "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (whitespace-separated; a spec that is itself an existing
// dataset's prefix, whitespace and all, is that one dataset). Errors name the value: an odd number of
// fields, a weight that is not a finite positive number, a prefix given twice. `option` names the
// flag in messages.
std::vector<BlendPart> parse_blend(std::string_view spec, std::string_view option = "--data");

// The rule above, one sample after the other. Document batching (data/documents.h) counts tokens
// instead of samples: choose() a document's dataset, then take() its tokens.
struct BlendChoice {
  int dataset;
  int64_t index;  // n_d before this sample: the sample of dataset `dataset` it reads
};
class BlendRule {
 public:
  explicit BlendRule(std::vector<double> weights);  // normalised to sum 1
  // The d maximising w_d·(n + 1) − n_d, n the sum of the n_d (the first on ties). Each product is
  // rounded before its subtraction, as Megatron's helper and the held-out checks compute it:
  // blend.cpp is built without FMA contraction, which would break exact ties the other way
  // (0.7·15 − 10 against 0.3·15 − 4) and make the data order depend on the build's flags.
  int choose() const;
  void take(int dataset, int64_t units) { given_[size_t(dataset)] += units, taken_ += units; }
  void restart() { std::fill(given_.begin(), given_.end(), 0), taken_ = 0; }  // back to the run's start
  BlendChoice next();  // one sample from choose(): the choice for sample samples() of the run
  int64_t samples() const { return taken_; }                    // n
  const std::vector<int64_t>& given() const { return given_; }  // n_d

 private:
  std::vector<double> weights_;
  std::vector<int64_t> given_;
  int64_t taken_ = 0;
};

class DataBlend {
 public:
  // Opens every dataset (IndexedDataset::open validates it) and checks that all share one tokenizer
  // (PREFIX.tokenizer.json, or none): otherwise an Error naming the two that differ. seq_len 0: the
  // datasets alone, for document batching (data/documents.h), which reads no windows: a dataset
  // shorter than a window is fine, and the window readers below are not to be called.
  DataBlend(const std::vector<BlendPart>& parts, int64_t seq_len, SampleOrder order, uint64_t seed,
            std::string_view option = "--data");

  const std::vector<BlendPart>& parts() const { return parts_; }
  int64_t seq_len() const { return seq_len_; }
  uint64_t num_tokens() const;   // over every dataset
  int64_t num_windows() const;   // over every dataset
  int64_t windows(size_t d) const { return samplers_[d]->num_windows(); }  // of dataset d
  const IndexedDataset& dataset(size_t d) const { return *datasets_[d]; }
  // PREFIX.tokenizer.json of the datasets ("" when they have none).
  const std::string& tokenizer_path() const { return tokenizer_path_; }
  const nlohmann::json& tokenizer() const { return tokenizer_; }  // its contents (null when none)
  // The file as read when the blend opened ("" when none): what a checkpoint of the run records,
  // whatever happens to the file during the run.
  const std::string& tokenizer_bytes() const { return tokenizer_bytes_; }
  // An Error unless `other` was made with the same tokenizer (`what` names the two in the message).
  void require_same_tokenizer(const DataBlend& other, const std::string& what) const;
  // The prefixes of `other` whose data this blend reads too (the same .bin, however the path is spelled):
  // validation data that is also training data.
  std::vector<std::string> shared_datasets(const DataBlend& other) const;
  // e.g. "fortunes: 1234 tokens, 40 windows of 128" or "0.7 a (…) + 0.3 b (…)".
  std::string describe() const;
  // Memory the samplers take (the shuffled orders' permutations) and the blend's choices for `span`
  // samples at a time (a global batch).
  int64_t bytes(int64_t span) const;

  // Writes the T + 1 tokens of sample i of the run. Not thread-safe. Reading samples in increasing
  // order costs O(1) each; going back replays the rule from sample 0.
  void window(int64_t i, int32_t* out_T_plus_1);
  // Samples each dataset gives among samples [first, first + n) of the run.
  std::vector<int64_t> samples_per_dataset(int64_t first, int64_t n);
  // An Error unless samples 0..n−1 read every dataset's windows at most once (`what` names the
  // reader in the message). O(n) time, O(1) memory.
  void require_no_repeat(int64_t n, const std::string& what) const;

 private:
  // choices_ holds the choices of samples [first_, first_ + choices_.size()) ⊇ [first, first + n),
  // none before `first` (several datasets only).
  void cover(int64_t first, int64_t n);

  std::vector<BlendPart> parts_;
  int64_t seq_len_;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;  // (the samplers hold references)
  std::vector<std::unique_ptr<WindowSampler>> samplers_;
  std::string tokenizer_path_;
  nlohmann::json tokenizer_;  // its contents (null when none)
  std::string tokenizer_bytes_;
  BlendRule rule_;                    // stands after the last sample of choices_
  int64_t first_ = 0;
  std::vector<BlendChoice> choices_;  // of samples first_, first_ + 1, ...
};

}  // namespace origami
