// Per-op oracle (DESIGN.md, "Correctness: three oracles"): every layer's backward is checked against
// central finite differences in double precision, and forwards against naive direct formulas.
//
// Objective: L = Σ r ⊙ output with a fixed random r (so ∂L/∂output = r), except the LM head
// (its summed loss) and MoE (Σ r ⊙ out + loss_scale·(aux + z)).
// Criterion for every compared element: |analytic − numeric| ≤ tol·max(1, |numeric|), tol = 1e-6 for
// finite differences with h = 1e-6 (central-difference truncation is O(h²) ≈ 1e-12 and rounding
// ≈ 1e-16·|L|/h ≈ 1e-9 here, so a real bug cannot hide under it).
// Sizes are deliberately odd: non-power-of-two channels, T = 70 and 130 (not multiples of the
// attention block of 64, and more than one block), GQA with KV < H, MoE with E = 5, K = 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "model/layers/activation.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/linear.h"
#include "model/layers/lm_head.h"
#include "model/layers/moe.h"
#include "model/layers/norm.h"
#include "model/layers/rope.h"

using namespace origami;

namespace {

using Vec = std::vector<double>;
using LD = long double;

constexpr double kH = 1e-6;      // finite-difference step
constexpr double kFdTol = 1e-6;  // |a − n| ≤ kFdTol·max(1, |n|)

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  double uni(double lo = -1, double hi = 1) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  double normal(double s = 1) { return std::normal_distribution<double>(0, s)(g); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  Vec vec(size_t n, double lo = -1, double hi = 1) {
    Vec v(n);
    for (auto& x : v) x = uni(lo, hi);
    return v;
  }
};

// Σ r ⊙ y, accumulated in long double so the objective adds no rounding of its own worth mentioning.
double dot(const Vec& r, const Vec& y) {
  LD s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += LD(r[i]) * LD(y[i]);
  return double(s);
}

std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t(0));
  return v;
}
// All indices when n ≤ m, else m distinct random ones (sorted), always including the first and last.
std::vector<size_t> some_indices(size_t n, size_t m, Rng& rng) {
  if (n <= m) return all_indices(n);
  std::vector<size_t> v = all_indices(n);
  std::shuffle(v.begin() + 1, v.end() - 1, rng.g);
  v.resize(m - 1);
  v.push_back(n - 1);
  std::sort(v.begin(), v.end());
  return v;
}

// Compares analytic[i] with the central difference of loss() in p[i], for i in idx.
void fd_check(const std::string& what, Vec& p, const Vec& analytic, const std::function<double()>& loss,
              const std::vector<size_t>& idx, double tol = kFdTol, double h = kH) {
  ASSERT_EQ(p.size(), analytic.size()) << what;
  double worst = 0;
  size_t worst_i = 0, fails = 0;
  for (size_t i : idx) {
    const double keep = p[i];
    p[i] = keep + h;
    const double lp = loss();
    p[i] = keep - h;
    const double lm = loss();
    p[i] = keep;
    const double num = (lp - lm) / (2 * h);
    const double err = std::abs(analytic[i] - num) / std::max(1.0, std::abs(num));
    if (!(err <= worst)) worst = err, worst_i = i;  // (a NaN, analytic or numeric, is the worst and fails)
    if (!(err <= tol) && fails++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " vs numeric " << num
                    << " (rel err " << err << ")";
  }
  EXPECT_EQ(fails, 0u) << what << ": " << fails << " of " << idx.size() << " elements off";
  std::printf("  fd %-28s %6zu elems, max rel err %.2e (at %zu)\n", what.c_str(), idx.size(), worst, worst_i);
}

// Elementwise |a − b| ≤ tol·max(1, |b|).
void expect_close(const std::string& what, const Vec& a, const Vec& b, double tol) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0;
  size_t fails = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i]));
    worst = std::max(worst, err);
    if (!(err <= tol) && fails++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs " << b[i] << " (rel err " << err << ")";
  }
  EXPECT_EQ(fails, 0u) << what;
  std::printf("  cmp %-27s %6zu elems, max rel err %.2e\n", what.c_str(), a.size(), worst);
}

Vec sub(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}
Vec scaled(const Vec& a, double s) {
  Vec d(a);
  for (auto& x : d) x *= s;
  return d;
}
std::vector<float> to_f(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }
Vec to_d(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }
const Vec& to_d(const Vec& v) { return v; }

constexpr double kFloatTol = 1e-5;  // float vs double instantiation agreement

}  // namespace

// ───────────────────────────── Linear ─────────────────────────────

class LinearFd : public ::testing::TestWithParam<std::tuple<WeightLayout, bool>> {};

TEST_P(LinearFd, BackwardMatchesFiniteDifferences) {
  const auto [layout, with_bias] = GetParam();
  const int64_t N = 7, in = 13, out = 11;
  Rng rng(11 + int(layout) * 2 + with_bias);
  Vec x = rng.vec(N * in), w = rng.vec(in * out), b = rng.vec(out), r = rng.vec(N * out);
  const double* bp = with_bias ? b.data() : nullptr;
  auto fwd = [&] {
    Vec y(N * out, 12345.0);  // garbage: forward must overwrite
    linear_forward(y.data(), x.data(), w.data(), bp, N, in, out, layout);
    return y;
  };
  // Forward vs direct formula.
  {
    Vec y = fwd(), ref(N * out);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) {
        LD s = with_bias ? b[o] : 0;
        for (int64_t i = 0; i < in; ++i)
          s += LD(x[n * in + i]) * (layout == WeightLayout::out_in ? w[o * in + i] : w[i * out + o]);
        ref[n * out + o] = double(s);
      }
    expect_close("linear y", y, ref, 1e-13);
  }
  auto loss = [&] { return dot(r, fwd()); };
  // dx overwritten (pre-filled garbage), dw and db accumulated onto pre-filled values.
  Vec dx(N * in, 777.0), dw0 = rng.vec(in * out), db0 = rng.vec(out), dw = dw0, db = db0;
  linear_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, r.data(), x.data(), w.data(), N, in, out,
                  layout);
  fd_check("linear dx", x, dx, loss, all_indices(x.size()));
  fd_check("linear dw (+=)", w, sub(dw, dw0), loss, all_indices(w.size()));
  if (with_bias) fd_check("linear db (+=)", b, sub(db, db0), loss, all_indices(b.size()));
  else EXPECT_EQ(db, db0);
  // accumulate_dx: dx += on top of the previous result.
  Vec dx2 = dx;
  linear_backward(dx2.data(), (double*)nullptr, (double*)nullptr, r.data(), x.data(), w.data(), N, in, out, layout,
                  true);
  expect_close("linear dx accumulate", dx2, scaled(dx, 2), 1e-14);
  // Float instantiation agrees.
  {
    auto xf = to_f(x), wf = to_f(w), bf = to_f(b), rf = to_f(r);
    std::vector<float> yf(N * out), dxf(N * in), dwf(in * out, 0.f), dbf(out, 0.f);
    linear_forward(yf.data(), xf.data(), wf.data(), with_bias ? bf.data() : nullptr, N, in, out, layout);
    linear_backward(dxf.data(), dwf.data(), with_bias ? dbf.data() : nullptr, rf.data(), xf.data(), wf.data(), N, in,
                    out, layout);
    expect_close("linear y float", to_d(yf), fwd(), kFloatTol);
    expect_close("linear dx float", to_d(dxf), dx, kFloatTol);
    expect_close("linear dw float", to_d(dwf), sub(dw, dw0), kFloatTol);
  }
}

namespace origami {
void PrintTo(WeightLayout l, std::ostream* os) { *os << (l == WeightLayout::out_in ? "out_in" : "in_out"); }
}  // namespace origami

// Test names say the case (e.g. LinearFd.BackwardMatchesFiniteDifferences/OutIn_Bias).
std::string linear_case_name(const ::testing::TestParamInfo<std::tuple<WeightLayout, bool>>& info) {
  const auto [layout, with_bias] = info.param;
  return std::string(layout == WeightLayout::out_in ? "OutIn" : "InOut") + (with_bias ? "_Bias" : "_NoBias");
}

INSTANTIATE_TEST_SUITE_P(Layouts, LinearFd,
                         ::testing::Combine(::testing::Values(WeightLayout::out_in, WeightLayout::in_out),
                                            ::testing::Bool()),
                         linear_case_name);

// ───────────────────────────── Norms ─────────────────────────────

TEST(NormFd, LayerNorm) {
  const int64_t N = 9, C = 37;
  const double eps = 1e-5;
  Rng rng(21);
  Vec x = rng.vec(N * C, -2, 3), w = rng.vec(C, 0.5, 1.5), b = rng.vec(C), r = rng.vec(N * C);
  for (int64_t n = 0; n < N; ++n)  // rows with different offsets and scales
    for (int64_t c = 0; c < C; ++c) x[n * C + c] = x[n * C + c] * (0.3 + 0.4 * n) + n - 3;
  Vec mean(N), rstd(N);
  auto fwd = [&] {
    Vec y(N * C, 999.0);
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
    return y;
  };
  {
    Vec y = fwd(), ref(N * C), rm(N), rs(N);
    for (int64_t n = 0; n < N; ++n) {
      LD m = 0, v = 0;
      for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
      m /= C;
      for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
      v /= C;
      const LD s = 1 / std::sqrt(v + eps);
      for (int64_t c = 0; c < C; ++c) ref[n * C + c] = double((x[n * C + c] - m) * s * w[c] + b[c]);
      rm[n] = double(m), rs[n] = double(s);
    }
    expect_close("layernorm y", y, ref, 1e-13);
    expect_close("layernorm mean", mean, rm, 1e-14);
    expect_close("layernorm rstd", rstd, rs, 1e-14);
  }
  auto loss = [&] { return dot(r, fwd()); };
  fwd();
  Vec dx0 = rng.vec(N * C), dw0 = rng.vec(C), db0 = rng.vec(C), dx = dx0, dw = dw0, db = db0;
  layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  fd_check("layernorm dx (+=)", x, sub(dx, dx0), loss, all_indices(x.size()));
  fd_check("layernorm dw (+=)", w, sub(dw, dw0), loss, all_indices(w.size()));
  fd_check("layernorm db (+=)", b, sub(db, db0), loss, all_indices(b.size()));
  {
    auto xf = to_f(x), wf = to_f(w), bf = to_f(b), rf = to_f(r);
    std::vector<float> yf(N * C), mf(N), sf(N), dxf(N * C, 0.f), dwf(C, 0.f), dbf(C, 0.f);
    layernorm_forward(yf.data(), mf.data(), sf.data(), xf.data(), wf.data(), bf.data(), N, C, eps);
    layernorm_backward(dxf.data(), dwf.data(), dbf.data(), rf.data(), xf.data(), wf.data(), mf.data(), sf.data(), N, C);
    expect_close("layernorm y float", to_d(yf), fwd(), kFloatTol);
    expect_close("layernorm dx float", to_d(dxf), sub(dx, dx0), kFloatTol);
    expect_close("layernorm dw float", to_d(dwf), sub(dw, dw0), kFloatTol);
    expect_close("layernorm db float", to_d(dbf), sub(db, db0), kFloatTol);
  }
}

TEST(NormFd, RMSNorm) {
  const int64_t N = 9, C = 37;
  const double eps = 1e-6;
  Rng rng(22);
  Vec x = rng.vec(N * C, -2, 3), w = rng.vec(C, 0.5, 1.5), r = rng.vec(N * C);
  Vec rstd(N);
  auto fwd = [&] {
    Vec y(N * C, 999.0);
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    return y;
  };
  {
    Vec y = fwd(), ref(N * C), rs(N);
    for (int64_t n = 0; n < N; ++n) {
      LD ss = 0;
      for (int64_t c = 0; c < C; ++c) ss += LD(x[n * C + c]) * x[n * C + c];
      const LD s = 1 / std::sqrt(ss / C + eps);
      for (int64_t c = 0; c < C; ++c) ref[n * C + c] = double(x[n * C + c] * s * w[c]);
      rs[n] = double(s);
    }
    expect_close("rmsnorm y", y, ref, 1e-13);
    expect_close("rmsnorm rstd", rstd, rs, 1e-14);
  }
  auto loss = [&] { return dot(r, fwd()); };
  fwd();
  Vec dx0 = rng.vec(N * C), dw0 = rng.vec(C), dx = dx0, dw = dw0;
  rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  fd_check("rmsnorm dx (+=)", x, sub(dx, dx0), loss, all_indices(x.size()));
  fd_check("rmsnorm dw (+=)", w, sub(dw, dw0), loss, all_indices(w.size()));
  {
    auto xf = to_f(x), wf = to_f(w), rf = to_f(r);
    std::vector<float> yf(N * C), sf(N), dxf(N * C, 0.f), dwf(C, 0.f);
    rmsnorm_forward(yf.data(), sf.data(), xf.data(), wf.data(), N, C, eps);
    rmsnorm_backward(dxf.data(), dwf.data(), rf.data(), xf.data(), wf.data(), sf.data(), N, C);
    expect_close("rmsnorm y float", to_d(yf), fwd(), kFloatTol);
    expect_close("rmsnorm dx float", to_d(dxf), sub(dx, dx0), kFloatTol);
    expect_close("rmsnorm dw float", to_d(dwf), sub(dw, dw0), kFloatTol);
  }
}

// ───────────────────────────── Activations ─────────────────────────────

TEST(ActivationFd, GeluTanh) {
  const int64_t n = 101;
  Rng rng(31);
  Vec x = rng.vec(n, -5, 5), r = rng.vec(n);
  x[0] = 0, x[1] = -1e-3, x[2] = 8;
  auto fwd = [&] {
    Vec y(n, 999.0);
    gelu_forward(y.data(), x.data(), n);
    return y;
  };
  {
    Vec y = fwd(), ref(n);
    const LD k = std::sqrt(LD(2) / LD(3.14159265358979323846264338327950288L));
    for (int64_t i = 0; i < n; ++i) {
      const LD v = x[i];
      ref[i] = double(LD(0.5) * v * (1 + std::tanh(k * (v + LD(0.044715) * v * v * v))));
    }
    expect_close("gelu y", y, ref, 1e-14);
  }
  auto loss = [&] { return dot(r, fwd()); };
  Vec dx(n, 999.0);
  gelu_backward(dx.data(), r.data(), x.data(), n);
  fd_check("gelu dx", x, dx, loss, all_indices(n));
  {
    auto xf = to_f(x), rf = to_f(r);
    std::vector<float> yf(n), dxf(n);
    gelu_forward(yf.data(), xf.data(), n);
    gelu_backward(dxf.data(), rf.data(), xf.data(), n);
    expect_close("gelu y float", to_d(yf), fwd(), kFloatTol);
    expect_close("gelu dx float", to_d(dxf), dx, kFloatTol);
  }
}

TEST(ActivationFd, SwiGLU) {
  const int64_t N = 7, F = 13;
  Rng rng(32);
  Vec gu = rng.vec(N * 2 * F, -4, 4), r = rng.vec(N * F);
  auto fwd = [&] {
    Vec h(N * F, 999.0);
    swiglu_forward(h.data(), gu.data(), N, F);
    return h;
  };
  {
    Vec h = fwd(), ref(N * F);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < F; ++i) {
        const LD g = gu[n * 2 * F + i], u = gu[n * 2 * F + F + i];
        ref[n * F + i] = double(g / (1 + std::exp(-g)) * u);
      }
    expect_close("swiglu h", h, ref, 1e-14);
  }
  auto loss = [&] { return dot(r, fwd()); };
  Vec dgu(N * 2 * F, 999.0);
  swiglu_backward(dgu.data(), r.data(), gu.data(), N, F);
  fd_check("swiglu dgu", gu, dgu, loss, all_indices(gu.size()));
  {
    auto guf = to_f(gu), rf = to_f(r);
    std::vector<float> hf(N * F), dguf(N * 2 * F);
    swiglu_forward(hf.data(), guf.data(), N, F);
    swiglu_backward(dguf.data(), rf.data(), guf.data(), N, F);
    expect_close("swiglu h float", to_d(hf), fwd(), kFloatTol);
    expect_close("swiglu dgu float", to_d(dguf), dgu, kFloatTol);
  }
}

// The bf16 kernels (a bf16 run's dense MLP) give exactly the fp32 kernels' results on the rounded
// input, keep that input rounded, and round their output: sizes across several of their blocks.
// Backward, as the up projection's GEMMs read it: the fp32 kernel's result as a bf16 copy (or, where
// the bf16 GEMMs read fp32 values, rounded to bf16 precision in place), and the bias gradient summed
// from the unrounded values in row order (GELU's fused into the same pass), on one thread and on two.
TEST(ActivationBf16, EqualTheFp32KernelsOnTheRoundedInput) {
  auto rounded = [](const std::vector<float>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = to_float(to_bf16(x[i]));
    return r;
  };
  auto low_of = [](const std::vector<float>& x) {
    std::vector<bf16> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = to_bf16(x[i]);
    return r;
  };
  auto same = [](const char* what, const bf16* a, const std::vector<bf16>& b) {
    for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(a[i].bits, b[i].bits) << what << "[" << i << "]";
  };
  Rng rng(33);
  const int64_t N = 3, F = 1500;  // forward: 3 blocks of 2048 and a part (GELU); backward: runs of 512 and less
  const int before = num_threads();
  for (const bool gelu : {true, false}) {
    const int64_t pre_n = gelu ? N * F : N * 2 * F, act_n = N * F, Fa = pre_n / N;
    const std::vector<float> x = to_f(rng.vec(pre_n, -6, 6)), dy = to_f(rng.vec(act_n));
    const std::vector<float> xr = rounded(x);
    std::vector<float> y(act_n), dx(pre_n);
    std::vector<bf16> x_low(pre_n), y_low(act_n);
    if (gelu) gelu_forward(y.data(), xr.data(), N * F);
    else swiglu_forward(y.data(), xr.data(), N, F);
    std::vector<float> x_in = x;
    mlp_activation_forward(gelu, {x_in.data(), nullptr, x_low.data(), y_low.data()}, N, F);
    same(gelu ? "gelu x_low" : "swiglu gu_low", x_low.data(), low_of(x));
    same(gelu ? "gelu y_low" : "swiglu h_low", y_low.data(), low_of(y));
    if (gelu) gelu_backward(dx.data(), dy.data(), xr.data(), N * F);
    else swiglu_backward(dx.data(), dy.data(), xr.data(), N, F);
    std::vector<float> want_db(size_t(Fa), 0.25f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < Fa; ++c) want_db[size_t(c)] += dx[size_t(n * Fa + c)];
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      std::vector<float> dx_bf16(pre_n), db(size_t(Fa), 0.25f);
      const Mat<float> read = mlp_activation_backward(gelu, dx_bf16.data(), db.data(), dy.data(),
                                                      {nullptr, nullptr, x_low.data(), y_low.data()}, N, F);
      const std::string what = std::string(gelu ? "gelu" : "swiglu") + ", " + std::to_string(threads) + " threads";
      EXPECT_EQ(db, want_db) << what;
      EXPECT_EQ(read.ld, Fa) << what;
      if (bf16_gemm_reads_fp32()) {  // the values rounded in place, read where they are
        EXPECT_EQ(read.v, dx_bf16.data()) << what;
        EXPECT_TRUE(read.exact) << what;
        EXPECT_EQ(read.low, nullptr) << what;
        ASSERT_EQ(dx_bf16, rounded(dx)) << what;
      } else {  // the bf16 copy alone
        EXPECT_EQ(read.v, nullptr) << what;
        same(what.c_str(), read.low, low_of(dx));
      }
    }
  }
  set_num_threads(before);
}

// The MoE experts' SwiGLU in a bf16 run: exactly the fp32 kernels' outputs rounded to bf16 precision,
// in place (where the values are asked for) and as bf16 (where a copy is), forward and backward; rows
// across the threads. An output given as null is not written.
TEST(ActivationBf16, RoundedSwigluIsTheFp32KernelsRounded) {
  Rng rng(35);
  const int64_t N = 7, F = 300;
  const std::vector<float> gu = to_f(rng.vec(N * 2 * F, -6, 6)), dh = to_f(rng.vec(N * F));
  std::vector<float> h(N * F), dgu(N * 2 * F);
  swiglu_forward(h.data(), gu.data(), N, F);
  swiglu_backward(dgu.data(), dh.data(), gu.data(), N, F);
  for (const auto [values, copy] : {std::pair{true, false}, std::pair{true, true}, std::pair{false, true}}) {
    std::vector<float> h_r(N * F, 7.f), dgu_r(N * 2 * F, 7.f);
    std::vector<bf16> h_low(N * F, bf16{7}), dgu_low(N * 2 * F, bf16{7});
    swiglu_forward_rounded(values ? h_r.data() : nullptr, copy ? h_low.data() : nullptr, gu.data(), N, F);
    swiglu_backward_rounded(values ? dgu_r.data() : nullptr, copy ? dgu_low.data() : nullptr, dh.data(), gu.data(), N,
                            F);
    for (size_t i = 0; i < h.size(); ++i) {
      ASSERT_EQ(h_r[i], values ? to_float(to_bf16(h[i])) : 7.f) << "h[" << i << "]";
      ASSERT_EQ(h_low[i].bits, copy ? to_bf16(h[i]).bits : 7) << "h copy[" << i << "]";
    }
    for (size_t i = 0; i < dgu.size(); ++i) {
      ASSERT_EQ(dgu_r[i], values ? to_float(to_bf16(dgu[i])) : 7.f) << "dgu[" << i << "]";
      ASSERT_EQ(dgu_low[i].bits, copy ? to_bf16(dgu[i]).bits : 7) << "dgu copy[" << i << "]";
    }
  }
}

// ───────────────────────────── Embedding ─────────────────────────────

class EmbeddingFd : public ::testing::TestWithParam<bool> {};

TEST_P(EmbeddingFd, BackwardMatchesFiniteDifferences) {
  const bool with_wpe = GetParam();
  const int64_t B = 3, Tn = 11, C = 19, V = 17, stride = Tn + 1;
  Rng rng(41 + with_wpe);
  std::vector<int32_t> tokens(B * stride);
  for (auto& t : tokens) t = int32_t(rng.integer(0, 6));  // few distinct ids: many repeats
  tokens[5] = int32_t(V - 1);
  Vec wte = rng.vec(V * C), wpe = rng.vec(Tn * C), r = rng.vec(B * Tn * C);
  auto fwd = [&] {
    Vec x(B * Tn * C, 999.0);
    embedding_forward(x.data(), tokens.data(), stride, wte.data(), with_wpe ? wpe.data() : nullptr, B, Tn, C);
    return x;
  };
  {
    Vec x = fwd(), ref(B * Tn * C);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t c = 0; c < C; ++c)
          ref[(b * Tn + t) * C + c] = wte[tokens[b * stride + t] * C + c] + (with_wpe ? wpe[t * C + c] : 0.0);
    expect_close("embedding x", x, ref, 0);
  }
  auto loss = [&] { return dot(r, fwd()); };
  Vec dwte0 = rng.vec(V * C), dwpe0 = rng.vec(Tn * C), dwte = dwte0, dwpe = dwpe0;
  embedding_backward(dwte.data(), with_wpe ? dwpe.data() : nullptr, r.data(), tokens.data(), stride, B, Tn, C);
  fd_check("embedding dwte (+=)", wte, sub(dwte, dwte0), loss, all_indices(wte.size()));
  if (with_wpe) fd_check("embedding dwpe (+=)", wpe, sub(dwpe, dwpe0), loss, all_indices(wpe.size()));
  else EXPECT_EQ(dwpe, dwpe0);
  {
    auto wtef = to_f(wte), wpef = to_f(wpe), rf = to_f(r);
    std::vector<float> xf(B * Tn * C), dwtef(V * C, 0.f), dwpef(Tn * C, 0.f);
    embedding_forward(xf.data(), tokens.data(), stride, wtef.data(), with_wpe ? wpef.data() : nullptr, B, Tn, C);
    embedding_backward(dwtef.data(), with_wpe ? dwpef.data() : nullptr, rf.data(), tokens.data(), stride, B, Tn, C);
    expect_close("embedding x float", to_d(xf), fwd(), kFloatTol);
    expect_close("embedding dwte float", to_d(dwtef), sub(dwte, dwte0), kFloatTol);
  }
}

INSTANTIATE_TEST_SUITE_P(Wpe, EmbeddingFd, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "WithWpe" : "NoWpe"); });

// ───────────────────────────── RoPE ─────────────────────────────

class RopeFd : public ::testing::TestWithParam<int64_t> {};

TEST_P(RopeFd, ForwardBackwardInverseTransposeAndFd) {
  const int64_t D = GetParam(), B = 2, Tn = 70, H = 6, KV = 2, S = (H + 2 * KV) * D, half = D / 2;
  const double theta = 10000;
  const RopeTable rt(Tn + 3, D, theta);
  Rng rng(51 + D);
  Vec x = rng.vec(B * Tn * S), r = rng.vec(B * Tn * S);
  auto fwd = [&] {
    Vec y = x;
    rope_forward(y.data(), rt, B, Tn, H, KV, D);
    return y;
  };
  // Forward vs the Hugging Face formula q·cos + rotate_half(q)·sin; v untouched, position 0 identity.
  Vec y = fwd();
  {
    Vec ref(B * Tn * S);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t j = 0; j < S; ++j) {
          const int64_t row = (b * Tn + t) * S, head = j / D, i = j % D;
          if (head >= H + KV) {
            ref[row + j] = x[row + j];
            continue;
          }
          const int64_t fi = i % half;
          const LD inv_freq = std::pow(LD(theta), -LD(2 * fi) / LD(D)), ang = LD(t) * inv_freq;
          const LD rot = i < half ? -LD(x[row + head * D + i + half]) : LD(x[row + head * D + i - half]);
          ref[row + j] = double(x[row + j] * std::cos(ang) + rot * std::sin(ang));
        }
    expect_close("rope y vs HF formula", y, ref, 1e-13);
  }
  // Backward is the exact inverse (rotation) and transposition of the forward.
  {
    Vec z = y;
    rope_backward(z.data(), rt, B, Tn, H, KV, D);
    expect_close("rope bwd(fwd(x)) = x", z, x, 1e-14);
    Vec rb = r;
    rope_backward(rb.data(), rt, B, Tn, H, KV, D);
    const double lhs = dot(r, y), rhs = dot(rb, x);
    EXPECT_NEAR(lhs, rhs, 1e-12 * std::max(1.0, std::abs(lhs))) << "<r, R x> vs <Rᵀ r, x>";
    // FD: ∂(Σ r ⊙ R x)/∂x = Rᵀ r.
    auto loss = [&] { return dot(r, fwd()); };
    fd_check("rope dx", x, rb, loss, some_indices(x.size(), 1500, rng));
    auto xf = to_f(x), rf = to_f(r);
    rope_forward(xf.data(), rt, B, Tn, H, KV, D);
    rope_backward(rf.data(), rt, B, Tn, H, KV, D);
    expect_close("rope y float", to_d(xf), y, kFloatTol);
    expect_close("rope dx float", to_d(rf), rb, kFloatTol);
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDim, RopeFd, ::testing::Values(int64_t(8), int64_t(10)),
                         [](const auto& info) { return "D" + std::to_string(info.param); });

// ───────────────────────────── Attention ─────────────────────────────

struct AttnCase {
  int64_t B, T, H, KV, D;
  size_t fd_elems;  // random subset size of qkv for finite differences (all when larger than qkv)
  double amp = 1.5;  // qkv uniform in ±amp; large amp gives scores beyond float's exp range (> 88)
  double float_tol = kFloatTol;
};

std::string attention_case_name(const AttnCase& c);
void PrintTo(const AttnCase& c, std::ostream* os) { *os << attention_case_name(c); }  // gtest's case listing

class AttentionFd : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionFd, ForwardVsNaiveAndBackwardFd) {
  const auto [B, Tn, H, KV, D, fd_elems, amp, float_tol] = GetParam();
  const int64_t S = (H + 2 * KV) * D, HD = H * D, group = H / KV;
  Rng rng(61 + Tn * 7 + D + uint64_t(amp));
  Vec qkv = rng.vec(B * Tn * S, -amp, amp), r = rng.vec(B * Tn * HD);
  for (auto& v : qkv) v = double(float(v));  // the float run below sees exactly the same inputs
  Vec out(B * Tn * HD), lse(B * H * Tn);
  auto fwd = [&] {
    std::fill(out.begin(), out.end(), 999.0);
    std::fill(lse.begin(), lse.end(), 999.0);
    attention_forward(out.data(), lse.data(), qkv.data(), B, Tn, H, KV, D);
  };
  fwd();
  // Naive T×T causal softmax attention, in long double.
  {
    Vec ref_out(B * Tn * HD), ref_lse(B * H * Tn);
    std::vector<LD> s(Tn);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / group;
        for (int64_t i = 0; i < Tn; ++i) {
          const double* q = qkv.data() + (b * Tn + i) * S + h * D;
          LD m = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            const double* k = qkv.data() + (b * Tn + j) * S + (H + g) * D;
            LD acc = 0;
            for (int64_t d = 0; d < D; ++d) acc += LD(q[d]) * k[d];
            s[j] = acc / std::sqrt(LD(D));
            m = std::max(m, s[j]);
          }
          LD sum = 0;
          for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
          ref_lse[(b * H + h) * Tn + i] = double(m + std::log(sum));
          for (int64_t d = 0; d < D; ++d) {
            LD o = 0;
            for (int64_t j = 0; j <= i; ++j)
              o += std::exp(s[j] - m) / sum * qkv[(b * Tn + j) * S + (H + KV + g) * D + d];
            ref_out[(b * Tn + i) * HD + h * D + d] = double(o);
          }
        }
      }
    expect_close("attention out vs naive", out, ref_out, 1e-13);
    expect_close("attention lse vs naive", lse, ref_lse, 1e-13);
  }
  if (amp > 2)
    EXPECT_GT(*std::max_element(lse.begin(), lse.end()), 100.0) << "test does not reach large scores";
  auto loss = [&] {
    fwd();
    return dot(r, out);
  };
  fwd();
  Vec dqkv(B * Tn * S, 999.0);  // garbage: backward overwrites
  attention_backward(dqkv.data(), r.data(), qkv.data(), out.data(), lse.data(), B, Tn, H, KV, D);
  fd_check("attention dqkv", qkv, dqkv, loss, some_indices(qkv.size(), fd_elems, rng));
  // Every k and v element of the last position only influences rows ≥ that position: check the
  // final token's k/v gradient and the first token's q gradient explicitly (block edges).
  {
    std::vector<size_t> edge;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t : {int64_t(0), std::min<int64_t>(63, Tn - 1), std::min<int64_t>(64, Tn - 1), Tn - 1})
        for (int64_t j = 0; j < S; j += std::max<int64_t>(1, D / 3)) edge.push_back(size_t((b * Tn + t) * S + j));
    std::sort(edge.begin(), edge.end());
    edge.erase(std::unique(edge.begin(), edge.end()), edge.end());
    fd_check("attention dqkv block edges", qkv, dqkv, loss, edge);
  }
  // Float instantiation agrees.
  {
    fwd();
    auto qf = to_f(qkv), rf = to_f(r);
    std::vector<float> of(B * Tn * HD), lf(B * H * Tn), dqf(B * Tn * S);
    attention_forward(of.data(), lf.data(), qf.data(), B, Tn, H, KV, D);
    attention_backward(dqf.data(), rf.data(), qf.data(), of.data(), lf.data(), B, Tn, H, KV, D);
    expect_close("attention out float", to_d(of), out, float_tol);
    expect_close("attention lse float", to_d(lf), lse, float_tol);
    expect_close("attention dqkv float", to_d(dqf), dqkv, float_tol);
  }
}

std::string attention_case_name(const AttnCase& c) {  // e.g. B2_T70_H6_KV2_D8
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_KV" +
         std::to_string(c.KV) + "_D" + std::to_string(c.D) + (c.amp > 2 ? "_LargeScores" : "");
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionFd,
                         ::testing::Values(AttnCase{1, 5, 2, 1, 4, 100000},    // tiny: every element
                                           AttnCase{2, 70, 6, 2, 8, 700},     // two blocks, GQA 3:1
                                           AttnCase{1, 130, 6, 2, 10, 500},    // three blocks, D = 10
                                           AttnCase{1, 64, 3, 3, 8, 400},      // exactly one block, MHA
                                           AttnCase{1, 129, 4, 1, 8, 600},     // MQA, one-row last block
                                           // Scores up to ~±200: the online softmax must not overflow
                                           // (float exp overflows past 88). Float rounding of such
                                           // scores (~1e-5 absolute) bounds float agreement to ~1e-4.
                                           AttnCase{1, 70, 2, 1, 8, 400, 12.0, 2e-4}),
                         [](const ::testing::TestParamInfo<AttnCase>& info) { return attention_case_name(info.param); });

// Documents of a batch of rows: doc[b·T + t] is the document of position t of row b, starting a new
// one at each position in `starts[b]` (ascending).
std::vector<int32_t> document_ids(int64_t T, const std::vector<std::vector<int64_t>>& starts) {
  std::vector<int32_t> doc;
  for (const auto& row : starts)
    for (int64_t t = 0, d = 0, k = 0; t < T; ++t) {
      if (k < int64_t(row.size()) && row[size_t(k)] == t) ++d, ++k;
      doc.push_back(int32_t(d));
    }
  return doc;
}

// Context parallelism's premise (parallel/context_parallel.h): attention over a sequence computed as
// any set of (query chunk, key chunk) blocks, merged by log-sum-exp in any order, equals the whole
// computation, forward and backward — with or without documents. Chunks of uneven lengths crossing
// the 64-row tiles; the keys read from a separate k|v buffer (as a ring buffer holds them); key
// chunks visited in a shuffled order per query chunk; blocks whose keys all follow the queries skipped.
// In bf16 (float) the same holds within fp32 round-off: the probabilities' rounding does not depend on
// the order the keys come in (attention.cpp, "Precision").
// Returns the chunked results with the whole ones: {out, lse, dq, dk|dv} pairs (chunked, whole).
struct Chunked {
  std::vector<std::pair<Vec, Vec>> forward, backward;
};
template <typename T>
Chunked any_chunking(const int32_t* doc, Precision precision, bool exact = false) {
  using TVec = std::vector<T>;
  const int64_t B = 2, Tn = 130, H = 6, KV = 2, D = 8, S = (H + 2 * KV) * D, HD = H * D, W = 2 * KV * D;
  Rng rng(97);
  const Vec qkv_d = rng.vec(B * Tn * S, -2, 2), dout_d = rng.vec(B * Tn * HD);
  TVec qkv(qkv_d.begin(), qkv_d.end());
  const TVec dout(dout_d.begin(), dout_d.end());
  if constexpr (std::is_same_v<T, float>)  // exact: q|k|v rounded in place first, as a bf16 model does
    if (exact) round_in_place(qkv.data(), nullptr, int64_t(qkv.size()));
  // dqkv NaN on entry: the whole-sequence backward writes every element (zeros first in fp32; in bf16
  // each task stores its sums, BlockDims::overwrite), so none may survive — with documents too.
  TVec out(B * Tn * HD), lse(B * H * Tn), dqkv(B * Tn * S, std::numeric_limits<T>::quiet_NaN());
  attention_forward(out.data(), lse.data(), qkv.data(), B, Tn, H, KV, D, doc, precision, exact);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, Tn, H, KV, D, doc, precision,
                     exact);
  TVec kv(B * Tn * W);  // [B, T, k | v]
  for (int64_t n = 0; n < B * Tn; ++n)
    for (int64_t j = 0; j < W; ++j) kv[n * W + j] = qkv[n * S + H * D + j];
  const std::vector<int64_t> edges = {0, 17, 70, 71, 128, 130};  // chunk c is [edges[c], edges[c+1])
  const size_t chunks = edges.size() - 1;
  std::mt19937_64 g(5);
  TVec bout(out.size(), T(0)), blse(lse.size(), -INFINITY), bdq(dqkv.size(), T(0)), bdkv(kv.size(), T(0));
  auto blocks = [&](bool backward) {
    for (size_t qc = 0; qc < chunks; ++qc) {
      std::vector<size_t> order(qc + 1);  // key chunks up to the query chunk; later ones are empty
      std::iota(order.begin(), order.end(), size_t(0));
      std::shuffle(order.begin(), order.end(), g);
      for (size_t kc : order) {
        const int64_t q0 = edges[qc], k0 = edges[kc];
        BlockDims d{B, edges[qc + 1] - q0, edges[kc + 1] - k0, H, KV, D, kc == qc ? 0 : kAllKeys};
        if (doc) d.qdoc = doc + q0, d.kdoc = doc + k0, d.doc_row = Tn;
        d.precision = precision, d.qkv_exact = exact;
        const Heads<const T> q{qkv.data() + q0 * S, Tn * S, S}, k{kv.data() + k0 * W, Tn * W, W},
            v{kv.data() + k0 * W + KV * D, Tn * W, W};
        if (!backward) {
          attention_block_forward<T>({bout.data() + q0 * HD, Tn * HD, HD}, {blse.data() + q0, H * Tn, Tn}, q, k,
                                          v, d);
        } else {
          attention_block_backward<T>({bdq.data() + q0 * S, Tn * S, S}, {bdkv.data() + k0 * W, Tn * W, W},
                                           {bdkv.data() + k0 * W + KV * D, Tn * W, W},
                                           {dout.data() + q0 * HD, Tn * HD, HD}, q, k, v,
                                           {bout.data() + q0 * HD, Tn * HD, HD}, {blse.data() + q0, H * Tn, Tn}, d);
        }
      }
    }
  };
  blocks(false);
  blocks(true);
  TVec whole_q(dqkv.size(), T(0)), whole_kv(kv.size());
  for (int64_t n = 0; n < B * Tn; ++n) {
    for (int64_t j = 0; j < HD; ++j) whole_q[n * S + j] = dqkv[n * S + j];
    for (int64_t j = 0; j < W; ++j) whole_kv[n * W + j] = dqkv[n * S + HD + j];
  }
  return {{{to_d(bout), to_d(out)}, {to_d(blse), to_d(lse)}}, {{to_d(bdq), to_d(whole_q)}, {to_d(bdkv), to_d(whole_kv)}}};
}

void check_any_chunking(const int32_t* doc) {
  const Chunked c = any_chunking<double>(doc, Precision::fp32);
  expect_close("merged blocks: out", c.forward[0].first, c.forward[0].second, 1e-13);
  expect_close("merged blocks: lse", c.forward[1].first, c.forward[1].second, 1e-13);
  expect_close("merged blocks: dq", c.backward[0].first, c.backward[0].second, 1e-12);
  expect_close("merged blocks: dk|dv", c.backward[1].first, c.backward[1].second, 1e-12);
}

TEST(AttentionBlocks, AnyChunkingMergesToTheWhole) { check_any_chunking(nullptr); }

TEST(AttentionBlocks, AnyChunkingMergesToTheWholeWithDocuments) {
  // Documents that end inside chunks, at chunk edges (17, 71) and tile edges (64, 128), one of one token.
  const std::vector<int32_t> doc = document_ids(130, {{5, 17, 64, 65, 100, 128}, {30, 71, 129}});
  check_any_chunking(doc.data());
}

// ---- bf16 (layers/attention.h) ----

// Elementwise errors |a − b| relative to the root mean square of b: their median and their norm
// (‖a − b‖ / ‖b‖). A bf16 engine in fp32 rounds a few values the other way than one in double, where
// the value lies within fp32 round-off of a bf16 tie; each such flip moves a few outputs by up to
// ~1e-3, which the norm sees and the median does not, while a missing or misplaced rounding point
// moves every output.
struct Errors {
  double median, norm;
};
Errors errors(const Vec& a, const Vec& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) err += (a[i] - b[i]) * (a[i] - b[i]), ref += b[i] * b[i];
  const double rms = std::sqrt(ref / double(b.size()));
  Vec e(a.size());
  for (size_t i = 0; i < a.size(); ++i) e[i] = std::abs(a[i] - b[i]) / rms;
  std::nth_element(e.begin(), e.begin() + ptrdiff_t(e.size() / 2), e.end());
  return {e[e.size() / 2], std::sqrt(err / ref)};
}

// Runs f once per bf16 tile path this host has: fp32 tiles, and oneDNN's bf16 tiles where it has them.
void for_each_bf16_tile_path(const std::function<void(Bf16Tiles)>& f) {
  for (Bf16GemmMode mode : {Bf16GemmMode::portable, Bf16GemmMode::onednn}) {
    set_bf16_gemm_mode(mode);
    if (mode == Bf16GemmMode::onednn && bf16_tiles() == Bf16Tiles::fp32) continue;  // none here
    SCOPED_TRACE(bf16_tiles() == Bf16Tiles::onednn ? "oneDNN bf16 tiles" : "fp32 tiles");
    f(bf16_tiles());
  }
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
}

// Any chunking merges to the whole in bf16 too. Forward within fp32 round-off, elementwise (1e-6; the
// probabilities rounded relative to the running max instead of a power of two part by ~1e-3).
// Backward rounds P = exp(s − lse) and dS, whose fp32 values differ in their last bits with the
// chunking (lse's sums in another order), so a few of them round the other way at a bf16 tie: the
// median error within 1e-6, the norm within 2e-4 (errors(), below).
TEST(AttentionBf16, AnyChunkingMergesToTheWhole) {
  const std::vector<int32_t> doc = document_ids(130, {{5, 17, 64, 65, 100, 128}, {30, 71, 129}});
  for_each_bf16_tile_path([&](Bf16Tiles) {
    for (const int32_t* d : {static_cast<const int32_t*>(nullptr), doc.data()})
      for (const bool exact : {false, true}) {  // exact: k|v blocks read in place from the ring-like buffer
        const Chunked c = any_chunking<float>(d, Precision::bf16, exact);
        expect_close("bf16 merged blocks: out", c.forward[0].first, c.forward[0].second, 1e-6);
        expect_close("bf16 merged blocks: lse", c.forward[1].first, c.forward[1].second, 1e-6);
        for (const auto& [chunked, whole] : c.backward) {
          const Errors e = errors(chunked, whole);
          std::printf("  bf16 merged blocks, backward: median %.2e norm %.2e\n", e.median, e.norm);
          EXPECT_LE(e.median, 1e-6);
          EXPECT_LE(e.norm, 2e-4);
        }
      }
  });
}

// Rank 0's choice of oneDNN's bf16 tiles reaches every rank (trainer); a rank whose CPU has no bf16
// matmul (a job over unlike CPUs; here: ctest's isa_cap runs under ONEDNN_MAX_CPU_ISA=AVX2) takes the
// fp32 tiles instead, says so, and runs the core; elsewhere it takes oneDNN's.
TEST(AttentionBf16, RankZerosOneDnnChoiceWhereThisCpuLacksIt) {
  set_bf16_gemm_mode(Bf16GemmMode::portable);
  const bool has_onednn = (set_bf16_gemm_mode(Bf16GemmMode::onednn), bf16_tiles() == Bf16Tiles::onednn);
  set_bf16_gemm_mode(Bf16GemmMode::automatic);
  set_bf16_tiles(Bf16Tiles::onednn);
  EXPECT_EQ(bf16_tiles(), has_onednn ? Bf16Tiles::onednn : Bf16Tiles::fp32);
  const std::string line = describe_bf16_tiles();
  EXPECT_EQ(line.find("which this CPU lacks") != std::string::npos, !has_onednn) << line;
  const int64_t T = 70, H = 2, D = 8, S = 3 * H * D;
  std::vector<float> qkv = to_f(Rng(3).vec(T * S)), out(T * H * D), lse(H * T);
  EXPECT_EQ(attention_forward(out.data(), lse.data(), qkv.data(), 1, T, H, H, D, nullptr, Precision::bf16), 2 * 3);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  set_bf16_gemm_mode(Bf16GemmMode::automatic);  // forgets the choice
}

double bf16_value(double x) { return to_float(to_bf16(float(x))); }

struct Attention {
  Vec out, lse, dqkv;
};

// The bf16 core by its definition (attention.h; the PyTorch oracle's Bf16Attention), in double and
// naive loops: q, k, v rounded; P = bf16(exp(s − c)) with c = ln2·ceil(rowmax/ln2), normalised by
// its sum; backward with P = exp(s − lse) unrounded, dV = bf16(P)ᵀ·bf16(dO), dP = bf16(dO)·Vᵀ,
// dS = P∘(dP − Σ dO∘O), dQ = bf16(dS)·K/√D, dK = bf16(dS)ᵀ·Q/√D.
Attention bf16_attention_by_definition(const Vec& qkv, const Vec& dout, int64_t B, int64_t Tn, int64_t H, int64_t KV,
                                       int64_t D) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D, group = H / KV;
  const double scale = 1 / std::sqrt(double(D)), ln2 = std::log(2.0);
  Attention a{Vec(B * Tn * HD), Vec(B * H * Tn), Vec(B * Tn * S, 0.0)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      auto at = [&](int64_t t, int64_t col) { return bf16_value(qkv[(b * Tn + t) * S + col]); };
      auto q = [&](int64_t t, int64_t d) { return at(t, h * D + d); };
      auto k = [&](int64_t t, int64_t d) { return at(t, HD + g * D + d); };
      auto v = [&](int64_t t, int64_t d) { return at(t, HD + KV * D + g * D + d); };
      for (int64_t i = 0; i < Tn; ++i) {
        Vec s(size_t(i + 1));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < D; ++d) s[j] += q(i, d) * k(j, d);
          s[j] *= scale;
        }
        const double c = ln2 * std::ceil(*std::max_element(s.begin(), s.end()) / ln2);
        double sum = 0;
        Vec o(size_t(D), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = bf16_value(std::exp(s[j] - c));
          sum += p;
          for (int64_t d = 0; d < D; ++d) o[d] += p * v(j, d);
        }
        for (int64_t d = 0; d < D; ++d) a.out[(b * Tn + i) * HD + h * D + d] = o[d] / sum;
        const double lse = c + std::log(sum);
        a.lse[(b * H + h) * Tn + i] = lse;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += dout[(b * Tn + i) * HD + h * D + d] * o[d] / sum;
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - lse);
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += bf16_value(dout[(b * Tn + i) * HD + h * D + d]) * v(j, d);
          const double ds = bf16_value(p * (dp - delta)) * scale;
          for (int64_t d = 0; d < D; ++d) {
            const double dO = bf16_value(dout[(b * Tn + i) * HD + h * D + d]);
            a.dqkv[(b * Tn + j) * S + HD + KV * D + g * D + d] += bf16_value(p) * dO;
            a.dqkv[(b * Tn + i) * S + h * D + d] += ds * k(j, d);
            a.dqkv[(b * Tn + j) * S + HD + g * D + d] += ds * q(i, d);
          }
        }
      }
    }
  return a;
}

// origami's bf16 core against its definition, out, lse and dqkv: the median error within 1e-6 (fp32
// round-off) and the norm within 2e-4 (the flips above: up to 5e-5 measured). The fp32 core (no
// rounding) measured against the same definition must miss the median bound by 100× — it sees the
// rounding points. Three tiles a row (T = 150), GQA 2:1. Also with q|k|v rounded in place first and
// marked exact (qkv_exact, as the model passes them): the same bounds.
TEST(AttentionBf16, MatchesItsDefinition) {
  const int64_t B = 2, Tn = 150, H = 4, KV = 2, D = 16, S = (H + 2 * KV) * D, HD = H * D;
  Rng rng(31);
  const Vec qkv = rng.vec(B * Tn * S, -2, 2), dout = rng.vec(B * Tn * HD);
  const Attention want = bf16_attention_by_definition(qkv, dout, B, Tn, H, KV, D);
  auto run = [&](Precision p, bool exact) {
    std::vector<float> qf = to_f(qkv), rf = to_f(dout), out(B * Tn * HD), lse(B * H * Tn),
        dqkv(B * Tn * S, std::numeric_limits<float>::quiet_NaN());  // (every element written: none survives)
    if (exact) round_in_place(qf.data(), nullptr, int64_t(qf.size()));
    attention_forward(out.data(), lse.data(), qf.data(), B, Tn, H, KV, D, nullptr, p, exact);
    attention_backward(dqkv.data(), rf.data(), qf.data(), out.data(), lse.data(), B, Tn, H, KV, D, nullptr, p, exact);
    return Attention{to_d(out), to_d(lse), to_d(dqkv)};
  };
  const Attention fp32 = run(Precision::fp32, false);
  for_each_bf16_tile_path([&](Bf16Tiles) {
    for (const bool exact : {false, true}) {
      SCOPED_TRACE(exact ? "q|k|v exact" : "q|k|v rounded by the core");
      const Attention got = run(Precision::bf16, exact);
      for (auto [name, a, f, w] : {std::tuple{"out", &got.out, &fp32.out, &want.out},
                                   std::tuple{"lse", &got.lse, &fp32.lse, &want.lse},
                                   std::tuple{"dqkv", &got.dqkv, &fp32.dqkv, &want.dqkv}}) {
        const Errors e = errors(*a, *w), e_fp32 = errors(*f, *w);
        std::printf("  bf16 %-5s against its definition: median %.2e norm %.2e (fp32: median %.2e norm %.2e)\n", name,
                    e.median, e.norm, e_fp32.median, e_fp32.norm);
        EXPECT_LE(e.median, 1e-6) << name;
        EXPECT_LE(e.norm, 2e-4) << name;
        EXPECT_GE(e_fp32.median, 1e-4) << name;
      }
    }
  });
}

// Document masking: attention over a window of several documents equals each document's own causal
// attention, forward (out, lse) and backward (dq, dk, dv) — documents of 1 to 70 tokens, ends on and
// off the 64-row tiles, different per batch row.
TEST(AttentionDocuments, EqualsEachDocumentAlone) {
  const int64_t B = 2, Tn = 200, H = 4, KV = 2, D = 8, S = (H + 2 * KV) * D, HD = H * D;
  const std::vector<std::vector<int64_t>> starts = {{1, 64, 128, 129, 190}, {70, 75, 139}};
  const std::vector<int32_t> doc = document_ids(Tn, starts);
  Rng rng(43);
  const Vec qkv = rng.vec(B * Tn * S, -2, 2), dout = rng.vec(B * Tn * HD);
  Vec out(B * Tn * HD), lse(B * H * Tn), dqkv(B * Tn * S);
  attention_forward(out.data(), lse.data(), qkv.data(), B, Tn, H, KV, D, doc.data());
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, Tn, H, KV, D, doc.data());
  Vec ref_out(out.size()), ref_lse(lse.size()), ref_dqkv(dqkv.size());
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> edges = {0};
    for (int64_t t : starts[size_t(b)]) edges.push_back(t);
    edges.push_back(Tn);
    for (size_t k = 0; k + 1 < edges.size(); ++k) {  // document [t0, t1) of row b, alone
      const int64_t t0 = edges[k], n = edges[k + 1] - t0;
      const Vec q(qkv.begin() + (b * Tn + t0) * S, qkv.begin() + (b * Tn + t0 + n) * S);
      const Vec dq_out(dout.begin() + (b * Tn + t0) * HD, dout.begin() + (b * Tn + t0 + n) * HD);
      Vec o(n * HD), l(H * n), dq(n * S);
      attention_forward(o.data(), l.data(), q.data(), 1, n, H, KV, D);
      attention_backward(dq.data(), dq_out.data(), q.data(), o.data(), l.data(), 1, n, H, KV, D);
      std::copy(o.begin(), o.end(), ref_out.begin() + (b * Tn + t0) * HD);
      std::copy(dq.begin(), dq.end(), ref_dqkv.begin() + (b * Tn + t0) * S);
      for (int64_t h = 0; h < H; ++h)
        std::copy(l.begin() + h * n, l.begin() + (h + 1) * n, ref_lse.begin() + (b * H + h) * Tn + t0);
    }
  }
  expect_close("documents: out", out, ref_out, 1e-13);
  expect_close("documents: lse", lse, ref_lse, 1e-13);
  expect_close("documents: dqkv", dqkv, ref_dqkv, 1e-12);
}

// The tiles the mask empties are skipped: a window of 8 equal documents of T/8 = 512 positions costs
// 8 · (8·9/2) = 288 score tiles per head against the causal window's 64·65/2 = 2080 (the score pairs'
// ratio is 1/8; whole diagonal tiles make it 288/2080 = 0.138), forward and backward alike.
TEST(AttentionDocuments, EmptyTilesAreSkipped) {
  const int64_t Tn = 4096, H = 2, KV = 1, D = 8, S = (H + 2 * KV) * D;
  std::vector<int64_t> starts;
  for (int64_t t = 512; t < Tn; t += 512) starts.push_back(t);
  const std::vector<int32_t> doc = document_ids(Tn, {starts});
  Rng rng(5);
  std::vector<float> qkv(Tn * S), out(Tn * H * D), lse(H * Tn), dqkv(Tn * S);
  for (float& x : qkv) x = float(rng.uni());
  const int64_t causal = attention_forward(out.data(), lse.data(), qkv.data(), 1, Tn, H, KV, D);
  const int64_t documents = attention_forward(out.data(), lse.data(), qkv.data(), 1, Tn, H, KV, D, doc.data());
  const int64_t documents_back =
      attention_backward(dqkv.data(), out.data(), qkv.data(), out.data(), lse.data(), 1, Tn, H, KV, D, doc.data());
  EXPECT_EQ(causal, H * 2080);
  EXPECT_EQ(documents, H * 288);
  EXPECT_EQ(documents_back, H * 288);
}

// ───────────────────────────── LM head ─────────────────────────────

TEST(LmHeadFd, FusedCrossEntropy) {
  const int64_t N = 9, C = 13, V = 23;
  const double grad_scale = 0.37;
  Rng rng(71);
  Vec x = rng.vec(N * C, -2, 2), w = rng.vec(V * C, -1, 1);
  std::vector<int32_t> tgt(N);
  for (auto& t : tgt) t = int32_t(rng.integer(0, V - 1));
  tgt[0] = 0, tgt[1] = int32_t(V - 1);
  std::vector<double> scratch;
  auto loss = [&] {
    return lm_head_loss<double>(nullptr, nullptr, nullptr, x.data(), w.data(), tgt.data(), N, C, V, 1.0, scratch);
  };
  // Loss and logits vs direct formula.
  Vec logits(N * V, 999.0), dx(N * C, 999.0), dw0 = rng.vec(V * C), dw = dw0;
  const double L = lm_head_loss<double>(dx.data(), dw.data(), logits.data(), x.data(), w.data(), tgt.data(), N, C, V,
                                        grad_scale, scratch);
  {
    Vec ref(N * V);
    LD ref_loss = 0;
    for (int64_t n = 0; n < N; ++n) {
      LD m = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        LD s = 0;
        for (int64_t c = 0; c < C; ++c) s += LD(x[n * C + c]) * w[v * C + c];
        ref[n * V + v] = double(s);
        m = std::max(m, s);
      }
      LD sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(LD(ref[n * V + v]) - m);
      ref_loss += m + std::log(sum) - ref[n * V + tgt[n]];
    }
    expect_close("lm_head logits", logits, ref, 1e-13);
    EXPECT_NEAR(L, double(ref_loss), 1e-13 * double(ref_loss));
    EXPECT_NEAR(loss(), L, 1e-13 * L) << "loss without backward";
  }
  // dx = grad_scale·∂L/∂x (overwritten); dW += grad_scale·∂L/∂W.
  fd_check("lm_head dx", x, scaled(dx, 1 / grad_scale), loss, all_indices(x.size()));
  fd_check("lm_head dw (+=)", w, scaled(sub(dw, dw0), 1 / grad_scale), loss, all_indices(w.size()));
  {
    auto xf = to_f(x), wf = to_f(w);
    std::vector<float> dxf(N * C), dwf(V * C, 0.f), sf;
    const double Lf = lm_head_loss<float>(dxf.data(), dwf.data(), nullptr, xf.data(), wf.data(), tgt.data(), N, C, V,
                                          float(grad_scale), sf);
    EXPECT_NEAR(Lf, L, kFloatTol * L);
    expect_close("lm_head dx float", to_d(dxf), dx, kFloatTol);
    expect_close("lm_head dw float", to_d(dwf), sub(dw, dw0), kFloatTol);
  }
}

// Logits far outside float's exp range (|logit| up to ~300): the fused softmax must stay finite.
TEST(LmHeadFd, LargeLogitsStayFinite) {
  const int64_t N = 6, C = 11, V = 19;
  Rng rng(73);
  Vec x = rng.vec(N * C, -30, 30), w = rng.vec(V * C, -2, 2);
  for (auto& v : x) v = double(float(v));
  for (auto& v : w) v = double(float(v));
  std::vector<int32_t> tgt(N);
  for (auto& t : tgt) t = int32_t(rng.integer(0, V - 1));
  std::vector<double> scratch;
  Vec logits(N * V), dx(N * C), dw(V * C, 0.0);
  const double L = lm_head_loss<double>(dx.data(), dw.data(), logits.data(), x.data(), w.data(), tgt.data(), N, C, V,
                                        1.0, scratch);
  EXPECT_GT(*std::max_element(logits.begin(), logits.end()), 100.0) << "test does not reach large logits";
  LD ref = 0;
  for (int64_t n = 0; n < N; ++n) {
    const double m = *std::max_element(logits.begin() + n * V, logits.begin() + (n + 1) * V);
    LD sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(LD(logits[n * V + v]) - m);
    ref += m + std::log(sum) - logits[n * V + tgt[n]];
  }
  EXPECT_NEAR(L, double(ref), 1e-12 * std::max(1.0, double(ref)));
  auto loss = [&] {
    return lm_head_loss<double>(nullptr, nullptr, nullptr, x.data(), w.data(), tgt.data(), N, C, V, 1.0, scratch);
  };
  fd_check("lm_head large dx", x, dx, loss, all_indices(x.size()));
  fd_check("lm_head large dw", w, dw, loss, all_indices(w.size()));
  auto xf = to_f(x), wf = to_f(w);
  std::vector<float> dxf(N * C), dwf(V * C, 0.f), sf;
  const double Lf = lm_head_loss<float>(dxf.data(), dwf.data(), nullptr, xf.data(), wf.data(), tgt.data(), N, C, V,
                                        1.f, sf);
  ASSERT_TRUE(std::isfinite(Lf));
  EXPECT_NEAR(Lf, L, 1e-4 * std::max(1.0, L));  // logit rounding in float is ~1e-5 absolute here
  for (float v : dxf) ASSERT_TRUE(std::isfinite(v));
  expect_close("lm_head large dx float", to_d(dxf), dx, 1e-4);
}

// A rank whose vocabulary slice is padding only (a small vocabulary over many TP x PP ranks) adds
// nothing to the merged statistics: max −∞ and Σexp 0. Were its max a padding logit (0), a slice of
// real logits far below 0 (−200 here) would underflow to Σexp 0 in the merge: a loss of −∞.
TEST(LmHeadFd, ShardOfPaddingOnlyAddsNothing) {
  const int64_t N = 3, C = 4, V = 5;
  std::vector<float> x(N * C, 1.f), w(V * C, -50.f), padding(V * C, 0.f), scratch;
  const std::vector<int32_t> tgt{0, 1, 2};  // on the real slice, vocabulary rows [0, V)
  std::vector<float> real_stats, padding_stats;
  auto keep = [](std::vector<float>& into) { return [&into](float* s, int64_t n) { into.assign(s, s + 3 * n); }; };
  lm_head_loss<float>(nullptr, nullptr, nullptr, x.data(), w.data(), tgt.data(), N, C, V, 1.f, scratch,
                      {0, V, keep(real_stats)});
  lm_head_loss<float>(nullptr, nullptr, nullptr, x.data(), padding.data(), tgt.data(), N, C, V, 1.f, scratch,
                      {V, 0, keep(padding_stats)});
  std::vector<float> both = real_stats, merged(size_t(3 * N));
  both.insert(both.end(), padding_stats.begin(), padding_stats.end());
  merge_vocab_stats(merged.data(), both.data(), 2, N);
  for (int64_t r = 0; r < N; ++r) {
    EXPECT_EQ(padding_stats[size_t(3 * r)], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(padding_stats[size_t(3 * r + 1)], 0.f);
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(merged[size_t(3 * r + k)], real_stats[size_t(3 * r + k)]) << r << " " << k;
  }
  // A stage whose whole slice is padding merges its TP shards first (--tp 2 --pp 4 --vocab-parallel
  // with vocab_size 10): padding with padding stays padding, not NaN, and then adds nothing.
  std::vector<float> two_paddings = padding_stats, stage(size_t(3 * N)), all(size_t(3 * N));
  two_paddings.insert(two_paddings.end(), padding_stats.begin(), padding_stats.end());
  merge_vocab_stats(stage.data(), two_paddings.data(), 2, N);
  std::vector<float> stages = real_stats;
  stages.insert(stages.end(), stage.begin(), stage.end());
  merge_vocab_stats(all.data(), stages.data(), 2, N);
  for (int64_t r = 0; r < N; ++r) {
    EXPECT_EQ(stage[size_t(3 * r)], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(stage[size_t(3 * r + 1)], 0.f);
    EXPECT_EQ(stage[size_t(3 * r + 2)], 0.f);
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(all[size_t(3 * r + k)], real_stats[size_t(3 * r + k)]) << r << " " << k;
  }
}

// The head processes rows in chunks of ⌊8M / V⌋; with a large vocabulary the chunking is exercised.
TEST(LmHeadFd, ChunkedRowsMatchSingleRowCalls) {
  const int64_t N = 10, C = 3, V = (int64_t(1) << 20) + 1;  // chunk = 7 rows: two chunks, 7 + 3
  Rng rng(72);
  Vec x = rng.vec(N * C, -2, 2), w = rng.vec(V * C, -1, 1);
  std::vector<int32_t> tgt(N);
  for (auto& t : tgt) t = int32_t(rng.integer(0, V - 1));
  std::vector<double> scratch;
  Vec dx(N * C, 999.0), dw(V * C, 0.0);
  const double L = lm_head_loss<double>(dx.data(), dw.data(), nullptr, x.data(), w.data(), tgt.data(), N, C, V, 1.0,
                                        scratch);
  // Row by row (one chunk each), accumulating dW.
  Vec dx1(N * C), dw1(V * C, 0.0);
  double L1 = 0;
  for (int64_t n = 0; n < N; ++n)
    L1 += lm_head_loss<double>(dx1.data() + n * C, dw1.data(), nullptr, x.data() + n * C, w.data(), tgt.data() + n, 1,
                               C, V, 1.0, scratch);
  EXPECT_NEAR(L, L1, 1e-12 * L);
  expect_close("lm_head chunked dx", dx, dx1, 1e-12);
  expect_close("lm_head chunked dw", dw, dw1, 1e-12);
  // A few finite differences in x.
  auto loss = [&] {
    return lm_head_loss<double>(nullptr, nullptr, nullptr, x.data(), w.data(), tgt.data(), N, C, V, 1.0, scratch);
  };
  fd_check("lm_head chunked dx", x, dx, loss, {0, 5, 20, 22, 29});
}

// ───────────────────────────── MoE ─────────────────────────────

namespace {

struct MoeProblem {
  MoeSizes s;
  Vec x, gate, experts;
};

// Naive dense MoE forward, in long double: routing by sorting, every expert evaluated directly.
struct MoeNaive {
  Vec out, probs, lse;
  std::vector<int32_t> chosen;
  Vec weight;
  std::vector<int64_t> count;
  double aux = 0, z = 0;
};

MoeNaive moe_naive(const MoeProblem& p, double aux_coef, double z_coef) {
  const int64_t N = p.s.N, C = p.s.C, F = p.s.F, E = p.s.E, K = p.s.K;
  MoeNaive r;
  r.out.assign(N * C, 0), r.probs.assign(N * E, 0), r.lse.assign(N, 0), r.chosen.assign(N * K, -1);
  r.weight.assign(N * K, 0), r.count.assign(E, 0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<LD> lg(E), pr(E);
    LD m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
      LD s = 0;
      for (int64_t c = 0; c < C; ++c) s += LD(p.x[n * C + c]) * p.gate[e * C + c];
      lg[e] = s, m = std::max(m, s);
    }
    LD sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(lg[e] - m);
    r.lse[n] = double(m + std::log(sum));
    for (int64_t e = 0; e < E; ++e) pr[e] = std::exp(lg[e] - m) / sum, r.probs[n * E + e] = double(pr[e]);
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pr[a] > pr[b]; });
    LD psum = 0;
    for (int64_t k = 0; k < K; ++k) psum += pr[order[k]];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = order[k];
      r.chosen[n * K + k] = e, r.count[e]++;
      const LD wk = pr[e] / psum;
      r.weight[n * K + k] = double(wk);
      const double* w1 = p.experts.data() + e * 3 * F * C;
      const double *w3 = w1 + F * C, *w2 = w1 + 2 * F * C;
      std::vector<LD> act(F);
      for (int64_t f = 0; f < F; ++f) {
        LD g = 0, u = 0;
        for (int64_t c = 0; c < C; ++c) g += LD(w1[f * C + c]) * p.x[n * C + c], u += LD(w3[f * C + c]) * p.x[n * C + c];
        act[f] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t c = 0; c < C; ++c) {
        LD y = 0;
        for (int64_t f = 0; f < F; ++f) y += LD(w2[c * F + f]) * act[f];
        r.out[n * C + c] += double(wk * y);
      }
    }
  }
  LD aux = 0, z = 0;
  for (int64_t e = 0; e < E; ++e) {
    LD P = 0;
    for (int64_t n = 0; n < N; ++n) P += r.probs[n * E + e];
    aux += LD(r.count[e]) / LD(N * K) * P / LD(N);
  }
  for (int64_t n = 0; n < N; ++n) z += LD(r.lse[n]) * r.lse[n];
  r.aux = double(aux_coef * E * aux), r.z = double(z_coef * z / N);
  return r;
}

// Smallest gap, over tokens, between the K-th and (K+1)-th largest router logit.
double min_topk_margin(const MoeProblem& p) {
  const int64_t N = p.s.N, C = p.s.C, F = p.s.F, E = p.s.E, K = p.s.K;
  double worst = INFINITY;
  for (int64_t n = 0; n < N; ++n) {
    Vec lg(E);
    for (int64_t e = 0; e < E; ++e) {
      LD s = 0;
      for (int64_t c = 0; c < C; ++c) s += LD(p.x[n * C + c]) * p.gate[e * C + c];
      lg[e] = double(s);
    }
    std::sort(lg.begin(), lg.end(), std::greater<>());
    worst = std::min(worst, lg[K - 1] - lg[K]);
  }
  return worst;
}

// Random problem whose top-K selection is robust: K-th / (K+1)-th router logit gap ≥ 0.05 for every
// token (a perturbation of h = 1e-6 moves a logit by ≲ 1e-5). With starve_last, expert E−1 gets no token.
MoeProblem moe_problem(MoeSizes s, uint64_t seed, bool starve_last) {
  Rng rng(seed);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    MoeProblem p{s, rng.vec(s.N * s.C, -1, 1), rng.vec(s.E * s.C, -1, 1), rng.vec(s.E * 3 * s.F * s.C, -0.6, 0.6)};
    if (starve_last) {
      for (int64_t n = 0; n < s.N; ++n) p.x[n * s.C] = rng.uni(1, 2);
      p.gate[(s.E - 1) * s.C] = -8;
    }
    if (min_topk_margin(p) >= 0.05) return p;
  }
  ADD_FAILURE() << "no well-separated MoE problem found";
  return {};
}

}  // namespace

// Routing variants of the FD check (the naive comparison is for the default, variant 0):
// 1 sigmoid scores, sequence-wise aux loss over 2 rows; 2 a capacity of 1.0 (probs policy) padded,
// weights not renormalised; 3 a capacity of 0.75 (position policy), global-batch aux loss.
struct MoeCase {
  MoeSizes s;
  bool starve_last;
  double loss_scale;
  int variant = 0;
};

MoeRouting moe_variant(MoeSizes& s, int variant) {
  MoeRouting r;
  r.aux_coef = 0.3, r.z_coef = 0.05;  // large enough that router-loss gradients matter
  if (variant == 1) r.score = RouterScore::sigmoid, r.aux = AuxLoss::seq, s.B = 2;
  if (variant == 2) r.capacity_factor = 1.0, r.pad = true, r.norm_topk = false;
  if (variant == 3) r.capacity_factor = 0.75, r.drop = DropPolicy::position, r.aux = AuxLoss::global;
  s.cap = r.capacity(s.N, s.K, s.E), s.pad = r.pad;
  return r;
}

std::string moe_case_name(const MoeCase& c);
void PrintTo(const MoeCase& c, std::ostream* os) { *os << moe_case_name(c); }  // gtest's case listing

class MoeFd : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeFd, RoutingForwardAndBackwardFd) {
  const auto [case_s, starve_last, loss_scale, variant] = GetParam();
  MoeSizes s = case_s;
  const MoeRouting routing = moe_variant(s, variant);
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K;
  const double aux_coef = routing.aux_coef, z_coef = routing.z_coef;
  MoeProblem p = moe_problem(s, 81 + uint64_t(E) + starve_last, starve_last);
  ASSERT_FALSE(p.x.empty());
  Rng rng(91);
  Vec r = rng.vec(N * C);

  MoeCache<double> cache;
  Vec out(N * C, 999.0);
  moe_forward(out.data(), cache, p.x.data(), p.gate.data(), p.experts.data(), s, routing);
  const std::vector<int32_t> chosen0 = cache.expert_NK;
  const std::vector<int64_t> rows0 = cache.row_NK;
  if (variant >= 2) {  // the capacity binds: some assignment dropped, every expert within it
    EXPECT_GT(cache.dropped, 0);
    for (int64_t e = 0; e < E; ++e) EXPECT_LE(cache.count_E[size_t(e)], s.cap);
    if (s.pad)
      for (int64_t e = 0; e < E; ++e) EXPECT_EQ(cache.count_E[size_t(e)], s.cap);
  }

  // Routing vs naive selection; permutation consistent; forward output and router losses vs dense naive.
  if (variant == 0) {
    const MoeNaive ref = moe_naive(p, aux_coef, z_coef);
    EXPECT_EQ(cache.expert_NK, ref.chosen) << "top-k selection differs from naive";
    Vec probs(N * E);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) probs[size_t(n * E + e)] = std::exp(cache.logits_NE[size_t(n * E + e)] - cache.lse_N[size_t(n)]);
    expect_close("moe probs", probs, ref.probs, 1e-14);
    expect_close("moe lse", cache.lse_N, ref.lse, 1e-14);
    expect_close("moe weights", cache.weight_NK, ref.weight, 1e-14);
    EXPECT_EQ(cache.count_E, ref.count);
    EXPECT_EQ(cache.routed_E, ref.count);
    if (starve_last) EXPECT_EQ(cache.count_E[size_t(E - 1)], 0);
    ASSERT_EQ(cache.expert_begin.size(), size_t(E + 1));
    EXPECT_EQ(cache.expert_begin[0], 0);
    EXPECT_EQ(cache.expert_begin[size_t(E)], N * K);
    std::vector<int> seen(size_t(N * K), 0);
    for (int64_t i = 0; i < N * K; ++i) {
      const int64_t row = cache.row_NK[size_t(i)], e = cache.expert_NK[size_t(i)];
      ASSERT_GE(row, cache.expert_begin[size_t(e)]);
      ASSERT_LT(row, cache.expert_begin[size_t(e + 1)]);
      seen[size_t(row)]++;
      // one rank: the expert-side rows are the permuted rows themselves
      for (int64_t c = 0; c < C; ++c) EXPECT_EQ(cache.xe_RC[size_t(row * C + c)], p.x[size_t((i / K) * C + c)]);
    }
    for (int v : seen) EXPECT_EQ(v, 1) << "row_NK is not a permutation";
    expect_close("moe out vs naive", out, ref.out, 1e-13);
    EXPECT_NEAR(cache.aux, ref.aux, 1e-14);
    EXPECT_NEAR(cache.z, ref.z, 1e-14);
    EXPECT_GT(cache.aux, 0);
    EXPECT_GT(cache.z, 0);
  }

  // L = Σ r ⊙ out + loss_scale·(aux + z); backward gets dout = r and loss_scale.
  size_t selection_changed = 0;
  auto loss = [&] {
    MoeCache<double> c;
    Vec o(N * C);
    moe_forward(o.data(), c, p.x.data(), p.gate.data(), p.experts.data(), s, routing);
    if (c.expert_NK != chosen0 || c.row_NK != rows0) ++selection_changed;
    return dot(r, o) + loss_scale * (c.aux + c.z);
  };
  Vec dx(N * C, 999.0), dgate0 = rng.vec(E * C), dexp0 = rng.vec(E * 3 * F * C), dgate = dgate0, dexp = dexp0;
  moe_backward(dx.data(), dgate.data(), dexp.data(), r.data(), cache, p.x.data(), p.gate.data(), p.experts.data(), s,
               routing, loss_scale);
  fd_check("moe dx", p.x, dx, loss, all_indices(p.x.size()));
  fd_check("moe dgate (+=)", p.gate, sub(dgate, dgate0), loss, all_indices(p.gate.size()));
  fd_check("moe dexperts (+=)", p.experts, sub(dexp, dexp0), loss, all_indices(p.experts.size()));
  EXPECT_EQ(selection_changed, 0u) << "top-k selection or capacity drops changed under perturbation: FD invalid";
  (void)aux_coef, (void)z_coef;
  if (starve_last) {  // the unused expert's weights get no gradient
    for (int64_t i = (E - 1) * 3 * F * C; i < E * 3 * F * C; ++i) EXPECT_EQ(dexp[size_t(i)], dexp0[size_t(i)]);
  }

  // Float instantiation agrees.
  {
    auto xf = to_f(p.x), gf = to_f(p.gate), ef = to_f(p.experts), rf = to_f(r);
    MoeCache<float> cf;
    std::vector<float> of(N * C), dxf(N * C), dgf(E * C, 0.f), def(E * 3 * F * C, 0.f);
    moe_forward(of.data(), cf, xf.data(), gf.data(), ef.data(), s, routing);
    EXPECT_EQ(cf.expert_NK, cache.expert_NK);
    moe_backward(dxf.data(), dgf.data(), def.data(), rf.data(), cf, xf.data(), gf.data(), ef.data(), s, routing,
                 float(loss_scale));
    expect_close("moe out float", to_d(of), out, kFloatTol);
    EXPECT_NEAR(cf.aux, cache.aux, kFloatTol);
    EXPECT_NEAR(cf.z, cache.z, kFloatTol);
    expect_close("moe dx float", to_d(dxf), dx, kFloatTol);
    expect_close("moe dgate float", to_d(dgf), sub(dgate, dgate0), kFloatTol);
    expect_close("moe dexperts float", to_d(def), sub(dexp, dexp0), kFloatTol);
  }
}

std::string moe_case_name(const MoeCase& c) {  // e.g. N13_C6_F5_E5_K2_StarvedExpert
  static const char* const variants[] = {"", "_SigmoidSeqAux", "_Capacity1PaddedNoRenorm", "_Capacity075PositionGlobal"};
  return "N" + std::to_string(c.s.N) + "_C" + std::to_string(c.s.C) + "_F" + std::to_string(c.s.F) + "_E" +
         std::to_string(c.s.E) + "_K" + std::to_string(c.s.K) + (c.starve_last ? "_StarvedExpert" : "") +
         variants[c.variant];
}

INSTANTIATE_TEST_SUITE_P(Configs, MoeFd,
                         ::testing::Values(MoeCase{{11, 9, 7, 5, 2}, false, 0.7},
                                           MoeCase{{13, 6, 5, 5, 2}, true, 1.0},
                                           MoeCase{{10, 7, 3, 5, 3}, false, 2.5},
                                           MoeCase{{12, 6, 4, 5, 2}, false, 1.0, 1},
                                           MoeCase{{12, 6, 4, 5, 2}, false, 1.0, 2},
                                           MoeCase{{12, 6, 4, 5, 3}, true, 0.7, 3}),
                         [](const ::testing::TestParamInfo<MoeCase>& info) { return moe_case_name(info.param); });

// Sigmoid scores of logits far below zero are exactly 0: the chosen experts' weights (renormalised
// over a sum of zeros) and the aux loss (over Σ p = 0) stay finite, as do their gradients — before
// the floor on those sums they were 0/0.
TEST(MoeRouting, SigmoidScoresThatUnderflowStayFinite) {
  MoeSizes s{4, 3, 2, 5, 2};
  MoeRouting r;
  r.score = RouterScore::sigmoid, r.aux = AuxLoss::seq, r.aux_coef = 0.3, r.z_coef = 0;
  s.cap = r.capacity(s.N, s.K, s.E);
  const Vec x(size_t(s.N * s.C), 1.0), gate(size_t(s.E * s.C), -1000.0);  // every logit −3000: σ = 0
  Rng rng(5);
  const Vec experts = rng.vec(s.E * 3 * s.C * s.F), dout = rng.vec(s.N * s.C);
  MoeCache<double> cache;
  Vec out(size_t(s.N * s.C), 999.0);
  moe_forward(out.data(), cache, x.data(), gate.data(), experts.data(), s, r);
  for (double w : cache.weight_NK) EXPECT_EQ(w, 0.0);
  for (double o : out) EXPECT_EQ(o, 0.0);
  EXPECT_TRUE(std::isfinite(cache.aux));
  Vec dx(size_t(s.N * s.C)), dgate(size_t(s.E * s.C), 0.0), dexperts(experts.size(), 0.0);
  moe_backward(dx.data(), dgate.data(), dexperts.data(), dout.data(), cache, x.data(), gate.data(), experts.data(), s,
               r, 1.0);
  for (const Vec* v : {&dx, &dgate, &dexperts})
    for (double g : *v) ASSERT_TRUE(std::isfinite(g));
}

// Document batching (MoeSequences): 12 tokens of 4 sequences (one of one token, one split by padding
// from nothing) and 3 padding tokens. Padding routes to no expert, counts nowhere and gets no gradient;
// the per-sequence aux loss and the z-loss over the real tokens, divided by the given `tokens`, match
// their formulas (moe.h) in long double; the gradients match finite differences.
TEST(MoeSequences, PaddingRoutesNowhereAndTheLossesArePerSequence) {
  MoeSizes s{12, 6, 4, 5, 2};
  s.sequences = true;
  const int64_t N = s.N, C = s.C, F = s.F, E = s.E, K = s.K;
  const std::vector<int32_t> id = {0, 0, 0, 1, -1, -1, 2, 2, 2, 2, 3, -1};
  MoeRouting routing;
  routing.aux = AuxLoss::seq, routing.aux_coef = 0.3, routing.z_coef = 0.05;
  const std::unique_ptr<Comm> one = make_local_comm();
  MoeSequences docs{id.data(), 4, one.get(), 7.5};
  const MoeBalance bal{nullptr, nullptr, nullptr, &docs};
  MoeProblem p = moe_problem(s, 97, false);
  ASSERT_FALSE(p.x.empty());
  const MoeNaive ref = moe_naive(p, 0, 0);
  Rng rng(93);
  const Vec r = rng.vec(N * C);
  MoeCache<double> cache;
  Vec out(N * C, 999.0);
  moe_forward(out.data(), cache, p.x.data(), p.gate.data(), p.experts.data(), s, routing, bal);

  std::vector<int64_t> routed(size_t(E), 0), seq_count(size_t(4 * E), 0), len(4, 0);
  for (int64_t n = 0; n < N; ++n) {
    if (id[size_t(n)] < 0) continue;
    len[size_t(id[size_t(n)])]++;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = ref.chosen[size_t(n * K + k)];
      routed[size_t(e)]++, seq_count[size_t(id[size_t(n)] * E + e)]++;
    }
  }
  EXPECT_EQ(cache.routed_E, routed);
  EXPECT_EQ(cache.dropped, 0);
  LD aux = 0, z = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t q = id[size_t(n)];
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out[size_t(n * C + c)], q < 0 ? 0.0 : ref.out[size_t(n * C + c)], 1e-13) << "token " << n;
    if (q < 0) continue;
    for (int64_t e = 0; e < E; ++e)
      aux += LD(seq_count[size_t(q * E + e)]) / LD(len[size_t(q)] * K) * ref.probs[size_t(n * E + e)];
    z += LD(ref.lse[size_t(n)]) * ref.lse[size_t(n)];
  }
  EXPECT_NEAR(cache.aux, double(routing.aux_coef * E * aux / 7.5), 1e-14);
  EXPECT_NEAR(cache.z, double(routing.z_coef * z / 7.5), 1e-14);
  EXPECT_GT(cache.aux, 0);

  const double loss_scale = 0.8;
  auto loss = [&] {
    MoeCache<double> c;
    Vec o(N * C);
    moe_forward(o.data(), c, p.x.data(), p.gate.data(), p.experts.data(), s, routing, bal);
    return dot(r, o) + loss_scale * (c.aux + c.z);
  };
  Vec dx(N * C, 999.0), dgate(E * C, 0.0), dexp(E * 3 * F * C, 0.0);
  moe_backward(dx.data(), dgate.data(), dexp.data(), r.data(), cache, p.x.data(), p.gate.data(), p.experts.data(), s,
               routing, loss_scale);
  for (int64_t n = 0; n < N; ++n)
    if (id[size_t(n)] < 0)
      for (int64_t c = 0; c < C; ++c) EXPECT_EQ(dx[size_t(n * C + c)], 0.0) << "padding token " << n;
  fd_check("moe docs dx", p.x, dx, loss, all_indices(p.x.size()));
  fd_check("moe docs dgate", p.gate, dgate, loss, all_indices(p.gate.size()));
  fd_check("moe docs dexperts", p.experts, dexp, loss, all_indices(p.experts.size()));
}

// Ties in router probability go to the lower expert index (deterministic selection).
TEST(MoeRouting, TiesPreferLowerIndex) {
  const MoeSizes s{3, 4, 3, 5, 2};
  Vec x(s.N * s.C, 0.0), gate(s.E * s.C, 0.0), experts(s.E * 3 * s.F * s.C, 0.1);
  // Token 0: all logits equal → experts 0, 1. Token 1: experts 2 and 4 tie on top → 2, 4.
  x[1 * s.C + 0] = 1;
  gate[2 * s.C + 0] = 2, gate[4 * s.C + 0] = 2, gate[3 * s.C + 0] = 1;
  // Token 2: expert 3 alone on top, then 1 and 4 tie → 3, 1.
  x[2 * s.C + 1] = 1;
  gate[3 * s.C + 1] = 3, gate[1 * s.C + 1] = 1, gate[4 * s.C + 1] = 1;
  MoeCache<double> c;
  Vec out(s.N * s.C);
  moe_forward(out.data(), c, x.data(), gate.data(), experts.data(), s, MoeRouting{});
  EXPECT_EQ(c.expert_NK, (std::vector<int32_t>{0, 1, 2, 4, 3, 1}));
  // Tokens 0 and 2 chose their K-th expert over a tied one; token 1's 4 leads 3 by e² − e per share.
  EXPECT_EQ(c.near_ties, 2);
  // Margins just above and below kNearTie. Logits 2, 1, 1 − ε, 0, 0 choose experts 0 and 1, and p1
  // leads p2 by about p1·ε: token 0 by 3·kNearTie (clear), token 1 by 0.3·kNearTie (a near tie);
  // token 2's logits are all 0 (a tie).
  const double p1 = std::exp(1.0) / (std::exp(2.0) + 2 * std::exp(1.0) + 2);
  x.assign(size_t(s.N * s.C), 0.0), gate.assign(size_t(s.E * s.C), 0.0);
  x[0 * s.C + 0] = 1, x[1 * s.C + 1] = 1;
  for (int64_t f : {0, 1}) {
    const double eps = (f == 0 ? 3.0 : 0.3) * kNearTie / p1;
    gate[0 * s.C + f] = 2, gate[1 * s.C + f] = 1, gate[2 * s.C + f] = 1 - eps;
  }
  moe_forward(out.data(), c, x.data(), gate.data(), experts.data(), s, MoeRouting{});
  EXPECT_EQ(c.expert_NK, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(c.near_ties, 2);
}
