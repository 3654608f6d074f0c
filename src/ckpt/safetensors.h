// Hugging Face safetensors files: a memory-mapped reader and an atomic writer.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian unsigned header
// length N, N bytes of UTF-8 JSON, then the data buffer. The JSON maps each tensor name to
// {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} (offsets relative to the start
// of the data buffer, i.e. to byte 8 + N of the file), plus an optional "__metadata__" entry
// mapping strings to strings. Data is little-endian and row-major.
//
// The reader accepts exactly what the reference implementation (safetensors 0.4) accepts:
// every tensor's byte range has size numel x dtype size, the ranges tile the data buffer with
// no gap and no overlap, and the buffer ends where the file ends. Anything else throws
// origami::Error naming the file (and the tensor) and the rule broken.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace origami {

// Bytes per element of a safetensors dtype ("F32", "BF16", "I64", ...); throws for unknown ones.
// Known: BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 I64 U64 F64.
size_t safetensors_dtype_size(std::string_view dtype);

// Exact conversions between float and the 16-bit float formats. float -> 16 bits rounds to
// nearest even (as PyTorch does); overflow gives infinity; NaN stays NaN. The BF16 ones are
// kernels/cpu/bf16.h's to_bf16 / to_float.
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t b);
uint16_t f32_to_f16(float f);
uint16_t f32_to_bf16(float f);

struct TensorInfo {
  std::string name;
  std::string dtype;           // as in the file: "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;  // [] is a scalar (one element); a 0 anywhere means no elements
  uint64_t begin = 0, end = 0;  // byte range in the data buffer (not the file)
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps the file read-only and validates the header; throws origami::Error on any problem.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // In data-offset order (the order of the bytes in the file).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if there is no tensor of that name.
  const TensorInfo* find(std::string_view name) const;
  // Like find, but throws origami::Error naming the file and the tensor if it is missing.
  const TensorInfo& at(std::string_view name) const;
  // The "__metadata__" entry (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's raw little-endian bytes, valid while this object lives.
  std::span<const std::byte> bytes(const TensorInfo& t) const;
  // Converts F32, F16, BF16 or F64 into out[0 .. t.numel()); other dtypes throw.
  void read_f32(const TensorInfo& t, float* out) const;
  // Converts I32 or I64 (values must fit in int32) into out[0 .. t.numel()); others throw.
  void read_i32(const TensorInfo& t, int32_t* out) const;

 private:
  SafetensorsFile() = default;
  void release() noexcept;

  std::string path_;
  const std::byte* map_ = nullptr;  // whole file, mmap'ed
  size_t map_size_ = 0;
  const std::byte* data_ = nullptr;  // start of the data buffer inside map_
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, size_t> index_;  // views into tensors_[i].name
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. Values come from `data` (floats) and are stored as `dtype`: "F32", or
// "F16"/"BF16" (rounded to nearest even on the way out; BF16 by kernels/cpu/bf16.h's vectorised
// conversion); or, with dtype "I32", from `data_i32`.
// The pointer may be null only when the tensor has no elements.
struct TensorWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
  std::string dtype = "F32";
  const int32_t* data_i32 = nullptr;
};

// Writes a safetensors file with the tensors' bytes in the order given. The bytes go to
// path + ".tmp", are flushed to disk, and the file is then renamed to `path`, so `path` is
// either absent/unchanged or complete. The header is padded with spaces to a multiple of 8
// bytes (as the reference writer does), which keeps the data buffer 8-byte aligned.
// Throws origami::Error naming the path on bad input (duplicate or empty name, negative dim,
// unsupported dtype, null data) and on any I/O failure (missing directory, disk full, ...).
// Returns the file's size and the checksum (core/checksum.h) of its bytes, computed as they are written.
struct WrittenFile {
  uint64_t bytes = 0;
  std::string checksum;
};
WrittenFile write_safetensors(const std::string& path, const std::vector<TensorWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace origami
