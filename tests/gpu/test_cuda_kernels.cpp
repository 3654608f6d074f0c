// The CUDA kernels (src/kernels/cuda) against their CPU twins on random data: each CUDA kernel gets the
// inputs the CPU kernel gets and must give its outputs within fp32 rounding (max error ≤ 1e-4 of the
// largest magnitude), or in bf16 the same rounded products summed in another order. Without a CUDA
// device every test prints one SKIPPED line and passes (CI builds this, the device runs it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cuda/cuda_kernels.h"
#include "model/layers/activation.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/linear.h"
#include "model/layers/lm_head.h"
#include "model/layers/moe.h"
#include "model/layers/norm.h"
#include "model/layers/rope.h"

namespace origami {
namespace {

using Vec = std::vector<float>;

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (cuda::device_count(&why) == 0) GTEST_SKIP() << "SKIPPED: no CUDA device (" << why << ")";
  }
};

Vec random(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  Vec v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// A device copy of host values, and back.
template <typename T>
cuda::Buffer<T> up(const std::vector<T>& h) {
  cuda::Buffer<T> b(h.size());
  cuda::copy_to_device(b.data(), h.data(), h.size() * sizeof(T));
  return b;
}
template <typename T>
std::vector<T> down(const cuda::Buffer<T>& b) {
  std::vector<T> h(b.size());
  cuda::copy_to_host(h.data(), b.data(), h.size() * sizeof(T));
  return h;
}

// max |a − b| over max |b|: the error relative to the tensor's scale.
double rel_err(const Vec& a, const Vec& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i)
    num = std::max(num, double(std::fabs(a[i] - b[i]))), den = std::max(den, double(std::fabs(b[i])));
  return den > 0 ? num / den : num;
}
#define EXPECT_CLOSE(gpu, cpu, tol) EXPECT_LE(rel_err(gpu, cpu), tol) << #gpu " vs " #cpu

constexpr double kFp32 = 1e-4;

TEST_F(Cuda, MatmulEveryTransposeStrided) {
  for (Precision p : {Precision::fp32, Precision::bf16})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t M = 37, N = 50, K = 70, pad = 3;
        const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        const Vec A = random(static_cast<size_t>((ta ? K : M) * lda), 1),
                  B = random(static_cast<size_t>((tb ? N : K) * ldb), 2);
        Vec C = random(static_cast<size_t>(M * ldc), 3);
        auto dA = up(A), dB = up(B), dC = up(C);
        matmul<float>(p, ta, tb, M, N, K, 0.5f, {A.data(), lda}, {B.data(), ldb}, 0.25f, C.data(), ldc);
        cuda::matmul(p, ta, tb, M, N, K, 0.5f, {dA.data(), lda}, {dB.data(), ldb}, 0.25f, dC.data(), ldc);
        EXPECT_CLOSE(down(dC), C, p == Precision::fp32 ? kFp32 : 1e-5)
            << precision_name(p) << " ta " << ta << " tb " << tb;
      }
}

// An empty inner dimension leaves C = beta·C (beta 0: zeros, whatever C held), in both precisions.
TEST_F(Cuda, MatmulWithNoInnerDimensionScalesC) {
  const int64_t M = 5, N = 7, ldc = N + 2;
  for (Precision p : {Precision::fp32, Precision::bf16})
    for (float beta : {0.f, 0.5f}) {
      Vec C = random(static_cast<size_t>(M * ldc), 6);
      C[3] = std::nanf("");
      auto dC = up(C);
      const Vec none(1);
      auto dNone = up(none);
      matmul<float>(p, false, false, M, N, 0, 1.f, {none.data(), 1}, {none.data(), N}, beta, C.data(), ldc);
      cuda::matmul(p, false, false, M, N, 0, 1.f, {dNone.data(), 1}, {dNone.data(), N}, beta, dC.data(), ldc);
      const Vec got = down(dC);
      for (size_t i = 0; i < C.size(); ++i)
        if (!std::isnan(C[i])) EXPECT_EQ(got[i], C[i]) << precision_name(p) << " beta " << beta << " at " << i;
      EXPECT_EQ(std::isnan(got[3]), beta != 0.f) << precision_name(p) << " beta " << beta;
    }
}

TEST_F(Cuda, Bf16MatmulReadsTheWeightsCopy) {
  const int64_t M = 16, N = 24, K = 32;
  const Vec A = random(static_cast<size_t>(M * K), 4), W = random(static_cast<size_t>(N * K), 5);
  std::vector<bf16> twice(W.size());
  for (size_t i = 0; i < W.size(); ++i) twice[i] = to_bf16(2.f * W[i]);  // a copy unlike the values
  Vec C(static_cast<size_t>(M * N)), C2(static_cast<size_t>(M * N));
  auto dA = up(A), dW = up(W), dC = up(C);
  auto dLow = up(twice);
  cuda::matmul(Precision::bf16, false, true, M, N, K, 1.f, {dA.data(), K}, {dW.data(), K, dLow.data()}, 0.f, dC.data(),
               N);
  matmul<float>(Precision::bf16, false, true, M, N, K, 2.f, {A.data(), K}, {W.data(), K}, 0.f, C2.data(), N);
  EXPECT_CLOSE(down(dC), C2, 1e-5);
}

// (N = 1000 rows: the weight and bias gradients' column sums run in several chunks of rows)
TEST_F(Cuda, LinearForwardBackwardBothLayouts) {
  const int64_t in = 48, out = 40;
  for (int64_t N : {45, 1000})
  for (Precision p : {Precision::fp32, Precision::bf16})
    for (WeightLayout lay : {WeightLayout::out_in, WeightLayout::in_out}) {
      const Vec x = random(static_cast<size_t>(N * in), 6), w = random(static_cast<size_t>(in * out), 7, 0.2f),
                b = random(static_cast<size_t>(out), 8);
      const Vec dy = random(static_cast<size_t>(N * out), 9);
      std::vector<bf16> wl(w.size());
      to_bf16(wl.data(), w.data(), int64_t(w.size()));
      Vec y(static_cast<size_t>(N * out)), dx(static_cast<size_t>(N * in)), dw(w.size(), 0.5f),
          db(static_cast<size_t>(out), 0.5f);
      auto gx = up(x), gw = up(w), gb = up(b), gdy = up(dy), gy = up(y), gdx = up(dx), gdw = up(dw), gdb = up(db);
      auto gwl = up(wl);
      const Weights<float> W(w.data(), wl.data(), p), GW(gw.data(), gwl.data(), p);
      linear_forward<float>(y.data(), x.data(), W, b.data(), N, in, out, lay);
      linear_backward<float>(dx.data(), dw.data(), db.data(), dy.data(), x.data(), W, N, in, out, lay);
      const bool io = lay == WeightLayout::in_out;
      cuda::linear_forward(gy.data(), gx.data(), GW, gb.data(), N, in, out, io);
      cuda::linear_backward(gdx.data(), gdw.data(), gdb.data(), gdy.data(), gx.data(), GW, N, in, out, io);
      const double tol = p == Precision::fp32 ? kFp32 : 1e-5;
      EXPECT_CLOSE(down(gy), y, tol);
      EXPECT_CLOSE(down(gdx), dx, tol);
      EXPECT_CLOSE(down(gdw), dw, tol);
      EXPECT_CLOSE(down(gdb), db, kFp32);
    }
}

void check_norms(int64_t N, int64_t C) {
  const Vec x = random(static_cast<size_t>(N * C), 10, 2.f), w = random(static_cast<size_t>(C), 11),
            b = random(static_cast<size_t>(C), 12);
  const Vec dy = random(static_cast<size_t>(N * C), 13);
  auto gx = up(x), gw = up(w), gb = up(b), gdy = up(dy);
  {  // LayerNorm
    Vec y(x.size()), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N)), dx(x.size(), 1.f),
        dw(static_cast<size_t>(C), 1.f), db(static_cast<size_t>(C), 1.f);
    auto gy = up(y), gm = up(mean), gr = up(rstd), gdx = up(dx), gdw = up(dw), gdb = up(db);
    layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5);
    layernorm_backward<float>(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                              N, C);
    cuda::layernorm_forward(gy.data(), gm.data(), gr.data(), gx.data(), gw.data(), gb.data(), N, C, 1e-5);
    cuda::layernorm_backward(gdx.data(), gdw.data(), gdb.data(), gdy.data(), gx.data(), gw.data(), gm.data(), gr.data(),
                             N, C);
    EXPECT_CLOSE(down(gy), y, kFp32);
    EXPECT_CLOSE(down(gm), mean, kFp32);
    EXPECT_CLOSE(down(gr), rstd, kFp32);
    EXPECT_CLOSE(down(gdx), dx, kFp32);
    EXPECT_CLOSE(down(gdw), dw, kFp32);
    EXPECT_CLOSE(down(gdb), db, kFp32);
  }
  {  // RMSNorm
    Vec y(x.size()), rstd(static_cast<size_t>(N)), dx(x.size(), 1.f), dw(static_cast<size_t>(C), 1.f);
    auto gy = up(y), gr = up(rstd), gdx = up(dx), gdw = up(dw);
    rmsnorm_forward<float>(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6);
    rmsnorm_backward<float>(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    cuda::rmsnorm_forward(gy.data(), gr.data(), gx.data(), gw.data(), N, C, 1e-6);
    cuda::rmsnorm_backward(gdx.data(), gdw.data(), gdy.data(), gx.data(), gw.data(), gr.data(), N, C);
    EXPECT_CLOSE(down(gy), y, kFp32);
    EXPECT_CLOSE(down(gr), rstd, kFp32);
    EXPECT_CLOSE(down(gdx), dx, kFp32);
    EXPECT_CLOSE(down(gdw), dw, kFp32);
  }
}

TEST_F(Cuda, Norms) {
  for (int64_t N : {33, 1000}) check_norms(N, 300);  // (1000 rows: dw and db summed in several chunks)
}

TEST_F(Cuda, Activations) {
  const int64_t N = 17, F = 90;
  const Vec x = random(static_cast<size_t>(N * 2 * F), 14, 3.f), dy = random(static_cast<size_t>(N * 2 * F), 15);
  auto gx = up(x), gdy = up(dy);
  Vec y(x.size()), dx(x.size()), h(static_cast<size_t>(N * F)), dgu(x.size());
  auto gy = up(y), gdx = up(dx), gh = up(h), gdgu = up(dgu);
  const int64_t n = int64_t(x.size());
  gelu_forward<float>(y.data(), x.data(), n);
  gelu_backward<float>(dx.data(), dy.data(), x.data(), n);
  swiglu_forward<float>(h.data(), x.data(), N, F);
  swiglu_backward<float>(dgu.data(), dy.data(), x.data(), N, F);
  cuda::gelu_forward(gy.data(), gx.data(), n);
  cuda::gelu_backward(gdx.data(), gdy.data(), gx.data(), n);
  cuda::swiglu_forward(gh.data(), gx.data(), N, F);
  cuda::swiglu_backward(gdgu.data(), gdy.data(), gx.data(), N, F);
  EXPECT_CLOSE(down(gy), y, kFp32);
  EXPECT_CLOSE(down(gdx), dx, kFp32);
  EXPECT_CLOSE(down(gh), h, kFp32);
  EXPECT_CLOSE(down(gdgu), dgu, kFp32);
}

TEST_F(Cuda, RopeWithAndWithoutPositions) {
  const int64_t B = 2, T = 20, H = 4, KV = 2, D = 16;
  const RopeTable rt(64, D, 10000.0);
  auto table = cuda::rope_table(rt.cos.data(), rt.sin.data(), rt.max_T, rt.half);
  std::vector<int64_t> pos(static_cast<size_t>(B * T));
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = int64_t((i * 7) % 64);
  auto gpos = up(pos);
  for (bool with_pos : {false, true}) {
    Vec q = random(static_cast<size_t>(B * T * (H + 2 * KV) * D), 16), g = random(q.size(), 17);
    auto gq = up(q), gg = up(g);
    const int64_t* p = with_pos ? pos.data() : nullptr;
    rope_forward<float>(q.data(), rt, B, T, H, KV, D, p);
    rope_backward<float>(g.data(), rt, B, T, H, KV, D, p);
    cuda::rope_forward(gq.data(), table.data(), B, T, H, KV, D, with_pos ? gpos.data() : nullptr);
    cuda::rope_backward(gg.data(), table.data(), B, T, H, KV, D, with_pos ? gpos.data() : nullptr);
    EXPECT_CLOSE(down(gq), q, kFp32) << "positions " << with_pos;
    EXPECT_CLOSE(down(gg), g, kFp32) << "positions " << with_pos;
  }
}

void check_embedding(int64_t v0, int64_t rows) {
  const int64_t B = 3, T = 11, C = 40, V = 9;
  std::vector<int32_t> tokens(static_cast<size_t>(B * (T + 1)));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * i) % V);  // repeats
  tokens[5] = -1;                                                                // in no shard: zeros
  const Vec wte = random(static_cast<size_t>(std::min(V, rows) * C), 18), wpe = random(static_cast<size_t>(T * C), 19),
            dx = random(static_cast<size_t>(B * T * C), 20);
  Vec x(static_cast<size_t>(B * T * C)), dwte(wte.size(), 0.1f), dwpe(wpe.size(), 0.1f);
  auto gt = up(tokens);
  auto gwte = up(wte), gwpe = up(wpe), gdx = up(dx), gx = up(x), gdwte = up(dwte), gdwpe = up(dwpe);
  embedding_forward<float>(x.data(), tokens.data(), T + 1, wte.data(), wpe.data(), B, T, C, v0, rows);
  embedding_backward<float>(dwte.data(), dwpe.data(), dx.data(), tokens.data(), T + 1, B, T, C, v0, rows);
  cuda::embedding_forward(gx.data(), gt.data(), T + 1, gwte.data(), gwpe.data(), B, T, C, v0, rows);
  cuda::embedding_backward(gdwte.data(), gdwpe.data(), gdx.data(), gt.data(), T + 1, B, T, C, v0, rows);
  EXPECT_EQ(down(gx), x);        // a copy and one add: exact
  EXPECT_EQ(down(gdwte), dwte);  // the CPU's summation order: exact
  EXPECT_EQ(down(gdwpe), dwpe);
}

// Whole vocabulary, then a shard of rows [3, 7) of it: tokens outside embed as zeros and get no gradient.
TEST_F(Cuda, EmbeddingRepeatedTokensAndVocabShards) {
  for (const auto& [v0, rows] : {std::pair<int64_t, int64_t>{0, INT64_MAX}, {3, 4}})
    check_embedding(v0, rows);
}

// An attention test case: head dim, documents or not, query and kv heads, positions.
struct AttnCase {
  int64_t D;
  bool docs;
  int64_t H = 4, KV = 2, T = 150;
};
std::ostream& operator<<(std::ostream& os, const AttnCase& c) {
  return os << "D " << c.D << " docs " << c.docs << " H " << c.H << " KV " << c.KV << " T " << c.T;
}
// Documents of a batch row: four of lengths about 27%, 1, 53% and the rest of T.
std::vector<int32_t> documents(int64_t B, int64_t T) {
  std::vector<int32_t> doc(static_cast<size_t>(B * T));
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = i % T;
    doc[size_t(i)] = int32_t(t < T * 27 / 100 ? 0 : t < T * 27 / 100 + 1 ? 1 : t < T * 80 / 100 ? 2 : 3);
  }
  return doc;
}

// Causal attention with grouped-query heads, a length that is no multiple of a tile, optional documents.
void check_attention(const AttnCase& c) {
  const int64_t B = 2, T = c.T, H = c.H, KV = c.KV, D = c.D, S = (H + 2 * KV) * D;
  const bool docs = c.docs;
  const Vec qkv = random(static_cast<size_t>(B * T * S), 21, 1.5f),
            dout = random(static_cast<size_t>(B * T * H * D), 22);
  const std::vector<int32_t> doc = documents(B, T);
  Vec out(static_cast<size_t>(B * T * H * D)), lse(static_cast<size_t>(B * H * T)), dqkv(qkv.size());
  const int32_t* d = docs ? doc.data() : nullptr;
  attention_forward<float>(out.data(), lse.data(), qkv.data(), B, T, H, KV, D, d);
  attention_backward<float>(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, H, KV, D, d);
  auto gdoc = up(doc);
  auto gqkv = up(qkv), gdout = up(dout), gout = up(out), glse = up(lse), gdqkv = up(dqkv);
  cuda::Buffer<float> delta(static_cast<size_t>(B * H * T));
  const int32_t* gd = docs ? gdoc.data() : nullptr;
  cuda::attention_forward(gout.data(), glse.data(), gqkv.data(), B, T, H, KV, D, gd);
  EXPECT_CLOSE(down(gout), out, kFp32) << c;
  EXPECT_CLOSE(down(glse), lse, kFp32) << c;
  cuda::attention_backward(gdqkv.data(), gdout.data(), gqkv.data(), gout.data(), glse.data(), delta.data(), B, T, H, KV,
                           D, gd);
  const Vec first = down(gdqkv);
  EXPECT_CLOSE(first, dqkv, kFp32) << c;
  cuda::attention_backward(gdqkv.data(), gdout.data(), gqkv.data(), gout.data(), glse.data(), delta.data(), B, T, H, KV,
                           D, gd);
  EXPECT_EQ(down(gdqkv), first) << "a second backward gives other bits";
}

TEST_F(Cuda, AttentionCausalGqa) {
  for (int64_t D : {16, 32, 64, 128}) check_attention({D, false});
  check_attention({32, false, 4, 1});      // one kv head
  check_attention({32, false, 3, 3, 10});  // no grouping, shorter than a tile
}
TEST_F(Cuda, AttentionDocumentMask) {
  for (int64_t D : {16, 64}) check_attention({D, true});
  check_attention({16, true, 2, 1, 12});
}
TEST_F(Cuda, AttentionHeadsNotAMultipleOfKvHeads) {
  cuda::Buffer<float> buf(1024);
  EXPECT_THROW(cuda::attention_forward(buf.data(), buf.data(), buf.data(), 1, 4, 6, 4, 16), Error);
  EXPECT_THROW(cuda::attention_forward_bf16(buf.data(), buf.data(), buf.data(), 1, 4, 4, 0, 16), Error);
}

// bf16 attention on the tensor cores against the CPU's fp32 attention of the same bf16-rounded q, k, v
// (and dout): what remains is the rounding of the probabilities (forward; dv) and of dS (dq, dk), each
// at most bf16's unit roundoff u = 2^-8 relative per term, so to first order every element lies within u
// times its sum of term magnitudes (computed here in double; measured on an H100: at most 0.94 of it): out_i ≤ Σ_j
// p_ij|v_j|, dv_j ≤ Σ_i p_ij|dout_i|, dq_i ≤ scale·Σ_j |ds_ij||k_j|, dk_j ≤ scale·Σ_i |ds_ij||q_i|. The CPU backward
// reads the GPU's out and lse and the rounded dout, so both use one delta (the bf16 kernels compute it from the rounded
// dout too).
struct Bf16Bounds {
  Vec out, dqkv;
};
Bf16Bounds bf16_attention_bounds(const Vec& qkv, const Vec& dout, const Vec& out, const Vec& lse, const int32_t* doc,
                                 int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D) {
  const int64_t S = (H + 2 * KV) * D, G = H / KV;
  const double scale = 1.0 / std::sqrt(double(D)), u = std::ldexp(1.0, -8);
  Bf16Bounds bd{Vec(out.size(), 0.f), Vec(qkv.size(), 0.f)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t q = (b * T + i) * S + h * D, o = (b * T + i) * H * D + h * D;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += double(dout[size_t(o + d)]) * out[size_t(o + d)];
        for (int64_t j = 0; j <= i; ++j) {
          if (doc && doc[b * T + j] != doc[b * T + i]) continue;
          const int64_t k = (b * T + j) * S + (H + h / G) * D, v = k + KV * D;
          double sc = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d)
            sc += double(qkv[size_t(q + d)]) * qkv[size_t(k + d)],
                dp += double(dout[size_t(o + d)]) * qkv[size_t(v + d)];
          const double p = std::exp(sc * scale - lse[size_t((b * H + h) * T + i)]), ds = std::fabs(p * (dp - delta));
          for (int64_t d = 0; d < D; ++d) {
            bd.out[size_t(o + d)] += float(u * p * std::fabs(qkv[size_t(v + d)]));
            bd.dqkv[size_t(v + d)] += float(u * p * std::fabs(dout[size_t(o + d)]));
            bd.dqkv[size_t(q + d)] += float(u * scale * ds * std::fabs(qkv[size_t(k + d)]));
            bd.dqkv[size_t(k + d)] += float(u * scale * ds * std::fabs(qkv[size_t(q + d)]));
          }
        }
      }
  return bd;
}

// Elements outside |gpu − ref| ≤ bound + 1e-5·max|ref| (fp32 summation noise); the worst |gpu − ref| / bound
// is printed.
int64_t outside(const Vec& gpu, const Vec& ref, const Vec& bound) {
  double mx = 0, worst = 0;
  for (float r : ref) mx = std::max(mx, double(std::fabs(r)));
  int64_t n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(gpu[i] - ref[i]), allowed = bound[i] + 1e-5 * mx;
    n += !(err <= allowed);  // (a NaN is outside)
    if (!(err / allowed <= worst)) worst = err / allowed;
  }
  std::printf("bf16 attention: worst error %.3g of its bound\n", worst);
  return n;
}

Vec rounded(const Vec& v) {
  Vec r(v.size());
  to_bf16_precision(r.data(), v.data(), int64_t(v.size()));
  return r;
}

void check_attention_bf16(const AttnCase& c) {
  const int64_t B = 2, T = c.T, H = c.H, KV = c.KV, D = c.D, S = (H + 2 * KV) * D;
  const bool docs = c.docs;
  const Vec qkv = random(static_cast<size_t>(B * T * S), 40, 1.5f),
            dout = random(static_cast<size_t>(B * T * H * D), 41);
  const std::vector<int32_t> doc = documents(B, T);
  const int32_t* d = docs ? doc.data() : nullptr;
  auto gdoc = up(doc);
  auto gqkv = up(qkv), gdout = up(dout), gout = up(Vec(static_cast<size_t>(B * T * H * D))),
       glse = up(Vec(static_cast<size_t>(B * H * T))), gdqkv = up(Vec(qkv.size()));
  cuda::Buffer<float> delta(static_cast<size_t>(B * H * T));
  const int32_t* gd = docs ? gdoc.data() : nullptr;
  cuda::attention_forward_bf16(gout.data(), glse.data(), gqkv.data(), B, T, H, KV, D, gd);
  cuda::attention_backward_bf16(gdqkv.data(), gdout.data(), gqkv.data(), gout.data(), glse.data(), delta.data(), B, T,
                                H, KV, D, gd);
  const Vec out = down(gout), lse = down(glse), dqkv = down(gdqkv);
  const Vec rq = rounded(qkv), rd = rounded(dout);
  Vec out_ref(out.size()), lse_ref(lse.size()), dqkv_ref(qkv.size());
  attention_forward<float>(out_ref.data(), lse_ref.data(), rq.data(), B, T, H, KV, D, d);
  attention_backward<float>(dqkv_ref.data(), rd.data(), rq.data(), out.data(), lse.data(), B, T, H, KV, D, d);
  const Bf16Bounds bd = bf16_attention_bounds(rq, rd, out, lse, d, B, T, H, KV, D);
  EXPECT_CLOSE(lse, lse_ref, 1e-5) << c;
  EXPECT_EQ(outside(out, out_ref, bd.out), 0) << c;
  EXPECT_EQ(outside(dqkv, dqkv_ref, bd.dqkv), 0) << c;
  EXPECT_GT(rel_err(out, out_ref), 1e-6) << "no bf16 rounding of the probabilities seen";
  cuda::attention_backward_bf16(gdqkv.data(), gdout.data(), gqkv.data(), gout.data(), glse.data(), delta.data(), B, T,
                                H, KV, D, gd);
  EXPECT_EQ(down(gdqkv), dqkv) << "a second backward gives other bits";
}

TEST_F(Cuda, AttentionBf16TensorCores) {
  for (int64_t D : {16, 32, 64, 128}) check_attention_bf16({D, false});
  for (int64_t D : {16, 64, 128}) check_attention_bf16({D, true});
  check_attention_bf16({64, false, 4, 1});      // one kv head
  check_attention_bf16({32, true, 3, 3, 10});   // no grouping, shorter than a warp's 16 rows
  check_attention_bf16({64, false, 2, 2, 300}); // longer than a block's 128 rows
}

TEST_F(Cuda, LmHeadLossWithPaddingTargets) {
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    const int64_t N = 70, C = 48, V = 1000;
    const Vec x = random(static_cast<size_t>(N * C), 23), w = random(static_cast<size_t>(V * C), 24, 0.3f);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) tg[static_cast<size_t>(n)] = n % 9 == 4 ? -1 : int32_t((n * 131) % V);
    tg[3] = int32_t(V + 5);  // another shard's target: the loss without a target logit
    std::vector<bf16> wl(w.size());
    to_bf16(wl.data(), w.data(), int64_t(w.size()));
    Vec dx(x.size()), dw(w.size(), 0.f);
    std::vector<float> scratch;
    auto gx = up(x), gw = up(w), gdx = up(dx), gdw = up(dw);
    auto gwl = up(wl);
    auto gt = up(tg);
    const double loss = lm_head_loss<float>(dx.data(), dw.data(), nullptr, x.data(),
                                            Weights<float>(w.data(), wl.data(), p), tg.data(), N, C, V, 0.5f, scratch);
    cuda::Buffer<float> gscratch;
    const double gloss = cuda::lm_head_loss(gdx.data(), gdw.data(), gx.data(), Weights<float>(gw.data(), gwl.data(), p),
                                            gt.data(), N, C, V, 0.5f, gscratch);
    const double tol = p == Precision::fp32 ? kFp32 : 1e-5;
    EXPECT_NEAR(gloss, loss, kFp32 * std::fabs(loss)) << precision_name(p);
    EXPECT_CLOSE(down(gdx), dx, tol);
    EXPECT_CLOSE(down(gdw), dw, tol);
    // Without gradients the same loss.
    EXPECT_EQ(cuda::lm_head_loss(nullptr, nullptr, gx.data(), Weights<float>(gw.data(), gwl.data(), p), gt.data(), N, C,
                                 V, 0.5f, gscratch),
              gloss);
  }
}

// The one-rank MoE layer: softmax (mixtral) and sigmoid scores, aux loss and z-loss, fp32 and bf16 experts.
void check_moe(RouterScore score, bool norm_topk, Precision p) {
  MoeSizes s{96, 32, 48, 8, 2};
  MoeRouting r;
  r.score = score, r.norm_topk = norm_topk, r.aux_coef = 0.01, r.z_coef = 0.001;
  const Vec x = random(static_cast<size_t>(s.N * s.C), 30), gate = random(static_cast<size_t>(s.E * s.C), 31, 0.5f);
  const Vec experts = random(static_cast<size_t>(s.E * 3 * s.F * s.C), 32, 0.2f), dout = random(x.size(), 33);
  std::vector<bf16> low(experts.size());
  to_bf16(low.data(), experts.data(), int64_t(experts.size()));
  Vec out(x.size()), dx(x.size()), dgate(gate.size(), 0.f), dexp(experts.size(), 0.f);
  // Device copies first: the CPU backward accumulates into dgate and dexp.
  auto gx = up(x), ggate = up(gate), gexp = up(experts), gdout = up(dout), gout = up(out), gdx = up(dx),
       gdgate = up(dgate), gdexp = up(dexp);
  auto glow = up(low);
  MoeCache<float> cache;
  TokenDispatcher local;  // one rank: every expert here
  MoeScratch<float> scratch;
  const int64_t rows = TokenDispatcher::max_rows(s.N, s.K, s.E, 1, 1);
  cache.resize(s, rows), scratch.resize(s, rows, 1);
  const Weights<float> cpu_w(experts.data(), low.data(), p);
  moe_forward<float>(out.data(), cache, MoeInputs<float>{x.data(), gate.data(), cpu_w}, s, r, {}, local, scratch);
  moe_backward_experts<float>(dx.data(), dexp.data(), dout.data(), cache, scratch, cpu_w, s, local);
  moe_backward_router<float>(dx.data(), dgate.data(), scratch, cache, x.data(), gate.data(), s, r, 1.f);
  cuda::MoeDeviceCache c;
  const Weights<float> W(gexp.data(), glow.data(), p);
  cuda::moe_forward(gout.data(), c, gx.data(), ggate.data(), W, s, r);
  cuda::moe_backward(gdx.data(), gdgate.data(), gdexp.data(), gdout.data(), c, gx.data(), ggate.data(), W, s, r, 1.f);
  const double tol = p == Precision::fp32 ? kFp32 : 1e-5;
  EXPECT_EQ(c.count_E, cache.count_E) << "the rows per expert";
  EXPECT_CLOSE(down(gout), out, tol);
  EXPECT_NEAR(c.aux, cache.aux, kFp32 * cache.aux);
  EXPECT_NEAR(c.z, cache.z, kFp32 * cache.z);
  EXPECT_CLOSE(down(gdx), dx, tol);
  EXPECT_CLOSE(down(gdgate), dgate, tol);
  EXPECT_CLOSE(down(gdexp), dexp, tol);
}

TEST_F(Cuda, MoeSoftmaxRenormalised) { check_moe(RouterScore::softmax, true, Precision::fp32); }
TEST_F(Cuda, MoeSoftmaxNotRenormalised) { check_moe(RouterScore::softmax, false, Precision::fp32); }
TEST_F(Cuda, MoeSigmoid) { check_moe(RouterScore::sigmoid, true, Precision::fp32); }
TEST_F(Cuda, MoeBf16Experts) { check_moe(RouterScore::softmax, true, Precision::bf16); }

// More rows than one chunk of 2^28 logits holds: two chunks.
void check_lm_head_chunks(int64_t N, int64_t C, int64_t V) {
  const Vec x = random(static_cast<size_t>(N * C), 50), w = random(static_cast<size_t>(V * C), 51, 0.3f);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) tg[size_t(n)] = int32_t((n * 7919) % V);
  Vec dx(x.size()), dw(w.size(), 0.f);
  auto gx = up(x), gw = up(w), gdx = up(dx), gdw = up(dw);
  auto gt = up(tg);
  std::vector<float> scratch;
  const double loss = lm_head_loss<float>(dx.data(), dw.data(), nullptr, x.data(), w.data(), tg.data(), N, C, V, 0.5f,
                                          scratch);
  cuda::Buffer<float> gscratch;
  const double gloss =
      cuda::lm_head_loss(gdx.data(), gdw.data(), gx.data(), gw.data(), gt.data(), N, C, V, 0.5f, gscratch);
  EXPECT_NEAR(gloss, loss, kFp32 * std::fabs(loss));
  EXPECT_CLOSE(down(gdx), dx, kFp32);
  EXPECT_CLOSE(down(gdw), dw, kFp32);
}

// V = 50257 (GPT-2's, odd): the scratch's losses start 8-byte aligned after an odd count of logits.
TEST_F(Cuda, LmHeadInChunks) {
  for (int64_t V : {50000, 50257}) check_lm_head_chunks(5500, 8, V);
}

TEST_F(Cuda, MoeWithNoTokens) {
  const MoeSizes s{0, 32, 48, 8, 2};
  cuda::MoeDeviceCache c;
  cuda::Buffer<float> buf(1024);
  cuda::moe_forward(buf.data(), c, buf.data(), buf.data(), buf.data(), s, MoeRouting{});
  cuda::moe_backward(buf.data(), buf.data(), buf.data(), buf.data(), c, buf.data(), buf.data(), buf.data(), s,
                     MoeRouting{}, 1.f);
  EXPECT_EQ(c.count_E, std::vector<int64_t>(8, 0));
  EXPECT_EQ(c.aux, 0.0);
}

TEST_F(Cuda, AdamWUpdateAndSumSquares) {
  const int64_t n = 5000;
  Vec w = random(static_cast<size_t>(n), 25), g = random(static_cast<size_t>(n), 26),
      m = random(static_cast<size_t>(n), 27, 0.1f), v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::fabs(g[static_cast<size_t>(i)]) * 0.01f;
  auto gw = up(w), gg = up(g), gm = up(m), gv = up(v);
  const float b1 = 0.9f, b2 = 0.95f, step = 1e-3f / 0.19f, isq = float(1 / std::sqrt(0.0975)), eps = 1e-8f,
              keep = 0.999f;
  for (int64_t j = 0; j < n; ++j) {  // train/optimizer.cpp's update, element by element
    const float gj = g[static_cast<size_t>(j)] * 0.5f;
    m[static_cast<size_t>(j)] = b1 * m[static_cast<size_t>(j)] + (1.f - b1) * gj;
    v[static_cast<size_t>(j)] = b2 * v[static_cast<size_t>(j)] + (1.f - b2) * gj * gj;
    w[static_cast<size_t>(j)] = w[static_cast<size_t>(j)] * keep -
                                step * m[static_cast<size_t>(j)] / (std::sqrt(v[static_cast<size_t>(j)]) * isq + eps);
  }
  cuda::adamw_update(gw.data(), gg.data(), gm.data(), gv.data(), n, b1, b2, step, isq, eps, keep, 0.5f);
  EXPECT_CLOSE(down(gw), w, 1e-6);
  EXPECT_CLOSE(down(gm), m, 1e-6);
  EXPECT_CLOSE(down(gv), v, 1e-6);
  double ss = 0;
  for (float x : g) ss += double(x) * x;
  EXPECT_NEAR(cuda::sum_squares(gg.data(), n), ss, 1e-12 * ss);
  // Beyond one pass of the grid (264 blocks of 256 threads): each thread's strided loop runs several times.
  const Vec big = random(size_t(1) << 20, 28);
  double big_ss = 0;
  for (float x : big) big_ss += double(x) * x;
  EXPECT_NEAR(cuda::sum_squares(up(big).data(), int64_t(big.size())), big_ss, 1e-12 * big_ss);
}

}  // namespace
}  // namespace origami
