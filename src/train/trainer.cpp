#include "train/trainer.h"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/timer.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "kernels/cpu/gemm.h"
#include "model/model.h"
#include "model/params.h"

namespace origami {

namespace {

std::atomic<int> g_stop_signal{0};
void on_signal(int sig) { g_stop_signal = sig; }

std::string format_duration(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s / 60 % 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  else std::snprintf(buf, sizeof buf, "%lds", long(s));
  return buf;
}

}  // namespace

nlohmann::json TrainOptions::as_json() const {
  return {{"data", data}, {"steps", steps}, {"micro_batch", micro_batch}, {"global_batch", global_batch},
          {"seq_len", seq_len}, {"lr", lr.lr}, {"min_lr", lr.min_lr}, {"warmup", lr.warmup},
          {"lr_schedule", lr.schedule == LrSchedule::cosine ? "cosine" : "constant"},
          {"weight_decay", adam.weight_decay}, {"beta1", adam.beta1}, {"beta2", adam.beta2}, {"eps", adam.eps},
          {"grad_clip", grad_clip}, {"seed", seed}, {"data_order", data_order}};
}

void TrainOptions::validate(const ModelConfig& cfg) const {
  ORIGAMI_CHECK(!data.empty(), "no training data: give --data PREFIX (made by 'origami data prepare')");
  ORIGAMI_CHECK(steps > 0, "--steps must be positive, got ", steps);
  ORIGAMI_CHECK(micro_batch > 0, "--micro-batch must be positive, got ", micro_batch);
  ORIGAMI_CHECK(global_batch > 0 && global_batch % micro_batch == 0, "--global-batch (", global_batch,
                ") must be a positive multiple of --micro-batch (", micro_batch, ")");
  ORIGAMI_CHECK(seq_len > 0 && seq_len <= cfg.max_positions, "--seq-len must be in [1, ", cfg.max_positions,
                "] (the model's maximum positions), got ", seq_len);
  ORIGAMI_CHECK(lr.lr >= 0, "--lr must not be negative, got ", lr.lr);
  ORIGAMI_CHECK(lr.min_lr >= 0 && lr.min_lr <= lr.lr, "--min-lr must be in [0, --lr], got ", lr.min_lr);
  ORIGAMI_CHECK(lr.warmup >= 0, "--warmup must not be negative, got ", lr.warmup);
  ORIGAMI_CHECK(adam.weight_decay >= 0, "--weight-decay must not be negative, got ", adam.weight_decay);
  ORIGAMI_CHECK(adam.beta1 >= 0 && adam.beta1 < 1 && adam.beta2 >= 0 && adam.beta2 < 1,
                "--beta1 and --beta2 must be in [0, 1), got ", adam.beta1, " and ", adam.beta2);
  ORIGAMI_CHECK(adam.eps > 0, "--eps must be positive, got ", adam.eps);
  ORIGAMI_CHECK(grad_clip >= 0, "--grad-clip must not be negative (0 disables clipping), got ", grad_clip);
  ORIGAMI_CHECK(save_every >= 0, "--save-every must not be negative, got ", save_every);
  ORIGAMI_CHECK(save_every == 0 || !save.empty(), "--save-every needs --save DIR");
  ORIGAMI_CHECK(threads >= 0, "--threads must not be negative, got ", threads);
  parse_sample_order(data_order);
}

int run_training(const ModelConfig& cfg, const TrainOptions& o) {
  o.validate(cfg);
  if (o.threads > 0) set_num_threads(o.threads);

  // Data.
  IndexedDataset dataset = IndexedDataset::open(o.data);
  const std::string tokenizer_path = o.data + ".tokenizer.json";
  const bool has_tokenizer = std::filesystem::exists(tokenizer_path);
  if (has_tokenizer) {
    auto tok = load_tokenizer_file(tokenizer_path);
    ORIGAMI_CHECK(tok->vocab_size() <= cfg.vocab_size, "the dataset's tokenizer (", tokenizer_path, ") has ",
                  tok->vocab_size(), " tokens but the model's vocab_size is ", cfg.vocab_size);
  }
  WindowSampler sampler(dataset, o.seq_len, parse_sample_order(o.data_order), o.seed);

  // Model, parameters, optimizer.
  Params params(make_param_table(cfg));
  AdamW opt(params, o.adam);
  int64_t start_step = 0;
  if (o.init_from.empty()) {
    params.init(o.seed, cfg.num_layers);
  } else {
    load_weights(weights_file(o.init_from), cfg, params);
    if (is_checkpoint_dir(o.init_from) && std::filesystem::exists(o.init_from + "/optimizer.safetensors")) {
      start_step = load_optimizer_state(o.init_from, params, opt).step;
      ORIGAMI_CHECK(start_step < o.steps, "checkpoint '", o.init_from, "' is already at step ", start_step,
                    "; ask for more --steps to continue");
    }
  }
  Model model(cfg, params);

  std::unique_ptr<std::ofstream> metrics;
  if (!o.metrics.empty()) {
    metrics = std::make_unique<std::ofstream>(o.metrics, start_step > 0 ? std::ios::app : std::ios::trunc);
    ORIGAMI_CHECK(*metrics, "cannot write metrics file '", o.metrics, "'");
  }
  const int64_t B = o.micro_batch, G = o.global_batch, T = o.seq_len, micro = G / B;
  const double flops_per_step = train_flops_per_token(cfg, T) * double(G * T);
  std::printf("origami train: %s, %lld parameters, %lld layers | data %s: %llu tokens, %lld windows of %lld | "
              "global batch %lld = %lld x micro-batch %lld | %d threads\n",
              cfg.model_type().c_str(), (long long)params.size(), (long long)cfg.num_layers, o.data.c_str(),
              (unsigned long long)dataset.num_tokens(), (long long)sampler.num_windows(), (long long)T, (long long)G,
              (long long)micro, (long long)B, num_threads());
  if (start_step > 0) std::printf("resuming from '%s' at step %lld\n", o.init_from.c_str(), (long long)start_step);
  std::fflush(stdout);

  auto save = [&](int64_t steps_done) {
    if (o.save.empty()) return;
    save_checkpoint(o.save, cfg, params, opt, {steps_done, o.as_json()}, has_tokenizer ? tokenizer_path : "");
    std::printf("saved checkpoint to %s (step %lld)\n", o.save.c_str(), (long long)steps_done);
  };

  g_stop_signal = 0;
  auto old_int = std::signal(SIGINT, on_signal);
  auto old_term = std::signal(SIGTERM, on_signal);
  std::vector<int32_t> tokens(size_t(B * (T + 1)));
  Timer run_timer;
  int exit_code = 0;
  for (int64_t step = start_step; step < o.steps; ++step) {
    Timer step_timer;
    const double lr = lr_at(o.lr, step);
    params.zero_grad();
    Losses sum;
    std::vector<std::vector<int64_t>> counts;
    for (int64_t m = 0; m < micro; ++m) {
      for (int64_t r = 0; r < B; ++r) sampler.window(step * G + m * B + r, tokens.data() + r * (T + 1));
      // Each micro-batch's loss enters the step's objective with weight 1/micro (a mean).
      Losses l = model.forward_backward(tokens.data(), B, T, 1.f / float(micro), true);
      sum.loss += l.loss / double(micro), sum.lm_loss += l.lm_loss / double(micro);
      sum.aux_loss += l.aux_loss / double(micro), sum.z_loss += l.z_loss / double(micro);
      const auto ec = model.expert_counts();
      if (counts.empty()) counts = ec;
      else
        for (size_t i = 0; i < ec.size(); ++i)
          for (size_t e = 0; e < ec[i].size(); ++e) counts[i][e] += ec[i][e];
    }
    const double gnorm = clip_grad_norm(params, o.grad_clip);
    opt.step(params, lr);
    const double ms = step_timer.ms();
    const double tok_s = double(G * T) / (ms / 1000.0);
    const double gflops = flops_per_step / (ms / 1000.0) / 1e9;
    const int64_t done = step + 1;
    const double eta = run_timer.ms() / 1000.0 / double(done - start_step) * double(o.steps - done);
    if (!o.quiet || done == o.steps || done % 50 == 0) {
      std::printf("step %lld/%lld | loss %.4f", (long long)done, (long long)o.steps, sum.loss);
      if (cfg.is_moe()) std::printf(" (lm %.4f aux %.4f z %.5f)", sum.lm_loss, sum.aux_loss, sum.z_loss);
      std::printf(" | lr %.3e | grad norm %.3f | %.0f tok/s | %.1f ms | %.1f GFLOP/s | eta %s\n", lr, gnorm, tok_s, ms,
                  gflops, format_duration(eta).c_str());
      std::fflush(stdout);
    }
    if (metrics) {
      nlohmann::json j = {{"step", done}, {"loss", sum.loss}, {"lm_loss", sum.lm_loss}, {"aux_loss", sum.aux_loss},
                          {"z_loss", sum.z_loss}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", G * T},
                          {"ms", ms}, {"tokens_per_s", tok_s}, {"gflops", gflops}};
      if (cfg.is_moe()) j["expert_tokens"] = counts;
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    if (o.save_every > 0 && done % o.save_every == 0 && done < o.steps) save(done);
    if (g_stop_signal) {
      std::printf("stopping on signal %d after step %lld\n", int(g_stop_signal), (long long)done);
      save(done);
      exit_code = 130;
      break;
    }
    if (done == o.steps) save(done);
  }
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  return exit_code;
}

}  // namespace origami
