#include "core/io.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace origami {

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  ORIGAMI_CHECK(in, "cannot open ", what, " '", path, "': ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::string text = read_file(path, what);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(what, " '", path, "' is not valid JSON: ", e.what());
  }
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ORIGAMI_CHECK(out, "cannot write '", tmp, "': ", std::strerror(errno));
    out.write(contents.data(), std::streamsize(contents.size()));
    out.flush();
    ORIGAMI_CHECK(out, "writing '", tmp, "' failed: ", std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  ORIGAMI_CHECK(!ec, "cannot rename '", tmp, "' to '", path, "': ", ec.message());
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  ORIGAMI_CHECK(!ec, "cannot create directory '", path, "': ", ec.message());
}

}  // namespace origami
