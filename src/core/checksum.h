// A fast 64-bit checksum of a byte stream, for detecting damaged or truncated checkpoint files (not a
// cryptographic hash). Four independent lanes of multiply-rotate rounds over 32-byte blocks (the
// round of xxHash64) run at memory speed; a flipped bit anywhere, or a shorter stream, changes it.
// Feeding the same bytes in any split over update() calls gives the same value.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace origami {

class Checksum {
 public:
  void update(const void* data, size_t len);
  uint64_t value() const;
  std::string hex() const;  // value() as 16 lower-case hex digits (how checkpoints record it)

 private:
  void block(const unsigned char* p);
  uint64_t lane_[4] = {0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x85EBCA77C2B2AE63ull};
  unsigned char pending_[32] = {};
  size_t pending_len_ = 0;
  uint64_t total_ = 0;
};

// The checksum (hex()) of a whole file, read in bounded chunks; Error naming the file if unreadable.
std::string file_checksum(const std::string& path);

}  // namespace origami
