#include "core/files.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/progress.h"

namespace origami {

std::string read_file_bytes(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)  // the system's reason: a name too long, a file where a directory should be, ...
    fail(path, ": ", errno == ENOENT ? std::string("no such file") : std::string(std::strerror(errno)));
  ORIGAMI_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
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

void replace_dir(const std::string& from, const std::string& to, bool exchange) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (exchange && ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(from, ec);  // now the old directory
    return;
  }
  ORIGAMI_CHECK(!exchange || errno == EINVAL || errno == ENOSYS || errno == ENOTSUP, "cannot replace '", to,
                "' with '", from, "': ", std::strerror(errno));
  const fs::path target(to);
  const std::string aside = (target.parent_path() / cat(".", target.filename().string(), ".replaced")).string();
  fs::remove_all(aside, ec);  // (left by a crash in a replacement before)
  rename_file(to, aside);
  try {
    rename_file(from, to);
  } catch (const Error&) {
    std::rename(aside.c_str(), to.c_str());  // the old directory back in its place
    throw;
  }
  sync_dir(target.parent_path().string());
  fs::remove_all(aside, ec);
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ORIGAMI_CHECK(fd >= 0, tmp, ": cannot open for writing (", std::strerror(errno), ")");
  const char* p = bytes.data();
  size_t left = bytes.size();
  std::string err;
  while (left > 0 && err.empty()) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) err = w < 0 ? std::strerror(errno) : "no progress";
    else p += w, left -= size_t(w);
  }
  // On disk before the rename, so that after a crash `path` is the old file or the whole new one.
  if (err.empty() && ::fsync(fd) != 0 && errno != EINVAL) err = std::strerror(errno);
  progress_alive();  // (a busy disk's fsync can take seconds: under origami launch, not a hang)
  if (::close(fd) != 0 && err.empty()) err = std::strerror(errno);
  if (!err.empty()) {
    ::unlink(tmp.c_str());
    fail(tmp, ": write failed (", err, ")");
  }
  rename_or_remove(tmp, path);
  sync_dir(std::filesystem::path(path).parent_path().string());
}

void rename_or_remove(const std::string& tmp, const std::string& path) {
  try {
    rename_file(tmp, path);
  } catch (const Error&) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void require_writable_file(const std::string& path, const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ORIGAMI_CHECK(!path.empty() && path.back() != '/' && !fs::is_directory(path, ec), option, " '", path,
                "' is a directory: give a file name");
  const fs::path dir = fs::path(path).parent_path();
  ORIGAMI_CHECK(dir.empty() || fs::is_directory(dir, ec), option, " '", path, "': no directory '", dir.string(), "'");
  ORIGAMI_CHECK(::access(dir.empty() ? "." : dir.c_str(), W_OK) == 0, option, " '", path, "': cannot write into '",
                dir.empty() ? "." : dir.string(), "' (", std::strerror(errno), ")");
  ORIGAMI_CHECK(!fs::exists(path, ec) || ::access(path.c_str(), W_OK) == 0, option, " '", path, "': cannot write it (",
                std::strerror(errno), ")");
}

void require_writable_dir(const std::string& path, const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ORIGAMI_CHECK(!path.empty(), option, " needs a directory, got ''");
  fs::path dir = fs::absolute(path, ec);
  while (!fs::exists(dir, ec) && dir.has_parent_path() && dir.parent_path() != dir) dir = dir.parent_path();
  ORIGAMI_CHECK(fs::is_directory(dir, ec), option, " '", path, "': '", dir.string(), "' is not a directory");
  ORIGAMI_CHECK(::access(dir.c_str(), W_OK) == 0, option, " '", path, "': cannot write into '", dir.string(), "' (",
                std::strerror(errno), ")");
}

void sync_dir(const std::string& dir) {
  const std::string path = dir.empty() ? "." : dir;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // (a directory this process may write into but not read: nothing it can sync)
  if (fd < 0 && (errno == EACCES || errno == EPERM)) return;
  ORIGAMI_CHECK(fd >= 0, "cannot open '", path, "' to make its entries durable: ", std::strerror(errno));
  // Not every file system can sync a directory (EINVAL, ENOTSUP, EBADF on some); any other error
  // (EIO) means the entries just renamed into it may not survive a crash, which the caller must hear.
  int rc = 0, err = 0;
  do rc = ::fsync(fd), err = errno;
  while (rc != 0 && err == EINTR);
  progress_alive();
  ::close(fd);
  ORIGAMI_CHECK(rc == 0 || err == EINVAL || err == ENOTSUP || err == EBADF, "cannot make the entries of '", path,
                "' durable: ", std::strerror(err));
}

std::string filesystem_words(const std::exception& e) {
  const auto* fs = dynamic_cast<const std::filesystem::filesystem_error*>(&e);
  if (!fs) return e.what();
  return cat("'", fs->path1().string(), "': ", fs->code().message());
}

}  // namespace origami
