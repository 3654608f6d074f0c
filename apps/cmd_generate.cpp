// origami generate: sample text from a checkpoint directory.
#include <cmath>
#include <cstdio>
#include <limits>
#include <algorithm>

#include "ckpt/checkpoint.h"
#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/io.h"
#include "core/rng.h"
#include "data/bpe.h"
#include "data/tokenizer.h"
#include "kernels/cpu/gemm.h"
#include "model/model.h"
#include "train/sampling.h"

namespace origami {

namespace {

// The logits of the token after `ids`, predicted from its last `context` tokens. With the KV cache
// (Model::decode) the newest token alone runs through the layers while the window has room; once it
// is full the window slides, every position shifts, and the cache is rebuilt from the window. Without
// it the whole window runs every time; in bf16 padded with token 0 to a multiple of 32 positions (the
// bf16 GEMMs keep a path and a primitive per shape; causal attention keeps the padding out of the
// real positions' logits).
class NextToken {
 public:
  // `most`: the most tokens there will be (prompt and new ones), which the cache need not exceed.
  NextToken(Model& model, int64_t context, bool cached, int64_t most)
      : model_(model), context_(context), cached_(cached), vocab_(model.config().vocab_size),
        capacity_(std::max<int64_t>(1, std::min(context, most))) {
    if (cached_) model_.start_decoding(capacity_), logits_.resize(size_t(vocab_));
  }

  float* logits(const std::vector<int32_t>& ids) {  // (the caller may mask tokens out)
    const size_t T = std::min<size_t>(ids.size(), size_t(context_));
    const int32_t* window = ids.data() + (ids.size() - T);
    model_.reset_expert_counts();  // MoE: the per-step routing figures (training's), which grow per call
    if (cached_) {
      const int64_t held = model_.decoded();
      if (held > 0 && held < capacity_ && size_t(held) + 1 == ids.size()) {
        model_.decode(&ids.back(), 1, logits_.data());
      } else {
        model_.clear_decoding();
        model_.decode(window, int64_t(T), logits_.data());
      }
      return logits_.data();
    }
    const size_t padded = model_.precision() == Precision::bf16
                              ? std::min<size_t>((T + 31) / 32 * 32, size_t(model_.config().max_positions))
                              : T;
    window_.assign(window, window + T);
    window_.resize(padded + 1, 0);  // (and one unused target slot)
    logits_.resize(padded * size_t(vocab_));
    model_.forward_backward(window_.data(), 1, int64_t(padded), 1.f, false, logits_.data());
    return logits_.data() + (T - 1) * size_t(vocab_);
  }

 private:
  Model& model_;
  const int64_t context_;
  const bool cached_;
  const int64_t vocab_, capacity_;
  std::vector<float> logits_;
  std::vector<int32_t> window_;
};

}  // namespace

int cmd_generate(int argc, char** argv) {
  Args a("generate",
         "Sample a continuation of --prompt from a checkpoint written by 'origami train --save'\n"
         "(its tokenizer.json decodes the text).");
  a.option("checkpoint", "DIR", "checkpoint: a --save directory (its newest step), a step-N in it, or an exported one")
      .option("prompt", "TEXT", "text to continue (empty: a new document; an error after --batching documents, "
                                "which never predicts a document's first token); each token is predicted from the "
                                "last --seq-len tokens the checkpoint trained at (one less after --batching documents; "
                                "at most the config's max_position_embeddings, all of them for an export without "
                                "trainer state)", "")
      .allow_empty()
      .option("max-new-tokens", "N", "tokens to sample", "200")
      .option("temperature", "X", "softmax temperature (0: greedy)", "0.8")
      .option("top-k", "K", "sample among the K most likely tokens (0, or K beyond the vocabulary: all)", "40")
      .option("seed", "S", "sampling seed", "1")
      .option("threads", "N", "threads (0: all cores)", "0")
      .flag("stop-at-eod", "stop at the end-of-document token (always, for a checkpoint trained with --batching "
                           "documents: nothing after it was trained)")
      .flag("no-kv-cache", "run the whole window through the model for every token instead of keeping each layer's "
                           "keys and values (the cache's reference; slower)");
  add_precision_option(a);
  if (!a.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(a.has("checkpoint"), "give --checkpoint DIR");
  Checkpoint ck = Checkpoint::open(a.str("checkpoint"));
  ck.warn_fallback(a.str("checkpoint"), "generate");
  const int64_t max_new = a.integer("max-new-tokens"), top_k = a.integer("top-k");
  const double temperature = a.number("temperature");
  ORIGAMI_CHECK(max_new >= 0, "--max-new-tokens must not be negative, got ", max_new);
  ORIGAMI_CHECK(temperature >= 0, "--temperature must not be negative, got ", temperature);
  ORIGAMI_CHECK(top_k >= 0, "--top-k must not be negative, got ", top_k);
  // (temperature 0 takes the likeliest token: no draw, so nothing for a top-k or a seed to change)
  for (const char* drawn : {"top-k", "seed"})
    ORIGAMI_CHECK(temperature > 0 || !a.given(drawn), "--", drawn, " shapes the random draw, and --temperature 0 takes "
                  "the likeliest token without one: drop --", drawn, " or give a temperature above 0");
  use_threads(threads_option(a), "generate");
  const Precision precision = parse_precision(a.str("precision"));
  const uint64_t seed = a.unsigned_integer("seed");  // (every option checked before any work or output)

  ORIGAMI_CHECK(!ck.config_path().empty() && !ck.tokenizer_path().empty(), "checkpoint '", ck.path(),
                "' needs config.json and tokenizer.json (train on data with a tokenizer)");
  ModelConfig cfg = load_model_config(ck.config_path());
  auto tok = load_tokenizer_file(ck.tokenizer_path());
  // What the run trained beyond config.json: its routers' score and learned selection biases, and
  // attention that stops at each end of document (positions starting again after it).
  if (cfg.is_moe()) cfg.routing.score = parse_router_score(ck.trained_option("moe_router_score", "softmax"));
  // (document batching trains each document alone, positions from 0: after an end of document as well)
  const bool whole_documents = ck.trained_option("batching", "windows") == "documents";
  if (parse_attention_mask(ck.trained_option("attention_mask", "causal")) || whole_documents) cfg.document_eod = tok->eod();
  Params params(make_param_table(cfg));
  ck.bind(cfg);
  ck.verify_checksums(0, 1);  // a damaged shard is refused, not sampled from
  ck.read_weights(params);
  Model model(cfg, params);
  if (!ck.state().router_bias.empty())
    model.set_router_bias(ck.state().router_bias, cat("'", ck.path(), "/trainer_state.json'"));
  model.set_precision(precision);
  // Positions beyond the training sequence length were never trained: slide a window of that size. On
  // whole documents a sequence of --seq-len tokens predicts from its first seq-len - 1 only (its last
  // token has no target), so the window is one shorter.
  const int64_t trained = ck.trained_integer("seq_len", 0);
  const int64_t context = trained == 0 ? cfg.max_positions
                                       : std::min(cfg.max_positions, std::max<int64_t>(1, trained - whole_documents));
  if (trained == 0)
    std::fprintf(stderr, "origami generate: note: '%s' has no trainer state (an export without --optimizer): "
                 "predicting from up to the model's %lld positions and across ends of documents, whatever it trained with\n",
                 ck.path().c_str(), (long long)cfg.max_positions);

  std::vector<int32_t> ids = tok->encode_to_continue(a.str("prompt"));
  // (an empty text encodes to the tokenizer's own start, <s> under a template: only that is nothing)
  ORIGAMI_CHECK(a.str("prompt").empty() || ids != tok->encode_to_continue(""), "--prompt '", a.str("prompt"),
                "' encodes to no token: the checkpoint's tokenizer drops its characters (not in its vocabulary, which "
                "has no unknown token or byte fallback, or removed by its normalizer)");
  // Trained on whole documents, each ending at its end-of-document token, a model never predicted a
  // document's first token, nor anything after an end of document: it gets a start, and stops there.
  ORIGAMI_CHECK(!ids.empty() || !whole_documents, "'", ck.path(), "' trained on whole documents (--batching documents), "
                "which never predicts a document's first token: give --prompt with the start of the text");
  if (ids.empty()) ids.push_back(tok->eod());  // an empty prompt starts a new document
  const size_t prompt_len = ids.size();
  std::fwrite(a.str("prompt").data(), 1, a.str("prompt").size(), stdout);
  std::fflush(stdout);
  // The ids sampled from, and those among them the vocabulary skips (never drawn): found once.
  const int64_t vocab = std::min<int64_t>(cfg.vocab_size, tok->vocab_size());
  std::vector<int32_t> skipped;
  for (int32_t v = 0; v < int32_t(vocab); ++v)
    if (!tok->has_token(v)) skipped.push_back(v);
  NextToken next(model, context, !a.on("no-kv-cache") && max_new > 0, int64_t(prompt_len) + std::min(max_new, context));
  size_t printed = prompt_len;
  std::string pending;  // decoded bytes of an unfinished character
  for (int64_t i = 0; i < max_new; ++i) {
    float* last = next.logits(ids);
    for (int32_t v : skipped) last[v] = -std::numeric_limits<float>::infinity();
    ORIGAMI_CHECK(std::any_of(last, last + vocab, [](float l) { return std::isfinite(l); }), "the model's logits are "
                  "not finite at token ", ids.size(), " ('", ck.path(), "' holds weights of a run that diverged?)");
    const int32_t next = sample_token(last, int32_t(vocab), temperature, int32_t(std::min(top_k, vocab)),
                                      uniform01(seed, 0x9e3779b9, uint64_t(i)));
    if (next == tok->eod() && (a.on("stop-at-eod") || whole_documents)) break;
    ids.push_back(next);
    // Print decoded tokens as they come, up to the last whole character: a byte-level token may end in
    // the middle of a multi-byte one, which the next completes. Bytes that no later token can make a
    // character (a lead byte the next token did not continue, a lone continuation byte) are U+FFFD
    // there, as Hugging Face's decode prints them: the output stays UTF-8.
    pending += tok->decode(std::span<const int32_t>(ids.data() + printed, ids.size() - printed));
    printed = ids.size();
    const size_t whole = utf8_whole_prefix(pending);
    const std::string out = utf8_lossy(std::string_view(pending).substr(0, whole));
    std::fwrite(out.data(), 1, out.size(), stdout);  // (a token may decode to a 0 byte)
    std::fflush(stdout);
    pending.erase(0, whole);
  }
  // A character the generation cut short is U+FFFD, as Hugging Face's decode prints it.
  const std::string rest = utf8_lossy(pending);
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputs("\n", stdout);
  return 0;
}

}  // namespace origami
