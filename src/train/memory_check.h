// The memory check before allocation: every rank's parts (computed by rank_memory) and what its node
// has available (measured once every rank has set up its libraries) are gathered, and every rank
// takes the same decision, so one message — naming the neediest rank's breakdown and what shrinks
// its largest part — ends the job before anything large is allocated.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "train/memory_plan.h"
#include "train/plan.h"

namespace origami {

struct MemoryCheck {
  std::vector<MemoryParts> parts;  // per rank
  size_t neediest = 0;             // the rank with the largest total
  std::string budget;              // what rank 0's node (or the per-rank limit) allows, in words
};

// Collective over `world`; `sampler`: the bytes the data samplers will take. Error (on every rank)
// when a node or a rank (--memory-limit-gb) has too little.
MemoryCheck check_memory(const Plan& plan, int64_t sampler, Comm& world);

}  // namespace origami
