#include "core/files.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace origami {

std::string read_file_bytes(const std::string& path) {
  std::error_code ec;
  auto status = std::filesystem::status(path, ec);
  ORIGAMI_CHECK(std::filesystem::exists(status), path, ": no such file");
  ORIGAMI_CHECK(std::filesystem::is_regular_file(status), path, ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  ORIGAMI_CHECK(in, path, ": cannot open for reading (", std::strerror(errno), ")");
  std::string bytes;
  in.seekg(0, std::ios::end);
  bytes.resize(size_t(in.tellg()));
  in.seekg(0);
  in.read(bytes.data(), std::streamsize(bytes.size()));
  ORIGAMI_CHECK(in || bytes.empty(), path, ": read failed");
  return bytes;
}

void rename_file(const std::string& from, const std::string& to) {
  ORIGAMI_CHECK(std::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, " (",
                std::strerror(errno), ")");
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ORIGAMI_CHECK(out, tmp, ": cannot open for writing (", std::strerror(errno), ")");
    out.write(bytes.data(), std::streamsize(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      fail(tmp, ": write failed (disk full?)");
    }
  }
  rename_file(tmp, path);
}

}  // namespace origami
