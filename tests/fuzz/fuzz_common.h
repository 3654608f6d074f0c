// Shared by the libFuzzer targets of tests/fuzz (built with -DORIGAMI_FUZZ=ON, clang,
// -fsanitize=fuzzer,address,undefined; scripts/fuzz_libfuzzer.sh builds and runs them).
//
// The rule each target checks, beyond the sanitizers: a reader given any bytes either returns or throws
// origami::Error (a message for the user). Any other exception — a bare nlohmann::json or std::
// exception, std::bad_alloc from an unchecked size — is a finding: the target prints it and aborts, so
// libFuzzer saves the input as a crash.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <unistd.h>

#include "core/error.h"

namespace origami_fuzz {

// A directory of this process for the files a reader must open by name (removed at exit).
inline const std::filesystem::path& work_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = std::filesystem::temp_directory_path() / ("origami-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(std::filesystem::temp_directory_path() / ("origami-fuzz-" + std::to_string(getpid())), ec);
    });
    return d;
  }();
  return dir;
}

// Writes `bytes` to work_dir()/name (directories created) and returns the path.
inline std::string write_file(const std::string& name, std::string_view bytes) {
  const std::filesystem::path p = work_dir() / name;
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
  return p.string();
}

[[noreturn]] inline void finding(const char* what, const char* detail) {
  std::fprintf(stderr, "FUZZ FINDING: %s: %s\n", what, detail);
  std::fflush(stderr);
  std::abort();
}

// Runs fn; origami::Error is the expected way to refuse an input, anything else is a finding.
template <typename Fn>
void expect_errors(Fn&& fn) {
  try {
    fn();
  } catch (const origami::Error&) {
  } catch (const std::bad_alloc&) {
    finding("std::bad_alloc (an allocation sized by the input, not checked first)", "");
  } catch (const std::exception& e) {
    finding("an exception that is not origami::Error (the user would see 'unexpected error:')", e.what());
  }
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace origami_fuzz
