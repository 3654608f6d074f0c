#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "core/files.h"
#include "core/json_fields.h"

namespace origami {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// PCRE2 patterns. The library uses Oniguruma, whose \s is Unicode White_Space; PCRE2's (with UCP)
// also takes U+180E, so \s is spelled out.

namespace {
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      ++i;
      if (e == 's') out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      else if (e == 'S' && !in_class) out += "[^" + std::string(kWhiteSpace) + "]";
      else out += {c, e};
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a literal ']' first in the class
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

// Per-thread PCRE2 match data and JIT stack.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};
}  // namespace

class HfRegex {
 public:
  HfRegex(const std::string& pattern, bool literal, const std::string& what) : pattern_(pattern), what_(what) {
    int err = 0;
    PCRE2_SIZE off = 0;
    std::string p = literal ? pattern : onig_to_pcre2(pattern);
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), opts, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail(what, ": the regex '", pattern, "' does not compile (PCRE2: ", reinterpret_cast<char*>(msg), " at offset ",
           off, ")");
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) it still matches
  }
  ~HfRegex() { pcre2_code_free(code_); }
  HfRegex(const HfRegex&) = delete;
  HfRegex& operator=(const HfRegex&) = delete;

  // Calls f(start, end) for each match, left to right, not overlapping (an empty match advances
  // one character). As Hugging Face's (Oniguruma's find_iter, Rust regex's), an empty match where
  // the previous match ended is not one: "a*" on "ab" matches "a" and the empty end, not also at 1.
  template <typename F>
  void for_each_match(std::string_view text, F&& f) const {
    thread_local MatchState st;
    PCRE2_SIZE pos = 0, last_end = PCRE2_UNSET;
    const auto* s = reinterpret_cast<PCRE2_SPTR>(text.data());
    while (pos <= text.size()) {
      int rc = pcre2_match(code_, s, text.size(), pos, 0, st.data, st.context);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) fail_match(rc);
      // The match's bounds are copied before f runs: f may match another regex (the next Split of a
      // Sequence), which reuses this thread's match data.
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
      const PCRE2_SIZE start = ov[0], end = ov[1];
      if (end > start || start != last_end) f(size_t(start), size_t(end)), last_end = end;
      if (end > start) {
        pos = end;
      } else {
        if (end >= text.size()) return;
        char32_t cp;
        pos = end + size_t(next_code_point(text, end, cp));
      }
    }
  }

 private:
  // A match that fails (a pattern that backtracks past PCRE2's match limit on this input, ...).
  [[noreturn]] void fail_match(int rc) const {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    fail(what_, ": the regex '", pattern_, "' failed on the input (PCRE2 error ", rc, ": ",
         reinterpret_cast<char*>(msg), ")");
  }

  pcre2_code* code_ = nullptr;
  std::string pattern_, what_;  // for errors
};

// ---------------------------------------------------------------------------------------------
// Components

struct HfTokenizer::NormStep {
  enum Kind { unicode, prepend, replace } kind;
  const icu::Normalizer2* form = nullptr;  // unicode
  std::string a, b;                        // prepend: a; replace: a -> b
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct HfTokenizer::PreStep {
  enum Kind { split, byte_level, metaspace } kind;
  std::shared_ptr<HfRegex> regex;  // split
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  bool add_prefix_space = false, use_regex = true;  // byte_level
  std::string replacement;                          // metaspace
  enum Prepend { always, first, never } prepend = always;
  bool split_on_replacement = true;
};

struct HfTokenizer::DecStep {
  enum Kind { byte_level, replace, byte_fallback, fuse, strip, metaspace } kind;
  std::string a, b;  // replace: a -> b; strip: a = the character; metaspace: a = replacement
  int start = 0, stop = 0;
  bool prepend = true;  // metaspace: the first token's replacement characters are dropped
};

namespace {

// A Split/Replace "pattern": {"String": s} or {"Regex": r}; the text and whether it is literal.
std::pair<std::string, bool> pattern_of(const JsonField& j, const std::string& what) {
  const JsonField p = j["pattern"];
  if (p.object().json().size() != 1) p.fail_expected("{\"String\": ...} or {\"Regex\": ...}");
  if (p["String"].present()) return {p["String"].string(), true};
  ORIGAMI_CHECK(p["Regex"].present(), j.file(), ": ", what, " pattern kind '", p.json().begin().key(),
                "' is not supported (String or Regex)");
  return {p["Regex"].string(), false};
}

// One character as a UTF-8 string (Strip's and Metaspace's "character" fields).
std::string one_char(const JsonField& f) {
  const std::string& s = f.string();
  char32_t cp;
  if (s.empty() || size_t(next_code_point(s, 0, cp)) != s.size()) f.fail_expected("one character");
  return s;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if ((unsigned char)c >= 0x80) return false;
  return true;
}

// The library's word and space characters for added tokens' flags: Rust regex's Unicode \w
// ([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]) and \s (White_Space).
bool is_word_char(char32_t c) {
  if (u_isUAlphabetic(UChar32(c)) || c == 0x200C || c == 0x200D) return true;
  auto t = u_charType(UChar32(c));
  return t == U_NON_SPACING_MARK || t == U_COMBINING_SPACING_MARK || t == U_ENCLOSING_MARK ||
         t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION;
}
bool is_whitespace(char32_t c) { return u_isUWhiteSpace(UChar32(c)); }

char32_t last_char(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) --i;
  char32_t cp;
  next_code_point(s, i, cp);
  return cp;
}

constexpr int64_t kMaxTokenId = (1 << 28) - 1;  // ids in [0, 2^28)

const std::vector<std::string> kDefaultEodTokens = {"<|endoftext|>", "<|end_of_text|>", "</s>"};

bool is_added_token(const json& hf, const std::string& token) {
  if (hf.contains("added_tokens") && hf["added_tokens"].is_array())
    for (const auto& t : hf["added_tokens"])
      if (t.is_object() && t.contains("content") && t["content"] == token) return true;
  return false;
}

bool file_has_token(const json& hf, const std::string& token) {
  return is_added_token(hf, token) || (hf.contains("model") && hf["model"].contains("vocab") &&
                                       hf["model"]["vocab"].is_object() && hf["model"]["vocab"].contains(token));
}

}  // namespace

std::string HfTokenizer::default_eod_token(const json& hf, const std::string& config_dir, const std::string& source) {
  if (!config_dir.empty()) {
    std::filesystem::path cfg = std::filesystem::path(config_dir) / "tokenizer_config.json";
    if (std::filesystem::is_regular_file(cfg)) {
      const json c = parse_json_file(cfg.string());
      // "eos_token": its text, or an added-token object {"content": its text, ...}.
      const JsonField eos_field = JsonField(c, cfg.string())["eos_token"];
      const std::string eos = eos_field.present() && eos_field.json().is_object() ? eos_field["content"].string()
                                                                                 : eos_field.string_or("");
      if (!eos.empty()) {
        ORIGAMI_CHECK(file_has_token(hf, eos), cfg.string(), ": eos_token '", eos, "' is not a token of ", source,
                      "; pass --eod-token TEXT");
        return eos;
      }
    }
  }
  // An added (special) token first: a learned token that happens to spell one is ordinary text.
  for (const auto& t : kDefaultEodTokens)
    if (is_added_token(hf, t)) return t;
  for (const auto& t : kDefaultEodTokens)
    if (file_has_token(hf, t)) return t;
  fail(source, ": cannot choose the end-of-document token: no eos_token in a tokenizer_config.json beside it, and "
       "none of <|endoftext|>, <|end_of_text|>, </s> is a token of it; pass --eod-token TEXT");
}

HfTokenizer::~HfTokenizer() = default;

// ---------------------------------------------------------------------------------------------
// Construction: one reader per component of the file, called in the order of the checks

namespace {

// The steps of a component in order, a Sequence (its "normalizers", "pretokenizers", "decoders" or
// "processors") flattened; a null component has none. Every step has a string "type".
void flatten_sequence(const JsonField& j, std::vector<JsonField>& steps) {
  if (!j.present()) return;
  if (j["type"].string() == "Sequence") {
    const char* key = j["normalizers"].present()     ? "normalizers"
                      : j["pretokenizers"].present() ? "pretokenizers"
                      : j["decoders"].present()      ? "decoders" : "processors";
    j[key].for_each_element([&](const JsonField& x) { flatten_sequence(x, steps); });
    return;
  }
  steps.push_back(j);
}

// The steps of the component hf[key] (none if the file has no such key), every one of them
// checked for a "type" before any is read.
std::vector<JsonField> component_steps(const JsonField& hf, const char* key) {
  std::vector<JsonField> steps;
  flatten_sequence(hf[key], steps);
  return steps;
}

// The file as a whole: a model, and no truncation or padding.
void check_file(const JsonField& hf) {
  const json& j = hf.json();
  ORIGAMI_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), hf.file(),
                ": not a Hugging Face tokenizer file (no \"model\" object)");
  for (const char* key : {"truncation", "padding"})
    ORIGAMI_CHECK(!hf[key].present(), hf.file(), ": \"", key, "\" is set; origami encodes whole documents (set it to null)");
}

// The ids a post-processor puts around a single sequence.
struct SequenceWrap {
  std::vector<int32_t> prefix, suffix;
};

// A post-processor's special token given as [token, id]: its id.
int32_t special_id(const JsonField& pair) {
  pair.array(2, 2);
  pair[0].string();
  return int32_t(pair[1].integer(0, kMaxTokenId));
}

// TemplateProcessing's "single" template: the ids of its special tokens before and after $A.
SequenceWrap template_wrap(const JsonField& j) {
  const std::string& source = j.file();
  SequenceWrap w;
  bool seen_a = false;
  j["single"].for_each_element([&](const JsonField& piece) {
    if (piece["Sequence"].present()) {
      ORIGAMI_CHECK(!seen_a && piece["Sequence"]["id"].string_or("") == "A", source,
                    ": post_processor TemplateProcessing: the single template must hold $A once, got ",
                    j["single"].got());
      seen_a = true;
      return;
    }
    ORIGAMI_CHECK(piece["SpecialToken"].present(), source,
                  ": post_processor TemplateProcessing: unknown template piece ", piece.got());
    const std::string name = piece["SpecialToken"]["id"].string_or("");
    ORIGAMI_CHECK(j["special_tokens"][name].present(), source, ": post_processor TemplateProcessing: special token '",
                  name, "' is not in special_tokens");
    j["special_tokens"][name]["ids"].for_each_element(
        [&](const JsonField& id) { (seen_a ? w.suffix : w.prefix).push_back(int32_t(id.integer(0, kMaxTokenId))); });
  });
  ORIGAMI_CHECK(seen_a, source, ": post_processor TemplateProcessing: the single template has no $A");
  return w;
}

// One post-processor step (not a Sequence): the ids it puts around a single sequence.
SequenceWrap make_post_processor(const JsonField& j) {
  const std::string& type = j["type"].string();
  if (type == "ByteLevel") return {};  // offsets only
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const int32_t cls = special_id(j["cls"]);
    return {{cls}, {special_id(j["sep"])}};
  }
  if (type == "TemplateProcessing") return template_wrap(j);
  fail(j.file(), ": post_processor '", type,
       "' is not supported (origami implements TemplateProcessing, RobertaProcessing, BertProcessing, "
       "ByteLevel, Sequence)");
}

}  // namespace

HfTokenizer::HfTokenizer(const JsonField& hf, const std::string& eod_token) : hf_(hf.json()), eod_token_(eod_token) {
  const std::string& source = hf.file();
  check_file(hf);
  int32_t max_id = read_bpe_model(hf["model"]);
  read_added_tokens(hf);
  for (const auto& t : added_) max_id = std::max(max_id, t.id);
  ORIGAMI_CHECK(max_id >= 0, source, ": the vocabulary is empty");
  check_id_density(max_id, vocab_.size() + added_.size(), source);

  for (const JsonField& j : component_steps(hf, "normalizer")) norm_.push_back(make_normalizer(j));
  const std::vector<JsonField> pre_steps = component_steps(hf, "pre_tokenizer");
  for (size_t k = 0; k < pre_steps.size(); ++k) pre_.push_back(make_pre_tokenizer(pre_steps[k], k + 1 == pre_steps.size()));
  byte_level_ = !pre_.empty() && pre_.back().kind == PreStep::byte_level;  // ByteLevel is last if anywhere
  find_model_symbols();

  build_id_tables(max_id, source);
  build_matcher(raw_matcher_, false);
  build_matcher(normalized_matcher_, true);
  read_post_processor(hf);

  for (const JsonField& j : component_steps(hf, "decoder")) dec_.push_back(make_decoder(j));
  has_decoder_ = hf["decoder"].present();
  build_id_bytes();

  // ---- end of document
  ORIGAMI_CHECK(!eod_token.empty(), source, ": the end-of-document token is empty");
  eod_ = token_to_id(eod_token);
  ORIGAMI_CHECK(eod_ >= 0, source, ": end-of-document token '", eod_token, "' is not a token of the file");
}

// ---- model: BPE

int32_t HfTokenizer::read_bpe_model(const JsonField& m) {
  const std::string& source = m.file();
  const std::string mtype = m["type"].string_or("BPE");
  ORIGAMI_CHECK(mtype == "BPE", source, ": model type '", mtype,
                "' is not supported (origami reads BPE models, not WordPiece, Unigram or WordLevel)");
  ORIGAMI_CHECK(m["dropout"].number_or(0.0) == 0.0, source, ": BPE dropout ", m["dropout"].got(),
                " is not supported (null or 0)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    ORIGAMI_CHECK(m[key].string_or("").empty(), source, ": BPE option ", key, " '", m[key].string(),
                  "' is not supported (null)");
  byte_fallback_ = m["byte_fallback"].boolean_or(false);
  fuse_unk_ = m["fuse_unk"].boolean_or(false);
  ignore_merges_ = m["ignore_merges"].boolean_or(false);
  int32_t max_id = -1;
  vocab_.reserve(m["vocab"].object().json().size());
  m["vocab"].for_each_member([&](const std::string& token, const JsonField& id_field) {
    const int32_t id = int32_t(id_field.integer(0, kMaxTokenId));
    vocab_.emplace(token, id);
    max_id = std::max(max_id, id);
  });
  read_bpe_merges(m["merges"]);
  if (const std::string unk = m["unk_token"].string_or(""); !unk.empty()) {
    auto it = vocab_.find(unk);
    ORIGAMI_CHECK(it != vocab_.end(), source, ": BPE unk_token '", unk, "' is not in the vocabulary");
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = vocab_.find(std::string_view(name));
    byte_fallback_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  return max_id;
}

void HfTokenizer::read_bpe_merges(const JsonField& merges_field) {
  const std::string& source = merges_field.file();
  auto merges = parse_merges(merges_field);
  merges_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    ORIGAMI_CHECK(ia != vocab_.end() && ib != vocab_.end() && iab != vocab_.end(), source, ": merge ", rank + 1, " '",
                  a, " ", b, "' uses a token missing from the vocabulary ('",
                  ia == vocab_.end() ? a : ib == vocab_.end() ? b : a + b, "')");
    merges_.add(ia->second, ib->second, iab->second);
  }
}

// ---- model symbols: byte-level (each byte's symbol) or characters (ASCII table)

void HfTokenizer::find_model_symbols() {
  for (int b = 0; b < 256; ++b) {
    std::string key = byte_level_ ? byte_level_symbols()[b] : b < 128 ? std::string(1, char(b)) : std::string();
    auto it = key.empty() ? vocab_.end() : vocab_.find(key);
    unit_id_[b] = it == vocab_.end() ? -1 : it->second;
  }
  // Words may be cut before a "▁" that follows another character when no token holds such a pair:
  // then no merge can cross the cut and BPE of the parts equals BPE of the word (SentencePiece-
  // style files, whose normalizer makes a whole text one word).
  if (!byte_level_ && !ignore_merges_ && vocab_.count("\u2581")) {
    bool safe = true;
    for (const auto& [token, id] : vocab_) {
      for (size_t p = token.find("\u2581", 1); p != std::string::npos && safe; p = token.find("\u2581", p + 1))
        if (last_char(std::string_view(token).substr(0, p)) != U'\u2581') safe = false;
      if (!safe) break;
    }
    if (safe) safe_split_ = "\u2581";
  }
}

// ---- added tokens

// The library does not take an added token's "id" as given: loading the file, it adds the tokens in
// order, each with its vocabulary id where the vocabulary holds its text, else the next id after the
// vocabulary's size and the added ones before it (AddedVocabulary::add_tokens), and only warns where
// that differs. Such a file (hand-edited, ids with gaps) would encode to other ids here than there,
// so it is refused.
void HfTokenizer::read_added_tokens(const JsonField& hf) {
  if (!hf["added_tokens"].present()) return;
  std::unordered_map<std::string, int32_t> assigned;  // the library's ids of the added tokens so far
  int64_t max_assigned = -1;
  const int64_t vocab = int64_t(vocab_.size());
  hf["added_tokens"].for_each_element([&](const JsonField& t) {
    added_.push_back({t["content"].string(), int32_t(t["id"].integer(0, kMaxTokenId)), t["single_word"].boolean_or(false),
                      t["lstrip"].boolean_or(false), t["rstrip"].boolean_or(false), t["normalized"].boolean_or(true),
                      t["special"].boolean_or(false)});
    const AddedToken& a = added_.back();
    if (a.content.empty()) return;  // (the library skips it)
    int64_t id;
    if (const auto known = assigned.find(a.content); known != assigned.end()) id = known->second;
    else if (const auto in_vocab = vocab_.find(a.content); in_vocab != vocab_.end()) id = in_vocab->second;
    else id = max_assigned < 0 ? vocab : (max_assigned >= vocab || vocab == 0 ? max_assigned + 1 : vocab);
    ORIGAMI_CHECK(id == a.id, t.where(), ": added token '", a.content, "' has id ", a.id, ", but the tokenizers library "
                  "gives it ", id, id < vocab ? " (the vocabulary's id of its text)" : " (the next id after the vocabulary "
                  "and the added tokens before it)", ", and encodes with that one; renumber it in the file");
    assigned.emplace(a.content, int32_t(id));
    max_assigned = std::max(max_assigned, id);
  });
}

// ---- id tables (model vocabulary, then added tokens, which take precedence)

void HfTokenizer::build_id_tables(int32_t max_id, const std::string& source) {
  id_token_.assign(size_t(max_id) + 1, {});
  id_valid_.assign(size_t(max_id) + 1, false);
  id_special_.assign(size_t(max_id) + 1, false);
  for (const auto& [token, id] : vocab_) {
    ORIGAMI_CHECK(!id_valid_[id], source, ": id ", id, " is given to two tokens ('", id_token_[id], "' and '", token,
                  "')");
    id_token_[id] = token;
    id_valid_[id] = true;
  }
  for (const auto& t : added_) {
    id_token_[t.id] = t.content;
    id_valid_[t.id] = true;
    id_special_[t.id] = t.special;
  }
}

// ---- normalizer

HfTokenizer::NormStep HfTokenizer::make_normalizer(const JsonField& j) {
  const std::string& source = j.file();
  const std::string& type = j["type"].string();
  UErrorCode status = U_ZERO_ERROR;
  NormStep n{};
  if (type == "NFC") n = {NormStep::unicode, icu::Normalizer2::getNFCInstance(status), "", ""};
  else if (type == "NFD") n = {NormStep::unicode, icu::Normalizer2::getNFDInstance(status), "", ""};
  else if (type == "NFKC") n = {NormStep::unicode, icu::Normalizer2::getNFKCInstance(status), "", ""};
  else if (type == "NFKD") n = {NormStep::unicode, icu::Normalizer2::getNFKDInstance(status), "", ""};
  else if (type == "Prepend") {
    n = {NormStep::prepend, nullptr, j["prepend"].string(), ""};
  } else if (type == "Replace") {
    auto [pat, literal] = pattern_of(j, "normalizer Replace");
    ORIGAMI_CHECK(literal, source, ": normalizer Replace with a Regex pattern is not supported (String only)");
    n = {NormStep::replace, nullptr, pat, j["content"].string_or("")};
  } else {
    fail(source, ": normalizer '", type,
         "' is not supported (origami implements NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)");
  }
  ORIGAMI_CHECK(U_SUCCESS(status), source, ": ICU has no ", type, " normalizer (", u_errorName(status), ")");
  return n;
}

// ---- pre-tokenizer

namespace {
SplitBehavior split_behavior(const std::string& b, const std::string& source) {
  if (b == "Removed") return SplitBehavior::removed;
  if (b == "Isolated") return SplitBehavior::isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (b == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (b == "Contiguous") return SplitBehavior::contiguous;
  fail(source, ": pre_tokenizer Split behavior '", b, "' is not known");
}
}  // namespace

// last: the step is the last of the pre-tokenizer (where ByteLevel must be).
HfTokenizer::PreStep HfTokenizer::make_pre_tokenizer(const JsonField& j, bool last) {
  const std::string& source = j.file();
  const std::string& type = j["type"].string();
  PreStep p{};
  if (type == "Split") {
    p.kind = PreStep::split;
    auto [pat, literal] = pattern_of(j, "pre_tokenizer Split");
    p.regex = std::make_shared<HfRegex>(pat, literal, source + ": pre_tokenizer Split");
    p.behavior = split_behavior(j["behavior"].string_or("Isolated"), source);
    p.invert = j["invert"].boolean_or(false);
  } else if (type == "ByteLevel") {
    ORIGAMI_CHECK(last, source,
                  ": a ByteLevel pre_tokenizer followed by other pre-tokenizers is not supported (it must be last)");
    p.kind = PreStep::byte_level;
    p.add_prefix_space = j["add_prefix_space"].boolean_or(false);
    p.use_regex = j["use_regex"].boolean_or(true);
  } else if (type == "Metaspace") {
    p.kind = PreStep::metaspace;
    p.replacement = one_char(j["replacement"]);
    std::string scheme = j["prepend_scheme"].string_or("");
    if (scheme.empty()) scheme = j["add_prefix_space"].boolean_or(true) ? "always" : "never";
    if (scheme == "always") p.prepend = PreStep::always;
    else if (scheme == "first") p.prepend = PreStep::first;
    else if (scheme == "never") p.prepend = PreStep::never;
    else fail(source, ": pre_tokenizer Metaspace prepend_scheme '", scheme, "' is not known");
    p.split_on_replacement = j["split"].boolean_or(true);
    p.regex = std::make_shared<HfRegex>(p.replacement, true, source + ": pre_tokenizer Metaspace");
  } else {
    fail(source, ": pre_tokenizer '", type,
         "' is not supported (origami implements Split, ByteLevel, Metaspace, Sequence)");
  }
  return p;
}

// ---- post-processor: the ids around a single sequence

void HfTokenizer::read_post_processor(const JsonField& hf) {
  const std::string& source = hf.file();
  for (const JsonField& j : component_steps(hf, "post_processor")) {
    SequenceWrap w = make_post_processor(j);
    // A later processor wraps the result of the earlier ones.
    prefix_ids_.insert(prefix_ids_.begin(), w.prefix.begin(), w.prefix.end());
    suffix_ids_.insert(suffix_ids_.end(), w.suffix.begin(), w.suffix.end());
  }
  for (int32_t id : prefix_ids_)
    ORIGAMI_CHECK(id >= 0 && id < vocab_size() && id_valid_[id], source, ": post_processor token id ", id,
                  " is not in the vocabulary");
  for (int32_t id : suffix_ids_)
    ORIGAMI_CHECK(id >= 0 && id < vocab_size() && id_valid_[id], source, ": post_processor token id ", id,
                  " is not in the vocabulary");
}

// ---- decoder

HfTokenizer::DecStep HfTokenizer::make_decoder(const JsonField& j) {
  const std::string& source = j.file();
  const std::string& type = j["type"].string();
  DecStep d{};
  if (type == "ByteLevel") d.kind = DecStep::byte_level;
  else if (type == "ByteFallback") d.kind = DecStep::byte_fallback;
  else if (type == "Fuse") d.kind = DecStep::fuse;
  else if (type == "Replace") {
    d.kind = DecStep::replace;
    auto [pat, literal] = pattern_of(j, "decoder Replace");
    ORIGAMI_CHECK(literal, source, ": decoder Replace with a Regex pattern is not supported (String only)");
    d.a = pat;
    d.b = j["content"].string_or("");
  } else if (type == "Strip") {
    d.kind = DecStep::strip;
    d.a = one_char(j["content"]);
    d.start = int(j["start"].integer_or(0, 0, INT_MAX));
    d.stop = int(j["stop"].integer_or(0, 0, INT_MAX));
  } else if (type == "Metaspace") {
    d.kind = DecStep::metaspace;
    d.a = one_char(j["replacement"]);
    const std::string scheme = j["prepend_scheme"].string_or("");
    d.prepend = scheme.empty() ? j["add_prefix_space"].boolean_or(true) : scheme != "never";
  } else {
    fail(source, ": decoder '", type,
         "' is not supported (origami implements ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, "
         "Sequence)");
  }
  return d;
}

// Each token's decode() bytes: its text through the decoder's per-token steps.
void HfTokenizer::build_id_bytes() {
  id_bytes_.assign(id_token_.size(), {});
  for (size_t id = 0; id < id_token_.size(); ++id)
    if (id_valid_[id]) {
      auto parts = run_decoder({id_token_[id]}, /*streaming=*/true);
      for (const auto& p : parts) id_bytes_[id] += p;
    }
}

int32_t HfTokenizer::token_to_id(std::string_view token) const {
  for (const auto& t : added_)
    if (t.content == token) return t.id;
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

json HfTokenizer::to_json() const { return {{"type", "huggingface"}, {"eod_token", eod_token_}, {"tokenizer", hf_}}; }

// ---------------------------------------------------------------------------------------------
// Encoding

void HfTokenizer::build_matcher(Matcher& m, bool normalized) {
  for (size_t k = 0; k < added_.size(); ++k) {
    if (added_[k].normalized != normalized) continue;
    std::string pat = added_[k].content;
    if (normalized) normalize(pat);  // the library matches normalized tokens by their normalized text
    if (pat.empty()) continue;
    m.patterns.emplace_back(std::move(pat), int(k));
  }
  for (size_t p = 0; p < m.patterns.size(); ++p) m.by_first_byte[(unsigned char)m.patterns[p].first[0]].push_back(int(p));
  for (auto& v : m.by_first_byte)
    std::stable_sort(v.begin(), v.end(),
                     [&](int a, int b) { return m.patterns[a].first.size() > m.patterns[b].first.size(); });
}

// The library's AddedVocabulary::find_matches: leftmost-longest matches; a single_word token only
// where no word character touches it; lstrip/rstrip take the whitespace beside the token.
template <typename OnText, typename OnToken>
void HfTokenizer::split_added(const Matcher& m, std::string_view text, OnText&& on_text, OnToken&& on_token) const {
  if (m.empty()) {
    on_text(size_t(0), text.size());
    return;
  }
  size_t start_offset = 0;
  const size_t n = text.size();
  for (size_t pos = 0; pos < n;) {
    const auto& cands = m.by_first_byte[(unsigned char)text[pos]];
    int found = -1;
    for (int c : cands) {
      const std::string& p = m.patterns[c].first;
      if (text.compare(pos, p.size(), p) == 0) {
        found = c;
        break;
      }
    }
    if (found < 0) {
      ++pos;
      continue;
    }
    const AddedToken& tok = added_[m.patterns[found].second];
    size_t start = pos, stop = pos + m.patterns[found].first.size();
    pos = stop;
    if (tok.single_word) {
      bool start_space = start == 0 || !is_word_char(last_char(text.substr(0, start)));
      char32_t next = 0;
      bool stop_space = stop == n || (next_code_point(text, stop, next), !is_word_char(next));
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t s = start;
      while (s > start_offset) {
        size_t b = s - 1;
        while (b > 0 && ((unsigned char)text[b] & 0xC0) == 0x80) --b;
        char32_t cp;
        next_code_point(text, b, cp);
        if (!is_whitespace(cp)) break;
        s = b;
      }
      start = s;
    }
    if (tok.rstrip) {  // (the next match is still looked for from the token's own end, as the library does:
                       // one that begins with whitespace inside this run is found, and its span overlaps)
      while (stop < n) {
        char32_t cp;
        int l = next_code_point(text, stop, cp);
        if (!is_whitespace(cp)) break;
        stop += size_t(l);
      }
    }
    if (start > start_offset) on_text(start_offset, start);
    on_token(tok.id);
    start_offset = stop;
  }
  if (start_offset < n) on_text(start_offset, n);
}

void HfTokenizer::normalize(std::string& s) const {
  for (const auto& st : norm_) {
    switch (st.kind) {
      case NormStep::unicode: {
        if (is_ascii(s)) break;
        ORIGAMI_CHECK(s.size() <= size_t(std::numeric_limits<int32_t>::max()), "a document of ", s.size(),
                      " bytes after the normalizer's earlier steps: Unicode normalization takes at most 2147483647 "
                      "bytes (2 GiB) per document; split the input into smaller documents (data prepare --split)");
        std::string out;
        icu::StringByteSink<std::string> sink(&out);
        UErrorCode status = U_ZERO_ERROR;
        st.form->normalizeUTF8(0, icu::StringPiece(s.data(), int32_t(s.size())), sink, nullptr, status);
        ORIGAMI_CHECK(U_SUCCESS(status), "Unicode normalization failed (", u_errorName(status), ")");
        s = std::move(out);
        break;
      }
      case NormStep::prepend:
        if (!s.empty()) s.insert(0, st.a);
        break;
      case NormStep::replace:
        replace_all(s, st.a, st.b);
        break;
    }
  }
}

namespace {
// The library's SplitDelimiterBehavior over (start, end, is_match) spans covering a text; calls
// emit(start, end) for the resulting non-empty pieces.
template <typename Emit>
void split_spans(const std::vector<std::array<size_t, 3>>& spans, SplitBehavior b, Emit&& emit) {
  std::vector<std::array<size_t, 2>> out;
  switch (b) {
    case SplitBehavior::isolated:
      for (const auto& s : spans) out.push_back({s[0], s[1]});
      break;
    case SplitBehavior::removed:
      for (const auto& s : spans)
        if (!s[2]) out.push_back({s[0], s[1]});
      break;
    case SplitBehavior::contiguous: {
      bool prev = false;
      for (const auto& s : spans) {
        if (bool(s[2]) == prev && !out.empty()) out.back()[1] = s[1];
        else out.push_back({s[0], s[1]});
        prev = s[2];
      }
      break;
    }
    case SplitBehavior::merged_with_previous: {
      bool prev = false;
      for (const auto& s : spans) {
        if (s[2] && !prev && !out.empty()) out.back()[1] = s[1];
        else out.push_back({s[0], s[1]});
        prev = s[2];
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool prev = false;
      for (size_t k = spans.size(); k-- > 0;) {
        const auto& s = spans[k];
        if (s[2] && !prev && !out.empty()) out.back()[0] = s[0];
        else out.push_back({s[0], s[1]});
        prev = s[2];
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  for (const auto& o : out)
    if (o[1] > o[0]) emit(o[0], o[1]);
}
}  // namespace

template <typename Emit>
void HfTokenizer::pretokenize(size_t step, std::string_view piece, bool at_start, Emit& emit) const {
  if (piece.empty()) return;
  if (step == pre_.size()) {
    emit(piece);
    return;
  }
  const PreStep& p = pre_[step];
  switch (p.kind) {
    case PreStep::split: {
      if (p.behavior == SplitBehavior::isolated && !p.invert) {  // the common case, without a span list
        size_t prev = 0;
        p.regex->for_each_match(piece, [&](size_t s, size_t e) {
          if (s > prev) pretokenize(step + 1, piece.substr(prev, s - prev), at_start && prev == 0, emit);
          if (e > s) pretokenize(step + 1, piece.substr(s, e - s), at_start && s == 0, emit);
          prev = e;
        });
        if (prev < piece.size()) pretokenize(step + 1, piece.substr(prev), at_start && prev == 0, emit);
        return;
      }
      std::vector<std::array<size_t, 3>> spans;
      size_t prev = 0;
      p.regex->for_each_match(piece, [&](size_t s, size_t e) {
        if (s > prev) spans.push_back({prev, s, size_t(p.invert)});
        spans.push_back({s, e, size_t(!p.invert)});
        prev = e;
      });
      if (prev < piece.size()) spans.push_back({prev, piece.size(), size_t(p.invert)});
      split_spans(spans, p.behavior, [&](size_t s, size_t e) {
        pretokenize(step + 1, piece.substr(s, e - s), at_start && s == 0, emit);
      });
      return;
    }
    case PreStep::byte_level: {  // the last step: pieces stay raw bytes (the model maps them)
      std::string prefixed;
      if (p.add_prefix_space && piece[0] != ' ') {
        prefixed = " ";
        prefixed += piece;
        piece = prefixed;
      }
      if (p.use_regex) for_each_gpt2_piece(piece, emit);
      else emit(piece);
      return;
    }
    case PreStep::metaspace: {
      std::string s(piece);
      replace_all(s, " ", p.replacement);
      if ((p.prepend == PreStep::always || (p.prepend == PreStep::first && at_start)) && !s.starts_with(p.replacement))
        s.insert(0, p.replacement);
      if (!p.split_on_replacement) {
        pretokenize(step + 1, s, at_start, emit);
        return;
      }
      std::vector<std::array<size_t, 3>> spans;
      size_t prev = 0;
      p.regex->for_each_match(s, [&](size_t a, size_t b) {
        if (a > prev) spans.push_back({prev, a, 0});
        spans.push_back({a, b, 1});
        prev = b;
      });
      if (prev < s.size()) spans.push_back({prev, s.size(), 0});
      std::string_view sv(s);
      split_spans(spans, SplitBehavior::merged_with_next,
                  [&](size_t a, size_t b) { pretokenize(step + 1, sv.substr(a, b - a), at_start && a == 0, emit); });
      return;
    }
  }
}

// The library's BPE::merge_word: a symbol per character (per byte after ByteLevel), unknown ones as
// <0xNN> tokens (byte_fallback) or unk_token (fused when fuse_unk), else dropped; then the merges.
void HfTokenizer::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    std::string mapped;
    if (byte_level_)
      for (char c : word) mapped += byte_level_symbols()[(unsigned char)c];
    auto it = vocab_.find(byte_level_ ? std::string_view(mapped) : word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const size_t begin = out.size();
  bool pending_unk = false;
  for (size_t pos = 0; pos < word.size();) {
    std::string_view unit;
    int32_t id = -1;
    if (byte_level_) {
      unsigned char b = (unsigned char)word[pos++];
      id = unit_id_[b];
      unit = byte_level_symbols()[b];
    } else {
      char32_t cp;
      size_t len = size_t(next_code_point(word, pos, cp));
      unit = word.substr(pos, len);
      pos += len;
      if (len == 1 && (unsigned char)unit[0] < 128) {
        id = unit_id_[(unsigned char)unit[0]];
      } else {
        auto it = vocab_.find(unit);
        if (it != vocab_.end()) id = it->second;
      }
    }
    if (id >= 0) {
      if (pending_unk) out.push_back(unk_id_);
      pending_unk = false;
      out.push_back(id);
      continue;
    }
    if (byte_fallback_ && std::all_of(unit.begin(), unit.end(),
                                      [&](char c) { return byte_fallback_id_[(unsigned char)c] >= 0; })) {
      for (char c : unit) out.push_back(byte_fallback_id_[(unsigned char)c]);
      continue;  // as the library: a pending unk is not flushed here
    }
    if (unk_id_ >= 0) {
      if (pending_unk && !fuse_unk_) out.push_back(unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) out.push_back(unk_id_);
  merges_.apply(out, begin);
}

void HfTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  auto compute = [&](std::string_view w, std::vector<int32_t>& o) { bpe_word(w, o); };
  auto one = [&](std::string_view w) {
    if (w.size() == 1 && unit_id_[(unsigned char)w[0]] >= 0) out.push_back(unit_id_[(unsigned char)w[0]]);
    else cache_.encode(w, out, compute);
  };
  if (safe_split_.empty()) {
    one(word);
    return;
  }
  // Cut before each "▁" that follows another character (see the constructor).
  const std::string& c = safe_split_;
  size_t start = 0;
  for (size_t p = word.find(c, 1); p != std::string_view::npos; p = word.find(c, p + c.size())) {
    if (word.compare(p - std::min(p, c.size()), c.size(), c) == 0) continue;
    one(word.substr(start, p - start));
    start = p;
  }
  one(word.substr(start));
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  // (ICU's normalizer and the BPE's symbol list index a text with 32-bit ints)
  ORIGAMI_CHECK(text.size() <= size_t(std::numeric_limits<int32_t>::max()), "a document of ", text.size(),
                " bytes: a Hugging Face tokenizer encodes at most 2147483647 bytes (2 GiB) per document; split the "
                "input into smaller documents (data prepare --split)");
  std::vector<int32_t> out(prefix_ids_);
  out.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size() + 1);
  auto emit = [&](std::string_view word) { encode_word(word, out); };
  auto push_id = [&](int32_t id) { out.push_back(id); };
  std::string normalized;
  split_added(raw_matcher_, text, [&](size_t s, size_t e) {
    std::string_view seg = text.substr(s, e - s);
    std::string_view norm = seg;
    if (!norm_.empty()) {
      normalized.assign(seg);
      normalize(normalized);
      norm = normalized;
    }
    split_added(normalized_matcher_, norm, [&](size_t a, size_t b) {
      pretokenize(0, norm.substr(a, b - a), s == 0 && a == 0, emit);
    }, push_id);
  }, push_id);
  out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

std::vector<int32_t> HfTokenizer::encode_to_continue(std::string_view text) const {
  std::vector<int32_t> out = encode(text);
  out.resize(out.size() - suffix_ids_.size());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoding

// The library's decoders over token strings. streaming: one token at a time, as bytes (invalid
// UTF-8 kept, no leading-space strip, Metaspace never treats the token as the first).
std::vector<std::string> HfTokenizer::run_decoder(std::vector<std::string> tokens, bool streaming) const {
  if (!has_decoder_) {
    if (streaming) return tokens;
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return {joined};
  }
  static const std::unordered_map<char32_t, unsigned char> char_byte = [] {
    std::unordered_map<char32_t, unsigned char> m;
    for (int b = 0; b < 256; ++b) m[gpt2_byte_to_unicode()[b]] = (unsigned char)b;
    return m;
  }();
  for (const auto& d : dec_) {
    switch (d.kind) {
      case DecStep::byte_level: {
        std::string bytes;
        for (const auto& t : tokens) {
          std::string tb;
          bool all = true;
          for (size_t p = 0; p < t.size() && all;) {
            char32_t cp;
            p += size_t(next_code_point(t, p, cp));
            auto it = char_byte.find(cp);
            if (it == char_byte.end()) all = false;
            else tb += char(it->second);
          }
          bytes += all ? tb : t;
        }
        tokens = {streaming ? bytes : utf8_lossy(bytes)};
        break;
      }
      case DecStep::replace:
        for (auto& t : tokens) replace_all(t, d.a, d.b);
        break;
      case DecStep::byte_fallback: {
        std::vector<std::string> out;
        std::string pending;  // bytes of consecutive <0xNN> tokens
        auto flush = [&] {
          if (pending.empty()) return;
          if (streaming || utf8_lossy(pending) == pending) out.push_back(pending);
          else
            for (size_t k = 0; k < pending.size(); ++k) out.push_back("\xEF\xBF\xBD");
          pending.clear();
        };
        for (auto& t : tokens) {
          auto hex = [](char c) { return std::isxdigit((unsigned char)c) != 0; };
          if (t.size() == 6 && t.starts_with("<0x") && t[5] == '>' && hex(t[3]) && hex(t[4])) {
            pending += char(std::stoi(t.substr(3, 2), nullptr, 16));
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecStep::fuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case DecStep::strip: {
        if (streaming) break;
        for (auto& t : tokens) {
          std::vector<size_t> starts;  // char boundaries
          for (size_t p = 0; p < t.size();) {
            starts.push_back(p);
            char32_t cp;
            p += size_t(next_code_point(t, p, cp));
          }
          size_t nchars = starts.size(), lo = 0, hi = nchars;
          auto is_c = [&](size_t i) {
            size_t end = i + 1 < nchars ? starts[i + 1] : t.size();
            return t.compare(starts[i], end - starts[i], d.a) == 0;
          };
          for (size_t i = 0; i < size_t(d.start) && i < nchars && is_c(i); ++i) lo = i + 1;
          for (size_t i = 0; i < size_t(d.stop) && i < nchars && is_c(nchars - 1 - i); ++i) hi = nchars - 1 - i;
          if (lo >= hi) t.clear();
          else t = t.substr(starts[lo], (hi < nchars ? starts[hi] : t.size()) - starts[lo]);
        }
        break;
      }
      case DecStep::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i)
          replace_all(tokens[i], d.a, (!streaming && i == 0 && d.prepend) ? "" : " ");
        break;
    }
  }
  return tokens;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    ORIGAMI_CHECK(id >= 0 && id < vocab_size() && id_valid_[id], name(), " tokenizer: token id ", id,
                  " is not in the vocabulary (size ", vocab_size(), ")");
    out += id_bytes_[id];
  }
  return out;
}

std::string HfTokenizer::decode_text(std::span<const int32_t> ids, bool skip_special) const {
  std::vector<std::string> tokens;
  for (int32_t id : ids) {
    ORIGAMI_CHECK(id >= 0 && id < vocab_size() && id_valid_[id], name(), " tokenizer: token id ", id,
                  " is not in the vocabulary (size ", vocab_size(), ")");
    if (!(skip_special && id_special_[id])) tokens.push_back(id_token_[id]);
  }
  std::string out;
  for (const auto& t : run_decoder(std::move(tokens), false)) out += t;
  return out;
}

}  // namespace origami
