// Switches read from the environment (ORIGAMI_BF16_GEMM, ORIGAMI_TILE_GEMM): one parser, one error.
#pragma once
#include <initializer_list>
#include <string>
#include <string_view>

namespace origami {

// The value of environment variable `name`, which must be one of `choices`; unset or empty gives the
// first choice (the default). Anything else throws Error: "NAME='value': expected a, b or c".
std::string env_choice(const char* name, std::initializer_list<std::string_view> choices);

}  // namespace origami
