// `origami data`: make and inspect tokenized datasets (Megatron .bin/.idx + tokenizer JSON).
//
//   origami data prepare --input FILE|DIR --output PREFIX [--tokenizer byte|gpt2|FILE.json]
//                        [--vocab vocab.json --merges merges.txt] [--split auto|fortune|file|line]
//   origami data info --data PREFIX
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/timer.h"
#include "core/files.h"
#include "data/indexed_dataset.h"
#include "data/tokenizer.h"

namespace origami {
namespace {

namespace fs = std::filesystem;

const char* kDataUsage =
    "usage: origami data <subcommand> [options]\n"
    "\n"
    "subcommands:\n"
    "  prepare    tokenize text files into PREFIX.bin / PREFIX.idx (Megatron's indexed dataset)\n"
    "             and PREFIX.tokenizer.json\n"
    "  info       check a dataset and print its counts\n"
    "\n"
    "'origami data <subcommand> --help' describes its options.\n";

const char* kPrepareSummary =
    "Tokenizes text into a Megatron indexed dataset: PREFIX.bin, PREFIX.idx and PREFIX.tokenizer.json.\n"
    "Each document's tokens are followed by the tokenizer's end-of-document token (one sequence per document).\n"
    "\n"
    "A directory input takes its regular files recursively, sorted by path, skipping hidden entries,\n"
    "symbolic links and fortune's companion files X.dat / X.u8 of a file X.\n"
    "--split decides how a file becomes documents:\n"
    "  fortune  records separated by lines holding only '%' (the fortune(6) format)\n"
    "  file     the whole file is one document\n"
    "  line     each line (without its line break) is one document\n"
    "  auto     fortune for a file that has a '%' line, else file\n"
    "Documents that are empty or only whitespace are skipped.";

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); });
}

// The line starting at `pos` (without its '\n'); sets `next` past the '\n' (or to the end).
std::string_view line_at(std::string_view text, size_t pos, size_t& next) {
  size_t end = text.find('\n', pos);
  next = end == std::string_view::npos ? text.size() : end + 1;
  return text.substr(pos, (end == std::string_view::npos ? text.size() : end) - pos);
}

bool is_fortune_separator(std::string_view line) { return line == "%" || line == "%\r"; }

bool has_fortune_separator(std::string_view text) {
  for (size_t pos = 0, next; pos < text.size(); pos = next)
    if (is_fortune_separator(line_at(text, pos, next))) return true;
  return false;
}

// Calls emit(document) for each document of one file's text, per the split mode.
template <typename Emit>
void split_documents(std::string_view text, const std::string& split, Emit&& emit) {
  auto emit_nonblank = [&](std::string_view doc) {
    if (!is_blank(doc)) emit(doc);
  };
  std::string mode = split == "auto" ? (has_fortune_separator(text) ? "fortune" : "file") : split;
  if (mode == "file") {
    emit_nonblank(text);
  } else if (mode == "line") {
    for (size_t pos = 0, next; pos < text.size(); pos = next) {
      std::string_view line = line_at(text, pos, next);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      emit_nonblank(line);
    }
  } else {  // fortune: a record is the text (with its line breaks) between '%' lines
    size_t start = 0;
    for (size_t pos = 0, next; pos < text.size(); pos = next) {
      if (!is_fortune_separator(line_at(text, pos, next))) continue;
      emit_nonblank(text.substr(start, pos - start));
      start = next;
    }
    emit_nonblank(text.substr(start));
  }
}

// The input files: FILE itself, or DIR's regular files (recursively, sorted by path). In a
// directory, hidden entries, symbolic links and fortune's companions X.dat / X.u8 of a file X
// are skipped.
std::vector<std::string> collect_input_files(const std::string& input) {
  std::error_code ec;
  auto st = fs::status(input, ec);
  ORIGAMI_CHECK(fs::exists(st), "--input ", input, ": no such file or directory");
  if (fs::is_regular_file(st)) return {input};
  ORIGAMI_CHECK(fs::is_directory(st), "--input ", input, ": neither a regular file nor a directory");
  std::vector<std::string> files;
  auto it = fs::recursive_directory_iterator(input, ec);
  ORIGAMI_CHECK(!ec, "--input ", input, ": cannot list directory (", ec.message(), ")");
  for (auto end = fs::recursive_directory_iterator(); it != end; it.increment(ec)) {
    ORIGAMI_CHECK(!ec, "--input ", input, ": cannot list directory (", ec.message(), ")");
    const fs::path& p = it->path();
    std::string name = p.filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_symlink() || !it->is_regular_file()) continue;
    std::string ext = p.extension().string();
    if ((ext == ".dat" || ext == ".u8") && fs::is_regular_file(p.parent_path() / p.stem())) continue;
    files.push_back(p.string());
  }
  std::sort(files.begin(), files.end());
  ORIGAMI_CHECK(!files.empty(), "--input ", input, ": the directory holds no input files");
  return files;
}

std::unique_ptr<Tokenizer> make_tokenizer(const Args& args) {
  std::string kind = args.str("tokenizer");
  if (kind == "byte") return std::make_unique<ByteTokenizer>();
  if (kind == "gpt2") {
    ORIGAMI_CHECK(args.has("vocab") && args.has("merges"),
                  "--tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt");
    return Gpt2BpeTokenizer::from_files(args.str("vocab"), args.str("merges"));
  }
  ORIGAMI_CHECK(kind.ends_with(".json"), "--tokenizer '", kind,
                "' is not known (use byte, gpt2 with --vocab/--merges, or a tokenizer .json file)");
  return load_tokenizer_file(kind);
}

int data_prepare(int argc, char** argv) {
  Args args("data prepare", kPrepareSummary);
  args.option("input", "FILE|DIR", "text file, or directory of text files (recursive, sorted)")
      .option("output", "PREFIX", "output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
      .option("tokenizer", "NAME", "byte, gpt2 (needs --vocab and --merges) or a tokenizer .json file", "byte")
      .option("vocab", "FILE", "Hugging Face vocab.json of a GPT-2 byte-level BPE")
      .option("merges", "FILE", "Hugging Face merges.txt of a GPT-2 byte-level BPE")
      .option("split", "MODE", "auto, fortune, file or line (see above)", "auto");
  if (!args.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(args.has("input"), "--input is required (see 'origami data prepare --help')");
  ORIGAMI_CHECK(args.has("output"), "--output is required (see 'origami data prepare --help')");
  std::string split = args.str("split");
  ORIGAMI_CHECK(split == "auto" || split == "fortune" || split == "file" || split == "line", "--split '", split,
                "' is not known (use auto, fortune, file or line)");
  if (args.str("tokenizer") != "gpt2")
    ORIGAMI_CHECK(!args.has("vocab") && !args.has("merges"), "--vocab/--merges only apply to --tokenizer gpt2");
  const std::string prefix = args.str("output");
  fs::path out_dir = fs::path(prefix).parent_path();
  ORIGAMI_CHECK(out_dir.empty() || fs::is_directory(out_dir), "--output ", prefix, ": directory ",
                out_dir.string(), " does not exist");

  std::vector<std::string> files = collect_input_files(args.str("input"));
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(args);
  const TokenDtype dtype = token_dtype_for_vocab(tokenizer->vocab_size());

  Timer timer;
  double encode_ms = 0;
  uint64_t num_bytes = 0;
  IndexedDatasetWriter writer(prefix, dtype);
  std::vector<int32_t> ids;
  for (const auto& file : files) {
    std::string text = read_file_bytes(file);
    num_bytes += text.size();
    split_documents(text, split, [&](std::string_view doc) {
      Timer t;
      ids = tokenizer->encode(doc);
      encode_ms += t.ms();
      ids.push_back(tokenizer->eod());
      writer.add_document(ids);
    });
  }
  ORIGAMI_CHECK(writer.num_documents() > 0, "--input ", args.str("input"),
                ": no documents found (every document was empty or whitespace)");
  writer.finish();
  save_tokenizer_file(*tokenizer, prefix + ".tokenizer.json");
  double total_s = timer.ms() / 1e3, encode_s = std::max(encode_ms / 1e3, 1e-9);

  std::printf("prepared %zu file%s, %llu documents, %llu tokens (%.3f tokens/byte)\n", files.size(),
              files.size() == 1 ? "" : "s", (unsigned long long)writer.num_documents(),
              (unsigned long long)writer.num_tokens(), double(writer.num_tokens()) / double(std::max<uint64_t>(num_bytes, 1)));
  std::printf("tokenizer: %s, vocab %d, eod %d; tokens stored as %s\n", tokenizer->name().c_str(),
              tokenizer->vocab_size(), tokenizer->eod(), token_dtype_name(dtype));
  std::printf("wrote %s.bin, %s.idx, %s.tokenizer.json\n", prefix.c_str(), prefix.c_str(), prefix.c_str());
  std::printf("encode: %.2f MB in %.3f s = %.1f MB/s, %.0f tokens/s (total %.2f s)\n", num_bytes / 1e6, encode_s,
              num_bytes / 1e6 / encode_s, writer.num_tokens() / encode_s, total_s);
  return 0;
}

int data_info(int argc, char** argv) {
  Args args("data info", "Opens (and so fully validates) a dataset and prints its counts.");
  args.option("data", "PREFIX", "dataset prefix (PREFIX.bin, PREFIX.idx)");
  if (!args.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(args.has("data"), "--data is required (see 'origami data info --help')");
  const std::string prefix = args.str("data");
  IndexedDataset ds = IndexedDataset::open(prefix);
  std::printf("%s: %llu sequences, %llu documents, %llu tokens, dtype %s\n", prefix.c_str(),
              (unsigned long long)ds.num_sequences(), (unsigned long long)ds.num_documents(),
              (unsigned long long)ds.num_tokens(), token_dtype_name(ds.dtype()));
  // Unigram entropy in nats: the loss of a model that knows only token frequencies, the
  // baseline a trained model's loss must fall well below.
  {
    std::vector<uint64_t> freq;
    std::vector<int32_t> buf(1 << 16);
    for (uint64_t first = 0; first < ds.num_tokens(); first += buf.size()) {
      const uint64_t n = std::min<uint64_t>(buf.size(), ds.num_tokens() - first);
      ds.read_tokens(first, n, buf.data());
      for (uint64_t k = 0; k < n; ++k) {
        if (size_t(buf[k]) >= freq.size()) freq.resize(size_t(buf[k]) + 1, 0);
        ++freq[size_t(buf[k])];
      }
    }
    double h = 0;
    for (uint64_t f : freq)
      if (f) h -= double(f) / double(ds.num_tokens()) * std::log(double(f) / double(ds.num_tokens()));
    std::printf("unigram entropy: %.4f nats/token (loss of a model that knows only token frequencies)\n", h);
  }
  std::string tok_path = prefix + ".tokenizer.json";
  if (fs::exists(tok_path)) {
    auto tok = load_tokenizer_file(tok_path);
    std::printf("tokenizer: %s, vocab %d, eod %d\n", tok->name().c_str(), tok->vocab_size(), tok->eod());
    // Token ids beyond the tokenizer's vocabulary mean dataset and tokenizer do not belong together.
    std::vector<int32_t> buf(1 << 16);
    for (uint64_t first = 0; first < ds.num_tokens(); first += buf.size()) {
      uint64_t n = std::min<uint64_t>(buf.size(), ds.num_tokens() - first);
      ds.read_tokens(first, n, buf.data());
      for (uint64_t k = 0; k < n; ++k)
        ORIGAMI_CHECK(buf[k] < tok->vocab_size(), prefix, ".bin: token ", buf[k], " at position ", first + k,
                      " is outside the vocabulary of ", tok_path, " (size ", tok->vocab_size(), ")");
    }
  } else {
    std::printf("tokenizer: none (%s not found)\n", tok_path.c_str());
  }
  return 0;
}

}  // namespace

int cmd_data(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kDataUsage, stderr);
    fail("a subcommand is required (prepare or info)");
  }
  std::string sub = argv[1];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kDataUsage, stdout);
    return 0;
  }
  if (sub == "prepare") return data_prepare(argc - 1, argv + 1);
  if (sub == "info") return data_info(argc - 1, argv + 1);
  fail("unknown subcommand '", sub, "' (known: prepare, info; see 'origami data --help')");
}

}  // namespace origami
