// Writing universal checkpoints (the format: ckpt/checkpoint.h): who writes what, and the commit.
//
// The owner rule — every element of the model's state is written exactly once, by a rule every
// rank applies alone (no communication to decide):
//   - a tensor replicated over the TP group (split.dim < 0) is written by TP rank 0 only;
//   - the tied embedding held by the first and the last pipeline stage, by the first only;
//   - a buffer replicated over its gradient group (dense tensors: DP×CP; experts: EDP) is cut as
//     ZeRO cuts it — replica i writes its shard of every bucket — so under ZeRO each rank writes
//     exactly the moments it holds, and without ZeRO the replicas share the writing.
//
// The commit (crash safety): every rank writes its file into DIR/.step-N.tmp/ (temp name, fsync,
// rename); rank 0 then gathers each rank's pieces, sizes and checksums, checks that the pieces of
// every tensor cover it exactly, writes metadata.json last, renames the directory to DIR/step-N in
// one atomic rename and only then points DIR/latest at it. A crash (kill -9 of any rank) or a full
// disk at any moment leaves the previous committed checkpoint as DIR/latest names it; a failed save
// removes its temporary directory and stops the run with one message naming the file.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "comm/comm.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace origami {

// One piece this rank writes: elements [begin, end) of its TP shard (tp, tp_rank) of `spec`.
struct SavePiece {
  StateKind kind;
  const ParamSpec* spec;
  int tp, tp_rank;
  int64_t begin, end;
  const float* data;  // end − begin floats
};

// Appends this rank's pieces of one parameter set by the owner rule: its weights and AdamW moments,
// `replicas`/`replica` its gradient group (DP×CP or EDP), `first_stage_copy` whether it writes the
// tied embedding when it holds a pipeline-shared copy.
void add_owned_pieces(const Params& params, const AdamW& opt, int replicas, int replica, bool first_stage_copy,
                      std::vector<SavePiece>& out);

// Puts back a step that a crash left out of sight in `dir` (a --save directory): where the two-rename
// replacement of a step saved again (replace_dir) stopped between its renames, step-N is missing while
// .step-N.replaced (the old step) and .step-N.tmp (the new one) are there: the new one when its
// metadata.json shows it whole, else the old one, becomes step-N again. (--keep-last's .step-N.old,
// which a crash may leave half removed, stays out of sight.) Error when a rename fails.
void restore_replaced_steps(const std::string& dir);

class CheckpointWriter {
 public:
  // dir: --save; keep_last: committed checkpoints kept (0: all); async: --async-save; model_table:
  // the whole model's tensors (make_param_table; rank 0 checks the pieces against it at each commit).
  CheckpointWriter(Comm& world, std::string command, std::string dir, int keep_last, bool async,
                   std::vector<ParamSpec> model_table);
  ~CheckpointWriter();
  // Asynchronous saves: allocates (and touches) the host copy of `floats` elements now, at startup,
  // so that a save's stall is the copy alone, not the page faults of fresh memory.
  void reserve(int64_t floats);

  // Collective. Waits for the previous save to commit, then writes step `step`: `pieces` (this
  // rank's), and on rank 0 `files` (name → bytes: config.json, trainer_state.json, ...) and
  // `layout` (recorded in the metadata). Synchronous: returns after the commit. Asynchronous:
  // copies the pieces to a host buffer, starts a thread writing them and returns; the commit comes
  // at a later poll(). Returns the seconds the caller was blocked.
  double save(int64_t step, const std::vector<SavePiece>& pieces, const std::map<std::string, std::string>& files,
              const nlohmann::json& layout);
  // Collective, at step boundaries: commits a pending asynchronous save once every rank has written.
  void poll();
  // Collective: waits for a pending save and commits it.
  void finish();
  bool pending() const { return pending_step_ >= 0; }
  int64_t last_committed() const { return last_committed_; }  // DIR/latest's step (-1: none)
  const std::string& dir() const { return dir_; }

 private:
  void commit();
  std::string tmp_dir(int64_t step) const;

  Comm& world_;
  std::string command_, dir_;
  int keep_last_;
  bool async_;
  int64_t pending_step_ = -1, last_committed_ = -1;
  double started_at_ = 0;
  // This rank's pending write: its file's name, pieces and (async) their copy; the result.
  std::string file_name_;
  nlohmann::json pieces_json_;
  std::vector<float> host_;
  std::map<std::string, std::string> files_;
  nlohmann::json layout_;
  std::vector<ParamSpec> model_table_;
  std::thread thread_;
  std::atomic<bool> written_{false};
  WrittenFile result_;
  std::string error_;
};

}  // namespace origami
