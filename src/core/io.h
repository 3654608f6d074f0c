// Small file helpers with errors that name the file.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace origami {

std::string read_file(const std::string& path, const std::string& what);
nlohmann::json read_json_file(const std::string& path, const std::string& what);
// Writes `path + ".tmp"` and renames it, so a crash never leaves a half-written file.
void write_file_atomic(const std::string& path, const std::string& contents);
void make_dirs(const std::string& path);

}  // namespace origami
