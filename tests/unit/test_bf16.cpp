// bf16 conversions (kernels/cpu/bf16.h) and gemm_bf16 (kernels/cpu/gemm_bf16.h).
//
// Conversions: the scalar fp32 -> bf16 against the definition (the nearest bf16, ties to the even
// one, overflow to inf at the midpoint above the largest finite value, NaN kept NaN) on every
// exponent, sign and class of dropped bits; every vector path this CPU has gives the same bits as the
// scalar one, on array lengths that exercise the tails and on unaligned starts; widening is exact.
//
// gemm_bf16, on every path this CPU offers (the one timing picks, oneDNN whenever it has a bf16
// matmul here, the forced portable path): every transpose pair, beta 0 (C holding NaN is
// overwritten) and 1, sizes 1, 7, 33 and 257 in every combination with leading dimensions wider than
// the matrices and unaligned starts (padding holding NaN must not be read; C's must not be written),
// plus a side of 20000 (the portable path then widens in pieces),
// and GPT-2's layer and LM-head GEMMs (forward, input gradient, weight gradient) at 64 tokens.
// Two bounds, with u = 2^-24 (fp32) and u_bf16 = 2^-8:
//  1. Against a double GEMM of the bf16 inputs themselves. A product of two bf16 values (8
//     significant bits each) is exact in fp32, so only the sum rounds: C = α·Σ_k a_k·b_k + β·c is a
//     sum of K + 1 terms; whatever the order (blocked, split over threads, sliced through C with
//     beta 1 as the portable path does), each term meets at most K additions and one multiplication
//     by α, each rounding by at most u: |C − C_exact| ≤ γ(K+2)·(|α|·Σ|a||b| + |β||c|),
//     γ(n) = n·u/(1 − n·u) (Higham, Accuracy and Stability, §3.1), plus (K+2)·2^-126 for the
//     subnormal sums that AMX and AVX512-BF16 flush to zero.
//  2. Against gemm<float> of the unrounded fp32 inputs. Rounding each input to bf16 changes a product
//     by at most (2·u_bf16 + u_bf16²)·|a·b|; each GEMM then adds its own bound 1:
//     |C − C_fp32| ≤ |α|·(2·u_bf16 + u_bf16²)·Σ|a||b| + γ(K+2)·(S_bf16 + S_fp32), S the magnitudes of 1.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"

using namespace origami;

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Every fp32 high half (sign, exponent, top mantissa bits) with dropped halves that decide rounding:
// 0, the smallest, just below, at and just above one half, the largest, and a pseudo-random one.
std::vector<float> rounding_patterns() {
  std::vector<float> out;
  uint32_t s = 12345;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, (s = s * 1664525u + 1013904223u) >> 16})
      out.push_back(float_of(hi << 16 | lo));
  return out;
}

// The definition: the nearest bf16 to x, ties to the one with an even last bit; above the largest
// finite bf16 the next candidate is 2^128 (inf), so overflow happens at the midpoint, as IEEE says.
// The magnitude of a finite float, from its bits: converting a subnormal float to double would read
// it as 0 (the process sets DAZ: kernels/cpu/gemm.h, flush_denormals).
double magnitude_of(uint32_t u) {
  const int e = int((u >> 23) & 0xff);
  const uint32_t m = u & 0x7fffff;
  return e == 0 ? std::ldexp(double(m), -149) : std::ldexp(double(m | 0x800000), e - 150);
}

uint16_t nearest_bf16(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x40);
  if (std::isinf(x)) return uint16_t(u >> 16);
  const uint16_t down = uint16_t(u >> 16), up = uint16_t(down + 1);  // toward zero / away from zero
  const double lo = magnitude_of(uint32_t(down) << 16);
  const double hi = (up & 0x7fff) == 0x7f80 ? std::ldexp(1.0, 128) : magnitude_of(uint32_t(up) << 16);
  const double ax = magnitude_of(u);
  if (ax - lo < hi - ax) return down;
  if (ax - lo > hi - ax) return up;
  return (down & 1) ? up : down;
}

std::vector<Bf16Isa> paths_here() {
  std::vector<Bf16Isa> out;
  for (Bf16Isa isa : {Bf16Isa::scalar, Bf16Isa::avx2, Bf16Isa::avx512f, Bf16Isa::avx512bf16})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}

}  // namespace

TEST(Bf16Convert, SpecialValues) {
  struct Expect {
    uint32_t in;
    uint16_t out;
    const char* what;
  };
  const Expect cases[] = {
      {0x3f800000, 0x3f80, "1"},
      {0x3f808000, 0x3f80, "1 + 2^-8: a tie, to the even 1"},
      {0x3f818000, 0x3f82, "1 + 3·2^-8: a tie, up to the even 1 + 2^-6"},
      {0x3f808001, 0x3f81, "just above a tie: up"},
      {0x3f80ffff, 0x3f81, "just below the next bf16: up"},
      {0xbf808000, 0xbf80, "-(1 + 2^-8): ties to even on the magnitude"},
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0"},
      {0x00000001, 0x0000, "smallest subnormal: to +0"},
      {0x80000001, 0x8000, "its negative: to -0"},
      {0x00008000, 0x0000, "2^-134: a tie, to the even 0"},
      {0x00018000, 0x0002, "3·2^-134: a tie, up to the even 2^-132"},
      {0x00008001, 0x0001, "just above half the smallest bf16 subnormal: up"},
      {0x007fffff, 0x0080, "largest subnormal: up to the smallest normal"},
      {0x00400000, 0x0040, "a subnormal that is a bf16"},
      {0x7f7f0000, 0x7f7f, "largest finite bf16"},
      {0x7f7f7fff, 0x7f7f, "just below the overflow midpoint"},
      {0x7f7f8000, 0x7f80, "the overflow midpoint, odd last bit: to inf"},
      {0x7f7fffff, 0x7f80, "largest finite fp32: to inf"},
      {0xff7fffff, 0xff80, "its negative: to -inf"},
      {0x7f800000, 0x7f80, "inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x7fc00000, 0x7fc0, "quiet NaN"},
      {0xffc00000, 0xffc0, "negative quiet NaN"},
      {0x7f800001, 0x7fc0, "NaN with payload only in the dropped bits: quiet NaN, not inf"},
      {0x7fa00000, 0x7fe0, "signalling NaN: quiet, top payload kept"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(to_bf16(float_of(c.in)).bits, c.out) << c.what;
    for (Bf16Isa isa : paths_here()) {
      std::vector<float> in(37, float_of(c.in));  // one vector block and a tail
      std::vector<bf16> out(37);
      to_bf16(isa, out.data(), in.data(), 37);
      for (const bf16& o : out) ASSERT_EQ(o.bits, c.out) << c.what << " on " << name(isa);
    }
  }
}

TEST(Bf16Convert, ScalarIsTheNearestTiesToEven) {
  for (float x : rounding_patterns()) ASSERT_EQ(to_bf16(x).bits, nearest_bf16(x)) << std::hex << bits_of(x);
}

TEST(Bf16Convert, EveryPathGivesTheScalarBits) {
  const std::vector<float> x = rounding_patterns();
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = to_bf16(x[i]).bits;
  std::cout << "conversion paths on this CPU:";
  for (Bf16Isa isa : paths_here()) std::cout << " " << name(isa);
  std::cout << " (arrays use " << name(best_bf16_isa()) << ")\n";
  for (Bf16Isa isa : paths_here()) {
    std::vector<bf16> out(x.size());
    to_bf16(isa, out.data(), x.data(), int64_t(x.size()));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(out[i].bits, want[i]) << name(isa) << std::hex << " " << bits_of(x[i]);
    // Short arrays at unaligned starts: tails of every length, nothing written past n.
    for (int64_t start = 1; start < 4; ++start)
      for (int64_t n = 0; n <= 70; ++n) {
        std::vector<bf16> o(size_t(n + 1), bf16{0xabcd});
        to_bf16(isa, o.data(), x.data() + 8191 * start, n);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(o[size_t(i)].bits, want[size_t(8191 * start + i)]) << name(isa);
        ASSERT_EQ(o[size_t(n)].bits, 0xabcd) << name(isa) << " wrote past n = " << n;
      }
    // Rounded in fp32 (the portable GEMM's operands): the same bits in the top half, zeros below,
    // in place too, tails of every length at unaligned starts.
    std::vector<float> f(x.size());
    to_bf16_precision(isa, f.data(), x.data(), int64_t(x.size()));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(f[i]), uint32_t(want[i]) << 16) << name(isa) << " in fp32";
    std::vector<float> in_place = x;
    to_bf16_precision(isa, in_place.data(), in_place.data(), int64_t(x.size()));
    ASSERT_EQ(0, std::memcmp(in_place.data(), f.data(), f.size() * sizeof(float))) << name(isa) << " in place";
    for (int64_t start = 1; start < 4; ++start)
      for (int64_t n = 0; n <= 40; ++n) {
        std::vector<float> o(size_t(n + 1), -7.f);
        to_bf16_precision(isa, o.data(), x.data() + 8191 * start, n);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(o[size_t(i)]), uint32_t(want[size_t(8191 * start + i)]) << 16);
        ASSERT_EQ(o[size_t(n)], -7.f) << name(isa) << " wrote past n = " << n;
      }
  }
}

TEST(Bf16Convert, WideningIsExactOnEveryPath) {
  std::vector<bf16> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i].bits = uint16_t(i);
  for (Bf16Isa isa : paths_here())
    for (int64_t start : {0, 1, 3}) {
      std::vector<float> out(all.size() + 1, -7.f);
      to_float(isa, out.data(), all.data() + start, int64_t(all.size()) - start);
      for (size_t i = 0; i + size_t(start) < all.size(); ++i)
        ASSERT_EQ(bits_of(out[i]), uint32_t(all[i + size_t(start)].bits) << 16) << name(isa);
      ASSERT_EQ(out[all.size() - size_t(start)], -7.f) << name(isa) << " wrote past n";
    }
  std::vector<float> round_trip(65536);
  to_float(round_trip.data(), all.data(), 65536);
  for (size_t i = 0; i < 65536; ++i)
    if (!std::isnan(round_trip[i])) ASSERT_EQ(to_bf16(round_trip[i]).bits, i);  // bf16 -> fp32 -> bf16
}

// round_in_place: the values become their bf16 rounding (in fp32) and the copy their bf16 bits, over
// lengths that end inside a vector and a block of the threads' split.
TEST(Bf16Convert, RoundInPlaceKeepsTheValuesAndTheirCopy) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(37), int64_t(3 << 14) + 5}) {
    std::vector<float> x(static_cast<size_t>(n));
    uint32_t s = uint32_t(n) + 1;
    for (float& v : x) s = s * 1664525u + 1013904223u, v = float(double(s >> 8) / double(1 << 20) - 8.0);
    std::vector<float> v = x, alone = x;
    std::vector<bf16> low(static_cast<size_t>(n), bf16{0x7fff});
    round_in_place(v.data(), low.data(), n);
    round_in_place(alone.data(), nullptr, n);
    // From inside a parallel region (a kernel's row loop), each thread on its own copy: the blocks
    // run on the calling thread.
    const int threads = omp_get_max_threads();
    std::vector<std::vector<float>> inside(static_cast<size_t>(threads), x);
    std::vector<std::vector<bf16>> inside_low(static_cast<size_t>(threads), std::vector<bf16>(size_t(n)));
#pragma omp parallel num_threads(threads)
    round_in_place(inside[size_t(omp_get_thread_num())].data(), inside_low[size_t(omp_get_thread_num())].data(), n);
    for (size_t i = 0; i < size_t(n); ++i) {
      ASSERT_EQ(low[i].bits, to_bf16(x[i]).bits) << "n " << n << " at " << i;
      ASSERT_EQ(v[i], to_float(to_bf16(x[i]))) << "n " << n << " at " << i;
      ASSERT_EQ(alone[i], v[i]) << "n " << n << " at " << i;
      for (int t = 0; t < threads; ++t) {
        ASSERT_EQ(inside[size_t(t)][i], v[i]) << "thread " << t << ", n " << n << " at " << i;
        ASSERT_EQ(inside_low[size_t(t)][i].bits, low[i].bits) << "thread " << t << ", n " << n << " at " << i;
      }
    }
  }
}

// ---- gemm_bf16 ---------------------------------------------------------------------------------

namespace {

struct Case {
  bool ta, tb;
  int64_t M, N, K;
  float beta;
  bool padded;  // leading dimensions wider than the matrices, unaligned starts
};

std::string name(const Case& c) {
  return cat(c.ta ? "T" : "N", c.tb ? "T" : "N", " ", c.M, "x", c.N, "x", c.K, " beta ", c.beta,
             c.padded ? " padded" : "");
}

// A rows × cols matrix with row stride ld, entries uniform in [-1, 1), padding NaN.
std::vector<float> random_matrix(int64_t rows, int64_t cols, int64_t ld, uint32_t seed) {
  std::vector<float> m(size_t(rows * ld), std::numeric_limits<float>::quiet_NaN());
  uint32_t s = seed;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      s = s * 1664525u + 1013904223u;
      m[size_t(r * ld + c)] = float(double(s >> 8) / double(1 << 23) - 1.0);
    }
  return m;
}

// x rounded to bf16 behind `offset` leading elements (an unaligned start when odd).
std::vector<bf16> rounded(const std::vector<float>& x, size_t offset) {
  std::vector<bf16> out(x.size() + offset);
  to_bf16(out.data() + offset, x.data(), int64_t(x.size()));
  return out;
}

// As doubles, NaN padding as 0 (|x| with `absolute`), for the double-precision references.
std::vector<double> as_double(const std::vector<float>& x, bool absolute) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = std::isnan(x[i]) ? 0.0 : absolute ? std::fabs(x[i]) : x[i];
  return out;
}

std::vector<float> widened(const std::vector<bf16>& x, size_t offset) {
  std::vector<float> out(x.size() - offset);
  to_float(out.data(), x.data() + offset, int64_t(out.size()));
  return out;
}

double gamma(int64_t n) { return double(n) * 0x1p-24 / (1 - double(n) * 0x1p-24); }

// One case's operands and references; run() calls gemm_bf16 on a fresh C and returns the largest
// error over its bound (1 means at the bound) for each of the two bounds of this file's header.
struct GemmCheck {
  Case c;
  int64_t lda, ldb, ldc;
  size_t offset;
  float alpha = 0.75f;
  std::vector<float> a32, b32, c0;  // unrounded inputs, C before the call
  std::vector<float> a32_at, b32_at;  // the unrounded inputs behind `offset` elements, as a16 and b16
  std::vector<bf16> a16, b16;
  std::vector<double> exact, mag16, mag32;  // α·op(Ã)op(B̃) + β·C0; the magnitudes S_bf16, S_fp32
  std::vector<float> fp32;                  // gemm<float> on the unrounded inputs

  explicit GemmCheck(const Case& cs, uint32_t seed) : c(cs) {
    const int64_t ar = c.ta ? c.K : c.M, ac = c.ta ? c.M : c.K, br = c.tb ? c.N : c.K, bc = c.tb ? c.K : c.N;
    lda = ac + (c.padded ? 3 : 0), ldb = bc + (c.padded ? 5 : 0), ldc = c.N + (c.padded ? 7 : 0);
    offset = c.padded ? 1 : 0;
    a32 = random_matrix(ar, ac, lda, seed), b32 = random_matrix(br, bc, ldb, seed + 1);
    c0 = random_matrix(c.M, c.N, ldc, seed + 2);
    for (float& v : c0) v = std::isnan(v) ? -7.f : v;  // C's padding: a value to find unchanged
    a16 = rounded(a32, offset), b16 = rounded(b32, offset);
    a32_at.assign(offset, 0.f), b32_at.assign(offset, 0.f);
    a32_at.insert(a32_at.end(), a32.begin(), a32.end());
    b32_at.insert(b32_at.end(), b32.begin(), b32.end());
    references();
  }

  void dgemm(double a, const std::vector<double>& A, const std::vector<double>& B, double beta,
             const std::vector<double>& C0, std::vector<double>& out) const {
    out = C0;
    gemm<double>(c.ta, c.tb, c.M, c.N, c.K, a, A.data(), lda, B.data(), ldb, beta, out.data(), ldc);
  }

  void references() {
    const auto a16d = as_double(widened(a16, offset), false), b16d = as_double(widened(b16, offset), false);
    const auto a16m = as_double(widened(a16, offset), true), b16m = as_double(widened(b16, offset), true);
    const auto c0d = as_double(c0, false), c0m = as_double(c0, true);
    const double abs_alpha = std::fabs(alpha), abs_beta = std::fabs(c.beta);
    dgemm(alpha, a16d, b16d, c.beta, c0d, exact);
    dgemm(abs_alpha, a16m, b16m, abs_beta, c0m, mag16);
    dgemm(abs_alpha, as_double(a32, true), as_double(b32, true), abs_beta, c0m, mag32);
    fp32 = c0;
    if (c.beta == 0) fp32.assign(fp32.size(), std::numeric_limits<float>::quiet_NaN());
    gemm<float>(c.ta, c.tb, c.M, c.N, c.K, alpha, a32.data(), lda, b32.data(), ldb, c.beta, fp32.data(), ldc);
  }

  // gemm_bf16 of A and B on a fresh C.
  std::vector<float> multiply(const Bf16Operand& A, const Bf16Operand& B) const {
    std::vector<float> C = c0;
    if (c.beta == 0)  // beta 0 ignores C: NaN there must not reach the result
      for (int64_t i = 0; i < c.M; ++i)
        for (int64_t j = 0; j < c.N; ++j) C[size_t(i * ldc + j)] = std::numeric_limits<float>::quiet_NaN();
    gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, alpha, A, B, c.beta, C.data(), ldc);
    return C;
  }

  // The operands in bf16 or (fp32_operands) in fp32 for the call to round.
  std::vector<float> call(bool fp32_operands) const {
    const Bf16Operand A = fp32_operands ? Bf16Operand(a32_at.data() + offset, lda) : Bf16Operand(a16.data() + offset, lda);
    const Bf16Operand B = fp32_operands ? Bf16Operand(b32_at.data() + offset, ldb) : Bf16Operand(b16.data() + offset, ldb);
    return multiply(A, B);
  }

  // The bf16 values widened to fp32 where a16 and b16 hold them, passed as exact fp32 operands (what a
  // layer passes after round_in_place) for A, B or both (the other as bf16), with their bf16 copies
  // where `with_copies`.
  std::vector<float> call_exact(bool a_exact, bool b_exact, bool with_copies) const {
    const std::vector<float> a = widened(a16, 0), b = widened(b16, 0);
    const bf16 *a_low = a16.data() + offset, *b_low = b16.data() + offset;
    const Bf16Operand A = a_exact ? Bf16Operand(a.data() + offset, with_copies ? a_low : nullptr, lda, true)
                                  : Bf16Operand(a_low, lda);
    const Bf16Operand B = b_exact ? Bf16Operand(b.data() + offset, with_copies ? b_low : nullptr, ldb, true)
                                  : Bf16Operand(b_low, ldb);
    return multiply(A, B);
  }

  // The bf16 operands copied compactly (row stride = columns): what oneDNN's path reads when the call
  // rounds fp32 operands itself (gemm_bf16.h).
  std::vector<float> call_compact() const {
    const int64_t ar = c.ta ? c.K : c.M, ac = c.ta ? c.M : c.K, br = c.tb ? c.N : c.K, bc = c.tb ? c.K : c.N;
    std::vector<bf16> a(size_t(ar * ac)), b(size_t(br * bc));
    for (int64_t r = 0; r < ar; ++r) std::copy_n(a16.data() + offset + r * lda, ac, a.data() + r * ac);
    for (int64_t r = 0; r < br; ++r) std::copy_n(b16.data() + offset + r * ldb, bc, b.data() + r * bc);
    return multiply({a.data(), ac}, {b.data(), bc});
  }

  // {bound 1 ratio, bound 2 ratio} of a call's C; infinity when C's padding changed, NaN when a
  // result is NaN.
  std::pair<double, double> ratios(const std::vector<float>& C) const {
    const double g = gamma(c.K + 2), flushed = double(c.K + 2) * 0x1p-126, u16 = 2 * 0x1p-8 + 0x1p-16;
    double r1 = 0, r2 = 0;
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.N; ++j) {
        const size_t k = size_t(i * ldc + j);
        const double beta_c = std::fabs(c.beta) * std::fabs(c0[k]);
        const double e1 = std::fabs(C[k] - exact[k]) / (g * mag16[k] + flushed);
        const double e2 = std::fabs(C[k] - double(fp32[k])) / (u16 * (mag32[k] - beta_c) + g * (mag16[k] + mag32[k]) + flushed);
        if (!(e1 <= r1)) r1 = e1;  // NaN sticks
        if (!(e2 <= r2)) r2 = e2;
      }
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = c.N; j < ldc; ++j)
        if (C[size_t(i * ldc + j)] != -7.f) return {std::numeric_limits<double>::infinity(), 0};
    return {r1, r2};
  }
};

const char* path_name(Bf16GemmPath p) { return p == Bf16GemmPath::onednn ? "oneDNN" : "portable"; }

// Exact fp32 operands — A's, B's or both (the portable path reads them in place: its one-operand
// blocking over K slices and pieces, or one call), alone or with their bf16 copies — are within both
// bounds; where oneDNN's path takes a call with copies, as it took the bf16 operands (C), it reads the
// copies: C's bits.
void check_exact_operands(const GemmCheck& check, const std::vector<float>& C, Bf16GemmPath path,
                          const std::string& where) {
  for (const auto& [a_exact, b_exact] : {std::pair{true, false}, {false, true}, {true, true}})
    for (bool copies : {false, true}) {
      const std::vector<float> got = check.call_exact(a_exact, b_exact, copies);
      const Bf16GemmPath got_path = last_bf16_gemm_path();
      const std::string what = cat(where, ", exact fp32 ", a_exact && b_exact ? "A and B" : a_exact ? "A" : "B",
                                   copies ? " with copies" : "");
      const auto [r1, r2] = check.ratios(got);
      EXPECT_LE(r1, 1.0) << what << ": against the bf16 inputs";
      EXPECT_LE(r2, 1.0) << what << ": against fp32";
      if (copies && got_path == Bf16GemmPath::onednn && path == Bf16GemmPath::onednn)
        EXPECT_EQ(0, std::memcmp(C.data(), got.data(), C.size() * sizeof(float)))
            << what << ": oneDNN did not read the copies";
    }
}

// The ONEDNN_MAX_CPU_ISA of this run (an isa_cap test's, tests/CMakeLists.txt), or "".
std::string isa_cap() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  return cap ? cap : "";
}

// Why this run's cap takes none of the host's instructions away, or "" where it does: a cap at
// AVX512_CORE_BF16 on a host without AMX (or AVX512-FP16, the ISA between them), at AVX2 on one without
// AVX-512. oneDNN runs at the lower of the cap and the host, so such a run would repeat the uncapped one
// call for call (about 30 s of check_every_path each on an AVX2 host).
std::string cap_changes_nothing() {
  const std::string isa = isa_cap();
  if (isa == "AVX512_CORE_BF16" && !__builtin_cpu_supports("amx-bf16") && !__builtin_cpu_supports("avx512fp16"))
    return "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on a host without AMX: the uncapped run checked these paths";
  if (isa == "AVX2" && !__builtin_cpu_supports("avx512f"))
    return "ONEDNN_MAX_CPU_ISA=AVX2 on a host without AVX-512: the uncapped run checked these paths";
  return "";
}

// Runs every case on every path to check here — the timed choice, oneDNN wherever it has a bf16
// matmul, the forced portable path — against both bounds, and prints each mode's worst ratios. Skips
// the test where the run's cap changes nothing.
void check_every_path(const std::vector<Case>& cases) {
  if (const std::string why = cap_changes_nothing(); !why.empty()) GTEST_SKIP() << why;
  set_num_threads(2);
  const std::pair<Bf16GemmMode, const char*> modes[] = {
      {Bf16GemmMode::automatic, "automatic"}, {Bf16GemmMode::onednn, "onednn"}, {Bf16GemmMode::portable, "portable"}};
  int onednn[3] = {0, 0, 0};
  double worst1[3] = {0, 0, 0}, worst2[3] = {0, 0, 0};
  for (size_t i = 0; i < cases.size(); ++i) {
    const GemmCheck check(cases[i], 100 + uint32_t(i));
    for (int m = 0; m < 3; ++m) {
      set_bf16_gemm_mode(modes[m].first);  // also forgets the choices: the shape is timed afresh
      const std::vector<float> C = check.call(false);
      const auto [r1, r2] = check.ratios(C);
      const Bf16GemmPath path = last_bf16_gemm_path();
      // fp32 operands, rounded by the call: the same bits (NaN where C is NaN) as bf16 operands laid
      // out as the path reads them — where they are for the portable path, a compact copy for oneDNN's
      // (whose kernels, and so its sums' order, may differ with the strides: on Emerald Rapids they do).
      const std::vector<float> C_fp32 = check.call(true);
      const Bf16GemmPath fp32_path = last_bf16_gemm_path();
      const bool compact = fp32_path == Bf16GemmPath::onednn && cases[i].padded;
      const std::vector<float> C_ref = compact ? check.call_compact() : C;
      if (compact)  // the compact copy's key is the fp32 call's: the same choice
        EXPECT_EQ(last_bf16_gemm_path(), fp32_path) << name(cases[i]) << " (" << modes[m].second << ")";
      // A forced mode takes one path for every layout; the timed one may not for a shape large enough
      // to be timed (257³), which is a near tie on an AMX host, and whose padded bf16 operands form a
      // key of their own.
      if (modes[m].first != Bf16GemmMode::automatic) EXPECT_EQ(fp32_path, path) << name(cases[i]);
      if (compact || fp32_path == path)
        EXPECT_EQ(0, std::memcmp(C_ref.data(), C_fp32.data(), C.size() * sizeof(float)))
            << name(cases[i]) << " (" << modes[m].second << "): fp32 operands rounded by the call differ from bf16 ones";
      const std::string where = cat(name(cases[i]), " (", modes[m].second, ", ", path_name(path), ")");
      EXPECT_LE(r1, 1.0) << where << ": against the bf16 inputs";
      EXPECT_LE(r2, 1.0) << where << ": against fp32";
      check_exact_operands(check, C, path, where);
      onednn[m] += path == Bf16GemmPath::onednn;
      worst1[m] = std::max(worst1[m], r1), worst2[m] = std::max(worst2[m], r2);
    }
  }
  for (int m = 0; m < 3; ++m)
    std::cout << modes[m].second << ": " << onednn[m] << " of " << cases.size() << " cases on oneDNN; largest error / bound "
              << worst1[m] << " (bf16 inputs), " << worst2[m] << " (fp32)\n";
  EXPECT_EQ(onednn[2], 0);
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  // Where oneDNN has a bf16 matmul, forcing it reaches it on every case (the bound above then holds
  // for oneDNN's kernels, not for a quiet fallback to the portable path).
  if (!bf16_gemm_always_portable()) EXPECT_EQ(onednn[1], int(cases.size()));
}

std::vector<Case> odd_size_cases() {
  std::vector<Case> out;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.f, 1.f})
        for (int64_t M : {1, 7, 33, 257})
          for (int64_t N : {1, 7, 33, 257})
            for (int64_t K : {1, 7, 33, 257}) out.push_back({ta, tb, M, N, K, beta, true});
  // One side long enough (with K >= 256) that the portable path widens the other operand whole and
  // this one in pieces.
  for (bool t : {false, true}) {
    out.push_back({t, t, 20000, 7, 300, 1.f, true});
    out.push_back({t, !t, 7, 20000, 300, 0.f, true});
  }
  // K deeper than the portable path takes with both operands whole (M + N = 4200: 2^22 / 4200 = 998
  // deep): cut into two slices of 750, the second accumulating (both operands exact: one call).
  out.push_back({false, true, 4000, 200, 1500, 0.f, true});
  out.push_back({true, false, 200, 4000, 1500, 1.f, true});
  // Accumulating into a C of 2^24 elements or more: oneDNN's path runs it in row blocks (16 of 965
  // rows and one of 960 here; the LM head's dW of model_cases is the transposed-A case).
  out.push_back({false, false, 16400, 1024, 17, 1.f, true});
  return out;
}

// GPT-2 124M at T tokens, as the layers call gemm (model/layers/linear.cpp, lm_head.cpp): forward
// y = x·W, input gradient dx = dy·Wᵀ, weight gradient dW += xᵀ·dy; the LM head with W [V, C].
std::vector<Case> model_cases(int64_t T) {
  std::vector<Case> out;
  for (auto [in, o] : {std::pair<int64_t, int64_t>{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}}) {
    out.push_back({false, false, T, o, in, 0.f, false});
    out.push_back({false, true, T, in, o, 0.f, false});
    out.push_back({true, false, in, o, T, 1.f, false});
  }
  constexpr int64_t V = 50304, C = 768;
  out.push_back({false, true, T, V, C, 0.f, false});   // logits = x·Wᵀ
  out.push_back({false, false, T, C, V, 0.f, false});  // dx = dlogits·W
  out.push_back({true, false, V, C, T, 1.f, false});   // dW += dlogitsᵀ·x
  return out;
}

}  // namespace

TEST(GemmBf16, OddSizesEveryTransposeStridedBeta0And1) { check_every_path(odd_size_cases()); }

TEST(GemmBf16, Gpt2LayerAndLmHeadShapes) { check_every_path(model_cases(64)); }

// Attention's dK-like tile in bf16; and operands in fp32, padded and large enough (over 2^16 elements)
// that outside a region their widening and rounding would be spread over the threads: inside one, each
// thread does all of its own rows (over_rows).
TEST(GemmBf16, InsideParallelRegionPortableTilePerThread) {
  set_num_threads(2);
  for (const auto& [c, fp32_operands] : {std::pair{Case{true, false, 64, 64, 64, 1.f, true}, false},
                                        std::pair{Case{false, true, 300, 260, 280, 0.f, true}, true}}) {
    std::vector<double> r1(2, -1), r2(2, -1);
    std::vector<int> path(2, -1);
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      const GemmCheck check(c, 7 + uint32_t(t));
      std::tie(r1[size_t(t)], r2[size_t(t)]) = check.ratios(check.call(fp32_operands));
      path[size_t(t)] = int(last_bf16_gemm_path());
    }
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(r1[size_t(t)] >= 0 && r1[size_t(t)] <= 1 && r2[size_t(t)] >= 0 && r2[size_t(t)] <= 1)
          << name(c) << ": " << r1[size_t(t)];
      EXPECT_EQ(path[size_t(t)], int(Bf16GemmPath::portable));
    }
  }
}

TEST(GemmBf16, EmptyAndZeroK) {
  set_num_threads(2);
  std::vector<float> C = {std::numeric_limits<float>::quiet_NaN(), 2.f, -7.f, 4.f};
  const bf16* none = nullptr;
  gemm_bf16(false, false, 2, 1, 0, 1.f, {none, 1}, {none, 1}, 0.f, C.data(), 2);  // K = 0, beta 0: zeros
  EXPECT_EQ(C[0], 0.f);
  EXPECT_EQ(C[2], 0.f);
  EXPECT_EQ(C[1], 2.f);  // padding
  C[0] = 3.f;
  gemm_bf16(false, false, 2, 1, 0, 1.f, {none, 1}, {none, 1}, 0.5f, C.data(), 2);  // beta 0.5 scales
  EXPECT_EQ(C[0], 1.5f);
  gemm_bf16(false, false, 0, 1, 4, 1.f, {none, 4}, {none, 1}, 0.f, C.data(), 1);  // M = 0: nothing
  EXPECT_EQ(C[0], 1.5f);
}

// A bias row (the q|k|v and fc layers'): C is its bias rows plus the product — on the portable path
// bit for bit what writing the bias rows first and accumulating with beta 1 gives (it does just that);
// on oneDNN's (the bias added in its epilogue, or with the sums: the order of the fp32 additions is
// its kernel's) within fp32's rounding of the sums, (K + 2)·2⁻²³·(Σ|a·b| + |bias|) — on every transpose,
// padded rows of C (left as they were), and K = 0 (C is the bias rows); NaN in C before the call does
// not leak (beta 0).
TEST(GemmBf16, BiasRowIsAddedAsTheBiasRowsThenTheProduct) {
  set_num_threads(2);
  for (Bf16GemmMode mode : {Bf16GemmMode::onednn, Bf16GemmMode::portable}) {
    set_bf16_gemm_mode(mode);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{7, 33, 19}, {300, 257, 384}, {5, 9, 0}}) {
          const int64_t ldc = N + 3, lda = ta ? M : std::max<int64_t>(1, K), ldb = tb ? std::max<int64_t>(1, K) : N;
          std::vector<bf16> A(size_t(std::max<int64_t>(1, M * K))), B(size_t(std::max<int64_t>(1, K * N)));
          std::vector<float> bias(static_cast<size_t>(N));
          for (size_t i = 0; i < A.size(); ++i) A[i] = to_bf16(std::sin(0.37f * float(i)));
          for (size_t i = 0; i < B.size(); ++i) B[i] = to_bf16(std::cos(0.11f * float(i)));
          for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.01f * float(i) - 0.5f;
          std::vector<float> got(size_t(M * ldc), std::numeric_limits<float>::quiet_NaN()), want(got);
          for (int64_t r = 0; r < M; ++r) std::copy(bias.begin(), bias.end(), want.begin() + r * ldc);
          gemm_bf16(ta, tb, M, N, K, 1.f, {A.data(), lda}, {B.data(), ldb}, 1.f, want.data(), ldc);
          gemm_bf16(ta, tb, M, N, K, 1.f, {A.data(), lda}, {B.data(), ldb}, 0.f, got.data(), ldc, bias.data());
          const bool portable = last_bf16_gemm_path() == Bf16GemmPath::portable;
          const std::string what = cat(portable ? "portable" : "oneDNN", " ", ta ? "t" : "n", tb ? "t" : "n", " ", M,
                                       "x", N, "x", K);
          double worst = 0;  // error / bound, over C
          for (int64_t r = 0; r < M; ++r) {
            EXPECT_TRUE(std::isnan(got[size_t(r * ldc + N)])) << what << ": padding written";
            if (portable) {
              EXPECT_EQ(0, std::memcmp(got.data() + r * ldc, want.data() + r * ldc, size_t(N) * sizeof(float)))
                  << what << ", row " << r;
              continue;
            }
            for (int64_t c = 0; c < N; ++c) {
              double magnitude = std::fabs(bias[size_t(c)]);
              for (int64_t k = 0; k < K; ++k)
                magnitude += std::fabs(double(to_float(A[size_t(ta ? k * lda + r : r * lda + k)])) *
                                       double(to_float(B[size_t(tb ? c * ldb + k : k * ldb + c)])));
              const double bound = double(K + 2) * std::ldexp(1.0, -23) * magnitude;
              worst = std::max(worst, std::fabs(double(got[size_t(r * ldc + c)]) - want[size_t(r * ldc + c)]) / bound);
            }
          }
          EXPECT_LE(worst, 1.0) << what;
          if (K == 0) EXPECT_EQ(got[size_t(ldc + 4)], bias[4]) << what;
        }
  }
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
}

TEST(GemmBf16, RejectsALeadingDimensionTooSmall) {
  std::vector<bf16> A(16), B(16);
  std::vector<float> C(16);
  EXPECT_THROW(gemm_bf16(false, false, 4, 4, 4, 1.f, {A.data(), 2}, {B.data(), 4}, 0.f, C.data(), 4), Error);
}

TEST(GemmBf16, DescribesThePath) {
  set_num_threads(2);
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  const std::string line = describe_bf16_gemm();
  std::cout << line << "\n";
  EXPECT_EQ(line.rfind("bf16 GEMM: ", 0), 0u) << line;
  set_bf16_gemm_mode(Bf16GemmMode::portable);
  EXPECT_EQ(describe_bf16_gemm(), "bf16 GEMM: portable (forced by ORIGAMI_BF16_GEMM=portable)");
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
}

// A checkpoint's paths replace the timing (a resume sums as the saving run did): kept portable, a shape
// oneDNN runs takes the portable path, and kept oneDNN (fixed-size or runtime-size kernel) the other;
// the kept path is what bf16_gemms_to_keep reports again; a forced mode wins over it, and a shape too
// small to time follows the small GEMMs' choice whatever is kept. Skipped where oneDNN has no bf16 matmul.
TEST(GemmBf16, KeptPathsReplaceTheTiming) {
  set_num_threads(2);
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  if (bf16_gemm_always_portable()) GTEST_SKIP() << "oneDNN has no bf16 matmul here: every path is portable";
  const int64_t M = 256, N = 384, K = 256;  // 2^25 multiply-adds: a timed shape
  std::vector<bf16> A(size_t(M * K), to_bf16(0.5f)), B(size_t(K * N), to_bf16(0.25f));
  std::vector<float> C(size_t(M * N));
  auto run = [&](int64_t m, float beta) {
    gemm_bf16(true, false, m, N, K, 1.f, {A.data(), m}, {B.data(), N}, beta, C.data(), N);  // C += Aᵀ·B (a dW)
    return last_bf16_gemm_path();
  };
  auto kept_path = [&](int64_t m) {
    for (const KeptBf16Gemm& k : bf16_gemms_to_keep())
      if (k.ta && !k.tb && k.M == m && k.N == N && k.K == K && k.beta == 1.f) return std::optional<KeptBf16Path>(k.path);
    return std::optional<KeptBf16Path>();
  };
  for (KeptBf16Path path : {KeptBf16Path::portable, KeptBf16Path::onednn, KeptBf16Path::onednn_runtime}) {
    set_bf16_gemm_mode(Bf16GemmMode::automatic);
    keep_bf16_gemms({{true, false, M, N, K, M, N, N, 1.f, 1.f, path}, {true, false, 8, N, K, 8, N, N, 1.f, 1.f, path}});
    EXPECT_EQ(run(M, 1.f), path == KeptBf16Path::portable ? Bf16GemmPath::portable : Bf16GemmPath::onednn);
    EXPECT_EQ(kept_path(M), path);
    EXPECT_EQ(run(8, 1.f), bf16_small_gemms_onednn() ? Bf16GemmPath::onednn : Bf16GemmPath::portable);
    EXPECT_FALSE(kept_path(8)) << "a shape too small to time is not kept (it follows bf16_small_gemms)";
  }
  set_bf16_gemm_mode(Bf16GemmMode::onednn);  // (forgets the kept paths too)
  keep_bf16_gemms({{true, false, M, N, K, M, N, N, 1.f, 1.f, KeptBf16Path::portable}});
  EXPECT_EQ(run(M, 1.f), Bf16GemmPath::onednn) << "a forced mode wins over a kept path";
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
}

// The caps of tests/CMakeLists.txt's isa_cap runs take effect (else those runs repeat the host's own
// paths and prove nothing about the lower ones): under AVX2 oneDNN 2.6 has no bf16 matmul, so the GEMMs
// are portable; under AVX512_CORE_BF16 no oneDNN kernel is AMX's. Skipped outside those runs.
TEST(GemmBf16, TheIsaCapOfThisRunApplies) {
  const std::string isa = isa_cap();
  if (isa != "AVX2" && isa != "AVX512_CORE_BF16") GTEST_SKIP() << "run by the isa_cap tests";
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  const std::string described = describe_bf16_gemm();
  if (isa == "AVX2") {
    EXPECT_TRUE(bf16_gemm_always_portable());
    EXPECT_NE(described.find("oneDNN has no bf16 matmul here"), std::string::npos) << described;
  }
  EXPECT_EQ(described.find("AMX"), std::string::npos) << described;
}
