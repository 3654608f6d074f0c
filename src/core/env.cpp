#include "core/env.h"

#include <cstdlib>

#include "core/error.h"

namespace origami {

std::string env_choice(const char* name, std::initializer_list<std::string_view> choices) {
  ORIGAMI_ASSERT(choices.size() > 0);
  const char* v = std::getenv(name);
  const std::string s = v && *v ? v : std::string(*choices.begin());
  std::string expected;
  size_t i = 0;
  for (std::string_view c : choices) {
    if (s == c) return s;
    expected += cat(i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ", c);
    ++i;
  }
  fail(name, "='", s, "': expected ", expected);
}

}  // namespace origami
