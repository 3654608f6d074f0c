#!/usr/bin/env python3
"""Context-parallel benchmark: a llama-style model (d=256, 4 layers, 8 heads, 2 kv heads, head dim
32, FFN 688, vocabulary 256) at long sequences, split over 2 and 4 ranks with each CP mechanism
(p2p ring, a2a Ulysses, a2a+p2p with groups of 2), against one rank at the same global batch
(--global-batch 2 windows of T tokens, micro-batch 1: two micro-batches per step everywhere).

Per (T, layout) it reports, rank 0's metrics, medians over the measured steps and then over rounds:
  - tokens/s, and the CPU ratio: CPU seconds of all ranks for a step (`cpu_s`) over the one-rank run's
    (1.0: CP costs no extra work; target <= 1.15 for CP2 p2p at T = 8192);
  - bytes sent per step (`comm_bytes.cp`) against the analytic count of src/parallel/
    context_parallel.h (per attention layer and micro-batch, forward + backward) — they must agree;
  - the activation peak per rank (`act_bytes_peak`) against one rank's;
  - the fraction of ring transfer time hidden behind compute: 1 - (time waited) / (time the transfers
    took), from the executor's own timers (`cp.ring_wait_s`, `cp.ring_s`);
  - load balance: the causal (query, key) pairs each rank computed (`cp.pairs`), largest over smallest
    - 1 (target <= 2%).
4 ranks share the 2 cores (oversubscribed): their tokens/s is not a speed-up, their CPU ratio includes
MPI's polling while a descheduled peer runs.

Usage: /usr/bin/python3 bench/cp_bench.py [--seq 2048,8192] [--rounds 2] [--steps 2] [--warmup 1]
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

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}
# label, ranks, flags, (C, A)
LAYOUTS = [
    ("1 rank", 0, [], (1, 1)),
    ("CP2 p2p", 2, ["--cp", "2", "--cp-comm", "p2p"], (2, 1)),
    ("CP2 a2a", 2, ["--cp", "2", "--cp-comm", "a2a"], (2, 2)),
    ("CP4 p2p", 4, ["--cp", "4", "--cp-comm", "p2p"], (4, 1)),
    ("CP4 a2a", 4, ["--cp", "4", "--cp-comm", "a2a"], (4, 4)),
    ("CP4 a2a+p2p A2", 4, ["--cp", "4", "--cp-comm", "a2a+p2p", "--cp-a2a-size", "2"], (4, 2)),
]
B, G = 1, 2


def analytic_cp_bytes(T, C, A):
    """comm_bytes.cp per step: context_parallel.h's formulas, L layers x G/B micro-batches."""
    if C == 1:
        return 0
    H, KV, D, L = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"], CONFIG["num_hidden_layers"]
    N, R = B * T // C, C // A
    Ha, KVa = H // A, (KV // A if KV >= A else 1)
    Sa, W = (Ha + 2 * KVa) * D, 2 * KVa * D
    fwd = 4 * N * ((A - 1) * (Sa + Ha * D) + (R - 1) * A * W)
    bwd = 4 * N * ((A - 1) * (Sa + Ha * D) + (2 * R - 1 if R > 1 else 0) * A * W)
    return L * (G // B) * (fwd + bwd)


def run_one(a, cfg_path, prefix, ranks, flags, T, mpath):
    if os.path.exists(mpath):
        os.remove(mpath)
    args = ["train", "--config", cfg_path, "--data", prefix, "--steps", str(a.warmup + a.steps), "--micro-batch", str(B),
            "--global-batch", str(G), "--seq-len", str(T), "--lr", "3e-4", "--threads", "1", "--metrics", mpath,
            "--quiet", *flags]
    cmd = ["taskset", "-c", a.cores] + h.command(ranks, args, a.origami)
    p = subprocess.run(cmd, capture_output=True, text=True, env=h.env("cma"), timeout=a.timeout, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s" % (p.returncode, " ".join(cmd), (p.stdout + p.stderr)[-3000:]))
    recs = h.read_metrics(mpath)[a.warmup:]
    med = lambda f: statistics.median(f(r) for r in recs)
    out = {"tokens_per_s": med(lambda r: r["tokens_per_s"]), "cpu_s": med(lambda r: r["cpu_s"]),
           "cp_bytes": med(lambda r: r["comm_bytes"].get("cp", 0)), "act": med(lambda r: r["act_bytes_peak"][0]),
           "act_computed": med(lambda r: r["act_bytes_computed"][0])}
    if "cp" in recs[0]:
        out["ring_s"] = med(lambda r: r["cp"]["ring_s"])
        out["ring_wait_s"] = med(lambda r: r["cp"]["ring_wait_s"])
        out["pairs"] = recs[0]["cp"]["pairs"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="2048,8192", help="sequence lengths (32768 takes minutes per step on one core)")
    ap.add_argument("--layouts", default=",".join(l[0] for l in LAYOUTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of every run")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--workdir", default=os.path.join(HERE, "runs", "cp"))
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args()
    if not os.path.exists(a.origami):
        sys.exit("origami binary not found at %s (cmake -S . -B build -G Ninja && ninja -C build)" % a.origami)
    os.makedirs(a.workdir, exist_ok=True)
    wanted = [s.strip() for s in a.layouts.split(",")]
    layouts = [l for l in LAYOUTS if l[0] in wanted or l[0] == "1 rank"]
    cfg_path = h.write_json(os.path.join(a.workdir, "config.json"), CONFIG)
    t_start, load0 = time.time(), os.getloadavg()
    print("cp_bench: T %s, %d rounds x (%d warm-up + %d measured steps), cores %s, load %.2f" % (
        a.seq, a.rounds, a.warmup, a.steps, a.cores, load0[0]), flush=True)
    rows, results = [], {}
    for T in [int(x) for x in a.seq.split(",")]:
        prefix = os.path.join(a.workdir, "data_T%d" % T)
        rng = random.Random(T)
        n_tokens = max(1 << 16, G * (a.warmup + a.steps) * (T + 1) + 1)
        sbs.write_megatron(prefix, [rng.randrange(CONFIG["vocab_size"]) for _ in range(n_tokens)], CONFIG["vocab_size"])
        per = {}
        for rnd in range(a.rounds):
            order = layouts[rnd % len(layouts):] + layouts[:rnd % len(layouts)]
            for lab, ranks, flags, _ in order:
                r = run_one(a, cfg_path, prefix, ranks, flags, T, os.path.join(a.workdir, "m.jsonl"))
                per.setdefault(lab, []).append(r)
                print("  T %d round %d %-15s %7.0f tok/s  cpu %.2f s/step  cp bytes %d  act %.1f MB%s" % (
                    T, rnd + 1, lab, r["tokens_per_s"], r["cpu_s"], r["cp_bytes"], r["act"] / 1e6,
                    "  ring %.3f s, waited %.3f s" % (r["ring_s"], r["ring_wait_s"]) if "ring_s" in r else ""), flush=True)
        med = {lab: {k: statistics.median(x[k] for x in v) for k in v[0] if k != "pairs"} for lab, v in per.items()}
        for lab in per:
            if "pairs" in per[lab][0]:
                med[lab]["pairs"] = per[lab][0]["pairs"]
        results[T] = med
        ref = med["1 rank"]
        for lab, ranks, flags, (C, A) in layouts:
            m = med[lab]
            want = analytic_cp_bytes(T, C, A)
            hidden = "-"
            if m.get("ring_s"):
                hidden = "%.0f%%" % (100 * (1 - m["ring_wait_s"] / m["ring_s"]))
            balance = "-"
            if "pairs" in m:
                balance = "%.2f%%" % (100 * (max(m["pairs"]) / min(m["pairs"]) - 1))
            rows.append((T, lab, "%.0f" % m["tokens_per_s"], "%.3f" % (m["cpu_s"] / ref["cpu_s"]),
                         "%.2f MB / %.2f MB" % (m["cp_bytes"] / 1e6, want / 1e6) if C > 1 else "-",
                         "%.1f MB (%.3f)" % (m["act"] / 1e6, m["act"] / ref["act"]), hidden, balance))
    print()
    print("Medians over %d rounds of %d measured steps (global batch %d x T, micro-batch %d; ranks x 1 thread on "
          "cores %s)." % (a.rounds, a.steps, G, B, a.cores))
    print(h.fmt_table(("T", "layout", "tok/s", "CPU ratio vs 1 rank", "cp bytes/step measured / analytic",
                       "act peak per rank (vs 1 rank)", "ring hidden", "causal work spread"), rows))
    load1 = os.getloadavg()
    print("load average: start %.2f, end %.2f; total %.0f s" % (load0[0], load1[0], time.time() - t_start))
    with open(os.path.join(a.workdir, "results.json"), "w") as f:
        json.dump({"results": results, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
