// Errors. A user mistake (bad flag, bad file, impossible config) throws origami::Error with one
// message that names the value and the rule; the command's main() prints it and exits non-zero.
// Nothing below main() calls exit().
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace origami {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An Error that has already been printed (by the one rank chosen to report it); main() only exits non-zero.
struct ErrorReported : Error {
  using Error::Error;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

}  // namespace origami

// ORIGAMI_CHECK(cond, "message parts", value, ...): user-facing check, throws origami::Error.
#define ORIGAMI_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::origami::fail(__VA_ARGS__);    \
  } while (0)

// ORIGAMI_ASSERT(cond): internal invariant (a bug, not a user mistake); names file:line.
#define ORIGAMI_ASSERT(cond)                                                              \
  do {                                                                                    \
    if (!(cond)) ::origami::fail("internal error: ", #cond, " at ", __FILE__, ":", __LINE__); \
  } while (0)
