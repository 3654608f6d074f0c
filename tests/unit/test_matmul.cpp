// The kernel seam's GEMM in bf16 (kernels/cpu/matmul.h) and the layers that call it: the rounding
// happens exactly at the stated points — both GEMM operands, a weight through its bf16 copy, a
// backward's dy once for its two GEMMs, never the bias or its gradient — on the host's own bf16 path
// and on the forced portable one.
//
// Bound (test_bf16.cpp's bound 1): against a double GEMM of the rounded operands, only the fp32 sum
// rounds: |C − C_exact| ≤ γ(K+2)·Σ|ã||b̃| + (K+2)·2^-126, γ(n) = n·2^-24/(1 − n·2^-24). A result that
// used an unrounded operand, or rounded one twice, or read the weights instead of their copy, misses
// it by orders of magnitude (a bf16 step is 2^-8 relative, the bound ~K·2^-24).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/matmul.h"
#include "model/layers/linear.h"

using namespace origami;

namespace {

std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) seed = seed * 1664525u + 1013904223u, x = float(double(seed >> 8) / double(1 << 23) - 1.0);
  return v;
}

// The values rounded to bf16 and back, as doubles (|x| with `absolute`).
std::vector<double> rounded(const std::vector<float>& x, bool absolute = false) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double r = to_float(to_bf16(x[i]));
    out[i] = absolute ? std::fabs(r) : r;
  }
  return out;
}

std::vector<double> as_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// max over elements of |got − want| / (γ(K+2)·magnitude + flushed): at most 1 within the bound.
double worst_ratio(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& mag,
                   int64_t K) {
  const double g = double(K + 2) * 0x1p-24 / (1 - double(K + 2) * 0x1p-24), flushed = double(K + 2) * 0x1p-126;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double r = std::fabs(got[i] - want[i]) / (g * mag[i] + flushed);
    if (!(r <= worst)) worst = r;  // (a NaN becomes the worst: std::max would drop it)
  }
  return worst;
}

// Runs fn under the timed choice, the forced portable path and, where oneDNN has a bf16 matmul, forced
// oneDNN (which reads the bf16 copies that operand_in_place makes for it).
template <typename Fn>
void on_every_path(Fn fn) {
  const Bf16GemmMode was = bf16_gemm_mode();
  for (Bf16GemmMode m : {Bf16GemmMode::automatic, Bf16GemmMode::portable, Bf16GemmMode::onednn}) {
    set_bf16_gemm_mode(m);
    if (m == Bf16GemmMode::onednn && bf16_gemm_always_portable()) continue;
    SCOPED_TRACE(m == Bf16GemmMode::portable ? "portable path" : m == Bf16GemmMode::onednn ? "oneDNN" : "timed choice");
    fn();
  }
  set_bf16_gemm_mode(was);
}

}  // namespace

// Every transpose pair, strided operands: both rounded at the call; a weight's copy used instead of
// its values when given (the copy here is the rounding of 2·B, so reading B would be off by 2x).
TEST(Matmul, Bf16RoundsBothOperandsAndReadsTheWeightCopy) {
  on_every_path([] {
    const int64_t M = 37, N = 29, K = 75, pad = 3;
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const int64_t ar = ta ? K : M, ac = (ta ? M : K) + pad, br = tb ? N : K, bc = (tb ? K : N) + pad;
        const std::vector<float> A = random_values(ar * ac, 1), B = random_values(br * bc, 2);
        std::vector<float> B2(B.size());
        for (size_t i = 0; i < B.size(); ++i) B2[i] = 2 * B[i];
        std::vector<bf16> B2_low(B.size());
        to_bf16(B2_low.data(), B2.data(), int64_t(B2.size()));
        for (bool copy : {false, true}) {
          std::vector<float> C(size_t(M * N));
          matmul<float>(Precision::bf16, ta, tb, M, N, K, 1.f, {A.data(), ac}, {B.data(), bc, copy ? B2_low.data() : nullptr},
                        0.f, C.data(), N);
          std::vector<double> want(C.size()), mag(C.size());
          const std::vector<double> a = rounded(A), b = rounded(copy ? B2 : B), am = rounded(A, true),
                                    bm = rounded(copy ? B2 : B, true);
          gemm<double>(ta, tb, M, N, K, 1.0, a.data(), ac, b.data(), bc, 0.0, want.data(), N);
          gemm<double>(ta, tb, M, N, K, 1.0, am.data(), ac, bm.data(), bc, 0.0, mag.data(), N);
          EXPECT_LE(worst_ratio(C, want, mag, K), 1.0) << (ta ? "T" : "N") << (tb ? "T" : "N") << " copy " << copy;
        }
      }
  });
}

// Sizes that vary with the data (an MoE expert's rows as M, or as K of its weight gradient): one
// primitive with M and K left to the call serves every size, each within the bound.
TEST(Matmul, VaryingSizesShareOnePrimitiveWithinTheBound) {
  on_every_path([] {
    const int64_t N = 56, ld = 48;
    const std::vector<float> B = random_values(N * ld, 11);
    std::vector<bf16> B_low(B.size());
    to_bf16(B_low.data(), B.data(), int64_t(B.size()));
    for (int64_t rows : {1, 17, 64, 203}) {
      const std::vector<float> A = random_values(rows * ld, 12 + uint32_t(rows));
      // Forward-like, M = rows: C[rows, N] = A[rows, ld]·Bᵀ; gradient-like, K = rows: D[ld, N] = Aᵀ·G.
      std::vector<float> C(size_t(rows * N)), G = random_values(rows * N, 13), D(size_t(ld * N), 1.f);
      matmul<float>(Precision::bf16, false, true, rows, N, ld, 1.f, {A.data(), ld}, {B.data(), ld, B_low.data()}, 0.f,
                    C.data(), N, Sizes::varying);
      matmul<float>(Precision::bf16, true, false, ld, N, rows, 1.f, {A.data(), ld}, {G.data(), N}, 1.f, D.data(), N,
                    Sizes::varying);
      const auto a = rounded(A), b = rounded(B), g = rounded(G), am = rounded(A, true), bm = rounded(B, true),
                 gm = rounded(G, true);
      std::vector<double> want(C.size()), mag(C.size()), dwant(D.size(), 1.0), dmag(D.size(), 1.0);
      gemm<double>(false, true, rows, N, ld, 1.0, a.data(), ld, b.data(), ld, 0.0, want.data(), N);
      gemm<double>(false, true, rows, N, ld, 1.0, am.data(), ld, bm.data(), ld, 0.0, mag.data(), N);
      gemm<double>(true, false, ld, N, rows, 1.0, a.data(), ld, g.data(), N, 1.0, dwant.data(), N);
      gemm<double>(true, false, ld, N, rows, 1.0, am.data(), ld, gm.data(), N, 1.0, dmag.data(), N);
      EXPECT_LE(worst_ratio(C, want, mag, ld), 1.0) << rows << " rows (M)";
      EXPECT_LE(worst_ratio(D, dwant, dmag, rows), 1.0) << rows << " rows (K)";
    }
  });
}

// A weight gradient large enough to be timed (2^24 multiply-adds or more), adding into a C that
// holds values: within the bound on whichever kernel its choice keeps (on a host without AMX the
// cold timing keeps oneDNN's runtime-size kernel, gemm_bf16.cpp), the first call and the next; with
// A in fp32 (rounded compactly at the call) and as a strided bf16 copy, which oneDNN reads in place.
TEST(Matmul, TimedWeightGradientAddsIntoCWithinTheBound) {
  on_every_path([] {
    const int64_t M = 512, N = 384, K = 256, lda = M + 8, ldb = N + 8;
    const std::vector<float> A = random_values(K * lda, 21), B = random_values(K * ldb, 22), C0 = random_values(M * N, 23);
    std::vector<bf16> A_low(A.size());
    to_bf16(A_low.data(), A.data(), int64_t(A.size()));
    const auto a = rounded(A), b = rounded(B), am = rounded(A, true), bm = rounded(B, true);
    std::vector<double> want(C0.begin(), C0.end()), mag(C0.size());
    for (size_t i = 0; i < mag.size(); ++i) mag[i] = std::fabs(C0[i]);
    gemm<double>(true, false, M, N, K, 1.0, a.data(), lda, b.data(), ldb, 1.0, want.data(), N);
    gemm<double>(true, false, M, N, K, 1.0, am.data(), lda, bm.data(), ldb, 1.0, mag.data(), N);
    for (bool copy : {false, true})
      for (int call = 0; call < 2; ++call) {
        std::vector<float> C = C0;
        matmul<float>(Precision::bf16, true, false, M, N, K, 1.f, {A.data(), lda, copy ? A_low.data() : nullptr},
                      {B.data(), ldb}, 1.f, C.data(), N);
        EXPECT_LE(worst_ratio(C, want, mag, K), 1.0) << "call " << call << (copy ? ", strided bf16 A" : ", fp32 A");
      }
  });
}

// fp32 is gemm<float> itself, bit for bit.
TEST(Matmul, Fp32IsTheFloatGemm) {
  const int64_t M = 16, N = 24, K = 40;
  const std::vector<float> A = random_values(M * K, 3), B = random_values(K * N, 4);
  std::vector<float> C(size_t(M * N)), want(C.size());
  matmul<float>(Precision::fp32, false, false, M, N, K, 1.f, {A.data(), K}, {B.data(), N}, 0.f, C.data(), N);
  gemm<float>(false, false, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, want.data(), N);
  EXPECT_EQ(C, want);
}

// A linear layer in bf16: y from round(x)·round(W) plus the fp32 bias; backward dx = round(dy)·round(W),
// dW += round(x)ᵀ·round(dy) (fp32 accumulation onto what dW held), and db the fp32 sum of the
// unrounded dy (a db from rounded dy would be off by up to 2^-9 of each term). With x and dy as a
// layer passes them: x plain or rounded in place (an exact operand, which the portable path
// multiplies where it is), dy read-only (rounded into a copy) or consumed (linear_backward_consuming:
// rounded in place for the GEMMs after db has read it).
void check_linear_rounding(WeightLayout layout, bool exact_x, bool consuming) {
  SCOPED_TRACE(cat(exact_x ? "x rounded in place" : "x plain", consuming ? ", dy consumed" : ", dy read-only"));
  const int64_t N = 21, in = 48, out = 40;
  const bool oi = layout == WeightLayout::out_in;
  const std::vector<float> x = random_values(N * in, 5), w = random_values(in * out, 6),
                           b = random_values(out, 7), dy = random_values(N * out, 8);
  std::vector<bf16> w_low(w.size());
  to_bf16(w_low.data(), w.data(), int64_t(w.size()));
  const Weights<float> W(w.data(), w_low.data(), Precision::bf16);
  std::vector<float> x_in = x, dy_in = dy;
  if (exact_x) round_in_place(x_in.data(), nullptr, int64_t(x_in.size()));
  const Operand<float> X = rounded_values<float>(x_in.data(), exact_x);
  std::vector<float> y(size_t(N * out)), dx(size_t(N * in)), dw(w.size(), 0.5f), db(size_t(out), 0.25f);
  linear_forward<float>(y.data(), X, W, b.data(), N, in, out, layout);
  if (consuming) {
    linear_backward_consuming<float>(dx.data(), dw.data(), db.data(), dy_in.data(), X, W, N, in, out, layout);
    // Where the GEMMs read bf16, dy's copy alone (its values not written back: a pass saved); where
    // they read fp32, dy rounded in place.
    if (bf16_gemm_reads_fp32()) {
      for (size_t i = 0; i < dy.size(); ++i) ASSERT_EQ(dy_in[i], to_float(to_bf16(dy[i]))) << "dy not rounded in place";
    } else {
      ASSERT_EQ(dy_in, dy) << "dy written back";
    }
  } else {
    linear_backward<float>(dx.data(), dw.data(), db.data(), dy_in.data(), X, W, N, in, out, layout);
    ASSERT_EQ(dy_in, dy) << "a read-only dy was written";
  }

  const auto xr = rounded(x), wr = rounded(w), dyr = rounded(dy), xm = rounded(x, true), wm = rounded(w, true),
             dym = rounded(dy, true);
  std::vector<double> want(y.size()), mag(y.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) want[size_t(n * out + o)] = b[size_t(o)], mag[size_t(n * out + o)] = std::fabs(b[size_t(o)]);
  gemm<double>(false, oi, N, out, in, 1.0, xr.data(), in, wr.data(), oi ? in : out, 1.0, want.data(), out);
  gemm<double>(false, oi, N, out, in, 1.0, xm.data(), in, wm.data(), oi ? in : out, 1.0, mag.data(), out);
  EXPECT_LE(worst_ratio(y, want, mag, in), 1.0) << "y";

  std::vector<double> dx_want(dx.size()), dx_mag(dx.size());
  gemm<double>(false, !oi, N, in, out, 1.0, dyr.data(), out, wr.data(), oi ? in : out, 0.0, dx_want.data(), in);
  gemm<double>(false, !oi, N, in, out, 1.0, dym.data(), out, wm.data(), oi ? in : out, 0.0, dx_mag.data(), in);
  EXPECT_LE(worst_ratio(dx, dx_want, dx_mag, out), 1.0) << "dx";

  std::vector<double> dw_want(w.size(), 0.5), dw_mag(w.size(), 0.5);
  if (oi) {
    gemm<double>(true, false, out, in, N, 1.0, dyr.data(), out, xr.data(), in, 1.0, dw_want.data(), in);
    gemm<double>(true, false, out, in, N, 1.0, dym.data(), out, xm.data(), in, 1.0, dw_mag.data(), in);
  } else {
    gemm<double>(true, false, in, out, N, 1.0, xr.data(), in, dyr.data(), out, 1.0, dw_want.data(), out);
    gemm<double>(true, false, in, out, N, 1.0, xm.data(), in, dym.data(), out, 1.0, dw_mag.data(), out);
  }
  EXPECT_LE(worst_ratio(dw, dw_want, dw_mag, N), 1.0) << "dW";

  std::vector<double> db_want(size_t(out), 0.25), db_mag(size_t(out), 0.25);
  const std::vector<double> dyd = as_double(dy);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o)
      db_want[size_t(o)] += dyd[size_t(n * out + o)], db_mag[size_t(o)] += std::fabs(dyd[size_t(n * out + o)]);
  EXPECT_LE(worst_ratio(db, db_want, db_mag, N), 1.0) << "db";
}

// db += the column sums of dy, each column's fp32 adds in row order from db's value: bit for bit the
// sequential sums, on one thread or two, for widths below, at and past a thread's run of 512 columns.
TEST(Matmul, BiasGradientSumsEachColumnInRowOrder) {
  const int64_t N = 37;
  const int before = num_threads();
  for (int64_t out : {3, 40, 512, 1030}) {
    const std::vector<float> dy = random_values(N * out, 9), w = random_values(out, 10);
    std::vector<float> want(static_cast<size_t>(out));
    for (int64_t o = 0; o < out; ++o) {
      float s = 0.5f;
      for (int64_t n = 0; n < N; ++n) s += dy[size_t(n * out + o)];
      want[size_t(o)] = s;
    }
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      std::vector<float> db(size_t(out), 0.5f);
      linear_backward<float>(nullptr, nullptr, db.data(), dy.data(), Operand<float>(w.data()),
                             Weights<float>(w.data(), nullptr, Precision::fp32), N, 1, out, WeightLayout::in_out);
      EXPECT_EQ(db, want) << "out " << out << ", " << threads << " threads";
    }
  }
  set_num_threads(before);
}

TEST(Matmul, LinearLayerRoundsAtTheStatedPoints) {
  on_every_path([] {
    for (WeightLayout layout : {WeightLayout::out_in, WeightLayout::in_out})
      for (bool exact_x : {false, true})
        for (bool consuming : {false, true}) check_linear_rounding(layout, exact_x, consuming);
  });
}

TEST(Matmul, ParsesPrecisionNames) {
  EXPECT_EQ(parse_precision("fp32"), Precision::fp32);
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_STREQ(precision_name(Precision::bf16), "bf16");
  try {
    parse_precision("fp16");
    FAIL() << "fp16 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fp16' is not one of fp32, bf16"), std::string::npos) << e.what();
  }
}
