// origami dump: logits, losses and every parameter gradient of one micro-batch, written as
// safetensors — what independent implementations (tests/reference/) compare against.
#include <filesystem>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/memory.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "kernels/cpu/gemm.h"
#include "model/model.h"
#include "train/trainer.h"

namespace origami {

int cmd_dump(int argc, char** argv) {
  Args a("dump",
         "Run forward and backward on one micro-batch and write logits [B,T,V], loss, lm_loss,\n"
         "aux_loss, z_loss and grad.<name> for every parameter (F32 safetensors). Rows are the\n"
         "training windows s*B .. s*B+B-1 for --step s, as 'origami train' reads them.");
  a.option("config", "FILE", "model config.json")
      .option("init-from", "PATH", "weights: a checkpoint, Hugging Face directory or .safetensors file (default: init from --seed)")
      .option("data", "PREFIX", "dataset prefix")
      .option("micro-batch", "B", "rows", "2")
      .option("seq-len", "T", "tokens per row", "16")
      .option("step", "S", "which batch of B windows", "0")
      .option("data-order", "sequential|shuffled", "window order", "sequential")
      .option("seed", "S", "seed for initialisation and shuffling", "1234")
      .option("attention-mask", "causal|document", "document: attention within documents, positions restarting "
                                                   "(as 'origami train --attention-mask')", "causal")
      .option("threads", "N", "threads (0: all cores)", "0")
      .option("out", "FILE", "output .safetensors file");
  add_routing_options(a, false);
  add_precision_option(a);
  if (!a.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(a.has("out"), "give --out FILE.safetensors");
  ORIGAMI_CHECK(a.has("data"), "give --data PREFIX");
  std::string init = a.str("init-from"), config = a.str("config");
  if (config.empty() && !init.empty()) config = Checkpoint::config_of(init);
  ORIGAMI_CHECK(!config.empty(), "give --config config.json");
  use_threads(threads_option(a), "dump");
  const Precision precision = parse_precision(a.str("precision"));

  TrainOptions routing;
  read_routing_options(a, routing, false);
  const ModelConfig model_cfg = load_model_config(config);
  require_experts_for_given(a, model_cfg, false);
  routing.validate_routing(model_cfg);
  ModelConfig cfg = routing.with_routing(model_cfg);
  if (parse_attention_mask(a.str("attention-mask"))) {
    const std::string path = a.str("data") + ".tokenizer.json";
    const std::unique_ptr<Tokenizer> tok = std::filesystem::exists(path) ? load_tokenizer_file(path) : nullptr;
    cfg.document_eod = document_eod(cfg, tok.get(), a.str("data"));
  }
  const int64_t B = a.integer("micro-batch"), T = a.integer("seq-len"), step = a.integer("step");
  ORIGAMI_CHECK(B >= 1 && B <= kMaxBatch, "--micro-batch must be in [1, ", kMaxBatch, "], got ", B);
  ORIGAMI_CHECK(T >= 1 && T <= cfg.max_positions, "--seq-len must be in [1, ", cfg.max_positions,
                "] (the model's maximum positions), got ", T);
  ORIGAMI_CHECK(step >= 0 && step <= INT64_MAX / B - 1, "--step must be in [0, ", INT64_MAX / B - 1,
                "] (it reads windows step x B .. step x B + B - 1), got ", step);
  // (checked before the tokens, V times smaller, are read and the weights allocated; the weights are counted by none)
  const double logit_bytes = 4.0 * double(B) * double(T) * double(cfg.vocab_size);
  const AvailableMemory avail = available_memory();
  ORIGAMI_CHECK(logit_bytes <= double(avail.bytes), "dump writes logits [B, T, V] of ", B, " x ", T, " x ",
                cfg.vocab_size, " floats (", format_bytes(logit_bytes), "), more than the ", format_bytes(double(avail.bytes)),
                " of memory available (", avail.source, "): lower --micro-batch or --seq-len");
  IndexedDataset ds = IndexedDataset::open(a.str("data"));
  WindowSampler sampler(ds, T, parse_sample_order(a.str("data-order")), a.unsigned_integer("seed"));
  std::vector<int32_t> tokens(size_t(B * (T + 1)));
  for (int64_t r = 0; r < B; ++r) sampler.window(step * B + r, tokens.data() + r * (T + 1));

  Params params(make_param_table(cfg));
  if (init.empty()) params.init(a.unsigned_integer("seed"), cfg.num_layers, cfg.init_std);
  else {
    Checkpoint ck = Checkpoint::open(init);
    ck.warn_fallback(init, "dump");
    ck.bind(cfg);
    ck.verify_checksums(0, 1);  // a damaged shard is refused, not run
    ck.read_weights(params);
  }
  Model model(cfg, params);
  model.set_precision(precision);
  std::vector<float> logits(size_t(B * T * cfg.vocab_size));
  params.zero_grad();
  const Losses l = model.forward_backward(tokens.data(), B, T, 1.f, true, logits.data());

  const float loss = float(l.loss), lm = float(l.lm_loss), aux = float(l.aux_loss), z = float(l.z_loss);
  std::vector<TensorWrite> out = {{"logits", {B, T, cfg.vocab_size}, logits.data()},
                                  {"loss", {1}, &loss}, {"lm_loss", {1}, &lm}, {"aux_loss", {1}, &aux}, {"z_loss", {1}, &z}};
  TensorWrite tok{"tokens", {B, T + 1}, nullptr, "I32", tokens.data()};
  out.push_back(tok);
  for (size_t i = 0; i < params.table().size(); ++i)
    out.push_back({"grad." + params.table()[i].name, params.table()[i].shape, params.grad() + params.offset(i)});
  write_safetensors(a.str("out"), out);
  std::printf("loss %.6f (lm %.6f aux %.6f z %.6f) -> %s\n", l.loss, l.lm_loss, l.aux_loss, l.z_loss, a.str("out").c_str());
  return 0;
}

}  // namespace origami
