#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "core/error.h"
#include "core/files.h"

namespace origami {

static_assert(std::endian::native == std::endian::little, "the .bin/.idx format is little-endian");

TokenDtype token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size <= 65535 ? TokenDtype::uint16 : TokenDtype::int32;
}

int token_dtype_size(TokenDtype dtype) { return dtype == TokenDtype::uint16 ? 2 : 4; }

const char* token_dtype_name(TokenDtype dtype) { return dtype == TokenDtype::uint16 ? "uint16" : "int32"; }

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenDtype dtype)
    : prefix_(prefix), bin_tmp_(prefix + ".bin.tmp"), idx_tmp_(prefix + ".idx.tmp"), dtype_(dtype) {
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  ORIGAMI_CHECK(bin_, bin_tmp_, ": cannot open for writing (", std::strerror(errno), ")");
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    std::remove(bin_tmp_.c_str());
    std::remove(idx_tmp_.c_str());
    for (const std::string& t : companion_tmps_) std::remove(t.c_str());
  }
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  ORIGAMI_CHECK(!finished_, prefix_, ": add_document after finish");
  ORIGAMI_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()), prefix_, ": a document of ",
                tokens.size(), " tokens exceeds the format's int32 sequence length");
  const int64_t max_token = dtype_ == TokenDtype::uint16 ? 65535 : std::numeric_limits<int32_t>::max();
  const size_t item = size_t(token_dtype_size(dtype_));
  buffer_.resize(tokens.size() * item);
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    ORIGAMI_CHECK(t >= 0 && t <= max_token, prefix_, ".bin: token ", t, " does not fit dtype ",
                  token_dtype_name(dtype_), " (range 0..", max_token, ")");
    if (dtype_ == TokenDtype::uint16) {
      uint16_t v = uint16_t(t);
      std::memcpy(&buffer_[i * 2], &v, 2);
    } else {
      std::memcpy(&buffer_[i * 4], &t, 4);
    }
  }
  if (!buffer_.empty())
    ORIGAMI_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) == buffer_.size(), bin_tmp_,
                  ": write failed (", std::strerror(errno), ")");
  sequence_lengths_.push_back(int32_t(tokens.size()));
  num_tokens_ += tokens.size();
}

void IndexedDatasetWriter::finish(const std::map<std::string, std::string>& companions) {
  ORIGAMI_CHECK(!finished_, prefix_, ": finish called twice");
  // On disk before it is renamed (EINVAL: a file system without fsync).
  int rc = std::fflush(bin_) == 0 && (::fsync(fileno(bin_)) == 0 || errno == EINVAL) ? 0 : -1;
  rc = std::fclose(bin_) == 0 ? rc : -1;
  bin_ = nullptr;
  ORIGAMI_CHECK(rc == 0, bin_tmp_, ": write failed on close (", std::strerror(errno), ")");

  const uint64_t S = sequence_lengths_.size(), D = S + 1;
  std::string idx;
  idx.reserve(kIndexHeaderBytes + S * 12 + D * 8);
  auto put = [&](const void* p, size_t n) { idx.append(static_cast<const char*>(p), n); };
  put(kIndexMagic, 9);
  put(&kIndexVersion, 8);
  uint8_t code = uint8_t(dtype_);
  put(&code, 1);
  put(&S, 8);
  put(&D, 8);
  put(sequence_lengths_.data(), S * 4);
  int64_t pointer = 0;
  for (int32_t len : sequence_lengths_) {
    put(&pointer, 8);
    pointer += int64_t(len) * token_dtype_size(dtype_);
  }
  for (int64_t d = 0; d <= int64_t(S); ++d) put(&d, 8);
  write_file_atomically(idx_tmp_, idx);  // lands at idx_tmp_, renamed below with the .bin
  for (const auto& [suffix, bytes] : companions) {
    companion_tmps_.push_back(prefix_ + suffix + ".tmp");
    write_file_atomically(companion_tmps_.back(), bytes);
  }

  // An older dataset at the prefix loses its index first: a crash between the renames leaves a .bin
  // without an index (refused), never the new .bin paired with the old index.
  std::remove((prefix_ + ".idx").c_str());
  for (const auto& [suffix, bytes] : companions) rename_file(prefix_ + suffix + ".tmp", prefix_ + suffix);
  rename_file(bin_tmp_, prefix_ + ".bin");
  rename_file(idx_tmp_, prefix_ + ".idx");
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------
// Reader

namespace {

// Maps `path` read-only. Returns nullptr for an empty file (size 0), which mmap cannot map.
const unsigned char* map_file(const std::string& path, size_t& size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ORIGAMI_CHECK(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  size = size_t(st.st_size);
  if (size == 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  ORIGAMI_CHECK(p != MAP_FAILED, path, ": mmap failed (", std::strerror(err), ")");
  return static_cast<const unsigned char*>(p);
}

template <typename T>
T load(const unsigned char* p) {  // unaligned little-endian load
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept { *this = std::move(o); }

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& o) noexcept {
  if (this != &o) {
    release();
    prefix_ = std::move(o.prefix_);
    dtype_ = o.dtype_;
    num_sequences_ = o.num_sequences_;
    num_doc_indices_ = o.num_doc_indices_;
    idx_ = std::exchange(o.idx_, nullptr);
    idx_size_ = std::exchange(o.idx_size_, 0);
    bin_ = std::exchange(o.bin_, nullptr);
    bin_size_ = std::exchange(o.bin_size_, 0);
    token_offsets_ = std::move(o.token_offsets_);
    o.token_offsets_ = {0};
  }
  return *this;
}

IndexedDataset::~IndexedDataset() { release(); }

void IndexedDataset::release() {
  if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
  if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
  idx_ = bin_ = nullptr;
  idx_size_ = bin_size_ = 0;
}

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.prefix_ = prefix;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  ORIGAMI_CHECK(::access(idx_path.c_str(), F_OK) == 0, idx_path,
                ": no such file (a dataset PREFIX names PREFIX.idx and PREFIX.bin; make them with "
                "'origami data prepare')");
  ORIGAMI_CHECK(::access(bin_path.c_str(), F_OK) == 0, bin_path, ": no such file (the index ", idx_path,
                " exists but its token file does not)");
  ds.idx_ = map_file(idx_path, ds.idx_size_);
  ds.bin_ = map_file(bin_path, ds.bin_size_);

  const unsigned char* p = ds.idx_;
  ORIGAMI_CHECK(ds.idx_size_ >= kIndexHeaderBytes, idx_path, ": truncated: ", ds.idx_size_,
                " bytes, shorter than the ", kIndexHeaderBytes, "-byte header");
  ORIGAMI_CHECK(std::memcmp(p, kIndexMagic, 9) == 0, idx_path,
                ": bad magic (expected \"MMIDIDX\\0\\0\"): not a Megatron indexed-dataset index");
  uint64_t version = load<uint64_t>(p + 9);
  ORIGAMI_CHECK(version == kIndexVersion, idx_path, ": index version ", version, " is not supported (expected 1)");
  uint8_t code = p[17];
  ORIGAMI_CHECK(code == uint8_t(TokenDtype::uint16) || code == uint8_t(TokenDtype::int32), idx_path,
                ": dtype code ", int(code), " is not a supported token type (8 = uint16, 4 = int32)");
  ds.dtype_ = TokenDtype(code);
  const uint64_t S = load<uint64_t>(p + 18), D = load<uint64_t>(p + 26);
  ds.num_sequences_ = S;
  ds.num_doc_indices_ = D;
  // Sizes in 128 bits would be overkill; bound the counts so the arithmetic cannot overflow.
  ORIGAMI_CHECK(S <= ds.idx_size_ && D <= ds.idx_size_, idx_path, ": sequence count ", S,
                " / document count ", D, " cannot fit in a file of ", ds.idx_size_, " bytes (truncated?)");
  const uint64_t expected = kIndexHeaderBytes + S * 4 + S * 8 + D * 8;
  ORIGAMI_CHECK(ds.idx_size_ == expected, idx_path, ": size is ", ds.idx_size_, " bytes but a header with ", S,
                " sequences and ", D, " document indices needs exactly ", expected,
                ds.idx_size_ < expected ? " (truncated)" : " (trailing bytes)");
  ORIGAMI_CHECK(D >= 1, idx_path, ": document count is 0 (Megatron's document indices hold at least [0])");

  const unsigned char* lengths = p + kIndexHeaderBytes;
  const unsigned char* pointers = lengths + S * 4;
  const unsigned char* docs = pointers + S * 8;
  const uint64_t item = uint64_t(token_dtype_size(ds.dtype_));
  ds.token_offsets_.resize(S + 1);
  ds.token_offsets_[0] = 0;
  for (uint64_t i = 0; i < S; ++i) {
    int32_t len = load<int32_t>(lengths + 4 * i);
    int64_t ptr = load<int64_t>(pointers + 8 * i);
    ORIGAMI_CHECK(len >= 0, idx_path, ": sequence ", i, " has negative length ", len);
    ORIGAMI_CHECK(ptr >= 0 && uint64_t(ptr) % item == 0 && uint64_t(ptr) <= ds.bin_size_ &&
                      uint64_t(len) * item <= ds.bin_size_ - uint64_t(ptr),
                  idx_path, ": sequence ", i, " (", len, " tokens at byte ", ptr, ") lies outside ", bin_path,
                  " (", ds.bin_size_, " bytes, ", token_dtype_name(ds.dtype_), " tokens)");
    ds.token_offsets_[i + 1] = ds.token_offsets_[i] + uint64_t(len);
  }
  int64_t prev = 0;
  for (uint64_t d = 0; d < D; ++d) {
    int64_t v = load<int64_t>(docs + 8 * d);
    ORIGAMI_CHECK(v >= prev && uint64_t(v) <= S, idx_path, ": document index ", d, " = ", v,
                  " must be non-decreasing and within [0, ", S, "]");
    prev = v;
  }
  ORIGAMI_CHECK(load<int64_t>(docs) == 0 && uint64_t(load<int64_t>(docs + 8 * (D - 1))) == S, idx_path,
                ": document indices must start at 0 and end at the sequence count ", S);
  return ds;
}

int32_t IndexedDataset::sequence_length(uint64_t i) const {
  ORIGAMI_ASSERT(i < num_sequences_);
  return load<int32_t>(idx_ + kIndexHeaderBytes + 4 * i);
}

int64_t IndexedDataset::sequence_pointer(uint64_t i) const {
  ORIGAMI_ASSERT(i < num_sequences_);
  return load<int64_t>(idx_ + kIndexHeaderBytes + 4 * num_sequences_ + 8 * i);
}

int64_t IndexedDataset::document_index(uint64_t i) const {
  ORIGAMI_ASSERT(i < num_doc_indices_);
  return load<int64_t>(idx_ + kIndexHeaderBytes + 12 * num_sequences_ + 8 * i);
}

void IndexedDataset::read_tokens(uint64_t first, uint64_t count, int32_t* out) const {
  ORIGAMI_CHECK(first <= num_tokens() && count <= num_tokens() - first, prefix_, ": tokens [", first, ", ",
                first + count, ") are beyond the dataset's ", num_tokens(), " tokens");
  // The sequence holding token `first`: last offset <= first (skips empty sequences).
  uint64_t seq = uint64_t(std::upper_bound(token_offsets_.begin(), token_offsets_.end(), first) -
                          token_offsets_.begin()) - 1;
  const uint64_t item = uint64_t(token_dtype_size(dtype_));
  while (count > 0) {
    ORIGAMI_ASSERT(seq < num_sequences_);
    uint64_t within = first - token_offsets_[seq];
    uint64_t n = std::min(count, token_offsets_[seq + 1] - first);
    const unsigned char* src = n ? bin_ + uint64_t(sequence_pointer(seq)) + within * item : nullptr;
    if (n == 0) {
    } else if (dtype_ == TokenDtype::uint16) {
      for (uint64_t k = 0; k < n; ++k) out[k] = int32_t(load<uint16_t>(src + 2 * k));
    } else {
      std::memcpy(out, src, n * 4);
    }
    out += n;
    first += n;
    count -= n;
    ++seq;
  }
}

}  // namespace origami
