// File helpers: whole-file reads and atomic writes (temp file in the
// same directory, then rename, so a reader never sees a half-written file).
#pragma once
#include <exception>
#include <string>
#include <string_view>

namespace origami {

// The bytes of `path`. Error naming the file when it is missing, not a regular file or unreadable.
std::string read_file_bytes(const std::string& path);

// Writes `bytes` to `path` atomically and durably (temp file, fsync, rename, directory fsync).
// Error naming the file on any I/O failure (the temp file is removed; `path` is unchanged).
void write_file_atomically(const std::string& path, std::string_view bytes);

// An Error unless `path` can be written as a file (checked before long work, not after it): it is not
// a directory, it lies in an existing directory this process may write into, and where it exists this
// process may write it. `option` names it.
void require_writable_file(const std::string& path, const std::string& option);
// The same for a directory the command will create or write into: `path` is one, or its nearest
// existing ancestor is a writable directory.
void require_writable_dir(const std::string& path, const std::string& option);

// Makes renames and new entries in `dir` durable (fsync of the directory): an Error when the sync
// fails, except on file systems that cannot sync a directory.
void sync_dir(const std::string& dir);

// Renames `from` to `to` (replacing `to`); Error naming both on failure.
void rename_file(const std::string& from, const std::string& to);
// The same for a temporary file written in `to`'s place: removed when the rename fails.
void rename_or_remove(const std::string& tmp, const std::string& to);

// Puts directory `from` in the place of the existing directory `to` (in the same parent) and removes
// the old one: atomically where the file system exchanges two names (renameat2 RENAME_EXCHANGE: `to`
// is always whole), else (NFS, CephFS and Lustre clients refuse the flag, as `exchange` false does)
// by moving `to` aside to .NAME.replaced and `from` into its place, where a crash between the two
// leaves no `to` (but .NAME.replaced whole). Error naming both on failure.
void replace_dir(const std::string& from, const std::string& to, bool exchange = true);

// The words of a std::filesystem error: the path it concerns and the system's reason ("'P': File name
// too long"). Such an error is always about a path a user gave (a blend prefix, a checkpoint's
// `latest`), so it is reported as a user mistake, not as an unexpected library exception.
std::string filesystem_words(const std::exception& e);

}  // namespace origami
