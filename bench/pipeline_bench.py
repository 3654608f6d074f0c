#!/usr/bin/env python3
"""Pipeline benchmark: measured bubble per stage and bytes per stage against theory, on the (b)
model of side_by_side.py (GPT-2, 6 layers, d=384, 6 heads, vocabulary 256, T=256).

Layouts: PP2 (3 layers per stage), PP4 (--pp-layers 1,2,2,1: the outer stages also hold the
embedding and the LM head) with 1F1B, and PP2 interleaved with v=3 (one layer per virtual stage),
each with m = 4, 8, 16 micro-batches of --micro-batch rows (default 1: a step is m rows).

Reported per stage, from the executor's own timers in the metrics (`pp_busy_ms`: time in forward
and backward compute; `pp_ms`: the schedule's wall time; idle = pp_ms - busy):
  - bubble = idle / busy, next to the theory (p-1)/m (1F1B) and (p-1)/(v·m) (interleaved) — the
    bubble time over the ideal (bubble-free) time, the papers' definition; and idle / pp_ms, next to
    (p-1)/(m+p-1) and (p-1)/(v·m+p-1) (the same quantity as a share of the step). The theory assumes
    equal stages and free communication;
  - bytes sent per step by each stage over the pipeline group (`pp_bytes`) against the analytic
    count m · B·T·C·4 · (chunks whose virtual stage is not the last + chunks not the first).

Method: each run does --warmup + --steps steps in a fresh mpirun job (1 thread per rank,
OMP_WAIT_POLICY=passive, --bind-to none, Open MPI's shared-memory transport with the single-copy
mechanism --single-copy, under `taskset -c CORES`); warm-up steps are dropped and
per-stage values are medians over the measured steps. PP4 runs 4 ranks on 2 cores: ranks share
cores, so a stage's "busy" time includes time descheduled while a neighbour computes, and its
bubble is not the schedule's; PP2 has one core per rank.

Usage: /usr/bin/python3 bench/pipeline_bench.py [--micro 4,8,16] [--steps 3] [--warmup 1]
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

# label, p, v, flags
LAYOUTS = [
    ("PP2 1f1b", 2, 1, ["--pp", "2"]),
    ("PP2 interleaved v3", 2, 3, ["--pp", "2", "--vpp", "3"]),
    ("PP4 1f1b", 4, 1, ["--pp", "4", "--pp-layers", "1,2,2,1"]),
]


def run_one(a, cfg_path, prefix, p, flags, m, T, mpath):
    if os.path.exists(mpath):
        os.remove(mpath)
    args = ["train", "--config", cfg_path, "--data", prefix, "--steps", str(a.warmup + a.steps), "--micro-batch",
            str(a.micro_batch), "--global-batch", str(m * a.micro_batch), "--seq-len", str(T), "--lr", "3e-4",
            "--threads", "1", "--metrics", mpath, "--quiet", *flags]
    cmd = ["taskset", "-c", a.cores] + h.command(p, args, a.origami)
    p_ = subprocess.run(cmd, capture_output=True, text=True, env=h.env(a.single_copy), timeout=a.timeout,
                        stdin=subprocess.DEVNULL)
    if p_.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s" % (p_.returncode, " ".join(cmd), (p_.stdout + p_.stderr)[-3000:]))
    recs = h.read_metrics(mpath)[a.warmup:]
    stages = len(recs[0]["pp_ms"])
    med = lambda k, s: statistics.median(r[k][s] for r in recs)
    return {"busy": [med("pp_busy_ms", s) for s in range(stages)], "total": [med("pp_ms", s) for s in range(stages)],
            "bytes": [med("pp_bytes", s) for s in range(stages)], "ms": statistics.median(r["ms"] for r in recs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs), "layout": recs[0]["layout"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro", default="4,8,16", help="micro-batches per step")
    ap.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of every run")
    ap.add_argument("--layouts", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--single-copy", default="cma", help="Open MPI shared-memory single-copy mechanism for large "
                    "messages (cma: the receiver copies straight from the sender; none: fragments both sides "
                    "must drive)")
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--workdir", default=os.path.join(HERE, "runs", "pipeline"))
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if not os.path.exists(a.origami):
        sys.exit("origami binary not found at %s (cmake -S . -B build -G Ninja && ninja -C build)" % a.origami)
    os.makedirs(a.workdir, exist_ok=True)
    micros = [int(x) for x in a.micro.split(",")]
    case = sbs.CASES["b"]
    cfg, T = case["config"], case["T"]
    C = cfg["n_embd"]
    cfg_path = h.write_json(os.path.join(a.workdir, "config.json"), cfg)
    prefix = os.path.join(a.workdir, "data")
    n_tokens = max(1 << 16, (a.warmup + a.steps) * max(micros) * a.micro_batch * (T + 1) + 1)
    rng = random.Random(1234)
    sbs.write_megatron(prefix, [rng.randrange(cfg["vocab_size"]) for _ in range(n_tokens)], cfg["vocab_size"])
    load0 = os.getloadavg()
    t_start = time.time()
    print("pipeline_bench: model (b) %s, micro-batch %d x T %d, m in %s, %d warm-up + %d measured steps, cores %s, "
          "single copy %s, load %.2f %.2f %.2f" % (case["name"], a.micro_batch, T, micros, a.warmup, a.steps, a.cores,
                                                 a.single_copy, *load0), flush=True)
    rows, results = [], []
    for lab, p, v, flags in LAYOUTS:
        if a.layouts and lab not in a.layouts.split(","):
            continue
        for m in micros:
            mpath = os.path.join(a.workdir, "m_%s_%d.jsonl" % ("".join(x if x.isalnum() else "_" for x in lab), m))
            r = run_one(a, cfg_path, prefix, p, flags, m, T, mpath)
            theory = (p - 1) / (v * m)
            theory_share = (p - 1) / (v * m + p - 1)
            for s in range(p):
                idle = r["total"][s] - r["busy"][s]
                chunks = [c * p + s for c in range(v)]
                msgs = sum(u != p * v - 1 for u in chunks) + sum(u != 0 for u in chunks)
                want = m * a.micro_batch * T * C * 4 * msgs
                rows.append((lab, m, s, "%.0f" % r["total"][s], "%.0f" % r["busy"][s], "%.3f" % (idle / r["busy"][s]),
                             "%.3f" % theory, "%.3f" % (idle / r["total"][s]), "%.3f" % theory_share,
                             "%d" % r["bytes"][s], "%d" % want, "yes" if r["bytes"][s] == want else "NO"))
            results.append({"layout": lab, "p": p, "v": v, "m": m, **r})
            print("  %-20s m=%-3d %8.1f ms/step %6.0f tok/s  bubble/busy per stage %s (theory %.3f)  (load %.2f)" % (
                lab, m, r["ms"], r["tokens_per_s"],
                " ".join("%.3f" % ((t - b) / b) for t, b in zip(r["total"], r["busy"])), theory, os.getloadavg()[0]),
                flush=True)
    print()
    print(h.fmt_table(("layout", "m", "stage", "schedule ms", "busy ms", "bubble idle/busy", "theory (p-1)/(v·m)",
                       "idle/schedule", "theory (p-1)/(v·m+p-1)", "pp bytes sent", "analytic", "equal"), rows))
    load1 = os.getloadavg()
    print("load average: start %.2f %.2f %.2f, end %.2f %.2f %.2f; total %.0f s" % (*load0, *load1, time.time() - t_start))
    out = os.path.join(a.workdir, "results.json")
    with open(out, "w") as f:
        json.dump({"results": results, "args": vars(a), "load_start": load0, "load_end": load1}, f, indent=1)
    print("raw numbers: %s" % out)


if __name__ == "__main__":
    main()
