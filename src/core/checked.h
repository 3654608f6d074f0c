// Checked 64-bit size arithmetic. Sizes, byte counts and element counts that come from user input
// (model dimensions, batch and sequence options, checkpoint shapes) are computed as Size: every +, −,
// × and / is checked, and an overflow throws SizeOverflow instead of wrapping around (a wrapped size
// once let a run allocate too little and write past it). The functions that size a run catch it where
// they know which inputs were involved and rethrow an Error naming them (size_error below).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/error.h"

namespace origami {

struct SizeOverflow : Error {
  SizeOverflow() : Error("a size overflows 64-bit arithmetic") {}
};

class Size {
 public:
  constexpr Size() = default;
  constexpr Size(int64_t v) : v_(v) {}  // NOLINT: implicit, so that Size mixes with plain integers
  constexpr int64_t get() const { return v_; }
  explicit constexpr operator int64_t() const { return v_; }
  explicit constexpr operator size_t() const { return size_t(v_); }
  explicit operator double() const { return double(v_); }

  friend Size operator+(Size a, Size b) { return check(__builtin_add_overflow(a.v_, b.v_, &a.v_), a); }
  friend Size operator-(Size a, Size b) { return check(__builtin_sub_overflow(a.v_, b.v_, &a.v_), a); }
  friend Size operator*(Size a, Size b) { return check(__builtin_mul_overflow(a.v_, b.v_, &a.v_), a); }
  friend Size operator/(Size a, Size b) { return a.v_ / b.v_; }  // sizes are not negative: no INT64_MIN / -1
  friend Size operator%(Size a, Size b) { return a.v_ % b.v_; }
  Size& operator+=(Size b) { return *this = *this + b; }
  Size& operator-=(Size b) { return *this = *this - b; }
  Size& operator*=(Size b) { return *this = *this * b; }
  friend constexpr auto operator<=>(Size a, Size b) = default;

 private:
  static Size check(bool overflow, Size r) {
    if (overflow) throw SizeOverflow();
    return r;
  }
  int64_t v_ = 0;
};

// Runs `f` (which computes sizes); an overflow becomes an Error naming what was sized and from which
// inputs: "<what> overflows 64-bit arithmetic (<inputs>)". `inputs` is a string, or a function that
// returns one (called only on overflow: the planner sizes millions of layouts).
template <typename I, typename F>
auto size_error(std::string_view what, const I& inputs, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const SizeOverflow&) {
    std::string named;
    if constexpr (std::is_invocable_v<const I&>)
      named = inputs();
    else
      named = inputs;
    fail(what, " overflows 64-bit arithmetic (", named, ")");
  }
}

}  // namespace origami
