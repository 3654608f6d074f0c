// JSON files and directories, with errors that name the file (whole-file I/O: core/files.h).
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace origami {

// Parses a JSON file; `what` names it in errors ("model config", "run config", ...). Text nested
// deeper than kMaxJsonDepth is refused before parsing: the library parses any depth, but copying or
// destroying the value recurses, and 200000 levels overflowed the stack.
nlohmann::json read_json_file(const std::string& path, const std::string& what);
constexpr int kMaxJsonDepth = 1000;
// The deepest nesting of arrays and objects in JSON text (brackets inside strings do not count).
int json_depth(std::string_view text);
void make_dirs(const std::string& path);

}  // namespace origami
