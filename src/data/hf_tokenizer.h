// HfTokenizer: a Hugging Face `tokenizers` file (the Hub's tokenizer.json) with a BPE model, giving
// the ids of the library's `Tokenizer.encode(text)` (add_special_tokens=True).
//
// Implemented, as the library does them (anything else is an Error naming the component):
//   added_tokens   matched in the text first, leftmost-longest, with their single_word / lstrip /
//                  rstrip flags; "normalized" ones are matched in the normalized text
//   normalizer     NFC, NFD, NFKC, NFKD (ICU), Prepend, Replace (string pattern), Sequence
//   pre_tokenizer  Split (regex through PCRE2, or string; every behavior; invert), ByteLevel (last
//                  step; its GPT-2 regex by hand), Metaspace, Sequence
//   model          BPE: merges as "a b" or [a, b], byte_fallback, unk_token, fuse_unk, ignore_merges
//   post_processor TemplateProcessing (single template), RobertaProcessing, BertProcessing, ByteLevel,
//                  Sequence
//   decoder        ByteLevel, Replace (string), ByteFallback, Fuse, Strip, Metaspace, Sequence
//
// The end-of-document token is a token of the file chosen by the caller (see default_eod_token).
// JSON form: {"type":"huggingface","eod_token":TEXT,"tokenizer":{the Hugging Face file, verbatim}}.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace origami {

class HfRegex;  // a compiled PCRE2 pattern (hf_tokenizer.cpp)

class HfTokenizer final : public Tokenizer {
 public:
  // hf: the parsed Hugging Face file (its file and path name it in error messages); eod_token: the
  // text of a token of it.
  HfTokenizer(const JsonField& hf, const std::string& eod_token);
  ~HfTokenizer() override;

  // The end-of-document token when none is given: the eos_token of a tokenizer_config.json in
  // config_dir (if config_dir is not empty and has one), else the first of <|endoftext|>,
  // <|end_of_text|>, </s> that is an added token of the file, else the first in its model's
  // vocabulary, else an Error asking for --eod-token.
  static std::string default_eod_token(const nlohmann::json& hf, const std::string& config_dir,
                                       const std::string& source);

  // Thread-safe: the piece cache is per thread, PCRE2 match data per thread.
  std::vector<int32_t> encode(std::string_view text) const override;
  std::vector<int32_t> encode_to_continue(std::string_view text) const override;
  // Each token's text through the decoder's per-token steps, concatenated (no leading-space strip,
  // invalid UTF-8 kept as bytes): the form `generate` prints token by token.
  std::string decode(std::span<const int32_t> ids) const override;
  // The library's `decode(ids, skip_special_tokens=skip_special)`.
  std::string decode_text(std::span<const int32_t> ids, bool skip_special = false) const override;
  int32_t vocab_size() const override { return int32_t(id_token_.size()); }
  bool has_token(int32_t id) const override { return id >= 0 && id < vocab_size() && id_valid_[size_t(id)]; }
  int32_t eod() const override { return eod_; }
  std::string name() const override { return "huggingface-bpe"; }
  nlohmann::json to_json() const override;
  // The id of a token's text (an added token first, then the model's vocabulary), or -1.
  int32_t token_to_id(std::string_view token) const;

 private:
  struct AddedToken {
    std::string content;
    int32_t id;
    bool single_word, lstrip, rstrip, normalized, special;
  };
  // Added tokens matched in text, leftmost-longest (the library's Aho-Corasick match kind).
  struct Matcher {
    std::vector<std::pair<std::string, int>> patterns;  // (text, index into added_)
    std::array<std::vector<int>, 256> by_first_byte;    // indices into patterns, longest first
    bool empty() const { return patterns.empty(); }
  };
  struct NormStep;
  struct PreStep;
  struct DecStep;
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  // Construction, one part of the file each, every field read by its type (core/json_fields.h). The
  // factories build one step of a component (a Sequence is flattened by the caller).
  int32_t read_bpe_model(const JsonField& model);  // the largest id, or -1
  void read_bpe_merges(const JsonField& merges);
  void read_added_tokens(const JsonField& hf);
  static NormStep make_normalizer(const JsonField& step);
  static PreStep make_pre_tokenizer(const JsonField& step, bool last);
  void find_model_symbols();  // unit_id_ and safe_split_, once vocab_ and byte_level_ are known
  void build_id_tables(int32_t max_id, const std::string& source);
  void read_post_processor(const JsonField& hf);
  static DecStep make_decoder(const JsonField& step);
  void build_id_bytes();
  void build_matcher(Matcher& m, bool normalized);
  // Splits `text` at the matches of `m`: calls on_text(start, end) and on_token(id) in order.
  template <typename OnText, typename OnToken>
  void split_added(const Matcher& m, std::string_view text, OnText&& on_text, OnToken&& on_token) const;
  void normalize(std::string& s) const;
  template <typename Emit>
  void pretokenize(size_t step, std::string_view piece, bool at_start, Emit& emit) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;  // model, with cache
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;     // model, no cache
  std::vector<std::string> run_decoder(std::vector<std::string> tokens, bool streaming) const;

  nlohmann::json hf_;  // the file, for to_json
  std::string eod_token_;
  int32_t eod_ = -1;
  std::vector<AddedToken> added_;
  Matcher raw_matcher_, normalized_matcher_;
  std::vector<NormStep> norm_;
  std::vector<PreStep> pre_;
  std::vector<DecStep> dec_;
  bool has_decoder_ = false;
  bool byte_level_ = false;  // the pre-tokenizer ends in ByteLevel: words reach the model as raw bytes
  // Model.
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_;
  BpeMerges merges_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int32_t unk_id_ = -1;
  std::array<int32_t, 256> unit_id_{};           // byte-level: each byte's symbol; else ASCII chars
  std::array<int32_t, 256> byte_fallback_id_{};  // <0xNN>
  std::string safe_split_;  // a symbol no merge joins to a different character before it ("▁"), or ""
  PieceCache cache_;
  // Post-processor (single sequence) and decoding.
  std::vector<int32_t> prefix_ids_, suffix_ids_;
  std::vector<std::string> id_token_;  // id -> token text ("" and !id_valid_: no token)
  std::vector<bool> id_valid_, id_special_;
  std::vector<std::string> id_bytes_;  // id -> decode() bytes
};

}  // namespace origami
