// libFuzzer target: a blend string ("W1 PREFIX1 W2 PREFIX2 ...") through parse_blend, then the blending rule
// over its weights. An accepted blend has finite positive shares summing to 1.
#include <cmath>
#include <vector>

#include "data/blend.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view spec = origami_fuzz::as_text(data, size);
  origami_fuzz::expect_errors([&] {
    const std::vector<origami::BlendPart> parts = origami::parse_blend(spec);
    std::vector<double> w;
    double total = 0;
    for (const origami::BlendPart& p : parts) {
      if (!(p.weight > 0) || !std::isfinite(p.weight)) origami_fuzz::finding("a blend share that is not positive", p.prefix.c_str());
      w.push_back(p.weight), total += p.weight;
    }
    if (std::fabs(total - 1) > 1e-9) origami_fuzz::finding("blend shares that do not sum to 1", std::to_string(total).c_str());
    origami::BlendRule rule(w);
    for (int i = 0; i < 200; ++i) {
      const origami::BlendChoice c = rule.next();
      if (c.dataset < 0 || size_t(c.dataset) >= w.size()) origami_fuzz::finding("the rule chose no dataset", "");
    }
  });
  return 0;
}
