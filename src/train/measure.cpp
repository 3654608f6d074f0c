#include "train/measure.h"

#include "kernels/cpu/bf16.h"
#include "model/layers/attention.h"

namespace origami {

std::vector<GemmShape> model_gemm_shapes(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t N = B * T, C = c.hidden, S = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  const int64_t HD = c.num_heads * c.head_dim;
  // an expert's rows, evenly routed (at least one: a row per expert where N·K < E)
  const int64_t F = c.is_moe() ? c.expert_ffn : c.ffn,
                rows = c.is_moe() ? std::max<int64_t>(1, (N * c.top_k + c.num_experts - 1) / c.num_experts) : N;
  std::vector<GemmShape> out;
  auto linear = [&](int64_t n, int64_t in, int64_t o, bool expert) {
    out.push_back({n, o, in, false, true, expert});   // y = x·Wᵀ
    out.push_back({n, in, o, false, false, expert});  // dx = dy·W
    out.push_back({o, in, n, true, false, expert});   // dW = dyᵀ·x
  };
  linear(N, C, S, false);
  linear(N, HD, C, false);
  linear(rows, C, 2 * F, c.is_moe());
  linear(rows, F, C, c.is_moe());
  linear(N, C, c.vocab_size, false);
  return out;
}

std::vector<GemmShape> default_gemm_shapes() {
  std::vector<GemmShape> out;
  for (int64_t n : {128, 256, 512, 1024, 2048}) out.push_back({n, n, n, false, true});
  for (int64_t n : {256, 1024, 4096}) out.push_back({n, 1024, 4096, false, true}), out.push_back({n, 4096, 1024, false, true});
  return out;
}

size_t gemm_call_bytes(const GemmShape& s, Precision p) {
  return size_t(4 * (s.M * s.K + s.K * s.N + s.M * s.N) + (p == Precision::bf16 ? 2 * s.K * s.N : 0));
}

size_t cold_copies(const GemmShape& s, Precision p) {
  // (C counted twice: the copies also stand for the outputs a step writes between two uses)
  const size_t call_bytes = gemm_call_bytes(s, p) + size_t(4 * s.M * s.N);
  return std::clamp<size_t>((size_t(128) << 20) / std::max<size_t>(call_bytes, 1), 1, 1024);
}

double time_gemm(Comm& world, const GemmShape& s, Precision p, double seconds, bool cold) {
  // Cold: the calls cycle over cold_copies of the operands, as in a training step, where every other
  // layer's weights, gradients and activations pass through the caches between two uses of one
  // layer's. dW (ta) accumulates into C, as the layers' backward does.
  const size_t a_n = size_t(s.M * s.K), b_n = size_t(s.K * s.N), c_n = size_t(s.M * s.N);
  const size_t copies = cold ? cold_copies(s, p) : 1;
  std::vector<float> A(copies * a_n, 0.5f), Bm(copies * b_n, 0.25f), C(copies * c_n, 0.f);
  std::vector<bf16> low;  // B's bf16 copy (a weight's), rounded once
  if (p == Precision::bf16) low.resize(Bm.size()), round_to_bf16(low.data(), Bm.data(), int64_t(Bm.size()));
  size_t i = 0;
  return timed_best(world, seconds, 2 * int(copies), [&] {
    const size_t k = i++ % copies;
    const Mat<float> a{A.data() + k * a_n, s.ta ? s.M : s.K},
        b{Bm.data() + k * b_n, s.tb ? s.K : s.N, low.empty() ? nullptr : low.data() + k * b_n};
    matmul<float>(p, s.ta, s.tb, s.M, s.N, s.K, 1.f, a, b, s.ta ? 1.f : 0.f, C.data() + k * c_n, s.N,
                  s.varying ? Sizes::varying : Sizes::fixed);
  });
}

double time_attention(Comm& world, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t doc_len, Precision p,
                      double seconds) {
  const int64_t S = (H + 2 * KV) * D;
  std::vector<float> qkv(size_t(T * S), 0.01f), out(size_t(T * H * D)), lse(size_t(H * T)), dqkv(size_t(T * S)),
      dout(size_t(T * H * D), 0.01f);
  std::vector<int32_t> doc;
  for (int64_t t = 0; doc_len > 0 && t < T; ++t) doc.push_back(int32_t(t / doc_len));
  const int32_t* d = doc.empty() ? nullptr : doc.data();
  const bool exact = qkv_rounded_in_place(p);  // as a layer gives them (Model::cp_shape)
  if (exact) round_in_place(qkv.data(), nullptr, int64_t(qkv.size()));
  return timed(world, seconds, 1, [&] {
    attention_forward(out.data(), lse.data(), qkv.data(), 1, T, H, KV, D, d, p, exact);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), 1, T, H, KV, D, d, p, exact);
  });
}

}  // namespace origami
