#include "train/memory_check.h"

#include <map>

#include "core/error.h"
#include "core/memory.h"
#include "core/progress.h"
#include "kernels/cpu/gemm.h"

namespace origami {

MemoryCheck check_memory(const Plan& plan, int64_t sampler, Comm& world) {
  TrainOptions o = plan.options;
  o.threads = num_threads();  // what --threads 0 (all cores) came to: each may hold attention scratch
  const int64_t runtime = resident_bytes();
  progress_memory(runtime, sampler);  // (for origami launch --shrink)
  MemoryParts mine;
  check_on_every_rank(world, "train",
                      [&] { mine = rank_memory(plan.model, o, world.size(), world.rank(), runtime, sampler); });
  world.barrier();  // every rank on a node holds its runtime memory before any measures what is left
  const AvailableMemory avail = available_memory();
  const std::string host = host_name();
  // Per rank: the parts, a node id (a host-name hash exact in a double), available bytes, which bound.
  constexpr int K = MemoryParts::kCount + 3;
  std::vector<double> row(K), all(size_t(K) * size_t(world.size()));
  for (int i = 0; i < MemoryParts::kCount; ++i) row[size_t(i)] = double(mine[i]);
  row[K - 3] = double(std::hash<std::string>{}(host) & ((uint64_t(1) << 52) - 1));
  row[K - 2] = double(avail.bytes);
  row[K - 1] = avail.source == "MemAvailable" ? 0 : 1;
  world.all_gather(all.data(), row.data(), K, DType::f64);
  MemoryCheck out;
  out.parts.resize(size_t(world.size()));
  for (size_t r = 0; r < out.parts.size(); ++r) {
    for (int i = 0; i < MemoryParts::kCount; ++i) out.parts[r][i] = int64_t(all[r * K + size_t(i)]);
    if (out.parts[r].total() > out.parts[out.neediest].total()) out.neediest = r;
  }
  const std::vector<MemoryParts>& parts = out.parts;
  auto needs = [&](size_t worst) {
    const MemoryParts& w = parts[worst];
    return cat("rank ", worst, " needs ", format_bytes(double(w.total())), " (", w.describe(), "; the largest part is ",
               MemoryParts::name(w.largest()), ")");
  };
  const double limit = o.memory_limit_gb * double(1 << 30);
  out.budget = o.memory_limit_gb > 0 ? cat("--memory-limit-gb ", o.memory_limit_gb, " per rank")
                                     : cat(format_bytes(all[K - 2]), " available on rank 0's node");
  check_on_every_rank(world, "train", [&] {
    if (o.memory_limit_gb > 0) {
      const MemoryParts& w = parts[out.neediest];
      ORIGAMI_CHECK(double(w.total()) <= limit, "not enough memory: ", needs(out.neediest), ", more than --memory-limit-gb ",
                    o.memory_limit_gb, " (", format_bytes(limit), "); ", MemoryParts::advice(w.largest()));
      return;
    }
    // Per node: what its ranks will allocate beyond what they hold now, against what it has available.
    std::map<double, std::vector<size_t>> nodes;
    for (size_t r = 0; r < parts.size(); ++r) nodes[all[r * K + K - 3]].push_back(r);
    for (const auto& [id, ranks] : nodes) {
      double more = 0;
      size_t worst = ranks[0];
      for (size_t r : ranks) {
        more += double(parts[r].total() - parts[r].runtime);
        if (parts[r].total() > parts[worst].total()) worst = r;
      }
      const double* first = &all[ranks[0] * K];
      ORIGAMI_CHECK(more <= first[K - 2], "not enough memory: ", needs(worst), "; ",
                    ranks.size() == 1 ? std::string("its node") : cat("the ", ranks.size(), " ranks on its node"),
                    " would allocate ", format_bytes(more), " and it has ", format_bytes(first[K - 2]), " available (",
                    first[K - 1] == 0 ? "MemAvailable" : "its control group's limit", "); ",
                    MemoryParts::advice(parts[worst].largest()), " (--memory-limit-gb sets a limit per rank instead)");
    }
  });
  return out;
}

}  // namespace origami
