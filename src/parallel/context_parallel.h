// Context parallelism: the attention core of a sequence split over the CP ranks (Megatron-Core's
// `--context-parallel-size` with `--cp-comm-type p2p | a2a | a2a+p2p`). Everything else in a layer
// is token-wise and simply runs on the rank's tokens; only attention needs the other ranks' keys.
//
// Load-balanced split: a sequence of T positions is cut into 2·C chunks of m = T/(2C) and CP rank
// i holds chunks i and 2C−1−i (Tl = T/C local positions, in that order), so that every rank does the
// same causal work. position() maps a local position to its place in the sequence (RoPE, learned
// positions, the targets).
//
// Mechanisms, one code path: with A = the all-to-all group size (p2p: 1, a2a: C, a2a+p2p:
// --cp-a2a-size) and R = C/A ring size,
//   1. all-to-all inside groups of A consecutive CP ranks (Ulysses, DeepSpeed): q|k|v go from
//      sequence-sharded [B, Tl, heads] to head-sharded [A sources][B, Tl, heads/A] (kv heads fewer
//      than A are replicated to the ranks whose query heads read them);
//   2. a ring across the R groups (ring attention, Liu et al.; Megatron's p2p): the k|v of the
//      group's 2A chunks travel around it while each rank computes its queries against the chunks
//      it holds; the next transfer is in flight while the current blocks compute;
//   3. all-to-all back to sequence-sharded outputs.
// Each (query chunk, key chunk) pair is one attention block merged by log-sum-exp (attention.h);
// pairs whose keys all follow their queries are skipped, never computed. Backward: the same
// all-to-alls in reverse, and a ring that sends k|v again (R−1 transfers) with the k|v gradient
// accumulators travelling behind them (R transfers, the last one home).
//
//   forward                                        backward
//   a2a: q|k|v seq → heads, out heads → seq         a2a: d_out seq → heads, d_q|k|v heads → seq
//   ring: k|v, R−1 sends                            ring: k|v R−1 sends, d_k|v R sends
//
// Bytes one rank sends per attention layer and micro-batch (4-byte floats; N = B·Tl local tokens,
// Hl, KVl the rank's heads after TP, Ha = Hl/A, KVa = KVl/A or 1 when replicated,
// Sa = (Ha + 2·KVa)·D, W = 2·KVa·D):
//   forward   4·N·[(A−1)·(Sa + Ha·D) + (R−1)·A·W]
//   backward  4·N·[(A−1)·(Sa + Ha·D) + (R > 1 ? 2R−1 : 0)·A·W]
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "kernels/cpu/matmul.h"

namespace origami {

enum class CpComm { p2p, a2a, a2a_p2p };
CpComm parse_cp_comm(const std::string& s);  // "p2p" | "a2a" | "a2a+p2p"; else an Error naming it
const char* cp_comm_name(CpComm c);

// One rank's attention sizes for a batch: B rows of Tl local positions, H and KV its heads (after TP).
struct CpShape {
  int64_t B = 0, Tl = 0, H = 0, KV = 0, D = 0;
  int cp = 1, a2a = 1;  // C and A
  Precision precision = Precision::fp32;  // of the attention core's products (layers/attention.h)
  bool qkv_exact = false;                 // bf16: q|k|v rounded already (BlockDims::qkv_exact)
  int64_t N() const { return B * Tl; }
  int64_t Ha() const { return H / a2a; }
  int64_t KVa() const { return KV >= a2a ? KV / a2a : 1; }
  int64_t Sa() const { return (Ha() + 2 * KVa()) * D; }
  int64_t W() const { return 2 * KVa() * D; }
  int rings() const { return cp / a2a; }
  // Floats a layer keeps for backward: the output [N, H·D] and log-sum-exp [B, H, Tl] (in the
  // head-sharded order [A][B][Ha][Tl] when A > 1); with A > 1 also the head-sharded q|k|v [A][N][Sa]
  // and output [A][N][Ha·D].
  int64_t core_floats() const;
  // Work buffers (ContextParallel's, not kept): a2a staging and head-sharded gradients; ring k|v
  // buffers and gradient accumulators.
  int64_t workspace_floats() const;
  // The byte counts of the header's formulas.
  int64_t forward_bytes() const;
  int64_t backward_bytes() const;
};

// Since the last reset: the time the ring's transfers took (posted to done, as the executor saw it
// between blocks) and the part of it spent waiting (not hidden behind compute); the causal (query,
// key) pairs of this rank's forward blocks, summed over heads and batch rows (the load balance: equal
// on every CP rank under static CP; a sequence a rank runs alone, at degree 1, counts there whole);
// and the score tiles its forward attention computed (attention.h: fewer than the causal ones under
// document masking). Also kept without CP.
struct CpCounters {
  double transfer_s = 0, wait_s = 0;
  int64_t pairs = 0, tiles = 0;
};

// Document batching's CP degree per sequence (train/balance.h): the degrees a sequence may run at under
// CP size C, ascending: 1, the powers of two that divide C, and C. Degree d runs over aligned subgroups
// of d consecutive CP ranks.
std::vector<int> cp_degrees(int C);

class ContextParallel {
 public:
  ContextParallel();  // one rank: whole-sequence attention, no communication
  // Collective over cp: splits it into all-to-all groups of `a2a_size` consecutive ranks and the
  // rings across them.
  ContextParallel(Comm& cp, CpComm kind, int a2a_size);

  int size() const { return size_; }
  int rank() const { return rank_; }
  CpComm kind() const { return kind_; }
  int a2a_size() const { return a2a_->size(); }
  CpShape shape(int64_t B, int64_t Tl, int64_t H, int64_t KV, int64_t D) const {
    return {B, Tl, H, KV, D, size_, a2a_size()};
  }
  // Place in the sequence of local position t (of Tl = T/C).
  int64_t position(int64_t t, int64_t Tl) const;
  // Bytes sent by both of its groups since the last reset (the metrics' comm_bytes.cp).
  double bytes_sent() const { return a2a_->bytes_sent() + ring_->bytes_sent(); }
  const CpCounters& counters() const { return counters_; }
  void reset_counters();  // bytes and counters
  // The mechanism for the startup line, e.g. "a2a+p2p (all-to-all in groups of 2, ring of 2)", and
  // when the rank's kv_heads are fewer than the all-to-all group, that they are replicated.
  std::string describe(int64_t kv_heads) const;

  // Sizes the work buffers for a batch (the floats CpShape::workspace_floats counts).
  void reserve(const CpShape& s);
  // out [N, H·D] and lse ← attention of this rank's queries over the whole sequence's keys, from
  // qkv [N, S] (sequence-sharded, positions rotated). qkv_h and out_h ([A][N][Sa], [A][N][Ha·D];
  // null when A = 1) receive the head-sharded copies backward uses. doc [B, T] (null: causal only)
  // is the document of every position of the whole sequence, T = 2C chunks (document masking).
  void forward(float* out, float* lse, float* qkv_h, float* out_h, const float* qkv, const CpShape& s,
               const int32_t* doc = nullptr);
  // dqkv [N, S] (overwritten) ← from dout [N, H·D] and forward's results.
  void backward(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* qkv_h,
                const float* out, const float* out_h, const CpShape& s, const int32_t* doc = nullptr);

 private:
  struct Views;
  // The (query chunk, key chunk) blocks of this rank's queries against the k|v of ring group `kv_group`.
  template <typename F>
  void for_each_block(const CpShape& s, const int32_t* doc, int kv_group, const std::function<void()>& progress,
                      F&& fn);
  void forward_blocks(const Views& v, int kv_group, const std::function<void()>& progress);
  void backward_blocks(const Views& v, int kv_group, const std::function<void()>& progress);
  int64_t chunk(int cp_rank, int half) const { return half == 0 ? cp_rank : 2 * size_ - 1 - cp_rank; }

  int size_ = 1, rank_ = 0;
  CpComm kind_ = CpComm::p2p;
  std::unique_ptr<Comm> a2a_, ring_;  // consecutive groups of A CP ranks; the rings across them
  std::vector<float> stage_, dout_h_, dqkv_h_, kv_[2], dkv_[2], dkv_in_;
  CpCounters counters_;
};

}  // namespace origami
