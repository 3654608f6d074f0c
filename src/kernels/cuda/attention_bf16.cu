// Fused causal attention in bf16 on the tensor cores (cuda_kernels.h), FlashAttention-2's scheme and
// rounding points: q, k, v rounded to bf16 as they are read; scores S = q·kᵀ accumulated in fp32 and
// the softmax in fp32; the probabilities rounded to bf16 for P·V. Backward rounds dout, P and
// dS = P∘(dP − delta) for its products, accumulating in fp32. No atomics: dq is its own kernel (a
// block per query tile walking the key tiles), dk and dv another (a block per key tile walking the
// query tiles), so a run repeats bit for bit.
//
// Each block has 8 warps; a warp owns 16 rows (queries, or keys in the dk/dv kernel) and multiplies
// 16×16 by 16×8 tiles with mma.sync.m16n8k16 (bf16 in, fp32 out). Fragment layouts (PTX ISA,
// "Matrix Fragments for mma.m16n8k16"), lane = 4·g + t:
//   A (16×16, row-major): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16×8, given as Y = Bᵀ, 8×16 row-major): b0 = Y[g][2t, 2t+1], b1 = Y[g][2t+8, 2t+9]
//   C (16×8 fp32): c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// So every product is X·Yᵀ with both operands row-major along the summed index, read as bf16 pairs
// from shared memory; a C tile pair becomes an A fragment in registers (the probabilities, dS).
#include <cuda_bf16.h>

#include <map>
#include <mutex>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace origami::cuda {

namespace {
constexpr int kWarps = 8, kRows = 16 * kWarps, kTile = 64;  // rows per block; keys (queries) per tile
constexpr int kPad = 8;                                        // bf16 elements padding a shared row

__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A shared tile of bf16 rows with `ld` elements per row.
struct Tile {
  __nv_bfloat16* p;
  int ld;
  __device__ __nv_bfloat16* row(int r) const { return p + r * ld; }
};

// A fragments of the warp's 16 rows [r0, r0+16) of one head, all D/16 steps, read from global memory.
template <int D>
__device__ void load_a(uint32_t a[D / 16][4], const __nv_bfloat16* src, int64_t r0, int64_t T, int64_t tok) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  auto at = [&](int64_t r, int c) { return r < T ? pair(src + r * tok + c) : 0u; };
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    a[k][0] = at(r0 + g, 16 * k + 2 * t), a[k][1] = at(r0 + g + 8, 16 * k + 2 * t);
    a[k][2] = at(r0 + g, 16 * k + 2 * t + 8), a[k][3] = at(r0 + g + 8, 16 * k + 2 * t + 8);
  }
}

// The 16×64 fp32 tile c as A fragments (4 steps of 16 columns), rounded to bf16.
__device__ void to_a(uint32_t a[4][4], const float c[8][4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[k][0] = pack(c[2 * k][0], c[2 * k][1]), a[k][1] = pack(c[2 * k][2], c[2 * k][3]);
    a[k][2] = pack(c[2 * k + 1][0], c[2 * k + 1][1]), a[k][3] = pack(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

template <int N8>
__device__ void zero(float acc[N8][4]) {
#pragma unroll
  for (int n = 0; n < N8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// Row and column of element e of n-tile n in a warp's 16×64 C tile (rows from r0, columns from c0).
struct Place {
  int64_t row, col;
};
__device__ Place place(int64_t r0, int64_t c0, int n, int e) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  return {r0 + g + (e >= 2 ? 8 : 0), c0 + 8 * n + 2 * t + (e & 1)};
}

// ---- Asynchronous tile copies and ldmatrix (sm_80+) ----
// 16 bytes global → shared without passing through registers; zero-filled when `valid` is false.
__device__ __forceinline__ void copy16(void* smem_dst, const void* src, bool valid) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void copies_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Rows [r0, r0 + kTile) of one head into a row-major tile, asynchronously (rows past T: zeros).
template <int D>
__device__ void copy_rows(Tile t, const __nv_bfloat16* src, int64_t r0, int64_t T, int64_t tok) {
  for (int e = threadIdx.x; e < kTile * D / 8; e += blockDim.x) {
    const int r = e / (D / 8), d = e % (D / 8) * 8;
    const bool valid = r0 + r < T;
    copy16(t.row(r) + d, src + (valid ? r0 + r : 0) * tok + d, valid);
  }
}
// Four 8×8 bf16 matrices from shared memory, lane l giving the address of row l % 8 of matrix l / 8;
// each lane gets per matrix the pair (row l/4, columns 2(l%4), +1), or with .trans (rows 2(l%4), +1; column l/4).
__device__ __forceinline__ void ldmatrix4(uint32_t r[4], const __nv_bfloat16* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix4_trans(uint32_t r[4], const __nv_bfloat16* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// acc (16 × 64) += A (16 × 16·K16) · Yᵀ for the 64 rows of y (row-major along the summed index):
// the B fragments of two n-tiles per ldmatrix.
template <int K16>
__device__ void mma_rows_ld(float acc[8][4], const uint32_t a[K16][4], Tile y) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < K16; ++k)
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      uint32_t f[4];
      ldmatrix4(f, y.row(8 * (n + (l >> 4)) + (l & 7)) + 16 * k + ((l >> 3) & 1) * 8);
      mma(acc[n], a[k], f[0], f[1]);
      mma(acc[n + 1], a[k], f[2], f[3]);
    }
}
// acc (16 × D) += A (16 × 64, as fragments) · Y, Y a row-major [64][D] tile (the summed index along
// its rows: V under P, K under dS, dout and q under Pᵀ and dSᵀ): B fragments by ldmatrix.trans.
template <int D>
__device__ void mma_tile(float acc[D / 8][4], const uint32_t p[4][4], Tile v) {
  const int l = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t f[4];
      ldmatrix4_trans(f, v.row(16 * k + ((l >> 3) & 1) * 8 + (l & 7)) + 8 * (n + (l >> 4)));
      mma(acc[n], p[k], f[0], f[1]);
      mma(acc[n + 1], p[k], f[2], f[3]);
    }
}

// One key tile of the forward for a warp's 16 query rows: scores s (16 × 64, unscaled) masked and
// scaled, the running max and sum updated, o rescaled and o += P·V.
template <int D>
__device__ void softmax_pv(float s[8][4], float o[D / 8][4], float mx[2], float sum[2], const Dims& m, int64_t b,
                           int64_t w0, int64_t j0, Tile v) {
  float tile_max[2] = {-INFINITY, -INFINITY};
  const bool full = !m.doc && j0 + kTile - 1 <= w0 && w0 + 15 < m.T;  // every key visible to every row
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Place p = place(w0, j0, n, e);
      const bool vis = full || (p.row < m.T && p.col < m.T && m.visible(b, p.row, p.col));
      s[n][e] = vis ? s[n][e] * m.scale : -INFINITY;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
    }
  float keep[2], base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // the row's 4 threads agree on its max
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float new_max = fmaxf(mx[r], tile_max[r]);
    base[r] = new_max == -INFINITY ? 0.f : new_max;  // a row with no key yet: exp(−∞) = 0 below
    keep[r] = __expf(mx[r] - base[r]);
    mx[r] = new_max;
    sum[r] *= keep[r];
  }
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) sum[e >> 1] += (s[n][e] = __expf(s[n][e] - base[e >> 1]));
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] *= keep[0], o[n][1] *= keep[0], o[n][2] *= keep[1], o[n][3] *= keep[1];
  uint32_t pa[4][4];
  to_a(pa, s);
  mma_tile<D>(o, pa, v);
}

// Tile `which` (0 or 1) of two-stage buffering in shared memory: four row-major [kTile][D + kPad] tiles,
// stage s's pair at 2s and 2s + 1 (by arithmetic: an array of tiles indexed by the stage goes to local memory).
template <int D>
__device__ Tile staged(__nv_bfloat16* smem, int64_t stage, int which) {
  return {smem + (2 * stage + which) * kTile * (D + kPad), D + kPad};
}

// A block's walk over its tiles in two stages of shared memory: the next item's asynchronous copies
// run while this one is computed. `item` is the first (valid when `more`); advance(x) moves x to the
// next item and says whether there is one; fetch(stage, x) issues x's copies into the stage and commits
// them; fn(stage, x) runs between two barriers, its stage's copies complete.
template <typename Item, typename Advance, typename Fetch, typename Fn>
__device__ void staged_walk(Item item, bool more, Advance&& advance, Fetch&& fetch, Fn&& fn) {
  if (more) fetch(0, item);
  for (int stage = 0; more; stage ^= 1) {
    Item after = item;
    const bool next = advance(after);
    if (next) {
      fetch(stage ^ 1, after);
      copies_wait<1>();
    } else {
      copies_wait<0>();
    }
    __syncthreads();
    fn(stage, item);
    __syncthreads();  // the stage is refilled next iteration
    item = after, more = next;
  }
}

// The key tiles a block of queries [i0, i1) sees, in order, K and V staged (staged_walk): fn(k tile,
// v tile, j0). Tiles before the block's first document are empty (documents nondecreasing), the rest not.
template <int D, typename Fn>
__device__ void over_key_tiles(__nv_bfloat16* smem, const Dims& m, int64_t b, int64_t i0, int64_t i1,
                               const __nv_bfloat16* kh, const __nv_bfloat16* vh, Fn&& fn) {
  int64_t first = 0;
  while (first < i1 && m.empty(b, i0, i1, first, min(m.T, first + kTile))) first += kTile;
  staged_walk(
      first, first < i1, [&](int64_t& j0) { return (j0 += kTile) < i1; },
      [&](int stage, int64_t j0) {
        copy_rows<D>(staged<D>(smem, stage, 0), kh, j0, m.T, m.S), copy_rows<D>(staged<D>(smem, stage, 1), vh, j0, m.T, m.S);
        copies_commit();
      },
      [&](int stage, int64_t j0) { fn(staged<D>(smem, stage, 0), staged<D>(smem, stage, 1), j0); });
}

// ---- Forward: grid (⌈T/128⌉, H, B); warp w owns queries i0 + 16w .. +16 ----
// Heads up to 64 wide: at most 128 registers a thread, so two blocks share a multiprocessor (at 136,
// one: 0.20 -> 0.25 ms at D = 64); 128 wide would spill there.
template <int D>
__global__ void __launch_bounds__(32 * kWarps, D <= 64 ? 2 : 1) forward_bf16(float* out, float* lse, const __nv_bfloat16* qkv, Dims m) {
  extern __shared__ __align__(16) __nv_bfloat16 smem[];
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / m.group, i0 = int64_t(blockIdx.x) * kRows;
  const int64_t i1 = min(m.T, i0 + kRows), w0 = i0 + 16 * (threadIdx.x >> 5);
  uint32_t qa[D / 16][4];
  load_a<D>(qa, qkv + m.q_at(b, 0, h), w0, m.T, m.S);
  float o[D / 8][4], mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};
  zero<D / 8>(o);
  over_key_tiles<D>(smem, m, b, i0, i1, qkv + m.k_at(b, 0, g), qkv + m.v_at(b, 0, g), [&](Tile k, Tile v, int64_t j0) {
    if (w0 >= m.T || j0 > w0 + 15) return;  // the warp's queries see none of these keys
    float s[8][4];
    zero<8>(s);
    mma_rows_ld<D / 16>(s, qa, k);
    softmax_pv<D>(s, o, mx, sum, m, b, w0, j0, v);
  });
  const int gq = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    const int64_t i = w0 + gq + 8 * r;
    if (i >= m.T) continue;
    if (t == 0) lse[m.l_at(b, i, h)] = mx[r] + logf(sum[r]);
    float* dst = out + m.o_at(b, i, h);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) dst[8 * n + 2 * t] = o[n][2 * r] / sum[r], dst[8 * n + 2 * t + 1] = o[n][2 * r + 1] / sum[r];
  }
}

// The probabilities and dS of a warp's 16×64 tile (rows r0.. against columns c0..; `rows_are_queries`
// says which is which): p = exp(s·scale − lse_query) where visible, else 0; ds = p∘(dp − delta_query).
// lse and delta of the rows are given per thread (rows g, g+8), of the columns read from shared memory.
// full: every pair of the tile is visible (no test per element).
__device__ void probabilities(float s[8][4], float dp[8][4], const Dims& m, int64_t b, int64_t r0, int64_t c0,
                              bool rows_are_queries, bool full, const float row_lse[2], const float row_delta[2],
                              const float* col_lse, const float* col_delta) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Place p = place(r0, c0, n, e);
      const int64_t i = rows_are_queries ? p.row : p.col, j = rows_are_queries ? p.col : p.row;
      const bool vis = full || (p.row < m.T && p.col < m.T && m.visible(b, i, j));
      const int c = 8 * n + 2 * (threadIdx.x & 3) + (e & 1);
      const float L = rows_are_queries ? row_lse[e >> 1] : col_lse[c];
      const float dl = rows_are_queries ? row_delta[e >> 1] : col_delta[c];
      const float pr = vis ? __expf(s[n][e] * m.scale - L) : 0.f;
      s[n][e] = pr;
      dp[n][e] = pr * (dp[n][e] - dl);
    }
}

// ---- dq: grid (⌈T/128⌉, H, B); warp w owns queries i0 + 16w .. +16; the forward's key tiles ----
// Up to D = 64, two blocks a multiprocessor, as the forward: 128 registers with a few spilled beat 170
// with one block (0.672 against 0.725 ms for the whole backward on an H200; dk/dv, spilling 1 KiB at
// 128, is faster at one block).
template <int D>
__global__ void __launch_bounds__(32 * kWarps, D <= 64 ? 2 : 1) dq_bf16(float* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                                       const float* lse, const float* delta, Dims m) {
  extern __shared__ __align__(16) __nv_bfloat16 smem[];
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / m.group, i0 = int64_t(blockIdx.x) * kRows;
  const int64_t i1 = min(m.T, i0 + kRows), w0 = i0 + 16 * (threadIdx.x >> 5);
  const int gq = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  uint32_t qa[D / 16][4], oa[D / 16][4];
  load_a<D>(qa, qkv + m.q_at(b, 0, h), w0, m.T, m.S);
  load_a<D>(oa, dout + m.o_at(b, 0, h), w0, m.T, m.H * m.D);
  float L[2], dl[2], dq[D / 8][4];
  for (int r = 0; r < 2; ++r) {
    const int64_t i = w0 + gq + 8 * r;
    L[r] = i < m.T ? lse[m.l_at(b, i, h)] : 0.f, dl[r] = i < m.T ? delta[m.l_at(b, i, h)] : 0.f;
  }
  zero<D / 8>(dq);
  over_key_tiles<D>(smem, m, b, i0, i1, qkv + m.k_at(b, 0, g), qkv + m.v_at(b, 0, g), [&](Tile k, Tile v, int64_t j0) {
    if (w0 >= m.T || j0 > w0 + 15) return;
    float s[8][4], dp[8][4];
    zero<8>(s), zero<8>(dp);
    mma_rows_ld<D / 16>(s, qa, k);   // S = q·kᵀ
    mma_rows_ld<D / 16>(dp, oa, v);  // dP = dout·vᵀ
    probabilities(s, dp, m, b, w0, j0, true, !m.doc && j0 + kTile - 1 <= w0 && w0 + 15 < m.T, L, dl, nullptr,
                  nullptr);
    uint32_t da[4][4];
    to_a(da, dp);
    mma_tile<D>(dq, da, k);  // dq += dS·k
  });
  for (int r = 0; r < 2; ++r) {
    const int64_t i = w0 + gq + 8 * r;
    if (i >= m.T) continue;
    float* dst = dqkv + m.q_at(b, i, h);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      dst[8 * n + 2 * t] = dq[n][2 * r] * m.scale, dst[8 * n + 2 * t + 1] = dq[n][2 * r + 1] * m.scale;
  }
}

// The (query head, query tile) pairs that see a block of keys [j0, j1) of kv head g, in order (the
// group's heads, each over the query tiles from j0 on; empty ones skipped); h reaches `end` after the last.
struct QueryTiles {
  struct At {
    int64_t h, i0;
  };
  const Dims& m;
  int64_t b, j0, j1, end;
  // x where it is, or the first pair after it.
  __device__ void settle(At& x) const {
    while (x.h < end && (x.i0 >= m.T || m.empty(b, x.i0, min(m.T, x.i0 + kTile), j0, j1)))
      if ((x.i0 += kTile) >= m.T) ++x.h, x.i0 = j0;
  }
  // x to the next pair; whether there is one.
  __device__ bool advance(At& x) const {
    if ((x.i0 += kTile) >= m.T) ++x.h, x.i0 = j0;
    settle(x);
    return x.h < end;
  }
};

// ---- dk, dv: grid (⌈T/128⌉, KV, B); warp w owns keys j0 + 16w .. +16, over the group's query heads ----
// Each query tile's q and dout rows are copied in two stages (the next tile's during this one's
// compute); both serve twice, along D for Sᵀ and dPᵀ and along the queries (ldmatrix.trans) for dk and
// dv. The tile's lse and delta go into shared memory beside them.
template <int D>
__global__ void __launch_bounds__(32 * kWarps) dkv_bf16(float* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                                        const float* lse, const float* delta, Dims m) {
  extern __shared__ __align__(16) __nv_bfloat16 smem[];
  auto qs = [&](int stage) { return staged<D>(smem, stage, 0); };
  auto os = [&](int stage) { return staged<D>(smem, stage, 1); };
  float* cols = reinterpret_cast<float*>(smem + 4 * kTile * (D + kPad));  // [stage][lse kTile, delta kTile]
  const int64_t b = blockIdx.z, g = blockIdx.y, j0 = int64_t(blockIdx.x) * kRows;
  const int64_t j1 = min(m.T, j0 + kRows), w0 = j0 + 16 * (threadIdx.x >> 5);
  const int gk = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  uint32_t ka[D / 16][4], va[D / 16][4];
  load_a<D>(ka, qkv + m.k_at(b, 0, g), w0, m.T, m.S);
  load_a<D>(va, qkv + m.v_at(b, 0, g), w0, m.T, m.S);
  float dk[D / 8][4], dv[D / 8][4];
  zero<D / 8>(dk), zero<D / 8>(dv);
  const QueryTiles tiles{m, b, j0, j1, (g + 1) * m.group};
  using At = QueryTiles::At;
  At first{g * m.group, j0};
  tiles.settle(first);
  auto fetch = [&](int stage, At x) {
    copy_rows<D>(qs(stage), qkv + m.q_at(b, 0, x.h), x.i0, m.T, m.S);
    copy_rows<D>(os(stage), dout + m.o_at(b, 0, x.h), x.i0, m.T, m.H * m.D);
    copies_commit();
    for (int c = threadIdx.x; c < kTile; c += blockDim.x) {
      const bool in = x.i0 + c < m.T;
      cols[stage * 2 * kTile + c] = in ? lse[m.l_at(b, x.i0 + c, x.h)] : 0.f;
      cols[stage * 2 * kTile + kTile + c] = in ? delta[m.l_at(b, x.i0 + c, x.h)] : 0.f;
    }
  };
  staged_walk(first, first.h < tiles.end, [&](At& x) { return tiles.advance(x); }, fetch, [&](int stage, At x) {
    const int64_t i0 = x.i0;
    if (w0 >= m.T || i0 + kTile - 1 < w0) return;  // every query of the tile precedes the warp's keys
    float s[8][4], dp[8][4];
    zero<8>(s), zero<8>(dp);
    mma_rows_ld<D / 16>(s, ka, qs(stage));   // Sᵀ = k·qᵀ
    mma_rows_ld<D / 16>(dp, va, os(stage));  // dPᵀ = v·doutᵀ
    const float* col = cols + stage * 2 * kTile;
    probabilities(s, dp, m, b, w0, i0, false, !m.doc && w0 + 15 <= i0 && i0 + kTile - 1 < m.T, nullptr, nullptr,
                  col, col + kTile);
    uint32_t pa[4][4], da[4][4];
    to_a(pa, s), to_a(da, dp);
    mma_tile<D>(dv, pa, os(stage));  // dv += Pᵀ·dout
    mma_tile<D>(dk, da, qs(stage));  // dk += dSᵀ·q
  });
  for (int r = 0; r < 2; ++r) {
    const int64_t j = w0 + gk + 8 * r;
    if (j >= m.T) continue;
    float *dkd = dqkv + m.k_at(b, j, g), *dvd = dqkv + m.v_at(b, j, g);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dkd[8 * n + 2 * t] = dk[n][2 * r] * m.scale, dkd[8 * n + 2 * t + 1] = dk[n][2 * r + 1] * m.scale;
      dvd[8 * n + 2 * t] = dv[n][2 * r], dvd[8 * n + 2 * t + 1] = dv[n][2 * r + 1];
    }
  }
}

// A kernel with dynamic shared memory (above 48 KiB it must be allowed first).
template <typename Kernel, typename... Args>
void launch_with_smem(Kernel kernel, dim3 grid, size_t smem, const char* what, Args... args) {
  static std::mutex mu;
  static std::map<const void*, size_t> allowed;  // per kernel, the most shared memory allowed so far
  {
    std::lock_guard<std::mutex> lock(mu);
    size_t& a = allowed[reinterpret_cast<const void*>(kernel)];
    if (a < smem) {
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), what);
      a = smem;
    }
  }
  kernel<<<grid, 32 * kWarps, smem, cu_stream()>>>(args...);
  check_launch(what);
}
size_t rows_bytes(int64_t rows, int64_t ld) { return size_t(rows * ld) * sizeof(__nv_bfloat16); }

// n values rounded to bf16 into a scratch of their own (grown as needed; one stream: calls never overlap).
const __nv_bfloat16* rounded(Buffer<bf16>& scratch, const float* v, int64_t n) {
  cuda::round_to_bf16(grown(scratch, n), v, n);
  return reinterpret_cast<const __nv_bfloat16*>(scratch.data());
}
Buffer<bf16>& qkv_low = *new Buffer<bf16>;  // process-long scratch (common.cuh, grown())
Buffer<bf16>& dout_low = *new Buffer<bf16>;
}  // namespace

void attention_forward_bf16(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t KV,
                            int64_t D, const int32_t* doc) {
  if (B * T == 0) return;
  const Dims m = dims(T, H, KV, D, doc);
  const dim3 grid(blocks_for(T, kRows), unsigned(H), unsigned(B));
  const __nv_bfloat16* q = rounded(qkv_low, qkv, B * T * m.S);
  with_head_dim(D, [&]<int HD>() {
    const size_t smem = 4 * rows_bytes(kTile, HD + kPad);  // K and V tiles, two stages
    launch_with_smem(forward_bf16<HD>, grid, smem, "attention_forward_bf16", out, lse, q, m);
  });
}

void attention_backward_bf16(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                             float* delta, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, const int32_t* doc) {
  if (B * T == 0) return;
  const Dims m = dims(T, H, KV, D, doc);
  attention_delta(delta, dout, out, B, m, true);
  const __nv_bfloat16 *q = rounded(qkv_low, qkv, B * T * m.S), *o = rounded(dout_low, dout, B * T * H * D);
  with_head_dim(D, [&]<int HD>() {
    const size_t tiles = 4 * rows_bytes(kTile, HD + kPad);  // two stages of two tiles
    launch_with_smem(dq_bf16<HD>, dim3(blocks_for(T, kRows), unsigned(H), unsigned(B)), tiles,
                     "attention_backward_bf16 dq", dqkv, o, q, lse, static_cast<const float*>(delta), m);
    const size_t dkv_smem = tiles + 4 * kTile * sizeof(float);  // and two stages of lse, delta
    launch_with_smem(dkv_bf16<HD>, dim3(blocks_for(T, kRows), unsigned(KV), unsigned(B)), dkv_smem,
                     "attention_backward_bf16 dk dv", dqkv, o, q, lse, static_cast<const float*>(delta), m);
  });
}

}  // namespace origami::cuda
