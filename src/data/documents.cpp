#include "data/documents.h"

#include "core/error.h"
#include "core/rng.h"

namespace origami {

DocumentBatcher::DocumentBatcher(const IndexedDataset& dataset, int64_t max_len, int64_t step_tokens,
                                 SampleOrder order, uint64_t seed)
    : dataset_(&dataset), max_len_(max_len), step_tokens_(step_tokens), order_(order), seed_(seed) {
  ORIGAMI_CHECK(max_len >= 1, "--seq-len must be at least 1, got ", max_len);
  ORIGAMI_CHECK(step_tokens >= max_len, "--tokens-per-step (", step_tokens, ") must be at least --seq-len (", max_len,
                "): a step must have room for the longest sequence");
  ORIGAMI_CHECK(dataset.num_tokens() > 0 && dataset.num_documents() > 0, dataset.prefix(),
                ": the dataset has no tokens to make sequences of");
}

int64_t DocumentBatcher::bytes() const {
  const int64_t order = order_ == SampleOrder::shuffled ? num_documents() * int64_t(sizeof(int64_t)) : 0;
  return order + step_tokens_ * int64_t(sizeof(Sequence));  // a step holds at most N sequences
}

int64_t DocumentBatcher::document_at(int64_t epoch, int64_t index) {
  if (order_ == SampleOrder::sequential) return index;
  if (epoch != cached_epoch_) {
    shuffle_indices(permutation_, num_documents(), seed_, hash_name("data.documents") ^ splitmix64(uint64_t(epoch)));
    cached_epoch_ = epoch;
  }
  return permutation_[size_t(index)];
}

Sequence DocumentBatcher::peek() {
  for (;;) {
    const uint64_t d = uint64_t(document_at(cursor_.epoch, cursor_.index));
    const uint64_t begin = dataset_->sequence_offset(uint64_t(dataset_->document_index(d)));
    const uint64_t end = dataset_->sequence_offset(uint64_t(dataset_->document_index(d + 1)));
    const int64_t left = int64_t(end - begin) - cursor_.offset;
    if (left > 0) return {begin + uint64_t(cursor_.offset), std::min(left, max_len_)};
    cursor_.offset = 0;  // an empty document (the constructor checked that some is not)
    if (++cursor_.index == num_documents()) cursor_.index = 0, ++cursor_.epoch;
  }
}

// Each step takes at least one sequence, so a second epoch begins within as many steps as the first
// has sequences: the loop ends early however large `steps` is.
bool DocumentBatcher::repeats(int64_t steps) {
  for (int64_t s = 0; s < steps; ++s)
    if (step(s), last_epoch_ > 0) return true;
  return false;
}

void DocumentBatcher::advance(const Sequence& q) {
  last_epoch_ = cursor_.epoch;
  cursor_.offset += q.length;
  peek();  // moves to the next document once this one is used up
}

const std::vector<Sequence>& DocumentBatcher::step(int64_t s) {
  ORIGAMI_CHECK(s >= 0, "step must be >= 0, got ", s);
  if (s < step_) step_ = -1, cursor_ = {}, last_epoch_ = 0, sequences_.clear();
  while (step_ < s) {
    sequences_.clear();
    int64_t tokens = 0;
    for (Sequence q = peek(); tokens + q.length <= step_tokens_; q = peek()) {
      sequences_.push_back(q);
      tokens += q.length;
      advance(q);
    }
    ++step_;
  }
  return sequences_;
}

}  // namespace origami
