// Checkpoints in Hugging Face form. A checkpoint directory holds
//   model.safetensors      parameters under their Hugging Face names (F32)
//   config.json            the model config as read
//   optimizer.safetensors  AdamW exp_avg.<name> / exp_avg_sq.<name>
//   trainer_state.json     steps done, optimizer step count, the run's options, the MoE router's
//                          selection biases (aux-loss-free balancing)
//   tokenizer.json         origami's self-contained tokenizer (when the data had one)
// Every file is written to a temporary name and renamed, so an interrupted save never leaves a
// half-written checkpoint under the final names.
//
// A checkpoint is always in the global (one-rank) form, whatever the layout that wrote it: a
// parallel run gathers its tensor-parallel shards (and ZeRO optimizer shards) on rank 0 to save,
// and every rank of any layout loads by cutting its own shard out of the global tensors.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "model/config.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace origami {

// Loads every parameter from a safetensors file, by Hugging Face name, into this rank's shard
// (params.layout()); tensors of the model that other pipeline stages hold are skipped. A missing
// tensor, a shape mismatch or an unexpected tensor is an Error naming the file and the tensor. gpt2 names may carry the "transformer." prefix; GPT-2's attention-mask
// buffers and a tied lm_head.weight are skipped.
void load_weights(const std::string& path, const ModelConfig& cfg, Params& params);

// --init-from names either a .safetensors file or a checkpoint directory.
bool is_checkpoint_dir(const std::string& init_from);
std::string weights_file(const std::string& init_from);  // DIR/model.safetensors, or the file itself
// DIR/config.json for a checkpoint directory, else "" (a bare weights file carries no config).
std::string checkpoint_config(const std::string& init_from);
void save_weights(const std::string& path, const Params& params);

struct TrainerState {
  int64_t step = 0;        // optimizer steps completed
  int64_t adam_steps = 0;  // AdamW's step count (bias correction)
  nlohmann::json options;
  std::vector<std::vector<float>> router_bias;  // aux-loss-free balancing's [L][E] biases (empty: off)
};

// Writes a checkpoint from global (one-rank layout) buffers: `global` holds the parameters,
// exp_avg / exp_avg_sq the AdamW moments in the same layout.
void save_checkpoint(const std::string& dir, const ModelConfig& cfg, const Params& global, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& state, const std::string& tokenizer_path);
// Reads the AdamW moments of this rank's shard (params' layout) into m_flat / v_flat, and the
// trainer state, from a checkpoint directory.
TrainerState load_optimizer_state(const std::string& dir, const Params& params, float* m_flat, float* v_flat);

// Peak bytes of the buffers a save allocates on one rank (the trainer's save: moments flattened on
// every rank, then gather_tp_shards and gather_pp_stages for the weights and both moments):
// P floats in this rank's buffer, S in its stage's tensors, G in the whole model's, `other_stage`
// the largest other stage (what rank 0 receives at once). stage_root: TP rank 0 of DP replica 0
// of its stage (it gathers the stage); rank0: world rank 0 (it gathers the stages and writes).
int64_t save_buffer_bytes(int64_t P, int64_t S, int64_t G, int64_t other_stage, int tp, int pp, bool stage_root,
                          bool rank0);

// Tensor-parallel gather: every rank of `tp` passes its buffer `flat` (params' layout); TP rank 0
// returns the global buffer in `global`'s layout (one-rank layout; needed on TP rank 0 only), the
// others an empty vector.
std::vector<float> gather_tp_shards(Comm& tp, const Params& params, const float* flat, const Params* global);

// Gather by name: every rank of `pp` passes its part's buffer in the one-rank layout of its table
// (tables[rank], as gather_tp_shards returns it); pp rank 0 returns the buffer in `global`'s layout
// (needed on pp rank 0 only; a tensor held by two ranks is taken from the first; every tensor of
// `global` must come from some rank), the others an empty vector. Used for the pipeline stages, and
// for the EP ranks' experts of a stage.
std::vector<float> gather_pp_stages(Comm& pp, const std::vector<float>& stage_buf,
                                    const std::vector<std::vector<ParamSpec>>& tables, const Params* global);

}  // namespace origami
