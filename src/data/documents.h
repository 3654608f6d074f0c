// Document batching (--batching documents): whole documents as variable-length sequences.
//
// The rule (held-out checks use it, so it is exact):
//   - every document of the dataset, with its end-of-document token, is a sequence; a document longer
//     than L tokens (--seq-len) is cut into consecutive pieces of L tokens (the last shorter), each
//     its own sequence;
//   - the data order walks the documents epoch after epoch: in index order (sequential) or, each
//     epoch e, in the Fisher-Yates permutation of the documents drawn under (seed, "data.documents", e)
//     (shuffled); a document's pieces follow each other;
//   - step s takes the next sequences in that order while the step's token count stays <= N
//     (--tokens-per-step); the first that does not fit opens step s + 1 (L <= N, so every step takes
//     at least one).
// A sequence of n tokens predicts n − 1 of them, each from its own earlier tokens only; a step is the
// same on every rank whatever the layout, so the loss curve does not depend on it.
#pragma once
#include <cstdint>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/sampler.h"

namespace origami {

// Tokens [first, first + length) of the dataset's token stream.
struct Sequence {
  uint64_t first = 0;
  int64_t length = 0;
};

class DocumentBatcher {
 public:
  // Keeps a reference to `dataset`, which must outlive the batcher. A dataset without tokens, L < 1 or
  // N < L is an Error naming the value.
  DocumentBatcher(const IndexedDataset& dataset, int64_t max_len, int64_t step_tokens, SampleOrder order,
                  uint64_t seed);

  // The sequences of step s, in data order. Steps in increasing order cost O(their sequences) each;
  // going back replays the rule from step 0 (a resumed run does that once).
  const std::vector<Sequence>& step(int64_t s);
  // Writes the tokens of q to out (q.length of them).
  void read(const Sequence& q, int32_t* out) const { dataset_->read_tokens(q.first, uint64_t(q.length), out); }
  int64_t num_documents() const { return int64_t(dataset_->num_documents()); }
  // Whether steps 0 .. steps−1 read some document twice (their sequences reach a second epoch).
  bool repeats(int64_t steps);
  // Memory the batcher takes (the shuffled order's permutation of the documents, the step's sequences).
  int64_t bytes() const;

 private:
  struct Cursor {  // the next sequence: `offset` tokens into the document at `index` of epoch `epoch`'s order
    int64_t epoch = 0, index = 0, offset = 0;
  };
  Sequence peek();  // the sequence at cursor_ (moves cursor_ past empty documents)
  void advance(const Sequence& q);
  int64_t document_at(int64_t epoch, int64_t index);  // the order's document

  const IndexedDataset* dataset_;
  int64_t max_len_, step_tokens_;
  SampleOrder order_;
  uint64_t seed_;
  Cursor cursor_;                // after the sequences of step_
  int64_t step_ = -1;            // the step in sequences_ (−1: none yet)
  int64_t last_epoch_ = 0;       // of the last sequence taken
  std::vector<Sequence> sequences_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> permutation_;  // of cached_epoch_ (shuffled)
};

}  // namespace origami
