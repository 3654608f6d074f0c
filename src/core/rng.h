// Counter-based random numbers: a value depends only on (seed, stream key, index), never on the
// order of calls or on how work is split across threads or ranks. Parameter init uses
// key = hash(parameter's global name), index = element index, so any parallel layout that owns a
// slice of a parameter initialises exactly the same numbers as one rank does.
#pragma once
#include <cmath>
#include <cstdint>
#include <string_view>

namespace origami {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a of a name, mixed: the stream key of a parameter.
inline uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return splitmix64(h);
}

// Uniform in [0, 1) with 53 random bits, for (seed, key, index).
inline double uniform01(uint64_t seed, uint64_t key, uint64_t index) {
  uint64_t x = splitmix64(splitmix64(seed ^ key) + index);
  return double(x >> 11) * 0x1.0p-53;
}

// Standard normal for (seed, key, index), by Box-Muller on two derived uniforms.
inline double normal01(uint64_t seed, uint64_t key, uint64_t index) {
  double u1 = uniform01(seed, key, 2 * index);
  double u2 = uniform01(seed, key, 2 * index + 1);
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace origami
