#!/usr/bin/env python3
"""Parallel-efficiency benchmark of the distributed core: DP2 (ZeRO 0 and 1, gradients reduced in
fp32 and in bf16), TP2 and TP2+SP on 2 ranks (1 thread per rank) against one rank with 1 thread, on the (b) and (c) models of side_by_side.py.

For each case and layout it reports
  - tokens/s (rank 0's step time, `tokens_per_s` of the metrics) and the speed-up over one rank
    (medians; also the best round, a hint of what an unloaded pair of cores gives);
  - bytes sent per step per rank (`comm_bytes` of rank 0, per communicator, ring accounting of
    src/comm/comm.h);
  - the CPU-time ratio: CPU seconds of all ranks summed for a step (`cpu_s`) over the one-rank
    (1 thread) run's CPU seconds for the same global batch. 1.0 means parallelism costs no extra
    work; the issue's targets are ≤ 1.15 for DP2 and ≤ 1.3 for TP2.
The one-rank reference for a layout uses the same micro-batch size as each rank of that layout
(DP2 gives each rank half the global batch: micro-batch B/2 on two ranks against one rank doing
two micro-batches of B/2), so the ratio measures parallel overhead rather than GEMM-size effects;
the one-rank run with micro-batch B is also reported (column "vs 1 rank B").

Method: every run does --warmup + --steps optimizer steps in a fresh process (mpirun for the
layouts); warm-up steps are dropped; a run's value is the median over its measured steps; the
reported value is the median over --rounds rounds, in an order rotated each round. Environment:
OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1, OMP_WAIT_POLICY=passive, --threads 1, mpirun
--oversubscribe --bind-to none, Open MPI's shared-memory transport with the single-copy mechanism
--single-copy (default cma), the whole job under `taskset -c CORES`.

--layouts moe runs the expert-parallel layouts instead (MoE parallel folding: the paper's comparison
at the size this machine allows) on the Mixtral case (c) and (c16) (16 experts, top-2): EP2 (DP2
attention), EP2 with TP2 attention (folded, ETP1), EP4 (DP4 attention, 4 ranks on the 2 cores) and
EP2xETP2 (4 ranks), against DP2 and TP2; it also reports the receive imbalance (`expert_imbalance`:
the most expert-side rows a rank computed over the mean), the dispatcher's bytes per axis (ep,
etp; their exactness against the routed counts is tests/parallel/test_expert_parallel.py's) and the
dispatcher overhead: rank 0's time in regrouping rows, permute and weighted combine (forward and
backward, the exchanges excluded) over its MoE layers' time (the `moe_times` metric).
Targets: CPU ratio EP2 <= 1.15, EP4 <= 1.25; dispatcher overhead <= 5%.

--layouts zero runs DP2 under ZeRO 1, 2 and 3 on (b) and (c): what sharding the parameters costs.
--precision bf16 runs every run (the one-rank references too) in mixed precision: with --layouts zero,
ZeRO-3 gathers its GEMM weights as bf16 (half their bytes) while ZeRO-1/2 gather fp32.

Usage: /usr/bin/python3 bench/parallel_bench.py [--cases b,c] [--layouts dense|moe|zero] [--precision fp32|bf16]
           [--rounds 3] [--steps 4] [--warmup 1]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
import side_by_side as sbs  # noqa: E402
import harness as h  # noqa: E402

# label, ranks, flags, micro-batch divisor (DP splits the global batch), target CPU ratio
LAYOUTS = [
    ("DP2", 2, [], 2, 1.15),
    ("DP2 ZeRO-1", 2, ["--zero", "1"], 2, 1.15),
    ("DP2 bf16 grads", 2, ["--grad-reduce-dtype", "bf16"], 2, 1.15),
    ("DP2 ZeRO-1 bf16 grads", 2, ["--zero", "1", "--grad-reduce-dtype", "bf16"], 2, 1.15),
    ("TP2", 2, ["--tp", "2"], 1, 1.3),
    ("TP2+SP", 2, ["--tp", "2", "--sequence-parallel"], 1, 1.3),
]
# --layouts zero: ZeRO-3 against ZeRO-1 and 2 (the sharding issue's target: ZeRO-3 CPU ratio <= 1.15)
ZERO_LAYOUTS = [
    ("DP2 ZeRO-1", 2, ["--zero", "1"], 2, 1.15),
    ("DP2 ZeRO-2", 2, ["--zero", "2"], 2, 1.15),
    ("DP2 ZeRO-3", 2, ["--zero", "3"], 2, 1.15),
]
MOE_LAYOUTS = [
    ("DP2", 2, [], 2, 1.15),
    ("TP2", 2, ["--tp", "2"], 1, 1.3),
    ("EP2", 2, ["--ep", "2"], 2, 1.15),
    ("EP2 | TP2 attn", 2, ["--tp", "2", "--ep", "2"], 1, 1.15),
    ("EP4", 4, ["--ep", "4"], 4, 1.25),
    ("EP2xETP2", 4, ["--ep", "2", "--etp", "2"], 4, 1.25),
]


def fmt_bytes(b):
    return "%.2f MB" % (b / 1e6) if b >= 1e5 else "%.0f B" % b


def run_one(a, cfg_path, prefix, ranks, flags, B, G, T, mpath):
    if os.path.exists(mpath):
        os.remove(mpath)
    args = ["train", "--config", cfg_path, "--data", prefix, "--steps", str(a.warmup + a.steps), "--micro-batch", str(B),
            "--global-batch", str(G), "--seq-len", str(T), "--lr", "3e-4", "--weight-decay", "0.1", "--grad-clip", "1.0",
            "--threads", "1", "--metrics", mpath, "--quiet", "--precision", a.precision, *flags]
    cmd = ["taskset", "-c", a.cores] + h.command(ranks, args, a.origami)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=h.env(a.single_copy), timeout=a.timeout,
                       stdin=subprocess.DEVNULL)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s" % (p.returncode, " ".join(cmd), (p.stdout + p.stderr)[-3000:]))
    recs = h.read_metrics(mpath)[a.warmup:]
    if not recs:
        raise RuntimeError("no measured steps in %s" % mpath)
    med = lambda k: statistics.median(r[k] for r in recs) if all(k in r for r in recs) else float("nan")
    comm = {}
    for r in recs:
        for k, v in (r.get("comm_bytes") or {}).items():
            comm.setdefault(k, []).append(v)
    # MoE: the dispatcher's own work (regrouping rows, permute and combine, excluding the exchanges)
    # as a share of rank 0's MoE layer time.
    overhead = [(r["moe_times"]["regroup_s"] + r["moe_times"]["permute_s"]) / r["moe_times"]["layer_s"]
                for r in recs if r.get("moe_times", {}).get("layer_s")]
    return {"ms": med("ms"), "tokens_per_s": med("tokens_per_s"), "cpu_s": med("cpu_s"), "wall_s": wall,
            "imbalance": med("expert_imbalance"),
            "dispatch_overhead": statistics.median(overhead) if overhead else float("nan"),
            "comm": {k: statistics.median(v) for k, v in comm.items()}, "layout": recs[0].get("layout", "")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="b,c")
    ap.add_argument("--layouts", default="dense", choices=("dense", "moe", "zero"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="every run's --precision")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of every run")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--single-copy", default="cma", help="Open MPI shared-memory single-copy mechanism for large "
                    "messages (cma: the receiver copies straight from the sender; none: copied through shared "
                    "fragments by both ranks)")
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--workdir", default=os.path.join(HERE, "runs", "parallel"))
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if not os.path.exists(a.origami):
        sys.exit("origami binary not found at %s (cmake -S . -B build -G Ninja && ninja -C build)" % a.origami)
    os.makedirs(a.workdir, exist_ok=True)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    layouts = {"moe": MOE_LAYOUTS, "zero": ZERO_LAYOUTS}.get(a.layouts, LAYOUTS)
    if a.layouts == "moe" and a.cases == "b,c":
        cases = ["c", "c16"]
    load0 = os.getloadavg()
    t_start = time.time()
    print("parallel_bench: cases %s, %d rounds x (%d warm-up + %d measured steps), cores %s, single copy %s, %s, "
          "load %.2f %.2f %.2f" % (",".join(cases), a.rounds, a.warmup, a.steps, a.cores, a.single_copy, a.precision,
                                   *load0),
          flush=True)
    results = {}
    rows = []
    for c in cases:
        case = sbs.CASES[c] if c != "c16" else dict(
            sbs.CASES["c"], name="mixtral L4 d256 E16k2 F512 B8 T256 V256",
            config=dict(sbs.CASES["c"]["config"], num_local_experts=16))
        cfg, B, T = case["config"], case["B"], case["T"]
        cdir = os.path.join(a.workdir, "case_" + c)
        os.makedirs(cdir, exist_ok=True)
        cfg_path = h.write_json(os.path.join(cdir, "config.json"), cfg)
        prefix = os.path.join(cdir, "data")
        n_tokens = max(1 << 16, (a.warmup + a.steps) * B * (T + 1) + 1)
        rng = random.Random(1234)
        sbs.write_megatron(prefix, [rng.randrange(cfg["vocab_size"]) for _ in range(n_tokens)], cfg["vocab_size"])
        # runs: the one-rank references (micro-batch B and B/2) and the layouts
        runs = [("1 rank B=%d" % b, 0, [], b) for b in sorted({B} | {B // div for _, _, _, div, _ in layouts}, reverse=True)]
        runs += [(lab, ranks, flags, B // div) for lab, ranks, flags, div, _ in layouts]
        per = {}
        for rnd in range(a.rounds):
            order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
            for lab, ranks, flags, b in order:
                mpath = os.path.join(cdir, "m_%s_r%d.jsonl" % ("".join(x if x.isalnum() else "_" for x in lab), rnd))
                r = run_one(a, cfg_path, prefix, ranks, flags, b, B, T, mpath)
                per.setdefault(lab, []).append(r)
                print("  case %s round %d %-12s %8.1f ms/step %7.0f tok/s  cpu %.3f s/step  comm %s  (load %.2f)"
                      % (c, rnd + 1, lab, r["ms"], r["tokens_per_s"], r["cpu_s"],
                         json.dumps({k: int(v) for k, v in r["comm"].items()}), os.getloadavg()[0]), flush=True)
        med = {lab: {"ms": statistics.median(x["ms"] for x in v), "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v),
                     "cpu_s": statistics.median(x["cpu_s"] for x in v), "comm": v[-1]["comm"], "layout": v[-1]["layout"],
                     "rounds": v} for lab, v in per.items()}
        results[c] = med
        for lab, ranks, flags, div, target in layouts:
            m = med[lab]
            ref = med["1 rank B=%d" % (B // div)]
            refB = med["1 rank B=%d" % B]
            ratio = m["cpu_s"] / ref["cpu_s"]
            best = max(x["tokens_per_s"] for x in m["rounds"])
            rows.append(("(%s) %s" % (c, case["name"]), lab, "%.0f" % m["tokens_per_s"], "%.0f" % best,
                         "%.0f" % ref["tokens_per_s"], "%.2fx" % (m["tokens_per_s"] / ref["tokens_per_s"]),
                         ", ".join("%s %s" % (k, fmt_bytes(v)) for k, v in sorted(m["comm"].items())) or "-",
                         "%.3f / %.3f" % (m["cpu_s"], ref["cpu_s"]), "%.3f" % ratio, "%.3f" % (m["cpu_s"] / refB["cpu_s"]),
                         "%.2f" % statistics.median(x["imbalance"] for x in m["rounds"]),
                         "%.1f%%" % (100 * statistics.median(x["dispatch_overhead"] for x in m["rounds"])),
                         "<= %.2f %s" % (target, "met" if ratio <= target else "NOT met")))
    print()
    print("Medians over %d rounds of %d measured steps; ranks x 1 thread vs 1 rank x 1 thread, cores %s." % (
        a.rounds, a.steps, a.cores))
    print(h.fmt_table(("case", "layout", "tok/s", "best round tok/s", "1-rank tok/s (same micro-batch)", "speed-up",
                       "bytes sent per step, rank 0", "CPU s/step all ranks / 1 rank", "CPU ratio", "vs 1 rank B",
                       "expert imbalance", "dispatcher overhead (of the MoE layers' time)", "target"), rows))
    load1 = os.getloadavg()
    print("load average: start %.2f %.2f %.2f, end %.2f %.2f %.2f; total %.0f s" % (*load0, *load1, time.time() - t_start))
    print("(CPU time includes MPI's polling while a rank waits for its peer: on a machine shared with other work,\n"
          " a descheduled peer makes the waiting rank poll longer, which raises the ratio.)")
    out = os.path.join(a.workdir, "results.json")
    with open(out, "w") as f:
        json.dump({"cases": results, "args": vars(a), "load_start": load0, "load_end": load1}, f, indent=1)
    print("raw numbers: %s" % out)


if __name__ == "__main__":
    main()
