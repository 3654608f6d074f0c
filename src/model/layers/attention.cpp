#include "model/layers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/reduce.h"

namespace origami {

namespace {
constexpr int64_t kBlock = 64;  // query and key tile size
// In bf16 a query tile meets up to this many keys at once (fewer, larger products: oneDNN's AMX
// kernels cost about as much per call at 64 keys as at 256); the score tiles counted stay kBlock wide.
// The scores of a query tile and a key chunk are compact, [nq][nk]: oneDNN runs its AMX kernels on
// compact operands only (strided ones get its gemm:jit kernels, 5-10x slower here).
constexpr int64_t kWideKeys = 256;

// Keys of a tile row: query i (block row r of the tile at i0) sees keys j ≤ i + diag of the key
// tile at j0, i.e. the first `visible` of its nk keys (≤ 0: none).
inline int64_t visible(int64_t i0, int64_t r, int64_t j0, int64_t nk, int64_t diag) {
  return std::min(nk, i0 + r + diag - j0 + 1);
}
// Key tiles a query tile [i0, i0+nq) reaches: [0, key_end).
inline int64_t key_end(int64_t i0, int64_t nq, int64_t Tk, int64_t diag) {
  return std::min(Tk, i0 + nq + std::min(diag, Tk));
}

// The document mask of one batch row (BlockDims): a key tile is empty for a query tile when its last
// key's document precedes the first query's (documents are nondecreasing, so then every key's
// precedes every query's) — the tiles before the one holding the first key of that document; a
// query row's first visible key of a tile is the first in its own document.
struct RowDocs {
  const int32_t *q = nullptr, *k = nullptr;  // null: no document mask
  RowDocs(const BlockDims& d, int64_t b) {
    if (d.qdoc) q = d.qdoc + b * d.doc_row, k = d.kdoc + b * d.doc_row;
  }
  // The first key tile [j0, …) of keys [0, kend) that the query tile at i0 sees (kend: none).
  int64_t first_tile(int64_t i0, int64_t kend) const {
    if (!q || kend <= 0) return 0;
    const int64_t j = std::lower_bound(k, k + kend, q[i0]) - k;
    return j == kend ? kend : j / kBlock * kBlock;
  }
  int64_t first_key(int64_t i, int64_t j0, int64_t nk) const {
    return q ? std::lower_bound(k + j0, k + j0 + nk, q[i]) - (k + j0) : 0;
  }
};

// n values rounded to bf16 into dst, as S.
void round_into(bf16* dst, const float* src, int64_t n) { to_bf16(dst, src, n); }
void round_into(float* dst, const float* src, int64_t n) { to_bf16_precision(dst, src, n); }

// ---- Precision (BlockDims::precision) ----
// fp32 (and double): the tile products read the inputs where they are (gemm<T>), the probabilities
// are relative to the running row max. bf16, FlashAttention-2's rounding points: q, k, v and dout
// rounded to bf16 (by each task, as it reads its rows: head_rows), the probabilities P and
// backward's dS rounded for the products that read them; products exact, sums, softmax and
// log-sum-exp in fp32.
// A copy is stored as S: bf16 for oneDNN's bf16 tiles, or float holding bf16 values for the fp32
// tiles where those are faster (bf16_tiles()) — the same values, so the same rounding points. A
// model on fp32 tiles rounds q, k and v in place beforehand (BlockDims::qkv_exact), and their rows
// are then read where they are.
// The forward rounds P relative to a power of two (probabilities below): bf16 rounding commutes with
// scaling by 2ⁿ, so P's rounded values do not depend on which keys came first (the tile order, a
// context-parallel layout's blocks), and the PyTorch oracle rounds them the same way from its
// whole-row max.

// The forward's probabilities p[j] = exp(p[j] − ref) of keys [first, allowed) of a row whose scores'
// running max is m; returns ref, the reference they are relative to: m in fp32; in bf16 a multiple of
// ln 2 at or above m, each p computed as 2^frac(u)·2^(floor(u) − n) from u = score·log2 e alone, its
// mantissa bits independent of the reference n, then rounded to bf16.
template <bool kRound, typename T>
T probabilities(T* p, int64_t first, int64_t allowed, T m) {
  if constexpr (kRound) {
    constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
    const float n = std::ceil(m * kLog2e);
    for (int64_t j = first; j < allowed; ++j) {
      const float u = p[j] * kLog2e, whole = std::floor(u);
      p[j] = exp_fast((u - whole) * kLn2) * pow2(std::max(whole - n, -127.f));  // whole ≤ n
    }
    round_into(p + first, p + first, allowed - first);
    return n * kLn2;
  } else {
    for (int64_t j = first; j < allowed; ++j) p[j] = exp_fast(p[j] - m);
    return m;
  }
}

// The tile products on operands as stored: gemm<T> (gemm.h), or oneDNN's bf16 tiles.
template <typename T>
void tile(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void tile(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda, const bf16* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  tile_gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// P or dS (n values) as the products after it read it: in bf16 rounded into `low`; else itself.
template <bool kRound, typename T, typename S>
const S* as_read(const T* values, S* low, int64_t n) {
  if constexpr (kRound) {
    round_into(low, values, n);
    return low;
  } else {
    return values;
  }
}

// Values already rounded (or in fp32, not to be) as the products read them: themselves, or their
// bf16 copy in `low` (exact).
template <typename T>
const T* stored(const T* values, T*, int64_t) {
  return values;
}
const bf16* stored(const float* values, bf16* low, int64_t n) {
  to_bf16(low, values, n);
  return low;
}

// dst[t·tok + d] += src[t·D + d] (or = where !add) for t < rows, d < D.
template <typename T>
void add_rows(T* dst, int64_t tok, const T* src, int64_t rows, int64_t D, bool add) {
  for (int64_t t = 0; t < rows; ++t) {
    if (!add) {
      std::copy(src + t * D, src + (t + 1) * D, dst + t * tok);
      continue;
    }
    for (int64_t d = 0; d < D; ++d) dst[t * tok + d] += src[t * D + d];
  }
}

// Rows of one head as the tile products read them: n rows of D values, ld apart.
template <typename S>
struct Rows {
  const S* p = nullptr;
  int64_t ld = 0;
};

// Rows [0, n) of head h of batch row b of x: in place (fp32), or in bf16 rounded into `copy`
// compactly, [n][D] — compact, as oneDNN's AMX kernels take their operands (strided ones get its
// gemm:jit kernels, 5-10x slower here). A task rounds the rows it reads while they are in its
// cache, rather than a pass over the whole block first.
// With `exact` values (BlockDims::qkv_exact) fp32 tiles read them in place, as in fp32.
template <bool kRound, typename S, typename T>
Rows<S> head_rows(Heads<const T> x, int64_t b, int64_t h, int64_t n, int64_t D, std::vector<S>& copy,
                  bool exact = false) {
  const T* p = x.p + b * x.row + h * D;
  if constexpr (kRound) {
    if constexpr (std::is_same_v<S, T>)
      if (exact) return {p, x.tok};
    if (copy.size() < size_t(n * D)) copy.resize(size_t(n * D));
    // Rows are a token apart (q, k and v of every head between: 4.5 KiB in GPT-2 L6 d384), a stride
    // the hardware prefetchers do not follow: fetching rows kAhead ahead made the rounding of such
    // rows from memory 1.4x faster on an AMX host.
    constexpr int64_t kAhead = 4;
    for (int64_t t = 0; t < n; ++t) {
      if (t + kAhead < n)
        for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(p + (t + kAhead) * x.tok) + byte);
      round_into(copy.data() + t * D, p + t * x.tok, D);
    }
    return {copy.data(), D};
  } else {
    return {p, x.tok};
  }
}

// attention_block_forward with its products on operands stored as S (kRound: in bf16, see Precision above).
template <typename T, typename S, bool kRound>
int64_t forward_tiles(Heads<T> out, Lse<T> lse, Heads<const T> q, Heads<const T> k, Heads<const T> v,
                      const BlockDims& dm) {
  const int64_t B = dm.B, Tq = dm.Tq, Tk = dm.Tk, H = dm.H, D = dm.D, group = dm.H / dm.KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
  constexpr int64_t kKeys = kRound ? kWideKeys : kBlock;  // keys per product
  int64_t tiles = 0;
  tile_gemm_library();  // chosen here, outside the region (gemm.h)
#pragma omp parallel reduction(+ : tiles)
  {
    // row_ref: the reference acc and row_sum are relative to; row_max: the running max.
    std::vector<T> scores(kBlock * kKeys), acc(kBlock * D), row_ref(kBlock), row_max(kBlock), row_sum(kBlock);
    std::vector<S> low(kRound ? kBlock * kKeys : 0), q_copy, k_copy, v_copy;
    Rows<S> K, V;
    int64_t kv_at = -1;  // the (batch row, kv head) K and V hold: the next query head of a group reuses them
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / group;
        const Rows<S> Q = head_rows<kRound>(q, b, h, Tq, D, q_copy, dm.qkv_exact);
        if (b * dm.KV + g != kv_at) {
          K = head_rows<kRound>(k, b, g, Tk, D, k_copy, dm.qkv_exact);
          V = head_rows<kRound>(v, b, g, Tk, D, v_copy, dm.qkv_exact);
          kv_at = b * dm.KV + g;
        }
        T* O = out.p + b * out.row + h * D;
        T* L = lse.p + b * lse.row + h * lse.head;
        const RowDocs docs(dm, b);
        for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
          const int64_t nq = std::min(kBlock, Tq - i0), kend = key_end(i0, nq, Tk, dm.diag);
          if (kend <= 0) continue;
          // The running result in unnormalised form: acc = out·row_sum relative to row_ref = lse.
          for (int64_t r = 0; r < nq; ++r) {
            row_ref[r] = row_max[r] = L[i0 + r];
            row_sum[r] = T(1);
            for (int64_t d = 0; d < D; ++d) acc[r * D + d] = O[(i0 + r) * out.tok + d];
          }
          for (int64_t j0 = docs.first_tile(i0, kend); j0 < kend; j0 += kKeys) {
            const int64_t nk = std::min(kKeys, kend - j0);
            tiles += (nk + kBlock - 1) / kBlock;
            // scores[nq, nk] = scale · Q_i·K_jᵀ
            tile(false, true, nq, nk, D, scale, Q.p + i0 * Q.ld, Q.ld, K.p + j0 * K.ld, K.ld, T(0), scores.data(), nk);
            for (int64_t r = 0; r < nq; ++r) {
              T* p = scores.data() + r * nk;
              // This row sees keys [first, allowed) of the tile.
              const int64_t allowed = visible(i0, r, j0, nk, dm.diag), first = docs.first_key(i0 + r, j0, nk);
              if (allowed <= first) {
                std::fill(p, p + nk, T(0));
                continue;
              }
              const T m = std::max(row_max[r], lane_max(p + first, allowed - first));
              std::fill(p, p + first, T(0));
              const T ref = probabilities<kRound>(p, first, allowed, m);
              const T rescale = std::exp(row_ref[r] - ref);  // 0 while no key was seen (−∞)
              // Σ P as P·V reads it
              const T sum = lane_sum<T>(allowed - first, [p, first](int64_t j) { return p[first + j]; });
              std::fill(p + allowed, p + nk, T(0));
              row_sum[r] = row_sum[r] * rescale + sum;
              row_ref[r] = ref, row_max[r] = m;
              T* a = acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
            }
            // acc[nq, D] += P·V_j
            tile(false, false, nq, D, nk, T(1), stored(scores.data(), low.data(), nq * nk), nk, V.p + j0 * V.ld, V.ld,
                 T(1), acc.data(), D);
          }
          for (int64_t r = 0; r < nq; ++r) {
            T* o = O + (i0 + r) * out.tok;
            const T inv = T(1) / row_sum[r];
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
            L[i0 + r] = row_ref[r] + std::log(row_sum[r]);
          }
        }
      }
  }
  return tiles;
}

// attention_block_backward with its products on operands stored as S (kRound: in bf16, see Precision
// above); delta reads dout in fp32.
template <typename T, typename S, bool kRound>
int64_t backward_tiles(Heads<T> dq, Heads<T> dk, Heads<T> dv, Heads<const T> dout, Heads<const T> q, Heads<const T> k,
                       Heads<const T> v, Heads<const T> out, Lse<const T> lse, const BlockDims& dm) {
  const int64_t B = dm.B, Tq = dm.Tq, Tk = dm.Tk, D = dm.D, KV = dm.KV, group = dm.H / dm.KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
  constexpr int64_t kKeys = kRound ? kWideKeys : kBlock;  // keys per product
  int64_t tiles = 0;
  tile_gemm_library();  // chosen here, outside the region (gemm.h)
  // One task per (batch row, kv head): it owns dK, dV of that kv head and dQ of its query heads.
#pragma omp parallel reduction(+ : tiles)
  {
    std::vector<T> prob(kBlock * kKeys), dprob(kBlock * kKeys), delta(static_cast<size_t>(Tq));
    std::vector<S> prob_low(kRound ? kBlock * kKeys : 0), dprob_low(kRound ? kBlock * kKeys : 0), q_copy, k_copy,
        v_copy, dout_copy;
    // In bf16 the task's gradients accumulate in compact fp32 [rows][D] (oneDNN's AMX kernels take
    // compact operands only), added to dq, dk, dv when done; in fp32 the products add to them directly.
    std::vector<T> acc_q(kRound ? Tq * D : 0), acc_k(kRound ? Tk * D : 0), acc_v(kRound ? Tk * D : 0);
    const int64_t ldq = kRound ? D : dq.tok, ldk = kRound ? D : dk.tok, ldv = kRound ? D : dv.tok;  // of dQ, dK, dV
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g) {
        const Rows<S> K = head_rows<kRound>(k, b, g, Tk, D, k_copy, dm.qkv_exact),
                      V = head_rows<kRound>(v, b, g, Tk, D, v_copy, dm.qkv_exact);
        T* dK = kRound ? acc_k.data() : dk.p + b * dk.row + g * D;
        T* dV = kRound ? acc_v.data() : dv.p + b * dv.row + g * D;
        std::fill(acc_k.begin(), acc_k.end(), T(0));
        std::fill(acc_v.begin(), acc_v.end(), T(0));
        const RowDocs docs(dm, b);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const Rows<S> Q = head_rows<kRound>(q, b, h, Tq, D, q_copy, dm.qkv_exact),
                        dO = head_rows<kRound>(dout, b, h, Tq, D, dout_copy);
          T* dQ = kRound ? acc_q.data() : dq.p + b * dq.row + h * D;
          std::fill(acc_q.begin(), acc_q.end(), T(0));
          const T* O = out.p + b * out.row + h * D;
          const T* dOv = dout.p + b * dout.row + h * D;
          const T* L = lse.p + b * lse.row + h * lse.head;
          for (int64_t t = 0; t < Tq; ++t) {
            const T *dOt = dOv + t * dout.tok, *Ot = O + t * out.tok;
            // Σ_d dO·O = Σ_j P_ij·dP_ij over all keys of the query row
            delta[size_t(t)] = lane_sum<T>(D, [dOt, Ot](int64_t d) { return dOt[d] * Ot[d]; });
          }
          for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
            const int64_t nq = std::min(kBlock, Tq - i0), kend = key_end(i0, nq, Tk, dm.diag);
            for (int64_t j0 = docs.first_tile(i0, kend); j0 < kend; j0 += kKeys) {
              const int64_t nk = std::min(kKeys, kend - j0);
              tiles += (nk + kBlock - 1) / kBlock;
              tile(false, true, nq, nk, D, scale, Q.p + i0 * Q.ld, Q.ld, K.p + j0 * K.ld, K.ld, T(0), prob.data(), nk);
              for (int64_t r = 0; r < nq; ++r) {  // P of keys [first, allowed), 0 elsewhere
                T* p = prob.data() + r * nk;
                const int64_t allowed = std::max<int64_t>(0, visible(i0, r, j0, nk, dm.diag));
                const int64_t first = std::min(allowed, docs.first_key(i0 + r, j0, nk));
                std::fill(p, p + first, T(0));
                for (int64_t j = first; j < allowed; ++j) p[j] = exp_fast(p[j] - L[i0 + r]);
                std::fill(p + allowed, p + nk, T(0));
              }
              // dV_j += Pᵀ·dO_i ; dP = dO_i·V_jᵀ
              tile(true, false, nk, D, nq, T(1), as_read<kRound>(prob.data(), prob_low.data(), nq * nk), nk,
                   dO.p + i0 * dO.ld, dO.ld, T(1), dV + j0 * ldv, ldv);
              tile(false, true, nq, nk, D, T(1), dO.p + i0 * dO.ld, dO.ld, V.p + j0 * V.ld, V.ld, T(0),
                   dprob.data(), nk);
              // dS = P ∘ (dP − delta_i)
              for (int64_t r = 0; r < nq; ++r) {
                T *p = prob.data() + r * nk, *dp = dprob.data() + r * nk;
                const T dl = delta[size_t(i0 + r)];
                for (int64_t j = 0; j < nk; ++j) dp[j] = p[j] * (dp[j] - dl);
              }
              // dQ_i += scale·dS·K_j ; dK_j += scale·dSᵀ·Q_i
              const S* dS = as_read<kRound>(dprob.data(), dprob_low.data(), nq * nk);
              tile(false, false, nq, D, nk, scale, dS, nk, K.p + j0 * K.ld, K.ld, T(1), dQ + i0 * ldq, ldq);
              tile(true, false, nk, D, nq, scale, dS, nk, Q.p + i0 * Q.ld, Q.ld, T(1), dK + j0 * ldk, ldk);
            }
          }
          if constexpr (kRound) add_rows(dq.p + b * dq.row + h * D, dq.tok, acc_q.data(), Tq, D, !dm.overwrite);
        }
        if constexpr (kRound) {
          add_rows(dk.p + b * dk.row + g * D, dk.tok, acc_k.data(), Tk, D, !dm.overwrite);
          add_rows(dv.p + b * dv.row + g * D, dv.tok, acc_v.data(), Tk, D, !dm.overwrite);
        }
      }
  }
  return tiles;
}

}  // namespace

template <typename T>
int64_t attention_block_forward(Heads<T> out, Lse<T> lse, Heads<const T> q, Heads<const T> k, Heads<const T> v,
                                const BlockDims& dm) {
  if constexpr (std::is_same_v<T, float>) {
    if (dm.precision == Precision::bf16)
      return bf16_tiles() == Bf16Tiles::onednn ? forward_tiles<float, bf16, true>(out, lse, q, k, v, dm)
                                               : forward_tiles<float, float, true>(out, lse, q, k, v, dm);
  }
  ORIGAMI_ASSERT(dm.precision == Precision::fp32);  // bf16 is float-only
  return forward_tiles<T, T, false>(out, lse, q, k, v, dm);
}

template <typename T>
int64_t attention_block_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, Heads<const T> dout, Heads<const T> q,
                                 Heads<const T> k, Heads<const T> v, Heads<const T> out, Lse<const T> lse,
                                 const BlockDims& dm) {
  if constexpr (std::is_same_v<T, float>) {
    if (dm.precision == Precision::bf16)
      return bf16_tiles() == Bf16Tiles::onednn
                 ? backward_tiles<float, bf16, true>(dq, dk, dv, dout, q, k, v, out, lse, dm)
                 : backward_tiles<float, float, true>(dq, dk, dv, dout, q, k, v, out, lse, dm);
  }
  ORIGAMI_ASSERT(dm.precision == Precision::fp32);
  return backward_tiles<T, T, false>(dq, dk, dv, dout, q, k, v, out, lse, dm);
}

bool qkv_rounded_in_place(Precision p) { return p == Precision::bf16 && bf16_tiles() == Bf16Tiles::fp32; }

int64_t attention_scratch_bytes(int64_t T, int64_t D, Precision p) {
  return p == Precision::bf16 ? (4 + 3) * 4 * T * D : 0;
}

// The whole sequence is one causal block over the packed qkv rows (documents: the same ids for both).
template <typename T>
int64_t attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                          const int32_t* doc, Precision p, bool qkv_exact) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D;
  std::fill(out, out + B * Tn * HD, T(0));
  std::fill(lse, lse + B * H * Tn, -std::numeric_limits<T>::infinity());
  return attention_block_forward<T>({out, Tn * HD, HD}, {lse, H * Tn, Tn}, {qkv, Tn * S, S}, {qkv + H * D, Tn * S, S},
                                    {qkv + (H + KV) * D, Tn * S, S},
                                    {B, Tn, Tn, H, KV, D, 0, doc, doc, Tn, p, qkv_exact});
}

template <typename T>
int64_t attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int64_t B, int64_t Tn,
                           int64_t H, int64_t KV, int64_t D, const int32_t* doc, Precision p, bool qkv_exact) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D;
  const bool overwrite = p == Precision::bf16;  // (BlockDims::overwrite)
  if (!overwrite) std::fill(dqkv, dqkv + B * Tn * S, T(0));
  return attention_block_backward<T>({dqkv, Tn * S, S}, {dqkv + H * D, Tn * S, S}, {dqkv + (H + KV) * D, Tn * S, S},
                                     {dout, Tn * HD, HD}, {qkv, Tn * S, S}, {qkv + H * D, Tn * S, S},
                                     {qkv + (H + KV) * D, Tn * S, S}, {out, Tn * HD, HD}, {lse, H * Tn, Tn},
                                     {B, Tn, Tn, H, KV, D, 0, doc, doc, Tn, p, qkv_exact, overwrite});
}

#define ORIGAMI_ATTENTION(T)                                                                                        \
  template int64_t attention_forward<T>(T*, T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,          \
                                        const int32_t*, Precision, bool);                                           \
  template int64_t attention_backward<T>(T*, const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,     \
                                         int64_t, int64_t, const int32_t*, Precision, bool);                        \
  template int64_t attention_block_forward<T>(Heads<T>, Lse<T>, Heads<const T>, Heads<const T>, Heads<const T>,     \
                                              const BlockDims&);                                                    \
  template int64_t attention_block_backward<T>(Heads<T>, Heads<T>, Heads<T>, Heads<const T>, Heads<const T>,        \
                                               Heads<const T>, Heads<const T>, Heads<const T>, Lse<const T>,        \
                                               const BlockDims&);
ORIGAMI_ATTENTION(float)
ORIGAMI_ATTENTION(double)
#undef ORIGAMI_ATTENTION

}  // namespace origami
