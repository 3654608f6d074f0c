// `origami data`: make and inspect tokenized datasets (Megatron .bin/.idx + tokenizer JSON).
//
//   origami data prepare --input FILE|DIR --output PREFIX [--tokenizer byte|gpt2|FILE.json]
//                        [--vocab vocab.json --merges merges.txt] [--eod-token TEXT]
//                        [--split auto|fortune|file|line] [--threads N]
//   origami data info --data PREFIX
//   origami data decode --data PREFIX [--skip-special] [--json] [--first N]
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/timer.h"
#include "core/files.h"
#include "data/indexed_dataset.h"
#include "data/tokenizer.h"
#include "kernels/cpu/gemm.h"

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
    "  decode     print a dataset's documents as text (its tokenizer's decode)\n"
    "\n"
    "'origami data <subcommand> --help' describes its options.\n";

const char* kPrepareSummary =
    "Tokenizes text into a Megatron indexed dataset: PREFIX.bin, PREFIX.idx and PREFIX.tokenizer.json.\n"
    "Each document's tokens are followed by the tokenizer's end-of-document token (one sequence per document).\n"
    "\n"
    "A directory input takes its regular files recursively, sorted by path, skipping hidden entries,\n"
    "symbolic links, fortune's companion files X.dat / X.u8 of a file X and the files --output writes (an\n"
    "earlier run's dataset there); an --input that is one of those files is an error.\n"
    "--split decides how a file becomes documents:\n"
    "  fortune  records separated by lines holding only '%' (the fortune(6) format)\n"
    "  file     the whole file is one document\n"
    "  line     each line (without its line break) is one document\n"
    "  auto     fortune for a file that has a '%' line, else file (a warning for a document over 16 MiB)\n"
    "Documents that are empty or only whitespace are skipped.\n"
    "\n"
    "--tokenizer FILE.json takes origami's own tokenizer JSON (what prepare writes as PREFIX.tokenizer.json)\n"
    "or a Hugging Face `tokenizers` file (the Hub's tokenizer.json) with a BPE model: GPT-2, Llama-3, Qwen2\n"
    "and Llama-2/Mixtral style files give the library's `encode(text)` ids, its template's BOS included.\n"
    "Its end-of-document token is --eod-token, else the eos_token of a tokenizer_config.json beside the\n"
    "file, else whichever of <|endoftext|>, <|end_of_text|>, </s> the file has.\n"
    "Documents are encoded on all threads (--threads); inputs over 32 MB show progress on stderr.";

constexpr size_t kWholeFileWarnBytes = size_t(16) << 20;  // (16 MiB)

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

// The largest record of a text between '%' lines (the whole text without one), in bytes.
size_t largest_record(std::string_view text) {
  size_t largest = 0, start = 0;
  for (size_t pos = 0, next; pos < text.size(); pos = next)
    if (is_fortune_separator(line_at(text, pos, next))) largest = std::max(largest, pos - start), start = next;
  return std::max(largest, text.size() - start);
}

// --split auto: a large file taken whole is more often one document per line than one document, and
// so is one cut by a few stray '%' lines into records of more than 16 MiB.
void warn_large_documents(const std::string& file, std::string_view text) {
  if (text.size() <= kWholeFileWarnBytes) return;
  const size_t record = largest_record(text);
  if (record == text.size())
    std::fprintf(stderr, "origami data: warning: %s (%.0f MB) has no '%%' line, so --split auto takes it as one "
                 "document (one end-of-document token, encoded on one thread); --split line makes each line one\n",
                 file.c_str(), double(text.size()) / 1e6);
  else if (record > kWholeFileWarnBytes)
    std::fprintf(stderr, "origami data: warning: %s has a '%%' line, so --split auto takes it as records between '%%' "
                 "lines, and one record is %.0f MB (taken as one document); if its '%%' lines are text, --split line "
                 "makes each line one document\n", file.c_str(), double(record) / 1e6);
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

// The files `data prepare` writes at `prefix` (and their temporary names), as canonical paths.
std::set<fs::path> output_files(const std::string& prefix) {
  std::set<fs::path> out;
  for (const char* suffix : {".bin", ".idx", ".tokenizer.json"})
    for (const char* tmp : {"", ".tmp", ".tmp.tmp"}) out.insert(fs::weakly_canonical(prefix + suffix + tmp));
  return out;
}

// The input files: FILE itself, or DIR's regular files (recursively, sorted by path). In a
// directory, hidden entries, symbolic links, fortune's companions X.dat / X.u8 of a file X and
// the files of the --output prefix (an earlier run's dataset in the input directory) are skipped.
std::vector<std::string> collect_input_files(const std::string& input, const std::string& prefix) {
  std::error_code ec;
  auto st = fs::status(input, ec);
  ORIGAMI_CHECK(fs::exists(st), "--input ", input, ": no such file or directory");
  const std::set<fs::path> outputs = output_files(prefix);
  const auto is_output = [&](const fs::path& p) { return outputs.count(fs::weakly_canonical(p)) > 0; };
  ORIGAMI_CHECK(!is_output(input), "--input ", input, " is one of the files --output ", prefix, " writes");
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
    if (is_output(p)) continue;
    files.push_back(p.string());
  }
  std::sort(files.begin(), files.end());
  ORIGAMI_CHECK(!files.empty(), "--input ", input, ": the directory holds no input files");
  return files;
}

// Progress of a large prepare on stderr: MB done, documents, MB/s, about once a second (a line
// rewritten in place on a terminal). Silent for inputs under kMinBytes.
class Progress {
 public:
  static constexpr uint64_t kMinBytes = 32'000'000;
  explicit Progress(uint64_t total_bytes) : total_(total_bytes), tty_(isatty(2)) {}
  void update(uint64_t bytes, uint64_t docs) {
    if (total_ < kMinBytes || timer_.ms() - last_ms_ < 1000) return;
    last_ms_ = timer_.ms();
    print(bytes, docs);
  }
  void finish(uint64_t bytes, uint64_t docs) {
    if (total_ < kMinBytes) return;
    if (bytes != last_bytes_) print(bytes, docs);
    if (tty_) std::fputc('\n', stderr);
  }

 private:
  void print(uint64_t bytes, uint64_t docs) {
    last_bytes_ = bytes;
    std::fprintf(stderr, "%sprepare: %.1f / %.1f MB (%.0f%%), %llu documents, %.1f MB/s%s", tty_ ? "\r" : "",
                 bytes / 1e6, total_ / 1e6, 100.0 * double(bytes) / double(std::max<uint64_t>(total_, 1)),
                 (unsigned long long)docs, bytes / 1e3 / std::max(timer_.ms(), 1e-3), tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  uint64_t total_;
  bool tty_;
  Timer timer_;
  double last_ms_ = 0;
  uint64_t last_bytes_ = 0;
};

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
  return load_tokenizer_file(kind, args.has("eod-token") ? args.str("eod-token") : "");
}

int data_prepare(int argc, char** argv) {
  Args args("data prepare", kPrepareSummary);
  args.option("input", "FILE|DIR", "text file, or directory of text files (recursive, sorted)")
      .option("output", "PREFIX", "output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
      .option("tokenizer", "NAME",
              "byte (the UTF-8 bytes, and the text <|endoftext|> as the end-of-document token 256), gpt2 (needs "
              "--vocab and --merges) or a tokenizer .json file", "byte")
      .option("vocab", "FILE", "Hugging Face vocab.json of a GPT-2 byte-level BPE")
      .option("merges", "FILE", "Hugging Face merges.txt of a GPT-2 byte-level BPE")
      .option("eod-token", "TEXT", "end-of-document token of a Hugging Face tokenizer file (see above)")
      .option("split", "MODE", "auto, fortune, file or line (see above)", "auto")
      .option("threads", "N", "encoding threads (0: all cores)", "0");
  if (!args.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(args.has("input"), "--input is required (see 'origami data prepare --help')");
  ORIGAMI_CHECK(args.has("output"), "--output is required (see 'origami data prepare --help')");
  std::string split = args.str("split");
  ORIGAMI_CHECK(split == "auto" || split == "fortune" || split == "file" || split == "line", "--split '", split,
                "' is not known (use auto, fortune, file or line)");
  if (args.str("tokenizer") != "gpt2")
    ORIGAMI_CHECK(!args.has("vocab") && !args.has("merges"), "--vocab/--merges only apply to --tokenizer gpt2");
  ORIGAMI_CHECK(!args.has("eod-token") || args.str("tokenizer").ends_with(".json"),
                "--eod-token only applies to a Hugging Face tokenizer file (--tokenizer FILE.json)");
  use_threads(threads_option(args), "data prepare");
  const std::string prefix = args.str("output");
  ORIGAMI_CHECK(!prefix.empty() && prefix.back() != '/' && !fs::is_directory(prefix), "--output '", prefix,
                "' is a directory: give a prefix such as DIR/NAME (it writes DIR/NAME.bin, .idx and .tokenizer.json)");
  ORIGAMI_CHECK(!prefix.ends_with(".bin") && !prefix.ends_with(".idx"), "--output '", prefix, "' ends in ",
                prefix.substr(prefix.size() - 4), ": give the prefix without it (it writes PREFIX.bin, .idx and "
                ".tokenizer.json)");
  for (const char* suffix : {".bin", ".idx", ".tokenizer.json"})  // (checked before the work, not at its end)
    ORIGAMI_CHECK(!fs::is_directory(prefix + suffix), "--output '", prefix, "': '", prefix + suffix,
                  "' is a directory, where the dataset's file goes");
  fs::path out_dir = fs::path(prefix).parent_path();
  ORIGAMI_CHECK(out_dir.empty() || fs::is_directory(out_dir), "--output ", prefix, ": directory ",
                out_dir.string(), " does not exist");

  std::vector<std::string> files = collect_input_files(args.str("input"), prefix);
  std::unique_ptr<Tokenizer> tokenizer = make_tokenizer(args);
  const TokenDtype dtype = token_dtype_for_vocab(tokenizer->vocab_size());

  uint64_t total_bytes = 0;
  for (const auto& file : files) total_bytes += fs::file_size(file);

  Timer timer;
  double encode_ms = 0;
  uint64_t num_bytes = 0;
  IndexedDatasetWriter writer(prefix, dtype);
  Progress progress(total_bytes);
  // Documents are encoded in batches of about kBatchBytes, on all threads, and written in order.
  constexpr size_t kBatchBytes = 8 << 20;
  std::deque<std::string> texts;       // the files the batch's documents point into (stable addresses)
  std::vector<std::string_view> docs;  // the batch
  size_t batch_bytes = 0;
  std::vector<std::vector<int32_t>> ids;
  // progress_bytes: input bytes up to the batch's end; keep_current: the last text is still being split.
  auto flush = [&](uint64_t progress_bytes, bool keep_current) {
    ids.resize(docs.size());
    Timer t;
    std::string error;
    const int32_t eod = tokenizer->eod();
    // A post-processor that closes every sequence with the eod ("<s> $A </s>") closes the document.
    const std::vector<int32_t> closing = tokenizer->encode(""), open = tokenizer->encode_to_continue("");
    const bool closed_by_template = closing.size() > open.size() && closing.back() == eod;
#pragma omp parallel for schedule(dynamic, 16)
    for (size_t i = 0; i < docs.size(); ++i) {
      try {
        ids[i] = tokenizer->encode(docs[i]);
        if (!closed_by_template) ids[i].push_back(eod);
      } catch (const std::exception& e) {
#pragma omp critical
        if (error.empty()) error = e.what();
      }
    }
    encode_ms += t.ms();
    if (!error.empty()) throw Error(error);
    for (size_t i = 0; i < docs.size(); ++i) writer.add_document(ids[i]);
    progress.update(progress_bytes, writer.num_documents());
    while (texts.size() > (keep_current ? 1u : 0u)) texts.pop_front();
    docs.clear();
    ids.clear();
    batch_bytes = 0;
  };
  for (const auto& file : files) {
    texts.push_back(read_file_bytes(file));
    const std::string& text = texts.back();
    if (split == "auto") warn_large_documents(file, text);
    split_documents(text, split, [&](std::string_view doc) {
      docs.push_back(doc);
      batch_bytes += doc.size();
      if (batch_bytes >= kBatchBytes) flush(num_bytes + uint64_t(doc.data() + doc.size() - text.data()), true);
    });
    num_bytes += text.size();
    if (batch_bytes >= kBatchBytes || texts.size() >= 4096) flush(num_bytes, false);
  }
  flush(num_bytes, false);
  progress.finish(num_bytes, writer.num_documents());
  ORIGAMI_CHECK(writer.num_documents() > 0, "--input ", args.str("input"),
                ": no documents found (every document was empty or whitespace)");
  writer.finish({{".tokenizer.json", tokenizer_file_text(*tokenizer)}});
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
    // Counted in a table up to 2^22 ids (any real vocabulary) and in a map above: a corrupt id near
    // 2^31 must not allocate its value's worth of counters.
    constexpr int32_t kTable = 1 << 22;
    std::vector<uint64_t> freq;
    std::unordered_map<int32_t, uint64_t> large;
    std::vector<int32_t> buf(1 << 16);
    for (uint64_t first = 0; first < ds.num_tokens(); first += buf.size()) {
      const uint64_t n = std::min<uint64_t>(buf.size(), ds.num_tokens() - first);
      ds.read_tokens(first, n, buf.data());
      for (uint64_t k = 0; k < n; ++k) {
        ORIGAMI_CHECK(buf[k] >= 0, prefix, ".bin: token ", buf[k], " at position ", first + k, " is negative");
        if (buf[k] >= kTable) {
          ++large[buf[k]];
          continue;
        }
        if (size_t(buf[k]) >= freq.size()) freq.resize(size_t(buf[k]) + 1, 0);
        ++freq[size_t(buf[k])];
      }
    }
    for (const auto& entry : large) freq.push_back(entry.second);
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

int data_decode(int argc, char** argv) {
  Args args("data decode",
            "Prints a dataset's documents as text, decoded with PREFIX.tokenizer.json as its tokenizer library\n"
            "would decode them (Hugging Face: `decode(ids, skip_special_tokens=False)`), each followed by a newline.");
  args.option("data", "PREFIX", "dataset prefix (PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json)")
      .option("tokenizer", "FILE", "tokenizer JSON (default: PREFIX.tokenizer.json)")
      .flag("skip-special", "leave out special tokens (BOS, end-of-document, ...)")
      .flag("json", "print each document as a JSON string on its own line")
      .option("first", "N", "print only the first N documents (default: all)", "0");
  if (!args.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(args.has("data"), "--data is required (see 'origami data decode --help')");
  const std::string prefix = args.str("data");
  IndexedDataset ds = IndexedDataset::open(prefix);
  auto tok = load_tokenizer_file(args.has("tokenizer") ? args.str("tokenizer") : prefix + ".tokenizer.json");
  ORIGAMI_CHECK(args.integer("first") >= 0, "--first must not be negative, got ", args.integer("first"));
  uint64_t n = ds.num_documents();
  if (args.integer("first") > 0) n = std::min<uint64_t>(n, uint64_t(args.integer("first")));
  std::vector<int32_t> ids;
  uint64_t first = 0;  // the next token of the .bin
  // A document is its sequences (more than one in a Megatron dataset prepared with --split-sentences).
  for (uint64_t d = 0; d < n; ++d) {
    ids.clear();
    for (int64_t i = ds.document_index(d); i < ds.document_index(d + 1); ++i) {
      const size_t at = ids.size();
      ids.resize(at + size_t(ds.sequence_length(uint64_t(i))));
      ds.read_tokens(first, ids.size() - at, ids.data() + at);
      first += ids.size() - at;
    }
    std::string text = tok->decode_text(ids, args.on("skip-special"));
    if (args.on("json")) text = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
  }
  return 0;
}

}  // namespace

int cmd_data(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kDataUsage, stderr);
    fail("a subcommand is required (prepare, info or decode)");
  }
  std::string sub = argv[1];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kDataUsage, stdout);
    return 0;
  }
  if (sub == "prepare") return data_prepare(argc - 1, argv + 1);
  if (sub == "info") return data_info(argc - 1, argv + 1);
  if (sub == "decode") return data_decode(argc - 1, argv + 1);
  fail("unknown subcommand '", sub, "' (known: prepare, info, decode; see 'origami data --help')");
}

}  // namespace origami
