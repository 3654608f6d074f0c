// LM head with fused softmax cross-entropy: logits = x·Wᵀ, loss_n = logsumexp(logits_n) − logits_n[target_n].
// Logits exist only for a chunk of rows at a time (never [N, V] for the whole batch, unless the
// caller asks for them through logits_NV). With dx_NC, the backward is fused in:
// dlogits = grad_scale·(softmax − onehot(target)), dx_NC = dlogits·W (overwritten), dW += dlogitsᵀ·x.
// Legend: N rows, C channels, V vocabulary. W is [V, C] (the tied embedding or lm_head.weight).
//
// Vocabulary-parallel form (Megatron's vocab-parallel cross-entropy; logits are never gathered):
// W holds rows [vocab_begin, vocab_begin + V) of the vocabulary, of which the first `valid` are real
// (the rest pad the vocabulary to a multiple of TP and are masked out). Per row, the shard's
// statistics (max, Σ exp(logit − max), target logit or 0 when the target lives elsewhere) go through
// combine(stats_n3, n), which must turn them into the statistics of the whole vocabulary; then each
// rank finishes the loss and its shard of dlogits. dx_NC is then this shard's partial sum.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace origami {

template <typename T>
struct VocabShard {
  int64_t vocab_begin = 0;
  int64_t valid = -1;                                // −1: all V rows are real
  std::function<void(T* stats_n3, int64_t n)> combine;  // null on one rank
};

// Combines per-shard (max, sum-exp, target-logit) triples: stats_kn3 holds k shards' [n][3] blocks; the
// result (whole-vocabulary statistics) is written to out_n3. Shared by every vocab-parallel combine.
template <typename T>
void merge_vocab_stats(T* out_n3, const T* stats_kn3, int64_t k, int64_t n);

// Rows of logits computed at once for N rows of a V-row (shard of the) vocabulary: chunks of equal
// size with at most ~16M logits alive. The scratch holds chunk·(V + 4) elements.
int64_t lm_head_chunk_rows(int64_t N, int64_t V);

// Returns Σ_n loss_n (in double) over the rows with a target: a target of −1 adds no loss and no gradient. The GEMMs run in W's precision (kernels/cpu/matmul.h): in bf16 the logits come from x and W rounded, and dlogits is rounded once for dx and dW; the
// softmax, the statistics and the loss stay fp32.
template <typename T>
double lm_head_loss(T* dx_NC, T* dw_VC, T* logits_NV, const T* x_NC, Id<Weights<T>> w_VC, const int32_t* targets_N,
                    int64_t N, int64_t C, int64_t V, T grad_scale, std::vector<T>& scratch,
                    const VocabShard<T>& shard = {});

}  // namespace origami
