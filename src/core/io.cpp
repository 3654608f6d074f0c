#include "core/io.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/json_fields.h"

namespace origami {

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::string text = read_file_bytes(path);
  const int depth = json_depth(text);
  ORIGAMI_CHECK(depth <= kMaxJsonDepth, what, " '", path, "' nests arrays and objects ", depth,
                " levels deep; origami reads at most ", kMaxJsonDepth);
  try {
    return parse_json_keys_once(text, cat(what, " '", path, "'"));
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number past double's range
    fail(what, " '", path, "' is not valid JSON: ", e.what());
  }
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  ORIGAMI_CHECK(!ec, "cannot create directory '", path, "': ", ec.message());
}

}  // namespace origami
