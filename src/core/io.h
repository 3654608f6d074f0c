// JSON files and directories, with errors that name the file (whole-file I/O: core/files.h).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace origami {

// Parses a JSON file; `what` names it in errors ("model config", "run config", ...). Text nested
// deeper than kMaxJsonDepth (core/json_fields.h) is refused before parsing.
nlohmann::json read_json_file(const std::string& path, const std::string& what);
void make_dirs(const std::string& path);

}  // namespace origami
