// libFuzzer target: a Hugging Face config.json through parse_model_config, then what is computed from it
// before anything is allocated: the parameter table, the parameter count and the buffer plan.
#include <nlohmann/json.hpp>

#include "fuzz_common.h"
#include "model/config.h"
#include "model/params.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(origami_fuzz::as_text(data, size), nullptr, false);
  if (j.is_discarded()) return 0;
  origami_fuzz::expect_errors([&] {
    const origami::ModelConfig cfg = origami::parse_model_config(j, "fuzz config.json");
    const auto table = origami::make_param_table(cfg);
    const int64_t n = origami::num_parameters(cfg);
    if (n <= 0) origami_fuzz::finding("a config accepted with a parameter count <= 0", std::to_string(n).c_str());
    const origami::BufferPlan plan = origami::plan_buffer(table, {});
    if (plan.size < n) origami_fuzz::finding("the buffer plan is smaller than the parameter count", "");
  });
  return 0;
}
