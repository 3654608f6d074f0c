#include "core/checksum.h"

#include <cstdio>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/progress.h"

namespace origami {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full, kP3 = 0x165667B19E3779F9ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t round(uint64_t acc, uint64_t x) { return rotl(acc + x * kP2, 31) * kP1; }
uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

void Checksum::block(const unsigned char* p) {
  for (int i = 0; i < 4; ++i) lane_[i] = round(lane_[i], load64(p + 8 * i));
}

void Checksum::update(const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (pending_len_ > 0) {
    const size_t take = std::min(len, 32 - pending_len_);
    std::memcpy(pending_ + pending_len_, p, take);
    pending_len_ += take, p += take, len -= take;
    if (pending_len_ < 32) return;
    block(pending_);
    pending_len_ = 0;
  }
  for (; len >= 32; p += 32, len -= 32) block(p);
  std::memcpy(pending_, p, len);
  pending_len_ = len;
}

uint64_t Checksum::value() const {
  uint64_t h = rotl(lane_[0], 1) + rotl(lane_[1], 7) + rotl(lane_[2], 12) + rotl(lane_[3], 18);
  h = (h ^ total_) * kP3;
  for (size_t i = 0; i < pending_len_; ++i) h = rotl(h ^ (uint64_t(pending_[i]) * kP1), 11) * kP2;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  return h;
}

std::string Checksum::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value()));
  return buf;
}

std::string file_checksum(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ORIGAMI_CHECK(f != nullptr, "cannot read '", path, "': ", std::strerror(errno));
  std::vector<char> buf(size_t(16) << 20);
  Checksum sum;
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    sum.update(buf.data(), got);
    progress_alive();  // (origami launch's watchdog: a resume reading a large checkpoint is not a hang)
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  ORIGAMI_CHECK(!failed, "cannot read '", path, "': read error");
  return sum.hex();
}

}  // namespace origami
