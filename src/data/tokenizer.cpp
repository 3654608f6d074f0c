#include "data/tokenizer.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <unordered_set>

#include "core/error.h"
#include "core/files.h"
#include "data/unicode_classes.h"

namespace origami {

namespace {

constexpr std::string_view kEndOfText = "<|endoftext|>";

// Decodes the code point at text[pos]; returns its length in bytes. An invalid or truncated
// sequence yields (0xFFFD, 1): the byte stands alone, in class [^\s\p{L}\p{N}].
inline int next_code_point(std::string_view text, size_t pos, char32_t& cp) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data()) + pos;
  size_t left = text.size() - pos;
  unsigned char c = s[0];
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (len == 0 || c > 0xF4 || size_t(len) > left) {
    cp = 0xFFFD;
    return 1;
  }
  char32_t v = c & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    if ((s[k] & 0xC0) != 0x80) {
      cp = 0xFFFD;
      return 1;
    }
    v = (v << 6) | (s[k] & 0x3F);
  }
  // Overlong forms and surrogates are invalid.
  static constexpr char32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
    cp = 0xFFFD;
    return 1;
  }
  cp = v;
  return len;
}

enum class CharClass : uint8_t { letter, number, space, other };

inline CharClass classify(char32_t cp) {
  if (is_unicode_letter(cp)) return CharClass::letter;
  if (is_unicode_number(cp)) return CharClass::number;
  if (is_unicode_space(cp)) return CharClass::space;
  return CharClass::other;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// The length of a contraction ('s 't 're 've 'm 'll 'd, case-sensitive) at text[pos], or 0.
inline size_t contraction_at(std::string_view text, size_t pos) {
  if (text[pos] != '\'' || pos + 1 >= text.size()) return 0;
  char a = text[pos + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= text.size()) return 0;
  char b = text[pos + 2];
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

template <typename Emit>
void for_each_gpt2_piece(std::string_view text, Emit&& emit) {
  size_t pos = 0, n = text.size();
  while (pos < n) {
    if (size_t len = contraction_at(text, pos)) {
      emit(text.substr(pos, len));
      pos += len;
      continue;
    }
    char32_t cp;
    int len0 = next_code_point(text, pos, cp);
    CharClass cls = classify(cp);
    size_t run = pos + len0;  // end of the piece so far
    if (cp == ' ' && run < n) {
      // " ?X+" alternatives: a single leading space joins a following letter/number/other run.
      char32_t cp1;
      int len1 = next_code_point(text, run, cp1);
      CharClass cls1 = classify(cp1);
      if (cls1 != CharClass::space) {
        cls = cls1;
        run += len1;
      }
    }
    if (cls != CharClass::space) {
      while (run < n) {
        char32_t c;
        int l = next_code_point(text, run, c);
        if (classify(c) != cls) break;
        run += l;
      }
      emit(text.substr(pos, run - pos));
      pos = run;
      continue;
    }
    // Whitespace: \s+(?!\S) takes the run but leaves its last character when a non-space follows
    // (that character then starts the next piece, e.g. " word"); a lone space before a non-space
    // falls through to \s+ and stands alone.
    size_t last_start = pos;
    int num_chars = 1;
    while (run < n) {
      char32_t c;
      int l = next_code_point(text, run, c);
      if (!is_unicode_space(c)) break;
      last_start = run;
      run += l;
      ++num_chars;
    }
    if (run < n && num_chars >= 2) run = last_start;
    emit(text.substr(pos, run - pos));
    pos = run;
  }
}

// Byte-level symbols: each byte as a UTF-8 string of its GPT-2 code point.
std::array<std::string, 256> byte_symbols() {
  std::array<std::string, 256> sym;
  const auto& map = gpt2_byte_to_unicode();
  for (int b = 0; b < 256; ++b) append_utf8(sym[b], map[b]);
  return sym;
}

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

// ---------------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = int32_t(static_cast<unsigned char>(text[i]));
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

  auto symbols = byte_symbols();
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
    uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    // A repeated pair keeps its first (lowest) rank.
    merges_.emplace(key, Merge{int32_t(rank), iab->second});
  }

  auto eod = token_to_id.find(kEndOfText);
  ORIGAMI_CHECK(eod != token_to_id.end(), source, ": the vocabulary has no '", kEndOfText,
                "' token, which marks the end of each document");
  eod_ = eod->second;
}

std::unique_ptr<Gpt2BpeTokenizer> Gpt2BpeTokenizer::from_files(const std::string& vocab_json_path,
                                                               const std::string& merges_txt_path) {
  nlohmann::json vj;
  try {
    vj = nlohmann::json::parse(read_file_bytes(vocab_json_path));
  } catch (const nlohmann::json::exception& e) {
    fail(vocab_json_path, ": not valid JSON (", e.what(), ")");
  }
  ORIGAMI_CHECK(vj.is_object(), vocab_json_path, ": must hold a JSON object {token: id, ...}");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(vj.size());
  for (auto& [token, id] : vj.items()) {
    ORIGAMI_CHECK(id.is_number_integer(), vocab_json_path, ": the id of token '", token,
                  "' is not an integer");
    vocab.emplace_back(token, id.get<int32_t>());
  }

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

// BPE of one pre-tokenized piece: start from its bytes' symbols and repeatedly apply the merge of
// lowest rank, leftmost first on ties (Hugging Face's order), via a heap with lazy deletion.
void Gpt2BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const int n = int(piece.size());
  if (n == 1) {
    out.push_back(byte_id_[(unsigned char)piece[0]]);
    return;
  }
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; ++i) sym[i] = {byte_id_[(unsigned char)piece[i]], i - 1, i + 1 < n ? i + 1 : -1, true};
  struct Cand {
    int32_t rank, pos;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto find = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges_.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (int i = 0; i + 1 < n; ++i)
    if (const Merge* m = find(sym[i].id, sym[i + 1].id)) heap.push({m->rank, i});
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& s = sym[c.pos];
    if (!s.alive || s.next < 0) continue;
    const Merge* m = find(s.id, sym[s.next].id);
    if (!m || m->rank != c.rank) continue;  // stale: a neighbour was merged since
    Sym& right = sym[s.next];
    right.alive = false;
    s.id = m->id;
    s.next = right.next;
    if (s.next >= 0) sym[s.next].prev = c.pos;
    if (s.prev >= 0)
      if (const Merge* mp = find(sym[s.prev].id, s.id)) heap.push({mp->rank, s.prev});
    if (s.next >= 0)
      if (const Merge* mn = find(s.id, sym[s.next].id)) heap.push({mn->rank, c.pos});
  }
  for (int i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

void Gpt2BpeTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  for_each_gpt2_piece(text, [&](std::string_view piece) {
    if (piece.size() == 1) {
      out.push_back(byte_id_[(unsigned char)piece[0]]);
      return;
    }
    if (piece.size() > 256) {  // long runs (ASCII art, whitespace) are rare: don't cache them
      encode_piece(piece, out);
      return;
    }
    auto it = cache_.find(piece);
    if (it == cache_.end()) {
      if (cache_.size() >= kMaxCache) cache_.clear();
      std::vector<int32_t> ids;
      encode_piece(piece, ids);
      it = cache_.emplace(std::string(piece), std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  });
}

std::vector<int32_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::lock_guard<std::mutex> lock(cache_mutex_);
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

std::unique_ptr<Tokenizer> tokenizer_from_json(const nlohmann::json& j, const std::string& source) {
  ORIGAMI_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), source,
                ": a tokenizer must be a JSON object with a string \"type\" (\"byte\" or \"gpt2\")");
  std::string type = j["type"].get<std::string>();
  if (type == "byte") return std::make_unique<ByteTokenizer>();
  ORIGAMI_CHECK(type == "gpt2", source, ": unknown tokenizer type '", type, "' (known: byte, gpt2)");
  ORIGAMI_CHECK(j.contains("vocab") && j["vocab"].is_object(), source,
                ": a gpt2 tokenizer needs \"vocab\": {token: id, ...}");
  ORIGAMI_CHECK(j.contains("merges") && j["merges"].is_array(), source,
                ": a gpt2 tokenizer needs \"merges\": [\"a b\", ...]");
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (auto& [token, id] : j["vocab"].items()) {
    ORIGAMI_CHECK(id.is_number_integer(), source, ": the id of token '", token, "' is not an integer");
    vocab.emplace_back(token, id.get<int32_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& m : j["merges"]) {
    // "a b" (merges.txt style) or ["a", "b"] (newer Hugging Face tokenizer.json style).
    if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      continue;
    }
    ORIGAMI_CHECK(m.is_string(), source, ": merge ", merges.size() + 1, " must be \"a b\" or [\"a\", \"b\"]");
    std::string s = m.get<std::string>();
    size_t sp = s.find(' ');
    ORIGAMI_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos,
                  source, ": merge ", merges.size() + 1, " '", s, "' must be two tokens separated by one space");
    merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
  }
  return std::make_unique<Gpt2BpeTokenizer>(vocab, merges, source);
}

std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file_bytes(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  return tokenizer_from_json(j, path);
}

void save_tokenizer_file(const Tokenizer& tokenizer, const std::string& path) {
  write_file_atomically(path, tokenizer.to_json().dump() + "\n");
}

}  // namespace origami
