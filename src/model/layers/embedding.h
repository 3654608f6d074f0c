// Token (+ learned position) embedding: x[b,t,:] = wte[tokens[b,t]] (+ wpe[pos[b,t]]; pos null: t).
// pos [B, T] is each token's position id (context parallelism holds non-contiguous chunks; document
// masking restarts positions at every document).
// Legend: B batch rows, T positions, C channels, tokens_BT row stride `tok_stride` (the training
// window holds T+1 tokens per row). Backward accumulates (+=) into dwte / dwpe.
// Vocabulary-parallel form: wte holds only token ids [vocab_begin, vocab_begin + vocab_rows); other
// tokens embed as zeros here (their rows live on another tensor-parallel rank) and get no gradient.
#pragma once
#include <cstdint>
#include <climits>

namespace origami {

template <typename T>
void embedding_forward(T* x_BTC, const int32_t* tokens, int64_t tok_stride, const T* wte, const T* wpe,
                       int64_t B, int64_t Tn, int64_t C, int64_t vocab_begin = 0, int64_t vocab_rows = INT64_MAX,
                       const int64_t* pos = nullptr);
template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dx_BTC, const int32_t* tokens, int64_t tok_stride,
                        int64_t B, int64_t Tn, int64_t C, int64_t vocab_begin = 0, int64_t vocab_rows = INT64_MAX,
                        const int64_t* pos = nullptr);

}  // namespace origami
