#include "data/documents.h"

#include <string>

#include "core/error.h"
#include "core/rng.h"

namespace origami {

DocumentBatcher::DocumentBatcher(std::vector<const IndexedDataset*> datasets, std::vector<double> weights,
                                 int64_t max_len, StepSizes step_tokens, SampleOrder order, uint64_t seed)
    : rule_(weights), max_len_(max_len), step_tokens_(std::move(step_tokens)), order_(order),
      seed_(seed) {
  ORIGAMI_CHECK(max_len >= 1, "--seq-len must be at least 1, got ", max_len);
  for (const auto& [first, n] : step_tokens_.stretches())
    ORIGAMI_CHECK(n >= max_len, "--tokens-per-step (", n, ") must be at least --seq-len (", max_len,
                  "): a step must have room for the longest sequence",
                  first > 0 || step_tokens_.stretches().size() > 1 ? cat(" (the steps from ", first + 1, " on)") : "");
  ORIGAMI_ASSERT(!datasets.empty() && datasets.size() == weights.size());
  for (size_t d = 0; d < datasets.size(); ++d) {
    const IndexedDataset& ds = *datasets[d];
    ORIGAMI_CHECK(ds.num_tokens() > 0 && ds.num_documents() > 0, ds.prefix(),
                  ": the dataset has no tokens to make sequences of");
    const std::string name = d == 0 ? "data.documents" : "data.documents." + std::to_string(d);
    parts_.push_back({&ds, hash_name(name), {}, -1, {}});
  }
}

int64_t DocumentBatcher::num_documents() const {
  int64_t n = 0;
  for (const Part& p : parts_) n += int64_t(p.dataset->num_documents());
  return n;
}

int64_t DocumentBatcher::bytes() const {
  const int64_t order = order_ == SampleOrder::shuffled ? num_documents() * int64_t(sizeof(int64_t)) : 0;
  return order + step_tokens_.largest() * int64_t(sizeof(Sequence));  // a step holds at most N sequences
}

int64_t DocumentBatcher::document_at(Part& p, int64_t epoch, int64_t index) {
  if (order_ == SampleOrder::sequential) return index;
  if (epoch != p.cached_epoch) {
    shuffle_indices(p.permutation, int64_t(p.dataset->num_documents()), seed_, p.stream ^ splitmix64(uint64_t(epoch)));
    p.cached_epoch = epoch;
  }
  return p.permutation[size_t(index)];
}

Sequence DocumentBatcher::peek() {
  if (parts_[size_t(current_)].cursor.offset == 0) current_ = rule_.choose();  // a new document
  Part& p = parts_[size_t(current_)];
  Cursor& c = p.cursor;
  const int64_t documents = int64_t(p.dataset->num_documents());
  for (;;) {
    const uint64_t d = uint64_t(document_at(p, c.epoch, c.index));
    const uint64_t begin = p.dataset->sequence_offset(uint64_t(p.dataset->document_index(d)));
    const uint64_t end = p.dataset->sequence_offset(uint64_t(p.dataset->document_index(d + 1)));
    const int64_t left = int64_t(end - begin) - c.offset;
    if (left > 0) return {begin + uint64_t(c.offset), std::min(left, max_len_), current_};
    c.offset = 0;  // an empty document (the constructor checked that some is not)
    if (++c.index == documents) c.index = 0, ++c.epoch;
  }
}

// Each step takes at least one sequence, so a second epoch of some dataset begins within as many
// steps as the blend's first epochs have sequences: the loop ends early however large `steps` is.
bool DocumentBatcher::repeats(int64_t steps) {
  for (int64_t s = 0; s < steps; ++s)
    if (step(s), last_epoch_ > 0) return true;
  return false;
}

void DocumentBatcher::advance(const Sequence& q) {
  Part& p = parts_[size_t(q.part)];
  last_epoch_ = std::max(last_epoch_, p.cursor.epoch);
  rule_.take(q.part, q.length);
  p.cursor.offset += q.length;
  peek();  // moves to the next document once this one is used up
}

const std::vector<Sequence>& DocumentBatcher::step(int64_t s) {
  ORIGAMI_CHECK(s >= 0, "step must be >= 0, got ", s);
  if (s < step_) {
    step_ = -1, current_ = 0, last_epoch_ = 0, sequences_.clear();
    for (Part& p : parts_) p.cursor = {};
    rule_.restart();
  }
  while (step_ < s) {
    sequences_.clear();
    int64_t tokens = 0;
    const int64_t N = step_tokens_.size(step_ + 1);
    for (Sequence q = peek(); tokens + q.length <= N; q = peek()) {
      sequences_.push_back(q);
      tokens += q.length;
      advance(q);
    }
    ++step_;
  }
  return sequences_;
}

}  // namespace origami
