// Incremental decoding (Model::start_decoding / decode, origami generate's KV cache): the logits of
// each new token, computed from the cached keys and values, are the whole window's logits at its last
// position (Model::forward_backward over every token so far), for a prompt and then token by token
// over 300 positions — past the attention core's 64-key tiles and bf16's 256-key chunks — in fp32 and
// bf16, on two threads: gpt2 (learned positions, q/k/v biases), llama under document masking (ends
// of documents inside the prompt, between tiles and among the single tokens, positions restarting
// after each), mixtral and qwen2_moe (routing per token). A cleared cache starts again at position 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"

namespace origami {
namespace {

struct Case {
  std::string model;
  Precision precision;
  bool documents;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.precision == Precision::bf16 ? "_bf16" : "_fp32") << (c.documents ? "_documents" : "");
}

class KvCache : public ::testing::TestWithParam<Case> {};

// The largest |a − b| / max(1, |b|) over one token's logits.
double worst(const float* a, const float* b, int64_t V) {
  double w = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double e = std::fabs(double(a[v]) - double(b[v])) / std::max(1.0, std::fabs(double(b[v])));
    if (std::isnan(e)) return e;  // (a NaN anywhere is the worst)
    w = std::max(w, e);
  }
  return w;
}

TEST_P(KvCache, DecodedLogitsAreTheWholeWindows) {
  const Case c = GetParam();
  set_num_threads(2);
  ModelConfig cfg = load_model_config(std::string(ORIGAMI_SOURCE_DIR) + "/tests/parallel/configs/" + c.model + ".json");
  const int64_t L = 300, prompt = 37, V = cfg.vocab_size;
  cfg.max_positions = L;  // (gpt2's position table grows with it)
  const int32_t eod = 3;
  if (c.documents) cfg.document_eod = eod;
  std::vector<int32_t> tokens(size_t(L) + 1);
  for (int64_t t = 0; t <= L; ++t) tokens[size_t(t)] = int32_t((t * 7919 + 13) % V);
  for (int64_t t : {5, 30, 63, 64, 130, 200, 255, 256, 257, 290}) tokens[size_t(t)] = eod;  // (ends of documents)
  Params params(make_param_table(cfg));
  params.init(11, cfg.num_layers, cfg.init_std);
  Model cached(cfg, params), whole(cfg, params);
  cached.set_precision(c.precision), whole.set_precision(c.precision);
  cached.start_decoding(L);

  // The whole window's logits at position t (tokens 0..t), one row of t+1 tokens and its target slot.
  std::vector<float> all, got(static_cast<size_t>(V));
  auto reference = [&](int64_t t) {
    std::vector<int32_t> row(tokens.begin(), tokens.begin() + t + 2);
    all.resize(size_t((t + 1) * V));
    whole.forward_backward(row.data(), 1, t + 1, 1.f, false, all.data());
    return all.data() + t * V;
  };
  const double tol = c.precision == Precision::bf16 ? 5e-3 : 2e-6;  // (measured: 2.1e-4 and 2.4e-7)
  double most = 0;
  cached.decode(tokens.data(), prompt, got.data());
  most = worst(got.data(), reference(prompt - 1), V);
  ASSERT_LE(most, tol) << "the prompt's last position";
  for (int64_t t = prompt; t < L; ++t) {
    cached.decode(&tokens[size_t(t)], 1, got.data());
    const double e = worst(got.data(), reference(t), V);
    ASSERT_LE(e, tol) << "position " << t << (tokens[size_t(t - 1)] == eod ? " (a document's first)" : "");
    most = std::max(most, e);
  }
  EXPECT_EQ(cached.decoded(), L);
  // Cleared, the cache starts again at position 0: a later window, as the sliding window rebuilds it.
  cached.clear_decoding();
  cached.decode(tokens.data() + 100, 150, got.data());
  std::vector<int32_t> row(tokens.begin() + 100, tokens.begin() + 251);
  all.resize(size_t(150 * V));
  whole.forward_backward(row.data(), 1, 150, 1.f, false, all.data());
  EXPECT_LE(worst(got.data(), all.data() + 149 * V, V), tol);
  std::printf("  %s: largest difference %.2e (bound %.0e)\n", c.model.c_str(), most, tol);
}

INSTANTIATE_TEST_SUITE_P(Models, KvCache,
                         ::testing::Values(Case{"gpt2_tiny", Precision::fp32, false},
                                           Case{"llama_tiny", Precision::fp32, true},
                                           Case{"llama_tiny", Precision::bf16, true},
                                           Case{"mixtral_8e", Precision::fp32, false},
                                           Case{"mixtral_8e", Precision::bf16, false},
                                           Case{"qwen2_moe_8e", Precision::fp32, true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return c.model + (c.precision == Precision::bf16 ? "_bf16" : "_fp32") +
                                  (c.documents ? "_documents" : "");
                         });

}  // namespace
}  // namespace origami
