// Causal self-attention core with grouped-query heads, computed in blocks with an online softmax
// (FlashAttention-style): no T×T matrix per head is ever stored. Forward also yields the
// log-sum-exp of each query row's scores, which backward uses to recompute probabilities and
// which context parallelism will use to merge partial results.
//
// Legend: B batch, T positions, H query heads, KV key/value heads (H % KV == 0; query head h
// reads kv head h / (H/KV)), D head dim, S = (H + 2·KV)·D the packed row width.
//   qkv_BTS  per token [q heads (H·D) | k heads (KV·D) | v heads (KV·D)]
//   out_BTHD per token [H·D], the heads side by side (input of the output projection)
//   lse_BHT  log Σ_j exp(score_ij) per query row, scores scaled by 1/√D
// Backward overwrites dqkv_BTS.
#pragma once
#include <cstdint>

namespace origami {

template <typename T>
void attention_forward(T* out_BTHD, T* lse_BHT, const T* qkv_BTS, int64_t B, int64_t Tn, int64_t H,
                       int64_t KV, int64_t D);

template <typename T>
void attention_backward(T* dqkv_BTS, const T* dout_BTHD, const T* qkv_BTS, const T* out_BTHD,
                        const T* lse_BHT, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D);

}  // namespace origami
