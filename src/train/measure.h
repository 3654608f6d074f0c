// Timing this machine's kernels, every rank at once (each with its share of the cores, as in a
// training run on the same ranks): the layer GEMMs of a model and the attention core. `origami
// profile` writes what it measures into a cluster.json; document batching's balancer measures its
// costs with it at start (`train --balance-costs measure`).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "core/timer.h"
#include "kernels/cpu/matmul.h"
#include "model/config.h"

namespace origami {

// Seconds per call of fn, every rank at once and the same number of times (fn may communicate):
// a warm-up call sizes the count to about `seconds` (at least `min_calls`); the slowest rank's mean.
template <typename Fn>
double timed(Comm& world, double seconds, int min_calls, Fn&& fn) {
  world.barrier();
  Timer t;
  fn();
  const double once = world.all_reduce_value(t.ms() / 1000, ReduceOp::max);
  const int calls = std::max(min_calls, int(std::min(1e4, seconds / std::max(once, 1e-9))));
  world.barrier();
  t.reset();
  for (int i = 0; i < calls; ++i) fn();
  return world.all_reduce_value(t.ms() / 1000 / calls, ReduceOp::max);
}

// The least of `trials` timed() runs of seconds/trials each: a stall on a shared host (another
// process, the hypervisor) spoils one trial, not the figure.
template <typename Fn>
double timed_best(Comm& world, double seconds, int min_calls, Fn&& fn, int trials = 3) {
  double best = 0;
  for (int i = 0; i < trials; ++i) {
    const double t = timed(world, seconds / trials, min_calls, fn);
    best = i == 0 ? t : std::min(best, t);
  }
  return best;
}

// C[M, N] = op(A)·op(B), A [M, K] (ta: stored [K, M]), B [K, N] (tb: stored [N, K]).
struct GemmShape {
  int64_t M, N, K;
  bool ta, tb;
  bool varying = false;  // an expert's: M or K set by the routing, so matmul's Sizes::varying path
  double flops() const { return 2.0 * double(M) * double(N) * double(K); }
  double elements() const { return double(M) * double(K) + double(K) * double(N) + double(M) * double(N); }  // operands
};

// The layer GEMMs of a training step of `cfg` on B×T tokens (one rank, no TP): forward y = x·Wᵀ and
// backward dx = dy·W, dW = dyᵀ·x, for QKV, the attention output, the MLP (or one expert's, with its
// share of the tokens) and the LM head.
std::vector<GemmShape> model_gemm_shapes(const ModelConfig& c, int64_t B, int64_t T);
// Squares from 128 to 2048 and slabs of a 1024 × 4096 weight (a cluster file without a model).
std::vector<GemmShape> default_gemm_shapes();

// Seconds per GEMM of shape s in precision p as training's matmul runs it (bf16: the B operand a
// weight's bf16 copy, rounded once; the other rounded at the call; a weight gradient, ta, added into
// C), the best of three trials of about seconds/3. cold: every call's operands come from memory, not
// the caches.
double time_gemm(Comm& world, const GemmShape& s, Precision p, double seconds, bool cold = false);
// The copies of its operands a cold call of shape s cycles over: together 128 MiB (four times a 32 MiB
// L3), at most 1024; 1 for a call whose operands alone fill that, which runs from memory either way.
size_t cold_copies(const GemmShape& s, Precision p);
// The bytes time_gemm holds for one copy of a call's operands (fp32 A, B, C and the bf16 weight copy).
size_t gemm_call_bytes(const GemmShape& s, Precision p);

// Seconds per forward + backward of the attention core over one row of T tokens, H query and KV
// key/value heads of D, in precision p: one causal sequence (doc_len 0), or documents of doc_len
// tokens each (document-masked, as document batching packs them).
double time_attention(Comm& world, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t doc_len, Precision p,
                      double seconds);

}  // namespace origami
