// Causal self-attention core with grouped-query heads, computed in blocks with an online softmax
// (FlashAttention-style): no T×T matrix per head is ever stored. Forward also yields the
// log-sum-exp of each query row's scores, which backward uses to recompute probabilities and
// which context parallelism uses to merge partial results exactly.
//
// Legend: B batch, T positions, H query heads, KV key/value heads (H % KV == 0; query head h
// reads kv head h / (H/KV)), D head dim, S = (H + 2·KV)·D the packed row width.
//   qkv_BTS  per token [q heads (H·D) | k heads (KV·D) | v heads (KV·D)]
//   out_BTHD per token [H·D], the heads side by side (input of the output projection)
//   lse_BHT  log Σ_j exp(score_ij) per query row, scores scaled by 1/√D
//   doc_BT   optional (null: causal only): each position's document, nondecreasing along a row;
//            a query then sees only the keys of its own document (document masking)
// Backward overwrites dqkv_BTS. Both return the score tiles (kBlock × kBlock blocks of one head)
// they computed: under document masking the tiles the mask empties are skipped.
// Precision (float only): fp32, or bf16 with FlashAttention-2's rounding points — q, k, v and dout
// rounded to bf16, the probabilities and dS rounded for the products that read them, every sum,
// the softmax and the log-sum-exp in fp32 (attention.cpp says how P's rounding is kept
// independent of the order the keys come in).
#pragma once
#include <cstdint>

#include "kernels/cpu/matmul.h"

namespace origami {

// Whether a run in precision p rounds q, k and v in place for the core (qkv_exact): in bf16 where its
// tiles are fp32 ones (bf16_tiles()), which then read the rows where they are; oneDNN's bf16 tiles
// convert them anyway.
bool qkv_rounded_in_place(Precision p);

// qkv_exact (bf16): q, k and v hold bf16 values already (BlockDims::qkv_exact).
template <typename T>
int64_t attention_forward(T* out_BTHD, T* lse_BHT, const T* qkv_BTS, int64_t B, int64_t Tn, int64_t H,
                          int64_t KV, int64_t D, const int32_t* doc_BT = nullptr, Precision p = Precision::fp32,
                          bool qkv_exact = false);

// Bytes a thread holds while the core runs over windows of at most T tokens, head dim D, beyond the
// fp32 core's few tiles: in bf16 its head's rows as the products read them (q, k, v, dout; 4 bytes an
// element at most) and the compact fp32 accumulators of dq, dk, dv.
int64_t attention_scratch_bytes(int64_t T, int64_t D, Precision p);

template <typename T>
int64_t attention_backward(T* dqkv_BTS, const T* dout_BTHD, const T* qkv_BTS, const T* out_BTHD,
                           const T* lse_BHT, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                           const int32_t* doc_BT = nullptr, Precision p = Precision::fp32, bool qkv_exact = false);

// ---- Blocks: attention of Tq query rows against Tk key rows, merged into a running result ----
// The whole-sequence functions above are one block each; context parallelism (parallel/
// context_parallel.h) computes a sequence split over ranks as (query chunk, key chunk) blocks.
//
// Strided views, so a block reads its rows wherever they are (a packed qkv buffer, a ring buffer):
//   Heads: element d of head h at token t of batch row b is p[b·row + t·tok + h·D + d]
//   Lse:   the log-sum-exp of head h at query t of batch row b is p[b·row + h·head + t]
template <typename T>
struct Heads {
  T* p;
  int64_t row, tok;
};
template <typename T>
struct Lse {
  T* p;
  int64_t row, head;
};
// Key j is visible to query i iff j ≤ i + diag: diag 0 is the causal diagonal block (the same
// positions), kAllKeys a block of keys that all precede the queries. With document ids (qdoc of the
// query rows, kdoc of the key rows, element t of batch row b at [b·doc_row + t], nondecreasing along
// the sequence) it must also be in the query's document: kdoc[j] == qdoc[i]. A visible key precedes
// its query, so that is kdoc[j] ≥ qdoc[i], a lower bound on j per query row.
constexpr int64_t kAllKeys = int64_t(1) << 60;
struct BlockDims {
  int64_t B, Tq, Tk, H, KV, D, diag;
  const int32_t* qdoc = nullptr;  // null: no document mask
  const int32_t* kdoc = nullptr;
  int64_t doc_row = 0;
  Precision precision = Precision::fp32;
  // bf16: q, k and v hold bf16 values already (the model rounds them in place once, as only the core
  // reads them), so fp32 tiles read them where they are instead of rounding each head's rows.
  bool qkv_exact = false;
  // Backward in bf16: write dq, dk and dv instead of adding to them (the block is the whole sequence,
  // attention_backward's), so they need no zeros first. (Each (batch row, kv head) task sums its
  // gradients apart and stores them once; the fp32 products add into dq, dk and dv directly.)
  bool overwrite = false;
};

// Merges the block into (out, lse): on entry they hold the attention over the keys seen so far
// (normalised output; lse −∞ and out 0 for none), on return over those and this block's keys.
// Returns the score tiles computed.
template <typename T>
int64_t attention_block_forward(Heads<T> out, Lse<T> lse, Heads<const T> q, Heads<const T> k, Heads<const T> v,
                             const BlockDims& d);

// The block's part of the gradients, accumulated (+=) into dq, dk, dv (or stored: d.overwrite). out and lse are the final
// (fully merged) forward results of the query rows, dout their gradient. Returns the score tiles computed.
template <typename T>
int64_t attention_block_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, Heads<const T> dout, Heads<const T> q,
                              Heads<const T> k, Heads<const T> v, Heads<const T> out, Lse<const T> lse,
                              const BlockDims& d);

}  // namespace origami
