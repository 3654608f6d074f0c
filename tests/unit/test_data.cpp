// Data module: tokenizers, Megatron indexed dataset (layout and every validation error), sampler.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <set>
#include <unistd.h>

#include "core/error.h"
#include "core/files.h"
#include "data/bpe.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"

using namespace origami;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("origami_test_data_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// Expects fn() to throw origami::Error whose message contains every needle.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nlacks: " << n;
    return;
  }
  ADD_FAILURE() << "no origami::Error thrown";
}

std::string read_bytes(const std::string& path) { return read_file_bytes(path); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

template <typename T>
void append(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void write_dataset(const std::string& prefix, TokenDtype dtype, const std::vector<std::vector<int32_t>>& docs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tokenizers

TEST(DataByteTokenizer, RoundTripsEveryByte) {
  ByteTokenizer tok;
  std::string text;
  for (int b = 0; b < 256; ++b) text += char(b);
  text += "héllo\n";
  auto ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(ids[i], int32_t((unsigned char)text[i]));
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.eod(), 256);
  std::vector<int32_t> eod{256};
  EXPECT_EQ(tok.decode(eod), "<|endoftext|>");
  // The literal text of the end of document is that token (as in the gpt2 tokenizer and the Hub export).
  EXPECT_EQ(tok.encode("a<|endoftext|>b<|endoftext"), (std::vector<int32_t>{97, 256, 98, 60, 124, 101, 110, 100,
                                                                              111, 102, 116, 101, 120, 116}));
  EXPECT_EQ(tok.decode(tok.encode("x<|endoftext|>")), "x<|endoftext|>");
  std::vector<int32_t> bad{257};
  expect_error([&] { tok.decode(bad); }, {"257", "[0, 257)"});
  EXPECT_EQ(tok.to_json(), nlohmann::json({{"type", "byte"}}));
  EXPECT_EQ(tokenizer_from_json(tok.to_json())->name(), "byte");
}

// Decoded bytes as a stream prints them: a well-formed start of a multi-byte character at the end is held
// back (the next token completes it), anything else printed as it is; at the end of the stream the
// held-back start is one U+FFFD, as Python's errors="replace" reads it.
TEST(DataUtf8, WholePrefixHoldsBackOnlyACutCharacter) {
  EXPECT_EQ(utf8_whole_prefix("caf"), 3u);
  EXPECT_EQ(utf8_whole_prefix("caf\xC3"), 3u);              // é cut after its lead byte
  EXPECT_EQ(utf8_whole_prefix("caf\xC3\xA9"), 5u);
  EXPECT_EQ(utf8_whole_prefix("\xE2\x82"), 0u);             // € cut after two bytes
  EXPECT_EQ(utf8_whole_prefix("\xF0\x9F\x98"), 0u);         // an emoji cut after three
  EXPECT_EQ(utf8_whole_prefix("a\xFF"), 2u);                // not a lead byte: never completed
  EXPECT_EQ(utf8_whole_prefix("a\xC3("), 3u);               // a broken character, not a cut one
  EXPECT_EQ(utf8_whole_prefix("\xE0\x80"), 2u);             // E0 80 starts no character (overlong)
  EXPECT_EQ(utf8_lossy("caf\xC3"), "caf\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("a\xFF\xC3\xA9"), "a\xEF\xBF\xBD\xC3\xA9");
}

TEST(DataPretokenize, MatchesGpt2Regex) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(gpt2_pretokenize("Hello world"), (V{"Hello", " world"}));
  // \s+(?!\S) leaves the last space of a run to join the next word; a trailing run stays whole.
  EXPECT_EQ(gpt2_pretokenize("a   b  "), (V{"a", "  ", " b", "  "}));
  EXPECT_EQ(gpt2_pretokenize("it's we'll I'M"), (V{"it", "'s", " we", "'ll", " I", "'", "M"}));
  EXPECT_EQ(gpt2_pretokenize("x\n\ny"), (V{"x", "\n", "\n", "y"}));
  EXPECT_EQ(gpt2_pretokenize("abc123 45!?"), (V{"abc", "123", " 45", "!?"}));
  EXPECT_EQ(gpt2_pretokenize("Привет, мир"), (V{"Привет", ",", " мир"}));
  EXPECT_EQ(gpt2_pretokenize("日本語 ½²"), (V{"日本語", " ½²"}));
  EXPECT_EQ(gpt2_pretokenize("e\xcc\x81"), (V{"e", "\xcc\x81"}));             // combining mark: not \p{L}
  EXPECT_EQ(gpt2_pretokenize("a\xc2\xa0 b"), (V{"a", "\xc2\xa0", " b"}));     // NBSP is \s
  EXPECT_EQ(gpt2_pretokenize("a\xff\xfe b"), (V{"a", "\xff\xfe", " b"}));      // invalid UTF-8: "other"
  std::string text = "  mixed \t text's 12 ,,, \xe4\xb8\xad\n\n ";
  std::string joined;
  for (auto p : gpt2_pretokenize(text)) joined += p;
  EXPECT_EQ(joined, text);
}

namespace {
// A tiny byte-level BPE: the 256 byte symbols (ids 0..255 in byte order), <|endoftext|> = 256,
// then merged tokens.
Gpt2BpeTokenizer tiny_bpe(std::vector<std::pair<std::string, std::string>> merges, bool with_eod = true) {
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::string sym[256];
  for (int b = 0; b < 256; ++b) {
    char32_t cp = gpt2_byte_to_unicode()[b];
    std::string s;
    if (cp < 0x80) s += char(cp);
    else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    sym[b] = s;
    vocab.emplace_back(s, b);
  }
  if (with_eod) vocab.emplace_back("<|endoftext|>", 256);
  int32_t next = 257;
  std::set<std::string> seen;
  for (auto& [a, b] : merges)
    if (seen.insert(a + b).second) vocab.emplace_back(a + b, next++);
  return Gpt2BpeTokenizer(vocab, merges, "tiny");
}
}  // namespace

TEST(DataGpt2Bpe, MergesByRankAndRoundTrips) {
  // "Ġ" is the byte-level symbol of the space.
  auto tok = tiny_bpe({{"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"a", "a"}});
  EXPECT_EQ(tok.vocab_size(), 257 + 6);
  EXPECT_EQ(tok.eod(), 256);
  auto ids = tok.encode("hello");
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(tok.decode(ids), "hello");
  // Equal ranks merge leftmost first: aaa -> (aa)(a).
  auto aaa = tok.encode("aaa");
  ASSERT_EQ(aaa.size(), 2u);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{aaa[0]}), "aa");
  // Pieces are merged separately: " w" merges, "h"+"ello" across a piece boundary do not.
  auto ids2 = tok.encode("hello world");
  EXPECT_EQ(tok.decode(ids2), "hello world");
  EXPECT_EQ(ids2.size(), 1u + 1u + 4u);  // hello, Ġw, o r l d
  // A literal <|endoftext|> is the special token.
  auto ids3 = tok.encode("a<|endoftext|>b");
  EXPECT_EQ(ids3, (std::vector<int32_t>{'a', 256, 'b'}));
  std::string nasty = "ünïcödé \xff\xfe\n\t<|endoftext|>  ";
  EXPECT_EQ(tok.decode(tok.encode(nasty)), nasty);
  // The JSON form gives the same tokenizer.
  auto again = tokenizer_from_json(tok.to_json());
  EXPECT_EQ(again->encode(nasty), tok.encode(nasty));
  EXPECT_EQ(again->vocab_size(), tok.vocab_size());
  expect_error([&] { tok.decode(std::vector<int32_t>{9999}); }, {"9999", "not in the vocabulary"});
}

TEST(DataGpt2Bpe, RejectsBadVocabularies) {
  expect_error([] { tiny_bpe({{"h", "e"}}, /*with_eod=*/false); }, {"tiny", "<|endoftext|>"});
  std::vector<std::pair<std::string, int32_t>> vocab{{"a", 0}, {"<|endoftext|>", 1}};
  expect_error([&] { Gpt2BpeTokenizer(vocab, {}, "small.json"); }, {"small.json", "byte", "missing"});
  // A merge whose result is not in the vocabulary.
  auto ok = tiny_bpe({});
  auto j = ok.to_json();
  j["merges"].push_back("x y");
  expect_error([&] { tokenizer_from_json(j, "t.json"); }, {"t.json", "merge 1", "'xy'"});
  expect_error([] { tokenizer_from_json({{"type", "sentencepiece"}}, "t.json"); }, {"t.json", "sentencepiece"});
}

TEST(DataTokenizerFile, SaveLoadAndErrors) {
  TempDir dir;
  auto tok = tiny_bpe({{"h", "e"}});
  save_tokenizer_file(tok, dir / "t.json");
  auto loaded = load_tokenizer_file(dir / "t.json");
  EXPECT_EQ(loaded->name(), "gpt2");
  EXPECT_EQ(loaded->encode("he he"), tok.encode("he he"));
  expect_error([&] { load_tokenizer_file(dir / "missing.json"); }, {dir / "missing.json", "no such file"});
  write_bytes(dir / "bad.json", "{\"type\": ");
  expect_error([&] { load_tokenizer_file(dir / "bad.json"); }, {dir / "bad.json", "not valid JSON"});
  write_bytes(dir / "merges.txt", "#version: 0.2\nh e\nh e x\n");
  write_bytes(dir / "vocab.json", tok.to_json()["vocab"].dump());
  expect_error([&] { Gpt2BpeTokenizer::from_files(dir / "vocab.json", dir / "merges.txt"); },
               {dir / "merges.txt" + ":3", "two tokens"});
}

namespace {
// A tiny Llama-2 style Hugging Face file: <unk> <s> </s>, the 256 <0xNN> tokens, then ▁ h i ▁h ▁hi.
nlohmann::json tiny_llama2_json() {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["\u2581"] = 259;
  vocab["h"] = 260;
  vocab["i"] = 261;
  vocab["\u2581h"] = 262;
  vocab["\u2581hi"] = 263;
  nlohmann::json added = nlohmann::json::array();
  for (auto [t, id] : {std::pair{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}})
    added.push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\u2581"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", {"\u2581 h", nlohmann::json::array({"\u2581h", "i"})}}}}};
}
}  // namespace

TEST(DataHfTokenizer, SentencePieceStyleEncodesAndDecodes) {
  auto tok = tokenizer_from_json(tiny_llama2_json(), "tiny.json");
  EXPECT_EQ(tok->name(), "huggingface-bpe");
  EXPECT_EQ(tok->vocab_size(), 264);
  EXPECT_EQ(tok->eod(), 2);  // </s>: the default when no tokenizer_config.json says otherwise
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok->encode("hi hi"), (V{1, 263, 263}));                    // <s> ▁hi ▁hi
  EXPECT_EQ(tok->encode("h\xc3\xa9"), (V{1, 262, 3 + 0xC3, 3 + 0xA9}));  // é by byte fallback
  // A special token splits the text; each side is normalized on its own (so gets its own ▁).
  EXPECT_EQ(tok->encode("hi</s>hi"), (V{1, 263, 2, 263}));
  // decode_text is the library's decode: the fused text, its first space stripped.
  EXPECT_EQ(tok->decode_text(tok->encode("hi h\xc3\xa9")), "<s> hi h\xc3\xa9");
  EXPECT_EQ(tok->decode_text(tok->encode("hi h\xc3\xa9"), /*skip_special=*/true), "hi h\xc3\xa9");
  EXPECT_EQ(tok->decode_text(V{262, 3 + 0xC3}), "h\xef\xbf\xbd");  // a cut character: U+FFFD
  // decode is per token and concatenates (what generate prints token by token).
  V ids = tok->encode("hi hi h\xc3\xa9");
  std::string streamed;
  for (int32_t id : ids) streamed += tok->decode(V{id});
  EXPECT_EQ(streamed, tok->decode(ids));
  EXPECT_EQ(streamed, "<s> hi hi h\xc3\xa9");
  // The JSON form holds the file and the eod choice.
  auto again = tokenizer_from_json(tok->to_json());
  EXPECT_EQ(again->encode("hi hih"), tok->encode("hi hih"));
  EXPECT_EQ(tok->to_json()["eod_token"], "</s>");
  EXPECT_EQ(tokenizer_from_json(tiny_llama2_json(), "tiny.json", "<s>")->eod(), 1);
  expect_error([&] { tok->decode(V{999}); }, {"999", "not in the vocabulary"});
}

TEST(DataHfTokenizer, FilesAndErrors) {
  TempDir dir;
  auto j = tiny_llama2_json();
  write_file_atomically(dir / "tokenizer.json", j.dump());
  // A tokenizer_config.json beside a plain file names the eod token.
  write_file_atomically(dir / "tokenizer_config.json", R"({"eos_token": "<s>"})");
  EXPECT_EQ(load_tokenizer_file(dir / "tokenizer.json")->eod(), 1);
  EXPECT_EQ(load_tokenizer_file(dir / "tokenizer.json", "<unk>")->eod(), 0);
  // The export of a huggingface tokenizer file is the inner Hugging Face file.
  save_tokenizer_file(*load_tokenizer_file(dir / "tokenizer.json"), dir / "saved.json");
  EXPECT_EQ(nlohmann::json::parse(tokenizer_files_for_hf_export(dir / "saved.json").tokenizer_json), j);
  EXPECT_EQ(load_tokenizer_file(dir / "saved.json")->eod(), 1);
  auto bad = j;
  bad["model"]["type"] = "WordPiece";
  expect_error([&] { tokenizer_from_json(bad, "t.json"); }, {"t.json", "model type 'WordPiece'"});
  bad = j;
  bad["normalizer"] = {{"type", "Lowercase"}};
  expect_error([&] { tokenizer_from_json(bad, "t.json"); }, {"t.json", "normalizer 'Lowercase'"});
  bad = j;
  bad["model"]["end_of_word_suffix"] = "</w>";
  expect_error([&] { tokenizer_from_json(bad, "t.json"); }, {"t.json", "end_of_word_suffix"});
  bad = j;
  bad["added_tokens"].erase(2);
  bad["model"]["vocab"].erase("</s>");
  expect_error([&] { tokenizer_from_json(bad, "t.json"); }, {"t.json", "--eod-token"});
  expect_error([&] { tokenizer_from_json(j, "t.json", "<none>"); }, {"t.json", "'<none>'"});
  expect_error([&] { tokenizer_from_json(ByteTokenizer().to_json(), "b.json", "</s>"); }, {"b.json", "--eod-token"});
}

// Byte-level BPE with merges "b Ġ", "a b", "1 2" after Split(\\d+) and Split([a-z]+), both Isolated (as
// DeepSeek-V3's file chains three): the inner Split's matches must not move the outer one's position.
// The expected ids are the `tokenizers` library's.
TEST(DataHfTokenizer, ChainedIsolatedSplits) {
  nlohmann::json j = hub_tokenizer({{"type", "byte"}});
  j["model"]["vocab"]["ab"] = 256;
  j["model"]["vocab"]["12"] = 257;
  j["model"]["vocab"]["b\u0120"] = 258;
  j["added_tokens"][0]["id"] = 259;  // (the library numbers an added token after the vocabulary)
  j["model"]["merges"] = {"b \u0120", "a b", "1 2"};
  auto split = [](const char* regex) {
    return nlohmann::json{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}};
  };
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {split("\\d+"), split("[a-z]+"),
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  auto tok = tokenizer_from_json(j, "chain.json");
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok->encode("ab 12"), (V{256, 32, 257}));
  EXPECT_EQ(tok->encode("ab 12 cd34ef 5"), (V{256, 32, 257, 32, 99, 100, 51, 52, 101, 102, 32, 53}));
  EXPECT_EQ(tok->encode("x1y22ab b "), (V{120, 49, 121, 50, 50, 256, 32, 98, 32}));
}

TEST(DataHfTokenizer, SizeLimits) {
  // A vocabulary whose ids leave a vast gap would size the id tables by the largest (2^28: ~16 GiB).
  auto j = tiny_llama2_json();
  j["model"]["vocab"]["far"] = (1 << 28) - 1;
  expect_error([&] { tokenizer_from_json(j, "sparse.json"); }, {"sparse.json", "268435455", "4 x tokens + 65536"});
  // A document of 2^31 bytes is refused, not cut (ICU and the BPE index with 32-bit ints).
  // (an address range reserved, never touched: the check comes before any read)
  auto tok = tokenizer_from_json(tiny_llama2_json(), "tiny.json");
  const size_t n = size_t(1) << 31;
  void* big = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(big, MAP_FAILED);
  expect_error([&] { tok->encode(std::string_view(static_cast<const char*>(big), n)); }, {"2147483648 bytes", "--split"});
  ::munmap(big, n);
}

TEST(DataGpt2Bpe, EncodesOnManyThreads) {
  // Each thread has its own piece cache: results equal the single-threaded ones.
  auto tok = tiny_bpe({{"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {"\xc4\xa0", "w"}});
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) texts.push_back("hello world " + std::to_string(i * 7919) + " hellhole wow");
  std::vector<std::vector<int32_t>> serial, parallel(texts.size());
  for (const auto& t : texts) serial.push_back(tok.encode(t));
#pragma omp parallel for num_threads(4)
  for (size_t i = 0; i < texts.size(); ++i) parallel[i] = tok.encode(texts[i]);
  EXPECT_EQ(parallel, serial);
}

// ---------------------------------------------------------------------------------------------
// Indexed dataset

TEST(DataIndexedDataset, RoundTripBothDtypes) {
  TempDir dir;
  for (TokenDtype dtype : {TokenDtype::uint16, TokenDtype::int32}) {
    int32_t big = dtype == TokenDtype::uint16 ? 65535 : 1'000'000;
    std::vector<std::vector<int32_t>> docs{{1, 2, 3}, {}, {big, 0}, {7}, {8, 9, 10, 11}};
    std::string prefix = dir / token_dtype_name(dtype);
    write_dataset(prefix, dtype, docs);
    EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
    auto ds = IndexedDataset::open(prefix);
    EXPECT_EQ(ds.dtype(), dtype);
    EXPECT_EQ(ds.num_sequences(), 5u);
    EXPECT_EQ(ds.num_documents(), 5u);
    EXPECT_EQ(ds.num_tokens(), 10u);
    std::vector<int32_t> all;
    for (auto& d : docs) all.insert(all.end(), d.begin(), d.end());
    // Every sub-range of the concatenation, across document boundaries and the empty document.
    for (uint64_t first = 0; first <= all.size(); ++first)
      for (uint64_t count = 0; first + count <= all.size(); ++count) {
        std::vector<int32_t> out(count, -1);
        ds.read_tokens(first, count, out.data());
        EXPECT_TRUE(std::equal(out.begin(), out.end(), all.begin() + long(first))) << first << "+" << count;
      }
    int32_t x;
    expect_error([&] { ds.read_tokens(10, 1, &x); }, {prefix, "beyond", "10 tokens"});
    IndexedDataset moved = std::move(ds);
    EXPECT_EQ(moved.num_tokens(), 10u);
  }
}

TEST(DataIndexedDataset, HeaderLayoutIsMegatrons) {
  TempDir dir;
  write_dataset(dir / "ds", TokenDtype::uint16, {{1, 2, 3}, {4, 5}});
  std::string expected("MMIDIDX\0\0", 9);
  append<uint64_t>(expected, 1);           // version
  append<uint8_t>(expected, 8);            // dtype code: uint16
  append<uint64_t>(expected, 2);           // sequence count
  append<uint64_t>(expected, 3);           // document count = documents + 1
  append<int32_t>(expected, 3);            // sequence lengths
  append<int32_t>(expected, 2);
  append<int64_t>(expected, 0);            // byte pointers
  append<int64_t>(expected, 6);
  append<int64_t>(expected, 0);            // document indices
  append<int64_t>(expected, 1);
  append<int64_t>(expected, 2);
  EXPECT_EQ(read_bytes(dir / "ds.idx"), expected);
  std::string bin;
  for (uint16_t t : {1, 2, 3, 4, 5}) append<uint16_t>(bin, t);
  EXPECT_EQ(read_bytes(dir / "ds.bin"), bin);

  write_dataset(dir / "ds32", TokenDtype::int32, {{70000}});
  std::string idx32 = read_bytes(dir / "ds32.idx");
  EXPECT_EQ(uint8_t(idx32[17]), 4);
  EXPECT_EQ(read_bytes(dir / "ds32.bin"), std::string("\x70\x11\x01\x00", 4));
}

TEST(DataIndexedDataset, WriterRules) {
  TempDir dir;
  EXPECT_EQ(token_dtype_for_vocab(257), TokenDtype::uint16);
  EXPECT_EQ(token_dtype_for_vocab(65535), TokenDtype::uint16);
  EXPECT_EQ(token_dtype_for_vocab(65536), TokenDtype::int32);
  EXPECT_EQ(token_dtype_for_vocab(128256), TokenDtype::int32);
  {
    IndexedDatasetWriter w(dir / "ds", TokenDtype::uint16);
    std::vector<int32_t> too_big{65536};
    expect_error([&] { w.add_document(too_big); }, {"65536", "uint16"});
    std::vector<int32_t> negative{-1};
    expect_error([&] { w.add_document(negative); }, {"-1"});
  }  // destroyed before finish(): nothing left behind
  EXPECT_TRUE(fs::is_empty(dir.path));
}

TEST(DataIndexedDataset, EveryValidationError) {
  TempDir dir;
  const std::string good = dir / "good";
  write_dataset(good, TokenDtype::uint16, {{1, 2, 3}, {4, 5}});
  const std::string idx = read_bytes(good + ".idx"), bin = read_bytes(good + ".bin");
  int n = 0;
  // Writes a damaged copy of the good dataset and expects open() to reject it.
  auto damaged = [&](const std::string& idx_bytes, const std::string& bin_bytes,
                     std::initializer_list<std::string> needles) {
    std::string prefix = dir / ("bad" + std::to_string(n++));
    write_bytes(prefix + ".idx", idx_bytes);
    write_bytes(prefix + ".bin", bin_bytes);
    expect_error([&] { IndexedDataset::open(prefix); }, needles);
    expect_error([&] { IndexedDataset::open(prefix); }, {prefix});
  };
  auto patch = [&](size_t at, const std::string& bytes, std::string s = "") {
    if (s.empty()) s = idx;
    s.replace(at, bytes.size(), bytes);
    return s;
  };
  auto u64 = [](uint64_t v) { std::string s; append(s, v); return s; };
  auto i64 = [](int64_t v) { std::string s; append(s, v); return s; };
  auto i32 = [](int32_t v) { std::string s; append(s, v); return s; };

  expect_error([&] { IndexedDataset::open(dir / "none"); }, {dir / "none.idx", "no such file"});
  write_bytes(dir / "nobin.idx", idx);
  expect_error([&] { IndexedDataset::open(dir / "nobin"); }, {dir / "nobin.bin", "no such file"});
  damaged(idx.substr(0, 20), bin, {".idx", "truncated", "header"});
  damaged(patch(0, "XMIDIDX"), bin, {".idx", "bad magic"});
  damaged(patch(9, u64(2)), bin, {".idx", "version 2"});
  damaged(patch(17, std::string(1, '\x07')), bin, {".idx", "dtype code 7"});
  damaged(idx.substr(0, idx.size() - 1), bin, {".idx", "truncated"});
  damaged(idx + "x", bin, {".idx", "trailing bytes"});
  damaged(patch(18, u64(1000000)), bin, {".idx", "sequence count 1000000"});
  damaged(patch(18, u64(3)), bin, {".idx", "needs exactly"});  // count disagrees with the size
  damaged(patch(34, i32(-3)), bin, {".idx", "negative length -3"});
  damaged(patch(34 + 8 + 8, i64(8)), bin, {".idx", "sequence 1", "outside", ".bin"});   // pointer past end
  damaged(patch(34 + 8 + 8, i64(3)), bin, {".idx", "sequence 1", "outside"});           // misaligned pointer
  damaged(patch(34 + 8, i64(-2)), bin, {".idx", "sequence 0", "outside"});             // negative pointer
  damaged(idx, bin.substr(0, 8), {".idx", "sequence 1", "outside", "8 bytes"});         // truncated .bin
  damaged(patch(34 + 8 + 16, i64(1)), bin, {".idx", "start at 0"});                     // doc_idx[0] != 0
  damaged(patch(34 + 8 + 16 + 16, i64(1)), bin, {".idx", "end at the sequence count 2"});  // last != S
  damaged(patch(34 + 8 + 16 + 8, i64(3)), bin, {".idx", "document index 1 = 3"});          // beyond S
  damaged(patch(34 + 8 + 16 + 16, i64(1), patch(34 + 8 + 16 + 8, i64(2))), bin,
          {".idx", "document index 2 = 1", "non-decreasing"});                               // decreasing
  // D = 0 with a size that matches it.
  std::string no_docs = patch(26, u64(0)).substr(0, idx.size() - 24);
  damaged(no_docs, bin, {".idx", "document count is 0"});
}

// ---------------------------------------------------------------------------------------------
// Sampler

namespace {
// A dataset whose token at stream position p is p % 60000, in documents of assorted lengths.
std::string counting_dataset(const TempDir& dir, int64_t num_tokens) {
  std::string prefix = dir / "count";
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  int64_t p = 0, len = 1;
  while (p < num_tokens) {
    std::vector<int32_t> doc;
    for (int64_t k = 0; k < len && p < num_tokens; ++k, ++p) doc.push_back(int32_t(p % 60000));
    w.add_document(doc);
    len = len % 13 + 1;
  }
  w.finish();
  return prefix;
}
}  // namespace

TEST(DataSampler, SequentialWindowsFollowTheFormula) {
  TempDir dir;
  auto ds = IndexedDataset::open(counting_dataset(dir, 1001));
  const int64_t T = 16;
  WindowSampler s(ds, T, SampleOrder::sequential, 0);
  EXPECT_EQ(s.num_windows(), (1001 - 1) / 16);  // 62: the last window ends at token 62*16 = 992
  std::vector<int32_t> out(T + 1);
  for (int64_t i = 0; i < 3 * s.num_windows(); i += 7) {
    int64_t w = i % s.num_windows();
    EXPECT_EQ(s.window_index(i), w);
    s.window(i, out.data());
    for (int64_t k = 0; k <= T; ++k) ASSERT_EQ(out[k], int32_t(w * T + k)) << "sample " << i;
  }
  // Exactly T+1 tokens is one window; T tokens is an error naming the dataset.
  TempDir dir2;
  {
    auto exact = IndexedDataset::open(counting_dataset(dir2, 17));
    WindowSampler one(exact, 16, SampleOrder::sequential, 0);
    EXPECT_EQ(one.num_windows(), 1);
  }
  auto short_ds = IndexedDataset::open(counting_dataset(dir2, 16));
  expect_error([&] { WindowSampler(short_ds, 16, SampleOrder::sequential, 0); }, {dir2 / "count", "16 tokens", "17"});
  expect_error([] { parse_sample_order("random"); }, {"random", "sequential", "shuffled"});
  EXPECT_EQ(parse_sample_order("shuffled"), SampleOrder::shuffled);
}

TEST(DataSampler, ShuffledIsASeededPermutationPerEpoch) {
  TempDir dir;
  auto ds = IndexedDataset::open(counting_dataset(dir, 4000));
  const int64_t T = 8;
  WindowSampler a(ds, T, SampleOrder::shuffled, 1234);
  const int64_t N = a.num_windows();
  ASSERT_EQ(N, (4000 - 1) / 8);
  std::vector<std::vector<int64_t>> epochs(3);
  for (int64_t i = 0; i < 3 * N; ++i) epochs[size_t(i / N)].push_back(a.window_index(i));
  for (auto& e : epochs) {
    std::vector<int64_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> iota(static_cast<size_t>(N));
    std::iota(iota.begin(), iota.end(), int64_t(0));
    EXPECT_EQ(sorted, iota) << "an epoch must visit every window exactly once";
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  std::vector<int64_t> identity(static_cast<size_t>(N));
  std::iota(identity.begin(), identity.end(), int64_t(0));
  EXPECT_NE(epochs[0], identity);
  // Same seed: same order, even when visited in another order (random access across epochs).
  WindowSampler b(ds, T, SampleOrder::shuffled, 1234);
  for (int64_t i = 3 * N - 1; i >= 0; i -= 5) EXPECT_EQ(b.window_index(i), epochs[size_t(i / N)][size_t(i % N)]);
  // Another seed: another order.
  WindowSampler c(ds, T, SampleOrder::shuffled, 1235);
  std::vector<int64_t> other;
  for (int64_t i = 0; i < N; ++i) other.push_back(c.window_index(i));
  EXPECT_NE(other, epochs[0]);
  // The tokens are those of the chosen window.
  std::vector<int32_t> out(T + 1);
  a.window(N + 3, out.data());
  int64_t w = epochs[1][3];
  for (int64_t k = 0; k <= T; ++k) EXPECT_EQ(out[k], int32_t(w * T + k));
}
