// Universal checkpoints: every rank writes what it owns, and any layout reads any checkpoint
// (docs/DESIGN.md, "Checkpoints").
//
// `--save DIR` writes DIR/step-N/ (N: optimizer steps done):
//   rank-RRRRR.safetensors  what world rank R owns, as 1-D F32 tensors named "<kind>/<name>" (kind:
//                           weight, exp_avg, exp_avg_sq; name: the Hugging Face tensor name), each
//                           one piece of a global tensor
//   metadata.json           the step and the layout that saved it; per tensor its global shape, dtype
//                           and TP split rule; per piece its file, key and place in the global tensor;
//                           per file its size and checksum (core/checksum.h)
//   config.json, trainer_state.json (step, AdamW's step count, options, router biases, the skip
//                           count and last update, the loss-spike check's recent losses, the data's sizes,
//                           the timed kernel choices a resume keeps),
//   tokenizer.json (when the data has one)
// and DIR/latest then names the newest committed step-N (ckpt/checkpoint_writer.h commits).
//
// A piece is elements [begin, end) of TP rank r's shard of a tensor split over t ranks by the tensor's
// split rule: ParamSpec::for_each_run maps those elements onto the global tensor's row-major offsets,
// so a reader under any other layout finds, for every element it needs, the piece and byte that hold it.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "core/json_fields.h"
#include "data/step_sizes.h"
#include "kernels/cpu/gemm_bf16.h"
#include "model/config.h"
#include "model/params.h"

namespace origami {

enum class StateKind { weight, exp_avg, exp_avg_sq };
constexpr int kStateKinds = 3;
const char* state_kind_name(StateKind k);  // "weight", "exp_avg", "exp_avg_sq"

// Where a piece's elements lie: runs of `n` elements at `local` (counted from the piece's first
// element) and `global` (row-major offset in the global tensor), in increasing order of both.
struct ShardRun {
  int64_t local, global, n;
};
// The runs of elements [begin, end) of TP rank `tp_rank`'s shard of `spec` split over `tp` ranks
// (padding elements, e.g. of a padded vocabulary, are in no run).
std::vector<ShardRun> shard_runs(const ParamSpec& spec, int tp, int tp_rank, int64_t begin, int64_t end);

// The committed step-N directories (those with a metadata.json) of a --save directory, by step.
// Error naming the directory if it cannot be listed.
std::map<int64_t, std::string> committed_steps(const std::string& dir);

// A shape as messages and `ckpt info` write it: "[2, 3]".
std::string shape_str(const std::vector<int64_t>& shape);

// A checkpoint opened for reading, in any of the forms origami reads:
//   - a --save directory (its newest committed step: DIR/latest, else the highest step-N), or one
//     step-N directory of it;
//   - an origami checkpoint directory of the single-file form (model.safetensors,
//     optimizer.safetensors, trainer_state.json, config.json), as `ckpt export --optimizer` writes;
//   - a Hugging Face model directory: model.safetensors, or shards named by model.safetensors.index.json;
//   - one .safetensors file (weights only).
// Every rank reads only the byte ranges it needs (the files are memory-mapped).
class Checkpoint {
 public:
  // Resolves `path` and reads the metadata; Error naming the path and what is missing or wrong.
  static Checkpoint open(const std::string& path);
  // Whether the --save directory `dir` holds a committed checkpoint (latest, or a step-N).
  static bool committed_in(const std::string& dir);
  // Whether `path` is itself one checkpoint: a step, an export, a Hugging Face directory or a file.
  static bool is_checkpoint(const std::string& path);
  // What `path` names now: a --save directory's newest committed step (DIR/step-N), else `path`.
  static std::string resolved(const std::string& path);
  // The config.json that belongs to the checkpoint at `path` ("" for a bare weights file).
  static std::string config_of(const std::string& path);
  // The trainer state (trainer_state.json) of the checkpoint at `path`, read without the rest of it
  // (null when it has none).
  static nlohmann::json trainer_state_of(const std::string& path);

  const std::string& path() const { return path_; }  // the resolved step directory, directory or file
  bool sharded() const { return !metadata_.is_null(); }  // the universal (per-rank files) form
  bool has_optimizer() const { return has_optimizer_; }
  std::string config_path() const;     // "" when none
  std::string tokenizer_path() const;  // "" when none
  // trainer_state.json (null when the checkpoint has none: weights only).
  const nlohmann::json& trainer_state() const { return trainer_state_; }
  // Its fields a resumed run takes, checked when the checkpoint is opened (zero and empty without one).
  struct TrainerState {
    int64_t step = 0, adam_steps = 0;
    // Steps skipped for a non-finite loss or gradient up to `step`, and the last step that updated
    // the weights (a checkpoint written before these were saved: 0 and `step`).
    int64_t skipped_steps = 0, last_update = 0;
    std::vector<double> recent_losses;  // the loss-spike check's history (train/metrics.h LossSpikes)
    std::vector<std::vector<float>> router_bias;  // [layers][experts] (empty: none saved)
    std::vector<std::pair<int64_t, int64_t>> data_sizes;  // per dataset of --data: tokens, documents (empty: none saved)
    std::optional<StepSizes> step_sizes;  // the step size of each stretch up to `step` (none saved: a checkpoint
                                          // older than them, whose options give the one size it trained with)
    // The timed kernel choices that fix an order of summation, as the run that saved kept them
    // ("kernels"), each the index of its value in the list below (the order of the kernels' enums,
    // TileGemm, Bf16Tiles and the small GEMMs' portable/oneDNN, by which the trainer writes them); none
    // where not saved.
    std::optional<int> attention_tiles, bf16_tiles, bf16_small_gemms;
    // The timed bf16 GEMM shapes' paths, one list per rank of the run that saved ("bf16_gemms").
    std::vector<std::vector<KeptBf16Gemm>> bf16_gemms;
    static constexpr std::array<const char*, 3> kBf16GemmPaths{"portable", "onednn", "onednn-runtime"};
    using Names = std::array<const char*, 2>;
    static constexpr Names kAttentionTiles{"openblas", "onednn"}, kBf16Tiles{"fp32", "onednn"},
        kBf16SmallGemms{"portable", "onednn"};
  };
  const TrainerState& state() const { return state_; }
  // One of the training run's options (trainer_state.json's "options", as `train` wrote them), or
  // `fallback` where the checkpoint has none or the option is not a string.
  std::string trained_option(const std::string& key, const std::string& fallback) const;
  int64_t trained_integer(const std::string& key, int64_t fallback) const;  // the same for an integer
  const nlohmann::json& metadata() const { return metadata_; }  // null unless sharded()
  // Every weight tensor's name (as stored) and shape, in name order: what a file's headers say.
  std::vector<std::pair<std::string, std::vector<int64_t>>> weight_shapes() const;

  // Checks the checkpoint against the model: every tensor present with the config's shape, none
  // unknown (gpt2's "transformer." prefix, attention-mask buffers, RoPE's inv_freq buffers and a tied
  // lm_head are accepted).
  void bind(const ModelConfig& cfg);
  // Copies elements [begin, end) of TP rank tp_rank's shard of `spec` split over `tp` ranks from the
  // pieces of `kind` into dst[0 .. end − begin). Error when a piece is missing or damaged.
  void read(StateKind kind, const ParamSpec& spec, int tp, int tp_rank, int64_t begin, int64_t end, float* dst);
  // Every tensor of `params` (its layout's shards) from the weights.
  void read_weights(Params& params);
  // Checks the checksums of the shard files i with i % world == rank (every file once over the world).
  void verify_checksums(int rank, int world);
  // Checks that every shard file is there with its recorded size and a readable header (no checksums).
  void check_files();
  // Where `path` was a --save directory whose `latest` names no committed step, why the newest
  // committed step was opened instead (for a warning); else "".
  const std::string& fallback() const { return fallback_; }
  // That warning on stderr, "origami COMMAND: warning: 'GIVEN': ..." (nothing where none).
  void warn_fallback(const std::string& given, const char* command) const;

 private:
  const nlohmann::json* trained(const std::string& key) const;
  struct Piece {
    size_t file;
    std::string key;  // the tensor's name in that file
    int tp = 1, tp_rank = 0;
    int64_t begin = 0, end = 0;
  };
  struct Entry {
    std::vector<int64_t> shape;
    TpSplit split;
    std::vector<Piece> pieces[kStateKinds];
  };
  struct File {
    std::string path;
    int64_t bytes = -1;     // expected size (-1: unknown)
    std::string checksum;   // expected checksum ("": unknown)
    std::unique_ptr<SafetensorsFile> mapped;
  };
  const SafetensorsFile& file(size_t i);
  void add_file_tensors(const std::string& file_path, const std::string& prefix, StateKind kind);
  // Read and check one file of the checkpoint, every field by its type and range (core/json_fields.h).
  void read_trainer_state(const std::string& state_path);
  void read_index(const std::string& index_path);  // model.safetensors.index.json: the weights' shard files
  void read_metadata(const std::string& meta_path);
  void read_piece(const JsonField& piece);  // one of the metadata's pieces

  std::string path_, fallback_;
  nlohmann::json metadata_, trainer_state_;
  TrainerState state_;
  bool has_optimizer_ = false;
  std::vector<File> files_;
  std::map<std::string, Entry> tensors_;  // by name as stored (canonical after bind)
};

// The element type of an export's weights: fp32, the checkpoint's own, or bf16 (half the bytes,
// each weight rounded to nearest even by kernels/cpu/bf16.h, as torch's .to(torch.bfloat16) rounds).
enum class ExportDtype { fp32, bf16 };
ExportDtype parse_export_dtype(const std::string& s);  // "fp32" or "bf16"; Error naming --dtype otherwise

// Writes a Hugging Face model directory from any checkpoint: config.json (its torch_dtype
// "float32" or "bfloat16"), the weights as `dtype` (F32 or BF16) in model.safetensors or, above
// `max_shard_bytes` (counted in `dtype`'s bytes), model-0000i-of-0000n.safetensors shards with
// model.safetensors.index.json (the Hub's layout; its total_size in `dtype`'s bytes), tokenizer.json
// when the checkpoint has one, and with `optimizer` also optimizer.safetensors (exp_avg.<name>,
// exp_avg_sq.<name>) and trainer_state.json, which makes OUT an origami single-file checkpoint that
// --resume reads (fp32 only: checkpoints keep fp32 weights). Holds at most one shard's tensors in
// memory (with `optimizer`, all the moments). Returns the number of weight files written.
int export_checkpoint(Checkpoint& ck, const ModelConfig& cfg, const std::string& out, int64_t max_shard_bytes,
                      bool optimizer, ExportDtype dtype);

}  // namespace origami
