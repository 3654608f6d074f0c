// Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py, the "mmap" format),
// byte-compatible in both directions: Megatron reads what IndexedDatasetWriter writes, and
// IndexedDataset reads what Megatron's IndexedDatasetBuilder writes (uint16 or int32 tokens).
//
//   PREFIX.bin  the tokens of all sequences back to back, little-endian, in the index's dtype.
//   PREFIX.idx  (all little-endian, packed)
//     offset 0   char[9]  "MMIDIDX\0\0"
//            9   u64      version = 1
//           17   u8       dtype code (8 = uint16, 4 = int32; Megatron also defines 1 uint8,
//                         2 int8, 3 int16, 5 int64, 6 float64, 7 float32, which we do not read)
//           18   u64      S = sequence count
//           26   u64      D = document-index count
//           34   int32    sequence_lengths[S]   (tokens)
//                int64    sequence_pointers[S]  (byte offset of each sequence in .bin)
//                int64    document_indices[D]   (sequence index where each document starts,
//                                                then S: D = documents + 1, first 0, last S)
// Here every document is one sequence, so document_indices = 0, 1, ..., S.
#pragma once
#include <cstdint>
#include <cstdio>
#include <span>
#include <map>
#include <string>
#include <vector>

namespace origami {

enum class TokenDtype : uint8_t { int32 = 4, uint16 = 8 };  // values are Megatron's dtype codes

// uint16 when every id < vocab_size fits (vocab_size <= 65535), else int32.
TokenDtype token_dtype_for_vocab(int64_t vocab_size);
int token_dtype_size(TokenDtype dtype);
const char* token_dtype_name(TokenDtype dtype);

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr uint64_t kIndexVersion = 1;
constexpr uint64_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Writes PREFIX.bin and PREFIX.idx. Data goes to PREFIX.bin.tmp / PREFIX.idx.tmp, renamed into
// place by finish(); a writer destroyed before finish() removes its temp files, leaving any
// previous dataset at PREFIX untouched.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, TokenDtype dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one document (one sequence). A token outside the dtype's range is an Error.
  void add_document(std::span<const int32_t> tokens);
  // Writes the index and the companion files (suffix -> contents: ".tokenizer.json") and renames
  // them into place after an older dataset's index is removed: the companions, then PREFIX.bin, and
  // PREFIX.idx last, so an index is never beside another dataset's .bin or companion, and a dataset
  // with an index has its companions.
  void finish(const std::map<std::string, std::string>& companions = {});

  uint64_t num_documents() const { return sequence_lengths_.size(); }
  uint64_t num_tokens() const { return num_tokens_; }

 private:
  std::string prefix_, bin_tmp_, idx_tmp_;
  std::vector<std::string> companion_tmps_;  // removed with the others when finish() does not end
  TokenDtype dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> sequence_lengths_;
  uint64_t num_tokens_ = 0;
  bool finished_ = false;
  std::vector<unsigned char> buffer_;  // one document converted to the dtype
};

// A read-only view of PREFIX.bin / PREFIX.idx, both memory-mapped. open() validates the whole
// index (magic, version, dtype, counts against the file size, document indices, every sequence
// inside .bin) and throws an Error naming the file and what is wrong.
class IndexedDataset {
 public:
  static IndexedDataset open(const std::string& prefix);
  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  TokenDtype dtype() const { return dtype_; }
  uint64_t num_sequences() const { return num_sequences_; }
  uint64_t num_documents() const { return num_doc_indices_ - 1; }  // D - 1
  uint64_t num_tokens() const { return token_offsets_.back(); }
  int32_t sequence_length(uint64_t i) const;
  int64_t sequence_pointer(uint64_t i) const;
  int64_t document_index(uint64_t i) const;  // i in [0, D)
  uint64_t sequence_offset(uint64_t i) const { return token_offsets_[i]; }  // first token of sequence i in [0, S]

  // Tokens [first, first + count) of the concatenation of all sequences, in order.
  void read_tokens(uint64_t first, uint64_t count, int32_t* out) const;

 private:
  IndexedDataset() = default;
  void release();

  std::string prefix_;
  TokenDtype dtype_ = TokenDtype::int32;
  uint64_t num_sequences_ = 0, num_doc_indices_ = 0;
  const unsigned char* idx_ = nullptr;
  size_t idx_size_ = 0;
  const unsigned char* bin_ = nullptr;
  size_t bin_size_ = 0;
  std::vector<uint64_t> token_offsets_{0};  // [S + 1]: first token of each sequence, then total
};

}  // namespace origami
