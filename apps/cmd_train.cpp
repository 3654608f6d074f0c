// origami train: train a model from a Hugging Face config.json on a prepared dataset.
#include "ckpt/checkpoint.h"
#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/io.h"
#include "train/trainer.h"

namespace origami {

int cmd_train(int argc, char** argv) {
  Args a("train",
         "Train a gpt2, llama or mixtral model (Hugging Face config.json) on a dataset made by\n"
         "'origami data prepare'. Keys of a --run-config JSON file are these options without '--';\n"
         "options given on the command line win.");
  a.option("config", "FILE", "model config.json (default: config.json of an --init-from checkpoint)")
      .option("run-config", "FILE", "JSON file with any of these options")
      .option("data", "PREFIX", "dataset prefix (PREFIX.bin, PREFIX.idx)")
      .option("init-from", "PATH", "start from a .safetensors file, or resume a checkpoint directory")
      .option("steps", "N", "total optimizer steps", "100")
      .option("micro-batch", "B", "rows per forward/backward pass", "4")
      .option("global-batch", "G", "rows per optimizer step (a multiple of B)", "")
      .option("seq-len", "T", "tokens per row", "128")
      .option("lr", "X", "peak learning rate", "3e-4")
      .option("min-lr", "X", "final learning rate of the cosine schedule", "0")
      .option("warmup", "N", "linear warmup steps", "0")
      .option("lr-schedule", "constant|cosine", "learning-rate schedule after warmup", "cosine")
      .option("weight-decay", "X", "AdamW weight decay (matrices only)", "0.1")
      .option("beta1", "X", "AdamW beta1", "0.9")
      .option("beta2", "X", "AdamW beta2", "0.95")
      .option("eps", "X", "AdamW epsilon", "1e-8")
      .option("grad-clip", "X", "clip the global gradient norm to X (0: off)", "1.0")
      .option("seed", "S", "seed for initialisation and data order", "1234")
      .option("data-order", "sequential|shuffled", "order of training windows", "sequential")
      .option("metrics", "FILE", "append one JSON object per step to FILE (JSONL)")
      .option("save", "DIR", "write a checkpoint (HF safetensors + optimizer state) to DIR")
      .option("save-every", "N", "also save every N steps", "0")
      .option("threads", "N", "threads for BLAS and kernels (default: all cores)", "0")
      .flag("quiet", "print every 50th step only");
  if (!a.parse(argc, argv)) return 0;
  if (a.has("run-config")) a.fill_from_json(read_json_file(a.str("run-config"), "run config"), a.str("run-config"));

  TrainOptions o;
  o.data = a.str("data");
  o.init_from = a.str("init-from");
  o.steps = a.integer("steps");
  o.micro_batch = a.integer("micro-batch");
  o.global_batch = a.has("global-batch") ? a.integer("global-batch") : o.micro_batch;
  o.seq_len = a.integer("seq-len");
  o.lr.lr = a.number("lr");
  o.lr.min_lr = a.number("min-lr");
  o.lr.warmup = a.integer("warmup");
  o.lr.total_steps = o.steps;
  o.lr.schedule = parse_lr_schedule(a.str("lr-schedule"));
  o.adam.weight_decay = a.number("weight-decay");
  o.adam.beta1 = a.number("beta1");
  o.adam.beta2 = a.number("beta2");
  o.adam.eps = a.number("eps");
  o.grad_clip = a.number("grad-clip");
  o.seed = uint64_t(a.integer("seed"));
  o.data_order = a.str("data-order");
  o.metrics = a.str("metrics");
  o.save = a.str("save");
  o.save_every = a.integer("save-every");
  o.threads = int(a.integer("threads"));
  o.quiet = a.on("quiet");

  std::string config = a.str("config");
  if (config.empty()) config = checkpoint_config(o.init_from);
  ORIGAMI_CHECK(!config.empty(), "no model config: give --config config.json (see --help)");
  return run_training(load_model_config(config), o);
}

}  // namespace origami
