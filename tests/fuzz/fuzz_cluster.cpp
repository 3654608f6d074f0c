// libFuzzer target: a cluster.json through Cluster::from_json, then the rates the planner asks of it.
#include <cmath>

#include <nlohmann/json.hpp>

#include "fuzz_common.h"
#include "plan/cluster.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(origami_fuzz::as_text(data, size), nullptr, false);
  if (j.is_discarded()) return 0;
  origami_fuzz::expect_errors([&] {
    const origami::Cluster c = origami::Cluster::from_json(j, "fuzz cluster.json");
    if (c.devices() < 1) origami_fuzz::finding("a cluster accepted with fewer than 1 device", std::to_string(c.devices()).c_str());
    for (double m : {1.0, 64.0, 4096.0, 65536.0}) {
      const double r = c.gemm_rate(m, m, m);
      if (!(r > 0) || !std::isfinite(r)) origami_fuzz::finding("a GEMM rate that is not positive and finite", std::to_string(r).c_str());
    }
    for (bool inter : {false, true}) {
      const double t = c.transfer_seconds(1e6, 3, inter);
      if (!(t >= 0) || !std::isfinite(t)) origami_fuzz::finding("a transfer time that is negative or not finite", std::to_string(t).c_str());
    }
    (void)c.to_json().dump();
  });
  return 0;
}
