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
//     at least one); a run resumed under another N steps by each stretch's own (data/step_sizes.h);
//   - a blend (weights w_d normalised to sum 1) interleaves its datasets' orders by document: each
//     next document comes from the dataset d maximising w_d·(T + 1) − T_d, where T_d is the tokens
//     taken from d so far and T their sum (the first on ties), and its pieces follow each other; each
//     dataset walks its own epochs (shuffled: dataset d's permutation of epoch e under (seed,
//     "data.documents", e) for d = 0 and (seed, "data.documents.d", e) for the others). Every prefix
//     of the run then holds each dataset's share of the tokens to within one document.
// A sequence of n tokens predicts n − 1 of them, each from its own earlier tokens only; a step is the
// same on every rank whatever the layout, so the loss curve does not depend on it.
#pragma once
#include <cstdint>
#include <vector>

#include "data/blend.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "data/step_sizes.h"

namespace origami {

// Tokens [first, first + length) of dataset `part`'s token stream.
struct Sequence {
  uint64_t first = 0;
  int64_t length = 0;
  int32_t part = 0;  // the blend's dataset
};

class DocumentBatcher {
 public:
  // Keeps references to the datasets, which must outlive the batcher; `weights` (one per dataset,
  // positive) are normalised; `step_tokens`: N of each stretch of steps. A dataset without tokens,
  // L < 1 or an N < L is an Error naming the value.
  DocumentBatcher(std::vector<const IndexedDataset*> datasets, std::vector<double> weights, int64_t max_len,
                  StepSizes step_tokens, SampleOrder order, uint64_t seed);
  DocumentBatcher(const IndexedDataset& dataset, int64_t max_len, int64_t step_tokens, SampleOrder order,
                  uint64_t seed)
      : DocumentBatcher({&dataset}, {1.0}, max_len, StepSizes(step_tokens), order, seed) {}

  // The sequences of step s, in data order. Steps in increasing order cost O(their sequences) each;
  // going back replays the rule from step 0 (a resumed run does that once).
  const std::vector<Sequence>& step(int64_t s);
  // Writes the tokens of q to out (q.length of them).
  void read(const Sequence& q, int32_t* out) const {
    parts_[size_t(q.part)].dataset->read_tokens(q.first, uint64_t(q.length), out);
  }
  int64_t num_documents() const;  // over every dataset
  size_t num_parts() const { return parts_.size(); }
  // Whether steps 0 .. steps−1 read some document twice (their sequences reach a dataset's second epoch).
  bool repeats(int64_t steps);
  // Memory the batcher takes (the shuffled orders' permutations of the documents, the step's sequences).
  int64_t bytes() const;

 private:
  struct Cursor {  // the next sequence: `offset` tokens into the document at `index` of epoch `epoch`'s order
    int64_t epoch = 0, index = 0, offset = 0;
  };
  struct Part {  // one dataset of the blend and where its order stands
    const IndexedDataset* dataset;
    uint64_t stream;               // the shuffled order's stream name
    Cursor cursor;                 // after the sequences of step_
    int64_t cached_epoch = -1;
    std::vector<int64_t> permutation;  // of cached_epoch (shuffled)
  };
  Sequence peek();             // the next sequence (moves its dataset's cursor past empty documents)
  void advance(const Sequence& q);
  int64_t document_at(Part& p, int64_t epoch, int64_t index);  // the order's document

  std::vector<Part> parts_;
  BlendRule rule_;               // T_d, the tokens taken from each dataset: picks each document's dataset
  int64_t max_len_;
  StepSizes step_tokens_;
  SampleOrder order_;
  uint64_t seed_;
  int current_ = 0;              // the dataset whose document is under way (its cursor's offset > 0)
  int64_t step_ = -1;            // the step in sequences_ (−1: none yet)
  int64_t last_epoch_ = 0;       // the latest epoch a taken sequence came from, over the datasets
  std::vector<Sequence> sequences_;
};

}  // namespace origami
