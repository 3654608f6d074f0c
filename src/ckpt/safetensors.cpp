#include "ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/checksum.h"
#include "core/error.h"
#include "core/files.h"
#include "core/progress.h"
#include "core/io.h"
#include "core/json_fields.h"
#include "kernels/cpu/bf16.h"

// The format is little-endian; we read and write it with plain memcpy.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace origami {

namespace {

// The reference implementation refuses headers above 100 MB (MAX_HEADER_SIZE); so do we.
constexpr uint64_t max_header_bytes = 100'000'000;

struct DtypeSize {
  const char* name;
  size_t size;
};
constexpr DtypeSize dtype_sizes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8},
};

// 0 for an unknown dtype.
size_t dtype_size_or_zero(std::string_view dtype) {
  for (const auto& d : dtype_sizes)
    if (dtype == d.name) return d.size;
  return 0;
}

std::string errno_text() { return std::strerror(errno); }

std::string quote_path(const std::string& path) { return cat("'", path, "'"); }

// numel of a shape in uint64, false on overflow: of every partial product past INT64_MAX too, which
// TensorInfo::numel() forms in int64 ([2^62, 3, 0] has 0 elements, but not on the way).
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, uint64_t(d), &n) || n > uint64_t(INT64_MAX)) return false;
  }
  *out = n;
  return true;
}

}  // namespace

size_t safetensors_dtype_size(std::string_view dtype) {
  size_t s = dtype_size_or_zero(dtype);
  ORIGAMI_CHECK(s != 0, "unknown safetensors dtype '", dtype, "'");
  return s;
}

// ---- 16-bit floats -------------------------------------------------------------------------

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = float(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));  // rebias 15 -> 127
}

float bf16_to_f32(uint16_t b) { return to_float(bf16{b}); }

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u)  // inf, or NaN kept quiet with its top payload bits
    return sign | 0x7c00 | (x > 0x7f800000u ? uint16_t(0x200 | ((x >> 13) & 0x3ff)) : 0);
  // 65520 is halfway between the largest half (65504) and 65536; ties-to-even goes up to inf.
  if (x >= 0x477ff000u) return sign | 0x7c00;
  if (x < 0x38800000u) {  // below 2^-14: a half subnormal, round(value / 2^-24) to even
    const uint32_t e = x >> 23;
    if (e < 102) return sign;  // below 2^-25 (and 2^-25 itself ties to 0)
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;  // value = m * 2^(e - 150)
    const uint32_t shift = 126 - e;                   // 14 .. 24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return sign | uint16_t(q);  // q == 1024 is correctly the smallest normal
  }
  // Normal: round the 13 dropped mantissa bits to even (a carry ripples into the exponent),
  // then rebias the exponent 127 -> 15.
  const uint32_t rounded = x + 0xfffu + ((x >> 13) & 1);
  return sign | uint16_t((rounded - (112u << 23)) >> 13);
}

uint16_t f32_to_bf16(float f) { return to_bf16(f).bits; }

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- reader --------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    data_ = std::exchange(o.data_, nullptr);
    // index_ holds views of the names' characters, which live on the heap (or, for short names,
    // inside the TensorInfo objects; a moved vector keeps its elements in place either way).
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_) munmap(const_cast<std::byte*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
  data_ = nullptr;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  using nlohmann::json;
  const std::string where = cat("safetensors file ", quote_path(path), ": ");
  SafetensorsFile f;
  f.path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ORIGAMI_CHECK(fd >= 0, "cannot open safetensors file ", quote_path(path), ": ", errno_text());
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(where, "not a regular file");
  }
  const uint64_t file_size = uint64_t(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(where, "file is ", file_size, " bytes, too short for the 8-byte header length");
  }
  void* m = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) fail(where, "cannot mmap: ", std::strerror(mmap_errno));
  f.map_ = static_cast<const std::byte*>(m);
  f.map_size_ = file_size;  // from here on, f's destructor unmaps on any throw

  uint64_t header_len = 0;
  std::memcpy(&header_len, f.map_, 8);
  ORIGAMI_CHECK(header_len <= max_header_bytes, where, "header length ", header_len,
                " exceeds the format's limit of ", max_header_bytes, " bytes");
  ORIGAMI_CHECK(header_len <= file_size - 8, where, "header length ", header_len,
                " runs past the end of the file (", file_size, " bytes)");
  const char* hdr = reinterpret_cast<const char*>(f.map_ + 8);
  ORIGAMI_CHECK(header_len > 0 && hdr[0] == '{', where, "header does not start with '{'");
  f.data_ = f.map_ + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  // A duplicate key would silently lose a tensor (the JSON library keeps the last one).
  std::string duplicate;
  std::unordered_set<std::string> seen;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  const int depth = json_depth(std::string_view(hdr, header_len));
  ORIGAMI_CHECK(depth <= kMaxJsonDepth, where, "header nests arrays and objects ", depth, " levels deep; origami reads at most ",
                kMaxJsonDepth);
  try {
    header = json::parse(hdr, hdr + header_len, on_event);
  } catch (const json::exception& e) {
    fail(where, "header is not valid JSON (", e.what(), ")");
  }
  ORIGAMI_CHECK(header.is_object(), where, "header is not a JSON object");
  ORIGAMI_CHECK(duplicate.empty(), where, "header names '", duplicate, "' twice");

  const JsonField fields(header, path);
  fields.for_each_member([&](const std::string& key, const JsonField& value) {
    if (key == "__metadata__") {
      value.for_each_member([&](const std::string& mk, const JsonField& mv) { f.metadata_[mk] = mv.string(); });
      return;
    }
    const std::string tw = cat(where, "tensor '", key, "': ");
    value.object();
    TensorInfo t;
    t.name = key;
    t.dtype = value["dtype"].string();
    const size_t elem = dtype_size_or_zero(t.dtype);
    ORIGAMI_CHECK(elem != 0, tw, "unknown dtype '", t.dtype, "'");
    t.shape = value["shape"].integers(0, JsonField::kNoLimit);
    const JsonField off = value["data_offsets"];
    off.array(2, 2);
    t.begin = uint64_t(off[0].integer(0, JsonField::kNoLimit));
    t.end = uint64_t(off[1].integer(0, JsonField::kNoLimit));
    ORIGAMI_CHECK(t.begin <= t.end, tw, "data_offsets ", off.got(), " end before they begin");
    ORIGAMI_CHECK(t.end <= data_size, tw, "data_offsets ", off.got(),
                  " run past the end of the data buffer (", data_size, " bytes)");
    uint64_t numel = 0, nbytes = 0;
    ORIGAMI_CHECK(checked_numel(t.shape, &numel) && !__builtin_mul_overflow(numel, elem, &nbytes) &&
                      numel <= uint64_t(INT64_MAX),
                  tw, "shape ", value["shape"].got(), " overflows");
    ORIGAMI_CHECK(t.end - t.begin == nbytes, tw, "data_offsets ", off.got(), " span ", t.end - t.begin,
                  " bytes but shape ", value["shape"].got(), " of ", t.dtype, " needs ", nbytes);
    f.tensors_.push_back(std::move(t));
  });

  // Like the reference: the byte ranges, in order, tile the data buffer exactly.
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : f.tensors_) {
    ORIGAMI_CHECK(t.begin >= expected, where, "tensor '", t.name, "' [", t.begin, ", ", t.end,
                  ") overlaps tensor '", prev ? prev->name : "", "' [", prev ? prev->begin : 0, ", ",
                  expected, ")");
    ORIGAMI_CHECK(t.begin == expected, where, "gap of ", t.begin - expected, " bytes before tensor '",
                  t.name, "' (data offsets must be contiguous)");
    expected = t.end;
    prev = &t;
  }
  ORIGAMI_CHECK(expected == data_size, where, "data buffer has ", data_size - expected,
                " bytes after the last tensor (data offsets must cover it exactly)");

  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::at(std::string_view name) const {
  const TensorInfo* t = find(name);
  ORIGAMI_CHECK(t, "safetensors file ", quote_path(path_), " has no tensor '", name, "'");
  return *t;
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& t) const {
  ORIGAMI_ASSERT(data_ && t.begin <= t.end && t.end <= map_size_ - uint64_t(data_ - map_));
  return {data_ + t.begin, size_t(t.end - t.begin)};
}

void SafetensorsFile::read_f32(const TensorInfo& t, float* out) const {
  const auto b = bytes(t);
  const size_t n = size_t(t.numel());
  const std::byte* p = b.data();  // may be unaligned: memcpy element by element
  if (t.dtype == "F32") {
    std::memcpy(out, p, n * 4);
  } else if (t.dtype == "F16" || t.dtype == "BF16") {
    const bool half = t.dtype == "F16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = half ? f16_to_f32(v) : bf16_to_f32(v);
    }
  } else if (t.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      out[i] = float(v);
    }
  } else {
    fail("safetensors file ", quote_path(path_), ": tensor '", t.name, "' has dtype ", t.dtype,
         ", which cannot be read as float (F32, F16, BF16 or F64)");
  }
}

void SafetensorsFile::read_i32(const TensorInfo& t, int32_t* out) const {
  const auto b = bytes(t);
  const size_t n = size_t(t.numel());
  const std::byte* p = b.data();
  if (t.dtype == "I32") {
    std::memcpy(out, p, n * 4);
  } else if (t.dtype == "I64") {
    for (size_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      ORIGAMI_CHECK(v >= INT32_MIN && v <= INT32_MAX, "safetensors file ", quote_path(path_), ": tensor '",
                    t.name, "' element ", i, " = ", v, " does not fit in int32");
      out[i] = int32_t(v);
    }
  } else {
    fail("safetensors file ", quote_path(path_), ": tensor '", t.name, "' has dtype ", t.dtype,
         ", which cannot be read as int32 (I32 or I64)");
  }
}

// ---- writer --------------------------------------------------------------------------------

namespace {

// Owns the temporary file: closes it and, unless committed, removes it.
struct TmpFile {
  std::string path;
  int fd = -1;
  bool committed = false;
  Checksum sum;         // of every byte written
  uint64_t written = 0;
  ~TmpFile() {
    if (fd >= 0) ::close(fd);
    if (!committed) ::unlink(path.c_str());
  }
};

void write_all(TmpFile& tmp, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  tmp.sum.update(data, len);
  tmp.written += len;
  while (len > 0) {
    const ssize_t w = ::write(tmp.fd, p, std::min<size_t>(len, size_t(1) << 28));
    progress_alive();  // (origami launch's watchdog: a slow disk is not a hang)
    if (w < 0 && errno == EINTR) continue;
    ORIGAMI_CHECK(w > 0, "cannot write safetensors file ", quote_path(tmp.path), ": ",
                  w < 0 ? errno_text() : std::string("no progress"));
    p += w;
    len -= size_t(w);
  }
}

// Writes n floats as 16-bit elements through a 64 KiB buffer, converted chunk by chunk by
// convert(out, in, m). BF16 takes the vectorised conversion of kernels/cpu/bf16.h.
template <typename Elem, typename Convert>
void write_converted(TmpFile& tmp, const float* data, size_t n, Convert convert) {
  static_assert(sizeof(Elem) == 2);
  constexpr size_t chunk = size_t(1) << 15;
  std::vector<Elem> buf(std::min(n, chunk));
  for (size_t s = 0; s < n; s += chunk) {
    const size_t m = std::min(chunk, n - s);
    convert(buf.data(), data + s, m);
    write_all(tmp, buf.data(), m * 2);
  }
}

}  // namespace

WrittenFile write_safetensors(const std::string& path, const std::vector<TensorWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string where = cat("writing safetensors file ", quote_path(path), ": ");
  ORIGAMI_CHECK(!path.empty(), "writing safetensors file: empty path");

  // Validate everything and lay out the header before touching the disk.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header["__metadata__"];
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  std::unordered_set<std::string_view> names;
  std::vector<uint64_t> numels;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::string tw = cat(where, "tensor '", t.name, "': ");
    ORIGAMI_CHECK(!t.name.empty(), where, "a tensor has an empty name");
    ORIGAMI_CHECK(t.name != "__metadata__", tw, "the name is reserved for metadata");
    ORIGAMI_CHECK(names.insert(t.name).second, tw, "the name appears twice");
    ORIGAMI_CHECK(t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16" || t.dtype == "I32", tw,
                  "dtype '", t.dtype, "' cannot be written (F32, F16, BF16 or I32)");
    uint64_t numel = 0;
    ORIGAMI_CHECK(checked_numel(t.shape, &numel) && numel <= (uint64_t(1) << 60), tw,
                  "shape has a negative or too large dimension");
    const bool is_int = t.dtype == "I32";
    ORIGAMI_CHECK(numel == 0 || (is_int ? t.data_i32 != nullptr : t.data != nullptr), tw,
                  "no data pointer for ", is_int ? "data_i32" : "data", " (dtype ", t.dtype, ")");
    const uint64_t nbytes = numel * dtype_size_or_zero(t.dtype);
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    numels.push_back(numel);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail(where, "a tensor name or metadata string is not valid UTF-8 (", e.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data buffer 8-byte aligned
  const uint64_t header_len = text.size();

  TmpFile tmp;
  tmp.path = path + ".tmp";
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp.fd < 0) {
    tmp.committed = true;  // nothing of ours to remove
    fail("cannot create safetensors file ", quote_path(tmp.path), ": ", errno_text());
  }
  write_all(tmp, &header_len, 8);
  write_all(tmp, text.data(), text.size());

  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const size_t n = size_t(numels[i]);
    if (n == 0) continue;
    if (t.dtype == "F32") {
      write_all(tmp, t.data, n * 4);
    } else if (t.dtype == "I32") {
      write_all(tmp, t.data_i32, n * 4);
    } else if (t.dtype == "BF16") {
      write_converted<bf16>(tmp, t.data, n, [](bf16* out, const float* in, size_t m) { to_bf16(out, in, int64_t(m)); });
    } else {
      write_converted<uint16_t>(tmp, t.data, n, [](uint16_t* out, const float* in, size_t m) {
        for (size_t j = 0; j < m; ++j) out[j] = f32_to_f16(in[j]);
      });
    }
  }
  // Flush to disk before the rename, so that after a crash `path` is never a partial file.
  ORIGAMI_CHECK(::fsync(tmp.fd) == 0 || errno == EINVAL, "cannot flush safetensors file ",
                quote_path(tmp.path), ": ", errno_text());
  const int fd = std::exchange(tmp.fd, -1);
  ORIGAMI_CHECK(::close(fd) == 0, "cannot close safetensors file ", quote_path(tmp.path), ": ", errno_text());
  ORIGAMI_CHECK(::rename(tmp.path.c_str(), path.c_str()) == 0, "cannot rename ", quote_path(tmp.path),
                " to ", quote_path(path), ": ", errno_text());
  tmp.committed = true;
  sync_dir(std::filesystem::path(path).parent_path().string());  // the rename itself durable
  return {tmp.written, tmp.sum.hex()};
}

}  // namespace origami
