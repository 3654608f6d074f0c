// Mixed-precision GEMM on the CPU: C = alpha·op(A)·op(B) + beta·C with A and B in bf16 and C in fp32,
// accumulated in fp32 (the product of two bf16 values is exact in fp32). Row-major with the argument
// order and meaning of gemm<float> (gemm.h): op(A) is [M, K], op(B) is [K, N], C is [M, N];
// an operand's ld and ldc are row strides; beta = 0 ignores C (NaN there does not leak into the result).
// An operand is bf16 values, or fp32 values that the call rounds to bf16 (to_bf16) the way its path
// reads them: oneDNN's into a per-thread bf16 scratch, the portable path while it copies its blocks
// (one pass instead of rounding, then widening) — or fp32 values already at bf16 precision (exact,
// round_in_place), which the portable path multiplies where they are.
//
// Two paths:
//   oneDNN: its matmul primitive, bf16 × bf16 -> f32, on whatever it has — AMX tiles
//     (brg:avx512_core_amx_bf16), AVX512-BF16 dot products (brg:avx512_core_bf16, or gemm:jit for
//     strides with padding), emulation on plain AVX-512; ONEDNN_MAX_CPU_ISA caps the choice, and below
//     AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2, or an AVX2-only CPU) oneDNN 2.6 creates no bf16 matmul.
//     One primitive per (transposes, sizes, strides, alpha, beta, bias or not), created at its first call and
//     kept (a fixed-size one, or for a weight gradient possibly a runtime-size one: below); it runs
//     on the OpenMP pool of our loops (oneDNN's OpenMP build).
//   portable: op(A) and op(B) widened (an fp32 operand: rounded to bf16's precision; an exact one read
//     where it is) to fp32 block by block into a per-thread scratch buffer reused
//     across calls (16 MiB at most), each block pair multiplied by gemm<float>. Always available. Its
//     cost over gemm<float> on fp32 inputs is the widening pass, about F/(2W)·(1/M + 1/N) for a GEMM
//     rate F and a widening rate W (elements/s). On an AMX host's cores (bench/README.md, "bf16
//     GEMMs"), GPT-2's forward GEMMs at 256–2048 tokens: 0–17% on one core (median 5%); on two, the
//     same from 1024 tokens on, but up to 33% for the 768-wide weights at 256–512. Where the fp32
//     FMA rate is half (AVX2), about half that.
// Choice, per shape (the key above, with an fp32 operand's ld that of its compact rounded copy), at its
// first call: where oneDNN creates a primitive, both paths are timed alternately (a few runs each, on
// a slab of at most 4M elements of C written to a scratch buffer, on constant operands: the speed
// does not depend on the values) and oneDNN is kept unless the portable path is 20% faster (near ties, a fixed preference
// keeps processes from choosing differently, which would change the last bits of their sums).
// A weight gradient (ta, beta ≠ 0, C of at most 2^22 elements) where oneDNN is kept is also timed cold, its
// operands flushed from the caches as a training step finds them, on oneDNN's fixed-size kernel and on
// its runtime-size one; the fixed-size one stays only where it is 20% faster (gemm_bf16.cpp).
// Shapes under 2^24 multiply-adds (microseconds: timing them measures noise) take the choice timed
// once for a GPT-2 projection at 512 tokens instead. Speed decides, not CPU flags: oneDNN's AVX512-BF16 kernels run at
// half fp32 speed on an AMX host capped at that ISA, yet ~2× fp32 on Zen 4. The first call of a shape
// therefore costs a few extra GEMMs; every shape costs one cache entry, so a caller with
// data-dependent sizes (an MoE's rows per expert) must bucket them first.
// Inside an OpenMP parallel region (one tile per thread) the portable path runs, single-threaded.
// Calls from outside parallel regions may come from several threads at once (a mutex guards the cache).
//
// ORIGAMI_BF16_GEMM (read at the first call): auto (the default) times as above; portable forces the
// portable path; onednn takes oneDNN wherever it creates a primitive, untimed (tests, benchmarks).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gemm.h"

namespace origami {

// A GEMM operand: bf16 values, or fp32 values to round (see above), or both, with its row stride.
// `exact` fp32 values are at bf16 precision already (round_in_place): the portable path multiplies
// them where they are, without a copy; a path reads the bf16 values where it would otherwise
// convert the fp32 ones. Both, where given, hold the same matrix in the same layout.
struct Bf16Operand {
  const bf16* low = nullptr;
  const float* values = nullptr;
  int64_t ld = 0;
  bool exact = false;
  Bf16Operand(const bf16* v, int64_t row_stride) : low(v), ld(row_stride) {}
  Bf16Operand(const float* v, int64_t row_stride) : values(v), ld(row_stride) {}
  Bf16Operand(const float* v, const bf16* copy, int64_t row_stride, bool at_bf16_precision)
      : low(copy), values(v), ld(row_stride), exact(at_bf16_precision && v) {}
};

// With a bias [N] (beta 0), C = alpha·op(A)·op(B) + the bias on every row, in fp32: oneDNN adds it
// in its kernel (no pass over C before or after; where in the sum is the kernel's choice), the
// portable path writes the bias rows first and adds the product to them.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Bf16Operand A,
               Bf16Operand B, float beta, float* C, int64_t ldc, const float* bias = nullptr);

// gemm_bf16 for M and K that vary with the data (an MoE expert's rows), which must not each cost a
// cache entry and a timing: one oneDNN primitive per (transposes, N, strides, alpha, beta) with M
// and K given at each call (runtime dimensions), taken where oneDNN won the layer-sized GEMM timed
// for small shapes (below); else the portable path.
void gemm_bf16_varying(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Bf16Operand A,
                       Bf16Operand B, float beta, float* C, int64_t ldc);

enum class Bf16GemmMode { automatic, portable, onednn };
// Overrides ORIGAMI_BF16_GEMM and forgets every choice made so far (tests, benchmarks).
void set_bf16_gemm_mode(Bf16GemmMode mode);
Bf16GemmMode bf16_gemm_mode();
// Reads ORIGAMI_BF16_GEMM: an invalid value throws (the trainer checks it on every rank at start).
void check_bf16_gemm_env();

// Whether every bf16 GEMM takes the portable path: forced, or oneDNN has no bf16 matmul on this CPU
// (below AVX-512).
bool bf16_gemm_always_portable();

// Whether bf16 GEMMs here are best given fp32 operands rather than bf16 copies: where they all are
// portable, or the layer-sized GEMM that small and varying shapes follow timed the portable path
// faster (then a copy would only be widened again by each GEMM). An operand that several GEMMs read
// is then better rounded in place once (round_in_place), or else left in fp32 for each to round while
// it copies its blocks (matmul.h's `operand`). Speed only: either form gives the same products.
bool bf16_gemm_reads_fp32();

enum class Bf16GemmPath { portable, onednn };
// The path this thread's last gemm_bf16 call took (tests).
Bf16GemmPath last_bf16_gemm_path();

// ---- Attention's tiles in bf16 (one per thread, inside a parallel region) ----
// C = alpha·op(A)·op(B) + beta·C, A and B bf16, single-threaded on the calling thread, through this
// thread's oneDNN matmul primitive of the shape (created at its first call and kept: attention has a
// handful of tile shapes). Only where bf16_tiles() is onednn.
void tile_gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
                    int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Where attention's bf16 tiles multiply: oneDNN's bf16 matmul (tile_gemm_bf16), or the fp32 tiles
// (gemm<float>, tile_gemm_library()) on fp32 copies holding the same bf16 values — the same rounding
// points either way, only the speed differs. Chosen at the first call: ORIGAMI_BF16_GEMM=portable
// takes fp32 tiles, =onednn oneDNN's wherever it creates a primitive; auto (the default) times
// attention's two forward products (64 queries, 256 keys, head dim 64) on every thread at once
// through both and keeps oneDNN's where they are 1.2× faster. Call it first outside a parallel region.
// The path of the GEMMs below 2^24 multiply-adds, whose own timing would be noise: the one timed for
// a layer-sized GEMM (512 x 768 x 768) under ORIGAMI_BF16_GEMM=auto. A job takes rank 0's
// (set_bf16_small_gemms_onednn), so that its processes sum these products in one order; a shape
// oneDNN cannot run takes the portable path whatever the choice.
bool bf16_small_gemms_onednn();
void set_bf16_small_gemms_onednn(bool onednn);
// The small GEMMs' path a checkpoint keeps (set_tile_gemm_library's ChoiceFrom::checkpoint): oneDNN's
// or the portable one as this run takes them; none where every bf16 GEMM is portable (nothing chosen).
std::optional<bool> bf16_small_gemms_to_keep();

// A timed shape's path, for a checkpoint to keep (trainer_state.json's "kernels"): the shape's key
// (gemm_bf16's arguments but the pointers, an fp32 operand's ld that of its compact rounded copy) and
// its path. Two fresh processes can time a shape near the cuts differently (the cold weight gradients
// on a Zen 5 host: oneDNN's fixed-size kernel at 1.1–1.5x its runtime-size one's time), and the paths
// sum in different orders, so a resume takes the saving run's paths and repeats its steps bit for bit.
enum class KeptBf16Path { portable, onednn, onednn_runtime };  // oneDNN's fixed-size or runtime-size kernel
struct KeptBf16Gemm {
  bool ta = false, tb = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 1, beta = 0;
  KeptBf16Path path = KeptBf16Path::portable;
  bool bias = false;  // with a bias row (gemm_bf16's bias)
};
// The paths of the shapes timed (or forced onto oneDNN) so far, in no particular order; none where
// every bf16 GEMM is portable.
std::vector<KeptBf16Gemm> bf16_gemms_to_keep();
// A resume: these shapes' next calls take these paths instead of timing (under ORIGAMI_BF16_GEMM=auto
// only; a forced mode wins). A path oneDNN cannot create here (another CPU) is timed as usual. Call it
// while no bf16 GEMM runs (it forgets these shapes' choices made so far).
void keep_bf16_gemms(const std::vector<KeptBf16Gemm>& kept);

enum class Bf16Tiles { fp32, onednn };
Bf16Tiles bf16_tiles();
// Replaces the choice (a job takes rank 0's, one summation order for all its processes); oneDNN's
// where this CPU has no bf16 matmul (a job over unlike CPUs) gives fp32 tiles, and the startup line says so.
void set_bf16_tiles(Bf16Tiles tiles, ChoiceFrom from = ChoiceFrom::rank0);
// The startup line's words, e.g. "bf16 attention tiles: AMX (oneDNN; timed: fp32 tiles at 1.70x oneDNN's time)".
std::string describe_bf16_tiles();

// The startup line: the path a GPT-2 projection at 512 tokens (512×768×768, the first call of that
// shape decides it as above) takes, e.g. "bf16 GEMM: AMX (oneDNN)", "bf16 GEMM: AVX512-BF16 (oneDNN)",
// "bf16 GEMM: portable (no faster bf16 path on this CPU)". Call it outside a parallel region.
std::string describe_bf16_gemm();

}  // namespace origami
