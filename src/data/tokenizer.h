// Tokenizers: text <-> token ids.
//
//   ByteTokenizer     ids 0..255 are the bytes of the text, 256 is end-of-document; vocab 257.
//   Gpt2BpeTokenizer  GPT-2 byte-level BPE from Hugging Face `vocab.json` + `merges.txt` (what the
//                     `tokenizers` ByteLevel BPE `model.save()` writes, and what GPT-2 ships). Gives
//                     the same ids as Hugging Face `tokenizers` (ByteLevel pre-tokenizer with
//                     add_prefix_space=false, no normalizer) with `<|endoftext|>` as special token.
//   HfTokenizer       a Hugging Face `tokenizers` file (the Hub's tokenizer.json) with a BPE model:
//                     GPT-2, Llama-3/Qwen2 and Llama-2/Mixtral families (data/hf_tokenizer.h).
//
// A tokenizer has a self-contained JSON form, {"type":"byte"},
// {"type":"gpt2","vocab":{token:id,...},"merges":["a b",...]} or
// {"type":"huggingface","eod_token":"</s>","tokenizer":{the Hugging Face file}}. `origami data prepare` writes it as
// PREFIX.tokenizer.json next to the dataset; training copies it into checkpoints so that
// `origami generate` decodes with the tokenizer the data was made with.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/json_fields.h"
#include "data/bpe.h"

namespace origami {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The ids a continuation follows (generate's prompt): encode's without a post-processor's closing
  // tokens (a template "<s> $A </s>" would end the prompt as a document).
  virtual std::vector<int32_t> encode_to_continue(std::string_view text) const { return encode(text); }
  // Bytes of the tokens, concatenated (may be invalid UTF-8 when a multi-byte character is cut).
  // An id outside [0, vocab_size()) or with no token is an Error naming it.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // The text of a whole sequence, as the tokenizer's own library decodes it: for a Hugging Face file
  // its decoder (which may strip a leading space, or turn invalid UTF-8 into U+FFFD); skip_special
  // drops special tokens (the library's skip_special_tokens). Default: decode(), eod dropped when
  // skip_special.
  virtual std::string decode_text(std::span<const int32_t> ids, bool skip_special = false) const;
  virtual int32_t vocab_size() const = 0;  // one past the largest id
  // Whether `id` has a token (a vocabulary may skip ids; decode refuses those).
  virtual bool has_token(int32_t id) const { return id >= 0 && id < vocab_size(); }
  virtual int32_t eod() const = 0;         // end-of-document id, appended after each document
  virtual std::string name() const = 0;    // "byte", "gpt2" or "huggingface-bpe", for messages
  virtual nlohmann::json to_json() const = 0;
};

// Refuses a vocabulary whose largest id is far above its number of tokens (`tokens`), whose dense
// id-to-token tables would take gigabytes for a small file.
void check_id_density(int64_t max_id, size_t tokens, const std::string& source);

// Bytes as tokens, and the text "<|endoftext|>" as the end-of-document token (256) both ways.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return 257; }
  int32_t eod() const override { return 256; }
  std::string name() const override { return "byte"; }
  nlohmann::json to_json() const override;
};

// GPT-2 pre-tokenization: splits text into the pieces matched, left to right, by
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// implemented by hand over UTF-8 code points (classes in data/unicode_classes.h cover all of
// Unicode). Bytes that are not valid UTF-8 count, one each, as [^\s\p{L}\p{N}]. The pieces are
// views into `text` and concatenate to it.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// GPT-2's reversible byte -> printable code point map (bytes that are printable Latin-1 map to
// themselves, the rest to U+0100 onwards), as used by byte-level BPE vocabularies.
const std::array<char32_t, 256>& gpt2_byte_to_unicode();

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  // vocab: token (in byte-level alphabet) -> id; merges in rank order. `source` names where they
  // came from, for error messages. Errors: a byte symbol or merge result missing from the vocab,
  // duplicate ids, no "<|endoftext|>" token.
  Gpt2BpeTokenizer(const std::vector<std::pair<std::string, int32_t>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, const std::string& source);
  // Loads Hugging Face vocab.json + merges.txt (a first line "#version: ..." is skipped).
  static std::unique_ptr<Gpt2BpeTokenizer> from_files(const std::string& vocab_json_path,
                                                      const std::string& merges_txt_path);

  // Literal "<|endoftext|>" in the text becomes eod (as Hugging Face does for a special token);
  // everything else is pre-tokenized and BPE-merged by rank. Thread-safe (the word cache is per thread).
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return int32_t(id_bytes_.size()); }
  bool has_token(int32_t id) const override { return id >= 0 && id < vocab_size() && id_valid_[size_t(id)]; }
  int32_t eod() const override { return eod_; }
  std::string name() const override { return "gpt2"; }
  nlohmann::json to_json() const override;
  int64_t num_merges() const { return int64_t(merge_list_.size()); }

 private:
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;  // no cache
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;    // pre-tokenize + cache

  std::vector<std::pair<std::string, int32_t>> vocab_;              // as given, for to_json
  std::vector<std::pair<std::string, std::string>> merge_list_;     // as given, for to_json
  std::vector<std::string> id_bytes_;                               // id -> decoded bytes
  std::vector<bool> id_valid_;                                      // ids that have a token
  std::array<int32_t, 256> byte_id_{};                              // byte -> id of its symbol
  BpeMerges merges_;
  int32_t eod_ = -1;
  PieceCache cache_;  // encoded pieces, per thread
};

// BPE merges: an array of "a b" strings or ["a", "b"] pairs.
std::vector<std::pair<std::string, std::string>> parse_merges(const JsonField& merges);

// Builds a tokenizer from its JSON form (or from a plain Hugging Face tokenizer.json: no "type",
// a "model" object); `source` names it in error messages. A non-empty eod_token chooses the
// end-of-document token of a Hugging Face tokenizer (an Error for the other types).
std::unique_ptr<Tokenizer> tokenizer_from_json(const nlohmann::json& j,
                                               const std::string& source = "tokenizer JSON",
                                               const std::string& eod_token = "");
// As tokenizer_from_json; for a plain Hugging Face file the default end-of-document token may
// come from a tokenizer_config.json beside it (see HfTokenizer::default_eod_token).
std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path, const std::string& eod_token = "");
// A tokenizer file in the Hub's form (what `transformers` and `tokenizers` load): a huggingface
// file's inner Hub file; the byte and gpt2 tokenizers as the byte-level BPE they are (the byte one
// without merges or word splitting), "<|endoftext|>" a special token; any other JSON as it is. Equal
// for a dataset's tokenizer file and the tokenizer.json of its run's export: the same token ids.
nlohmann::json hub_tokenizer(const nlohmann::json& file);
// Whether a checkpoint's tokenizer.json was made from a dataset's tokenizer file: the same file (the
// end-of-document choice included), or for a Hugging Face export (a Hub file) the dataset's Hub form.
bool same_tokenizer_file(const nlohmann::json& checkpoint_file, const nlohmann::json& dataset_file);
// The tokenizer files of a Hugging Face model export, from origami's tokenizer file at `path`:
// tokenizer.json, hub_tokenizer of it; and tokenizer_config.json where origami's file names the
// end-of-document token (a huggingface file's chosen one, "<|endoftext|>" for byte and gpt2), else
// "": the Hub file alone does not say which token ends a document, and `generate`
// (HfTokenizer::default_eod_token) and transformers' AutoTokenizer read it there.
struct HfExportTokenizer {
  std::string tokenizer_json, tokenizer_config;
};
HfExportTokenizer tokenizer_files_for_hf_export(const std::string& path);
void save_tokenizer_file(const Tokenizer& tokenizer, const std::string& path);  // atomic
std::string tokenizer_file_text(const Tokenizer& tokenizer);                     // what it writes

}  // namespace origami
