// Times the CUDA kernels (src/kernels/cuda) at GPT-2 124M's shapes (8 rows of 1024 tokens, C = 768,
// 12 heads of 64, V = 50257): the layer GEMMs in fp32 and bf16, fused attention forward and backward,
// the LM head with cross-entropy, and LayerNorm. Median of 10 timed calls after 3 warm-ups, each call
// timed to the stream's end. bench/cuda_kernels_torch.py times PyTorch on the same work.
// Build: ninja -C build cuda_kernels_bench; run on a CUDA machine: ./build/cuda_kernels_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"

using namespace origami;

namespace {
double median_ms(const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  cuda::synchronize();
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return (ms[4] + ms[5]) / 2;  // the median of 10 (as Python's statistics.median, the peer's)
}

cuda::Buffer<float> random_buffer(size_t n, float scale) {
  std::mt19937 g(1);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> h(n);
  for (auto& x : h) x = d(g);
  cuda::Buffer<float> b(n);
  cuda::copy_to_device(b.data(), h.data(), n * sizeof(float));
  return b;
}

void report(const char* what, double ms, double flops) {
  std::printf("%-40s %9.3f ms  %8.1f TFLOP/s\n", what, ms, flops / ms * 1e-9);
}
}  // namespace

int main() {
  std::string why;
  if (cuda::device_count(&why) == 0) {
    std::printf("no CUDA device (%s)\n", why.c_str());
    return 1;
  }
  std::printf("device: %s\n", cuda::device_name().c_str());
  const int64_t B = 8, T = 1024, N = B * T, C = 768, H = 12, D = 64, V = 50257;
  auto x = random_buffer(size_t(N * 4 * C), 1.f), w = random_buffer(size_t(4 * C * C), 0.02f);
  auto y = random_buffer(size_t(N * 4 * C), 1.f);
  // The backward's outputs in buffers of their own: dx written over x, or dW added into w, would change
  // the operands from call to call (and overflow them).
  auto dx = random_buffer(size_t(N * C), 1.f), dw = random_buffer(size_t(4 * C * C), 0.02f);
  // bf16 copies of the weight and of the input activation, as a bf16 run keeps them
  cuda::Buffer<bf16> w_low(size_t(4 * C * C)), x_low(size_t(N * C));
  cuda::round_to_bf16(w_low.data(), w.data(), 4 * C * C);
  cuda::round_to_bf16(x_low.data(), x.data(), N * C);
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    const Weights<float> W(w.data(), w_low.data(), p);
    const Operand<float> X(x.data(), p == Precision::bf16 ? x_low.data() : nullptr);
    const double flops = 2.0 * N * C * 4 * C;
    report((std::string("MLP up GEMM 8192x3072x768 ") + precision_name(p)).c_str(),
           median_ms([&] { cuda::linear_forward(y.data(), X, W, nullptr, N, C, 4 * C, false); }), flops);
    report((std::string("MLP up backward (dx, dW) ") + precision_name(p)).c_str(),
           median_ms([&] { cuda::linear_backward(dx.data(), dw.data(), nullptr, y.data(), X, W, N, C, 4 * C, false); }),
           2 * flops);
  }
  {
    auto qkv = random_buffer(size_t(N * 3 * C), 1.f), dqkv = random_buffer(size_t(N * 3 * C), 1.f);
    auto out = random_buffer(size_t(N * C), 1.f), dout = random_buffer(size_t(N * C), 1.f);
    auto lse = random_buffer(size_t(B * H * T), 1.f), delta = random_buffer(size_t(B * H * T), 1.f);
    const double fwd = 4.0 * B * H * T * T * D / 2;  // causal: half the score matrix
    report("attention forward fp32 (causal)",
           median_ms([&] { cuda::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, H, D); }), fwd);
    report("attention backward fp32 (causal)", median_ms([&] {
             cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), delta.data(), B, T,
                                      H, H, D);
           }),
           2.5 * fwd);
    report("attention forward bf16 (causal)",
           median_ms([&] { cuda::attention_forward_bf16(out.data(), lse.data(), qkv.data(), B, T, H, H, D); }), fwd);
    report("attention backward bf16 (causal)", median_ms([&] {
             cuda::attention_backward_bf16(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), delta.data(),
                                           B, T, H, H, D);
           }),
           2.5 * fwd);
  }
  {
    auto wte = random_buffer(size_t(V * C), 0.02f), dwte = random_buffer(size_t(V * C), 0.01f);
    cuda::Buffer<bf16> wte_low(size_t(V * C));
    cuda::round_to_bf16(wte_low.data(), wte.data(), V * C);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) tg[size_t(n)] = int32_t((n * 7919) % V);
    cuda::Buffer<int32_t> targets(tg.size());
    cuda::copy_to_device(targets.data(), tg.data(), tg.size() * sizeof(int32_t));
    cuda::Buffer<float> scratch;
    for (Precision p : {Precision::fp32, Precision::bf16}) {
      const Weights<float> W(wte.data(), wte_low.data(), p);
      report((std::string("LM head + CE fwd+bwd ") + precision_name(p)).c_str(), median_ms([&] {
               cuda::lm_head_loss(y.data(), dwte.data(), x.data(), W, targets.data(), N, C, V, 1.f / N, scratch);
             }),
             3 * 2.0 * N * C * V);
    }
  }
  {  // A Mixtral-style MoE layer at C = 768: 8 experts of F = 1536, top 2
    const int64_t E = 8, K = 2, F = 1536;
    MoeSizes s{N, C, F, E, K};
    MoeRouting r;
    r.aux_coef = 0.01;
    auto gate = random_buffer(size_t(E * C), 0.02f), dgate = random_buffer(size_t(E * C), 0.01f);
    auto ex = random_buffer(size_t(E * 3 * F * C), 0.02f), dex = random_buffer(size_t(E * 3 * F * C), 0.01f);
    cuda::Buffer<bf16> ex_low(size_t(E * 3 * F * C));
    cuda::round_to_bf16(ex_low.data(), ex.data(), E * 3 * F * C);
    auto out = random_buffer(size_t(N * C), 1.f), dx = random_buffer(size_t(N * C), 1.f);
    cuda::MoeDeviceCache cache;
    for (Precision p : {Precision::fp32, Precision::bf16}) {
      const Weights<float> W(ex.data(), ex_low.data(), p);
      report((std::string("MoE 8x top-2 F=1536 fwd+bwd ") + precision_name(p)).c_str(), median_ms([&] {
               cuda::moe_forward(out.data(), cache, x.data(), gate.data(), W, s, r);
               cuda::moe_backward(dx.data(), dgate.data(), dex.data(), out.data(), cache, x.data(), gate.data(), W, s,
                                  r, 1.f);
             }),
             3 * 2.0 * N * K * 3 * F * C);
    }
  }
  {
    auto mean = random_buffer(size_t(N), 1.f), rstd = random_buffer(size_t(N), 1.f);  // (the forward writes both)
    auto g = random_buffer(size_t(C), 1.f), b = random_buffer(size_t(C), 1.f);
    auto dg = random_buffer(size_t(C), 1.f), db = random_buffer(size_t(C), 1.f);
    const double ms = median_ms([&] {
      cuda::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), N, C, 1e-5);
      cuda::layernorm_backward(dx.data(), dg.data(), db.data(), y.data(), x.data(), g.data(), mean.data(), rstd.data(),
                               N, C);
    });
    std::printf("%-40s %9.3f ms  %8.1f GB/s\n", "LayerNorm fwd+bwd 8192x768", ms, 7.0 * N * C * 4 / ms * 1e-6);
  }
  return 0;
}
