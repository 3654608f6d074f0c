#include "data/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/files.h"
#include "core/json_fields.h"
#include "data/hf_tokenizer.h"

namespace origami {

namespace {

constexpr std::string_view kEndOfText = "<|endoftext|>";

}  // namespace

const std::array<char32_t, 256>& gpt2_byte_to_unicode() {
  static const std::array<char32_t, 256> map = [] {
    std::array<char32_t, 256> m{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      m[b] = printable ? char32_t(b) : next++;
    }
    return m;
  }();
  return map;
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_gpt2_piece(text, [&](std::string_view p) { pieces.push_back(p); });
  return pieces;
}

void check_id_density(int64_t max_id, size_t tokens, const std::string& source) {
  const int64_t limit = 4 * int64_t(tokens) + 65536;
  ORIGAMI_CHECK(max_id < limit, source, ": the largest token id, ", max_id, ", is far beyond the ", tokens,
                " tokens the file defines (a vocabulary's ids run from 0 with few gaps; the id tables have an "
                "entry for every id up to the largest, so it must be below 4 x tokens + 65536 = ", limit, ")");
}

// ---------------------------------------------------------------------------------------------
// ByteTokenizer

// A literal "<|endoftext|>" in the text is the end-of-document token, as in the gpt2 tokenizer and in
// the Hub file `ckpt export --hf` writes for this one (where it is an added token, which the library
// matches in any text): the export encodes a text to the ids training read.
std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, kEndOfText.size(), kEndOfText) == 0) {
      ids.push_back(eod());
      i += kEndOfText.size();
    } else {
      ids.push_back(int32_t(static_cast<unsigned char>(text[i++])));
    }
  }
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    ORIGAMI_CHECK(id >= 0 && id <= 256, "byte tokenizer: token id ", id, " is outside [0, 257)");
    if (id == 256) out += kEndOfText;
    else out += char(id);
  }
  return out;
}

nlohmann::json ByteTokenizer::to_json() const { return {{"type", "byte"}}; }

// ---------------------------------------------------------------------------------------------
// Gpt2BpeTokenizer

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::vector<std::pair<std::string, int32_t>>& vocab,
                                   const std::vector<std::pair<std::string, std::string>>& merges,
                                   const std::string& source)
    : vocab_(vocab), merge_list_(merges) {
  ORIGAMI_CHECK(!vocab.empty(), source, ": the vocabulary is empty");
  std::unordered_map<std::string_view, int32_t> token_to_id;
  token_to_id.reserve(vocab.size());
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab) {
    ORIGAMI_CHECK(id >= 0, source, ": token '", token, "' has negative id ", id);
    ORIGAMI_CHECK(token_to_id.emplace(token, id).second, source, ": token '", token, "' appears twice");
    max_id = std::max(max_id, id);
  }
  ORIGAMI_CHECK(max_id < (1 << 28), source, ": token id ", max_id, " is implausibly large (limit 2^28)");
  check_id_density(max_id, vocab.size(), source);
  id_bytes_.assign(size_t(max_id) + 1, {});
  id_valid_.assign(size_t(max_id) + 1, false);

  // Inverse byte map: code point -> byte, to turn token strings back into bytes.
  std::unordered_map<char32_t, unsigned char> unicode_to_byte;
  for (int b = 0; b < 256; ++b) unicode_to_byte[gpt2_byte_to_unicode()[b]] = (unsigned char)b;
  for (const auto& [token, id] : vocab) {
    ORIGAMI_CHECK(!id_valid_[id], source, ": id ", id, " is given to two tokens");
    id_valid_[id] = true;
    std::string bytes;
    for (size_t p = 0; p < token.size();) {
      char32_t cp;
      int len = next_code_point(token, p, cp);
      auto it = unicode_to_byte.find(cp);
      // Tokens outside the byte-level alphabet (added special tokens) decode to their own text.
      if (it != unicode_to_byte.end() && token != kEndOfText) bytes += char(it->second);
      else bytes.append(token, p, size_t(len));
      p += size_t(len);
    }
    id_bytes_[id] = std::move(bytes);
  }

  const auto& symbols = byte_level_symbols();
  for (int b = 0; b < 256; ++b) {
    auto it = token_to_id.find(symbols[b]);
    ORIGAMI_CHECK(it != token_to_id.end(), source, ": byte-level symbol '", symbols[b], "' (byte ", b,
                  ") is missing; a GPT-2 byte-level vocabulary holds all 256 byte symbols");
    byte_id_[b] = it->second;
  }

  merges_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = token_to_id.find(a), ib = token_to_id.find(b);
    std::string ab = a + b;
    auto iab = token_to_id.find(ab);
    ORIGAMI_CHECK(ia != token_to_id.end() && ib != token_to_id.end() && iab != token_to_id.end(), source,
                  ": merge ", rank + 1, " '", a, " ", b, "' uses a token missing from the vocabulary ('",
                  ia == token_to_id.end() ? a : ib == token_to_id.end() ? b : ab, "')");
    merges_.add(ia->second, ib->second, iab->second);
  }

  auto eod = token_to_id.find(kEndOfText);
  ORIGAMI_CHECK(eod != token_to_id.end(), source, ": the vocabulary has no '", kEndOfText,
                "' token, which marks the end of each document");
  eod_ = eod->second;
}

namespace {

// A BPE vocabulary {token: id, ...}: ids in [0, 2^28).
std::vector<std::pair<std::string, int32_t>> read_vocab(const JsonField& vocab_field) {
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(vocab_field.object().json().size());
  vocab_field.for_each_member([&](const std::string& token, const JsonField& id) {
    vocab.emplace_back(token, int32_t(id.integer(0, (1 << 28) - 1)));
  });
  return vocab;
}

}  // namespace

std::unique_ptr<Gpt2BpeTokenizer> Gpt2BpeTokenizer::from_files(const std::string& vocab_json_path,
                                                               const std::string& merges_txt_path) {
  const nlohmann::json vj = parse_json_file(vocab_json_path);
  const std::vector<std::pair<std::string, int32_t>> vocab = read_vocab(JsonField(vj, vocab_json_path));

  std::string text = read_file_bytes(merges_txt_path);
  std::vector<std::pair<std::string, std::string>> merges;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    size_t sp = line.find(' ');
    ORIGAMI_CHECK(sp != std::string_view::npos && sp > 0 && sp + 1 < line.size() &&
                      line.find(' ', sp + 1) == std::string_view::npos,
                  merges_txt_path, ":", line_no, ": a merge line must be two tokens separated by one space, got '",
                  line, "'");
    merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
  }
  return std::make_unique<Gpt2BpeTokenizer>(vocab, merges, vocab_json_path + " + " + merges_txt_path);
}

// BPE of one pre-tokenized piece: its bytes' symbols, merged by rank.
void Gpt2BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  size_t begin = out.size();
  for (char c : piece) out.push_back(byte_id_[(unsigned char)c]);
  merges_.apply(out, begin);
}

void Gpt2BpeTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  for_each_gpt2_piece(text, [&](std::string_view piece) {
    if (piece.size() == 1) out.push_back(byte_id_[(unsigned char)piece[0]]);
    else cache_.encode(piece, out, [&](std::string_view p, std::vector<int32_t>& o) { encode_piece(p, o); });
  });
}

std::vector<int32_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  // Special token first: the text between literal "<|endoftext|>"s is encoded separately.
  for (size_t pos = 0;;) {
    size_t hit = text.find(kEndOfText, pos);
    encode_text(text.substr(pos, hit == std::string_view::npos ? std::string_view::npos : hit - pos), out);
    if (hit == std::string_view::npos) break;
    out.push_back(eod_);
    pos = hit + kEndOfText.size();
  }
  return out;
}

std::string Gpt2BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    ORIGAMI_CHECK(id >= 0 && id < vocab_size() && id_valid_[id], "gpt2 tokenizer: token id ", id,
                  " is not in the vocabulary (size ", vocab_size(), ")");
    out += id_bytes_[id];
  }
  return out;
}

nlohmann::json Gpt2BpeTokenizer::to_json() const {
  nlohmann::json vocab = nlohmann::json::object();
  for (const auto& [token, id] : vocab_) vocab[token] = id;
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [a, b] : merge_list_) merges.push_back(a + " " + b);
  return {{"type", "gpt2"}, {"vocab", std::move(vocab)}, {"merges", std::move(merges)}};
}

// ---------------------------------------------------------------------------------------------
// JSON form and files

std::string Tokenizer::decode_text(std::span<const int32_t> ids, bool skip_special) const {
  if (!skip_special) return decode(ids);
  std::vector<int32_t> kept;
  for (int32_t id : ids)
    if (id != eod()) kept.push_back(id);
  return decode(kept);
}

namespace {

// A plain Hugging Face tokenizer.json: no origami "type", a "model" object.
bool is_plain_hf_file(const nlohmann::json& j) {
  return j.is_object() && !j.contains("type") && j.contains("model") && j["model"].is_object();
}

std::unique_ptr<Tokenizer> from_json(const nlohmann::json& j, const std::string& source, const std::string& eod_token,
                                     const std::string& config_dir) {
  if (is_plain_hf_file(j)) {
    std::string eod = eod_token.empty() ? HfTokenizer::default_eod_token(j, config_dir, source) : eod_token;
    return std::make_unique<HfTokenizer>(JsonField(j, source), eod);
  }
  ORIGAMI_CHECK(j.is_object() && j.contains("type"), source,
                ": a tokenizer must be a JSON object with a string \"type\" (\"byte\", \"gpt2\" or "
                "\"huggingface\") or a Hugging Face tokenizer.json (with a \"model\" object)");
  const JsonField f(j, source);
  const std::string& type = f["type"].string();
  if (type == "huggingface") {
    f["tokenizer"].object();  // the Hugging Face tokenizer.json
    const std::string eod = eod_token.empty() ? f["eod_token"].string() : eod_token;
    return std::make_unique<HfTokenizer>(f["tokenizer"], eod);
  }
  ORIGAMI_CHECK(eod_token.empty(), source, ": --eod-token applies to Hugging Face tokenizer files only, not to a '",
                type, "' tokenizer (its end-of-document token is fixed)");
  if (type == "byte") return std::make_unique<ByteTokenizer>();
  ORIGAMI_CHECK(type == "gpt2", source, ": unknown tokenizer type '", type, "' (known: byte, gpt2, huggingface)");
  return std::make_unique<Gpt2BpeTokenizer>(read_vocab(f["vocab"]), parse_merges(f["merges"]), source);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> parse_merges(const JsonField& merges_field) {
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merges_field.array());
  merges_field.for_each_element([&](const JsonField& m) {
    // "a b" (merges.txt style) or ["a", "b"] (newer Hugging Face tokenizer.json style).
    const nlohmann::json* v = m.present() ? &m.json() : nullptr;
    if (v && v->is_array() && v->size() == 2 && (*v)[0].is_string() && (*v)[1].is_string()) {
      merges.emplace_back((*v)[0].get<std::string>(), (*v)[1].get<std::string>());
      return;
    }
    if (!v || !v->is_string()) m.fail_expected("\"a b\" or [\"a\", \"b\"]");
    const std::string& s = v->get_ref<const std::string&>();
    size_t sp = s.find(' ');
    if (!(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos))
      m.fail_expected("two tokens separated by one space");
    merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
  });
  return merges;
}

std::unique_ptr<Tokenizer> tokenizer_from_json(const nlohmann::json& j, const std::string& source,
                                               const std::string& eod_token) {
  return from_json(j, source, eod_token, "");
}

std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path, const std::string& eod_token) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  return from_json(parse_json_file(path), path, eod_token, dir.empty() ? "." : dir);
}

namespace {

// The Hub form of a byte-level BPE (GPT-2's pre-tokenizer and decoder) of `vocab` and `merges`, its end
// of text a special token. split_words: GPT-2's word-splitting regex (the byte tokenizer has none).
nlohmann::json hub_byte_level_bpe(const nlohmann::json& vocab, const nlohmann::json& merges, int32_t eod, bool split_words) {
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", split_words}};
  const nlohmann::json end = {{"id", eod}, {"content", kEndOfText}, {"single_word", false}, {"lstrip", false},
                              {"rstrip", false}, {"normalized", false}, {"special", true}};
  const nlohmann::json model = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                                {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                                {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab}, {"merges", merges}};
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", {end}},
          {"normalizer", nullptr}, {"pre_tokenizer", byte_level}, {"post_processor", nullptr},
          {"decoder", byte_level}, {"model", model}};
}

}  // namespace

nlohmann::json hub_tokenizer(const nlohmann::json& file) {
  const nlohmann::json type = file.is_object() ? file.value("type", nlohmann::json()) : nlohmann::json();
  if (type == "huggingface" && file.contains("tokenizer")) return file["tokenizer"];
  if (type == "byte") {  // ids 0-255 the bytes, 256 the end of text
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) {
      std::string symbol;
      append_utf8(symbol, gpt2_byte_to_unicode()[size_t(b)]);
      vocab[symbol] = b;
    }
    return hub_byte_level_bpe(vocab, nlohmann::json::array(), 256, false);
  }
  const nlohmann::json* vocab = type == "gpt2" && file.contains("vocab") ? &file["vocab"] : nullptr;
  if (vocab && vocab->is_object() && vocab->contains(kEndOfText) && (*vocab)[std::string(kEndOfText)].is_number_integer() &&
      file.contains("merges"))
    return hub_byte_level_bpe(*vocab, file["merges"], (*vocab)[std::string(kEndOfText)].get<int32_t>(), true);
  return file;
}

bool same_tokenizer_file(const nlohmann::json& checkpoint_file, const nlohmann::json& dataset_file) {
  if (checkpoint_file == dataset_file) return true;
  const bool hub = checkpoint_file.is_object() && !checkpoint_file.contains("type");  // (origami's files name theirs)
  return hub && checkpoint_file == hub_tokenizer(dataset_file);
}

HfExportTokenizer tokenizer_files_for_hf_export(const std::string& path) {
  const std::string bytes = read_file_bytes(path);
  ORIGAMI_CHECK(json_depth(bytes) <= kMaxJsonDepth, "tokenizer file '", path, "' nests arrays and objects more than ",
                kMaxJsonDepth, " levels deep");
  const nlohmann::json j = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json hub = hub_tokenizer(j);
  HfExportTokenizer out{hub == j ? bytes : hub.dump(2) + "\n", ""};
  const nlohmann::json type = j.is_object() ? j.value("type", nlohmann::json()) : nlohmann::json();
  std::string eod;
  if (type == "huggingface" && j.contains("eod_token") && j["eod_token"].is_string()) eod = j["eod_token"];
  if (type == "byte" || type == "gpt2") eod = kEndOfText;
  if (!eod.empty())
    out.tokenizer_config =
        nlohmann::json({{"tokenizer_class", "PreTrainedTokenizerFast"}, {"eos_token", eod}}).dump(2) + "\n";
  return out;
}

std::string tokenizer_file_text(const Tokenizer& tokenizer) { return tokenizer.to_json().dump() + "\n"; }

void save_tokenizer_file(const Tokenizer& tokenizer, const std::string& path) {
  write_file_atomically(path, tokenizer_file_text(tokenizer));
}

}  // namespace origami
