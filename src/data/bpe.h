// Building blocks shared by the BPE tokenizers (Gpt2BpeTokenizer in data/tokenizer.h, HfTokenizer in
// data/hf_tokenizer.h): UTF-8 helpers, GPT-2's hand-written pre-tokenizer, the rank-ordered merge loop
// and a per-thread cache of encoded pieces.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/unicode_classes.h"

namespace origami {

// Decodes the code point at text[pos]; returns its length in bytes. An invalid or truncated
// sequence yields (0xFFFD, 1): the byte stands alone.
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

void append_utf8(std::string& out, char32_t cp);

// `bytes` with each maximal invalid UTF-8 subpart replaced by U+FFFD (Rust's from_utf8_lossy,
// Python's errors="replace").
std::string utf8_lossy(std::string_view bytes);
// The length of `bytes` without a well-formed start of a multi-byte character cut at its end (bytes a
// stream of decoded tokens holds back until the next token completes them).
size_t utf8_whole_prefix(std::string_view bytes);

// GPT-2's reversible byte -> printable code point map (also declared in data/tokenizer.h).
const std::array<char32_t, 256>& gpt2_byte_to_unicode();
// Each byte's byte-level symbol: the UTF-8 of its code point in gpt2_byte_to_unicode().
const std::array<std::string, 256>& byte_level_symbols();

namespace detail {
enum class CharClass : uint8_t { letter, number, space, other };

inline CharClass classify(char32_t cp) {
  if (is_unicode_letter(cp)) return CharClass::letter;
  if (is_unicode_number(cp)) return CharClass::number;
  if (is_unicode_space(cp)) return CharClass::space;
  return CharClass::other;
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
}  // namespace detail

// GPT-2 pre-tokenization (see gpt2_pretokenize in data/tokenizer.h): calls emit(piece) for each piece.
template <typename Emit>
void for_each_gpt2_piece(std::string_view text, Emit&& emit) {
  using detail::CharClass;
  size_t pos = 0, n = text.size();
  while (pos < n) {
    if (size_t len = detail::contraction_at(text, pos)) {
      emit(text.substr(pos, len));
      pos += len;
      continue;
    }
    char32_t cp;
    int len0 = next_code_point(text, pos, cp);
    CharClass cls = detail::classify(cp);
    size_t run = pos + len0;  // end of the piece so far
    if (cp == ' ' && run < n) {
      // " ?X+" alternatives: a single leading space joins a following letter/number/other run.
      char32_t cp1;
      int len1 = next_code_point(text, run, cp1);
      CharClass cls1 = detail::classify(cp1);
      if (cls1 != CharClass::space) {
        cls = cls1;
        run += len1;
      }
    }
    if (cls != CharClass::space) {
      while (run < n) {
        char32_t c;
        int l = next_code_point(text, run, c);
        if (detail::classify(c) != cls) break;
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

// BPE merges over token ids, as Hugging Face `tokenizers` applies them: repeatedly merge the
// adjacent pair of lowest rank, leftmost first on ties. A pair given twice keeps its last rank
// (as the library's merge map does).
class BpeMerges {
 public:
  void reserve(size_t n);
  // Adds (left, right) -> result as the merge of the next rank (ids below 2^31).
  void add(int32_t left, int32_t right, int32_t result);
  // Merges the symbols ids[begin..] in place (the vector shrinks to the merged symbols).
  void apply(std::vector<int32_t>& ids, size_t begin) const;

 private:
  struct Merge {
    int32_t rank, id;
  };
  // Open addressing, linear probing: merge lookups dominate BPE.
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge{};
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t slot_of(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> shift_); }
  const Merge* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = slot_of(k);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == k) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }
  void grow();
  std::vector<Slot> slots_ = std::vector<Slot>(16);
  int shift_ = 64 - 4;
  size_t size_ = 0;
  int32_t next_rank_ = 0;
};

// Encoded pieces, keyed by their bytes, in a cache private to the calling thread (so encoding on
// many threads takes no lock). Each thread keeps the pieces of the last PieceCache it served; a
// thread that alternates between tokenizers starts over at each switch. A cache holds at most
// 2^20 pieces in 64 MiB and is cleared when full; pieces longer than kMaxPiece bytes are not cached.
// The table is flat (open addressing, growing; keys and ids in one arena): lookups are cache-miss bound.
class PieceCache {
 public:
  static constexpr size_t kMaxPiece = 256;
  PieceCache() : owner_(next_owner_.fetch_add(1) + 1) {}
  PieceCache(const PieceCache&) : PieceCache() {}
  PieceCache& operator=(const PieceCache&) { return *this; }

  // Appends the ids of `piece` to `out`: cached, or from compute(piece, out), which must append them.
  template <typename Compute>
  void encode(std::string_view piece, std::vector<int32_t>& out, Compute&& compute) const {
    if (piece.size() > kMaxPiece) {
      compute(piece, out);
      return;
    }
    Local& local = this_thread(owner_);
    const uint64_t h = hash(piece);
    if (local.append(piece, h, out)) return;
    const size_t begin = out.size();
    compute(piece, out);
    local.insert(piece, h, out.data() + begin, out.size() - begin);
  }

 private:
  struct Local {
    struct Slot {
      uint64_t hash;
      uint64_t offset;  // of the key in arena, then its ids (int32)
      uint32_t key_len, num_ids;  // num_ids == kEmpty: a free slot
    };
    static constexpr uint32_t kEmpty = ~uint32_t(0);
    uint64_t owner = 0;
    std::vector<Slot> slots;
    std::string arena;
    size_t count = 0;
    int bits = 0;  // slots.size() == 2^bits
    void clear();
    void place(const Slot& slot);
    bool append(std::string_view piece, uint64_t h, std::vector<int32_t>& out) const;
    void insert(std::string_view piece, uint64_t h, const int32_t* ids, size_t n);
  };
  static uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s) * 0x9E3779B97F4A7C15ull; }
  static Local& this_thread(uint64_t owner);
  uint64_t owner_;
  static std::atomic<uint64_t> next_owner_;
};

}  // namespace origami
