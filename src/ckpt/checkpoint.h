// Checkpoints in Hugging Face form. A checkpoint directory holds
//   model.safetensors      parameters under their Hugging Face names (F32)
//   config.json            the model config as read
//   optimizer.safetensors  AdamW exp_avg.<name> / exp_avg_sq.<name>
//   trainer_state.json     steps done, optimizer step count, the run's options
//   tokenizer.json         origami's self-contained tokenizer (when the data had one)
// Every file is written to a temporary name and renamed, so an interrupted save never leaves a
// half-written checkpoint under the final names.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace origami {

// Loads every parameter from a safetensors file, by Hugging Face name. A missing tensor, a
// shape mismatch or an unexpected tensor is an Error naming the file and the tensor.
// gpt2 names may carry the "transformer." prefix; GPT-2's attention-mask buffers and a tied
// lm_head.weight are skipped.
void load_weights(const std::string& path, const ModelConfig& cfg, Params& params);

// --init-from names either a .safetensors file or a checkpoint directory.
bool is_checkpoint_dir(const std::string& init_from);
std::string weights_file(const std::string& init_from);  // DIR/model.safetensors, or the file itself
// DIR/config.json for a checkpoint directory, else "" (a bare weights file carries no config).
std::string checkpoint_config(const std::string& init_from);
void save_weights(const std::string& path, const Params& params);

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  nlohmann::json options;
};

void save_checkpoint(const std::string& dir, const ModelConfig& cfg, const Params& params, AdamW& opt,
                     const TrainerState& state, const std::string& tokenizer_path);
// Restores optimizer moments and the step count from a checkpoint directory.
TrainerState load_optimizer_state(const std::string& dir, const Params& params, AdamW& opt);

}  // namespace origami
