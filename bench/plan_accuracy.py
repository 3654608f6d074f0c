#!/usr/bin/env python3
"""How close `origami plan` comes to what `origami train` measures on this machine.

Two models big enough that compute dominates a step on 2 cores — a dense llama (8 layers, hidden
512, FFN 1536) and a mixtral (4 layers, hidden 512, 8 experts top-2, expert FFN 1024) — at global
batch 8 x 256 tokens, on the two ways the 2 cores run a job: 2 ranks x 1 thread and 1 rank x 2
threads. For each (model, ranks x threads) the machine is first profiled with that model's GEMM
shapes (`origami profile`, under mpirun for 2 ranks), and that cluster file is what the planner
predicts with. Then for each layout (TP, SP, PP, VPP, DP with ZeRO 0/1/2, CP p2p/a2a, EP, ETP,
micro-batch, recomputation):
  - predicted: `origami plan --layout <every axis fixed> --top 1 --json`: step_time_s, and the
    memory of rank 0's stage (memory_bytes_per_stage[0]) without the runtime part;
  - measured: `origami train` for --warmup + --steps steps, the median step time of the measured
    steps (rank 0's `ms`); activations + state as rank 0's peak resident memory (`rss_peak_bytes`)
    less the process's own memory before the run (the memory check's runtime part, rank 0's:
    `memory_bytes_per_rank[0]` less the predicted parts) — the whole process, allocator and MPI
    included.
MoE layouts are predicted with the routing imbalance of a one-rank run of the same steps (`origami
plan --imbalance FILE`: each EP degree's figure from that run's token counts per expert; the run is
timed by nothing), or with a stated one (--imbalance X); the MoE layouts' lines print the imbalance
each run met (`expert_imbalance`, and `expert_sync_imbalance`, call by call, the figure `--imbalance`
means; medians over the measured steps).
Finally the planner's own choice (`origami plan` with nothing fixed) is run for each (model, ranks x
threads) and compared with the best measured layout.

Environment: the tests' (tests/parallel/harness.py: Open MPI's shared-memory transport, ranks that
yield while they wait, --bind-to none), profiles and runs alike, with CMA single copy for large
messages as the other benchmarks (--single-copy none: without it, as the tests run, which works in
every container; pipeline messages then move only while both ranks are in MPI, and PP layouts
measure 13-34% above their prediction; MPI also keeps more scratch, so memory comes out closer).

Each layout runs in fp32 or bf16 (--precision, the planner predicting with the profile's bf16 GEMM
rates). Targets (the planner issues): on 2 ranks x 1 thread at least 90% of the layouts within 15%
and a median within 7%; activation + state memory within 5%; the top choice within 5% of the best
measured.

Usage: /usr/bin/python3 bench/plan_accuracy.py [--rounds 1] [--steps 3] [--warmup 1] [--only dense|moe]
         [--ranks 1|2] [--single-copy cma|none] [--json OUT.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
import harness as h  # noqa: E402

T, G = 256, 8
MODELS = {
    "dense": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 512,
              "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
              "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 256},
    "moe": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 512, "hidden_size": 512,
            "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 512,
            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
            "sliding_window": None, "bos_token_id": 256, "eos_token_id": 256},
}
# (model, ranks, threads per rank, layout: every axis the planner varies, fixed)
CASES = [
    ("dense", 2, 1, "fp32", "tp1 cp1 pp1 vpp1 zero0 mb4 nosp"),
    ("dense", 2, 1, "fp32", "tp1 cp1 pp1 vpp1 zero1 mb2 nosp"),
    ("dense", 2, 1, "fp32", "tp1 cp1 pp1 vpp1 zero2 mb1 nosp"),
    ("dense", 2, 1, "fp32", "tp2 cp1 pp1 vpp1 zero0 mb4 nosp"),
    ("dense", 2, 1, "fp32", "tp2 cp1 pp1 vpp1 zero0 mb4 sp"),
    ("dense", 2, 1, "fp32", "tp2 cp1 pp1 vpp1 zero0 mb4 sp recompute=selective"),
    ("dense", 2, 1, "fp32", "tp1 cp1 pp2 vpp1 zero0 mb1 nosp"),
    ("dense", 2, 1, "fp32", "tp1 cp1 pp2 vpp2 zero0 mb1 nosp"),
    ("dense", 2, 1, "fp32", "tp1 cp1 pp2 vpp1 zero0 mb2 nosp recompute=full"),
    ("dense", 2, 1, "fp32", "tp1 cp2 pp1 vpp1 zero0 mb4 nosp cp-comm=p2p"),
    ("dense", 2, 1, "fp32", "tp1 cp2 pp1 vpp1 zero1 mb4 nosp cp-comm=a2a"),
    ("dense", 1, 2, "fp32", "tp1 cp1 pp1 vpp1 zero0 mb1 nosp"),
    ("dense", 1, 2, "fp32", "tp1 cp1 pp1 vpp1 zero0 mb4 nosp"),
    ("dense", 1, 2, "fp32", "tp1 cp1 pp1 vpp1 zero0 mb8 nosp recompute=full"),
    ("moe", 2, 1, "fp32", "tp1 cp1 ep2 etp1 pp1 vpp1 zero0 mb4 nosp"),
    ("moe", 2, 1, "fp32", "tp1 cp1 ep2 etp1 pp1 vpp1 zero1 mb2 nosp"),
    ("moe", 2, 1, "fp32", "tp1 cp1 ep1 etp1 pp1 vpp1 zero0 mb4 nosp"),
    ("moe", 2, 1, "fp32", "tp2 cp1 ep1 etp2 pp1 vpp1 zero0 mb4 sp"),
    ("moe", 2, 1, "fp32", "tp2 cp1 ep2 etp1 pp1 vpp1 zero0 mb4 sp"),
    ("moe", 2, 1, "fp32", "tp1 cp1 ep1 etp1 pp2 vpp1 zero0 mb2 nosp"),
    ("moe", 2, 1, "fp32", "tp1 cp2 ep2 etp1 pp1 vpp1 zero0 mb4 nosp cp-comm=p2p"),
    ("moe", 1, 2, "fp32", "tp1 cp1 ep1 etp1 pp1 vpp1 zero0 mb4 nosp"),
    ("moe", 1, 2, "fp32", "tp1 cp1 ep1 etp1 pp1 vpp1 zero0 mb2 nosp recompute=selective"),
    ("dense", 2, 1, "bf16", "tp1 cp1 pp1 vpp1 zero0 mb4 nosp"),
    ("dense", 2, 1, "bf16", "tp1 cp1 pp1 vpp1 zero1 mb2 nosp"),
    ("dense", 2, 1, "bf16", "tp2 cp1 pp1 vpp1 zero0 mb4 sp"),
    ("dense", 2, 1, "bf16", "tp1 cp1 pp2 vpp1 zero0 mb1 nosp"),
    ("dense", 2, 1, "bf16", "tp1 cp2 pp1 vpp1 zero0 mb4 nosp cp-comm=p2p"),
    ("moe", 2, 1, "bf16", "tp1 cp1 ep2 etp1 pp1 vpp1 zero0 mb4 nosp"),
    ("moe", 2, 1, "bf16", "tp1 cp1 ep1 etp1 pp1 vpp1 zero0 mb4 nosp"),
    ("moe", 2, 1, "bf16", "tp2 cp1 ep1 etp2 pp1 vpp1 zero0 mb4 sp"),
]
# Every case fixes the axes its words leave open, so that the planner prices the layout the run
# measures: recomputation off, no vocabulary parallelism, the experts sharded by EP (not FSSDP).
CASES = [(m, r, t, p, l + "".join(" " + w for w, given in (("recompute=none", "recompute=" in l), ("novocab", "vocab" in l),
                                                          ("nofssdp", m != "moe" or "fssdp" in l)) if not given))
         for m, r, t, p, l in CASES]
PARTS = ("weights", "gradients", "optimizer state", "activations", "workspace", "checkpoint")


SINGLE_COPY = ["cma"]  # Open MPI's single-copy mechanism (--single-copy)


def run(cmd, timeout=900):
    p = subprocess.run(cmd, capture_output=True, text=True, env=h.env(SINGLE_COPY[0]), timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s" % (p.returncode, " ".join(cmd), (p.stdout + p.stderr)[-2000:]))
    return p.stdout


def profile(cfg, ranks, threads, out):
    run(h.command(ranks, ["profile", "--config", cfg, "--threads", str(threads), "--micro-batch", "4", "--seq-len",
                          str(T), "--out", out]))


def plan(cfg, cluster, ranks, precision, imbalance, layout=None):
    args = ["plan", "--config", cfg, "--cluster", cluster, "--devices", str(ranks), "--global-batch", str(G),
            "--seq-len", str(T), "--top", "1", "--json", "--imbalance", str(imbalance), "--precision", precision]
    args += ["--layout", layout] if layout else []
    return json.loads(run(h.command(0, args)))[0]


def routing_run(a, cfg, data, threads, precision, tmp):
    """A one-rank run of the measured runs' steps, for `plan --imbalance FILE`: its metrics file without
    the warm-up steps (as the measured figures are taken)."""
    metrics = os.path.join(tmp, "routing_run_%s.jsonl" % precision)
    if os.path.exists(metrics):
        os.remove(metrics)
    run(h.command(1, ["train", "--config", cfg, "--data", data, "--steps", str(a.warmup + a.steps), "--global-batch",
                      str(G), "--seq-len", str(T), "--micro-batch", "4", "--threads", str(threads), "--quiet",
                      "--metrics", metrics, "--precision", precision]))
    measured = os.path.join(tmp, "routing_%s.jsonl" % precision)
    with open(metrics) as f, open(measured, "w") as out:
        out.writelines(f.readlines()[a.warmup:])
    return measured


def measure(a, cfg, data, ranks, threads, precision, layout, tmp):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run(h.command(ranks, ["train", "--config", cfg, "--data", data, "--steps", str(a.warmup + a.steps),
                          "--global-batch", str(G), "--seq-len", str(T), "--threads", str(threads), "--quiet",
                          "--metrics", metrics, "--precision", precision, *h.train_flags(layout)]))
    rows = h.read_metrics(metrics)
    measured = rows[a.warmup:]
    out = {"ms": statistics.median(r["ms"] for r in measured), "rss": max(r["rss_peak_bytes"] for r in rows),
           "rank0_total": rows[0]["memory_bytes_per_rank"][0], "act_peak": rows[0]["act_bytes_peak"][0]}
    if "expert_sync_imbalance" in rows[0]:  # MoE: the routing imbalance the run met, over the step and call by call
        out["imbalance"] = statistics.median(r["expert_imbalance"] for r in measured)
        out["sync_imbalance"] = statistics.median(r["expert_sync_imbalance"] for r in measured)
    return out


def pct(x):
    return "%+.1f%%" % (100 * x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each layout (the median is kept)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of a run")
    ap.add_argument("--only", choices=sorted(MODELS), help="one model")
    ap.add_argument("--ranks", type=int, choices=(1, 2), help="only the setups of this many ranks (2: 2 ranks x 1 thread)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--imbalance", default="routing",
                    help="MoE: 'routing' (from a one-rank run of the same steps, the default) or a stated X")
    ap.add_argument("--single-copy", choices=("cma", "none"), default="cma",
                    help="Open MPI's single-copy mechanism for large messages, profiles and runs alike (cma, as the "
                         "other benchmarks; none: what works in every container, as the tests)")
    a = ap.parse_args()
    SINGLE_COPY[0] = a.single_copy
    tmp = h.tmpdir("origami_plan_accuracy_")
    data = h.prepare_data(tmp, n_docs=400)
    load = os.getloadavg()
    print("plan_accuracy: global batch %d x %d tokens, %d round(s) of %d warm-up + %d measured steps; single copy %s; "
          "load %.2f %.2f %.2f" % (G, T, a.rounds, a.warmup, a.steps, a.single_copy, *load), flush=True)
    results = []
    setups = sorted({(m, r, t, p) for m, r, t, p, _ in CASES
                     if (not a.only or m == a.only) and (not a.ranks or r == a.ranks)})
    for model, ranks, threads, precision in setups:
        cfg = os.path.join(tmp, model + ".json")
        with open(cfg, "w") as f:
            json.dump(MODELS[model], f)
        cluster = os.path.join(tmp, "%s-%dx%d.json" % (model, ranks, threads))
        if not os.path.exists(cluster):  # one profile per (model, ranks x threads): it measures fp32 and bf16
            t0 = time.time()
            profile(cfg, ranks, threads, cluster)
            print("\n%s, %d rank(s) x %d thread(s): profiled in %.0f s" % (model, ranks, threads, time.time() - t0),
                  flush=True)
        print("\n%s, %d rank(s) x %d thread(s), %s:" % (model, ranks, threads, precision), flush=True)
        imbalance = 1.0
        if MODELS[model].get("num_local_experts"):
            imbalance = a.imbalance if a.imbalance != "routing" else routing_run(a, cfg, data, threads, precision, tmp)
        predictions = {l: plan(cfg, cluster, ranks, precision, imbalance, l) for m, r, t, p, l in CASES
                       if (m, r, t, p) == (model, ranks, threads, precision)}
        choice = plan(cfg, cluster, ranks, precision, imbalance)  # the planner's own pick: measured too when not a case
        if choice["layout"] not in {p["layout"] for p in predictions.values()}:
            predictions[choice["layout"]] = choice
        for layout, p in predictions.items():
            # (the layout the planner priced, in its words: what the run measures)
            runs = [measure(a, cfg, data, ranks, threads, precision, p["layout"], tmp) for _ in range(a.rounds)]
            m = sorted(runs, key=lambda r: r["ms"])[len(runs) // 2]
            stage0 = p["memory_bytes_per_stage"][0]
            predicted_mem = sum(stage0[k] for k in PARTS)
            runtime = m["rank0_total"] - predicted_mem  # the memory check's measured runtime part of rank 0
            measured_mem = m["rss"] - runtime
            r = {"model": model, "ranks": ranks, "threads": threads, "precision": precision, "layout": p["layout"],
                 "planner_choice": p["layout"] == choice["layout"], "predicted_s": p["step_time_s"],
                 "measured_s": m["ms"] / 1000, "predicted_memory": predicted_mem, "measured_memory": measured_mem,
                 "predicted_activations": stage0["activations"], "measured_activations": m["act_peak"],
                 "dominant": p["dominant"], "imbalance": m.get("imbalance"), "sync_imbalance": m.get("sync_imbalance"),
                 "priced_imbalance": p.get("imbalance")}
            r["time_error"] = r["predicted_s"] / r["measured_s"] - 1
            r["memory_error"] = predicted_mem / measured_mem - 1
            results.append(r)
            routing = "" if r["imbalance"] is None else \
                "; imbalance priced %.2f, met %.2f (call by call %.2f)" % (r["priced_imbalance"], r["imbalance"],
                                                                           r["sync_imbalance"])
            print("  %-58s predicted %6.3f s measured %6.3f s (%s); memory %7.1f MiB vs %7.1f MiB (%s)%s%s"
                  % (p["layout"], r["predicted_s"], r["measured_s"], pct(r["time_error"]), predicted_mem / 2**20,
                     measured_mem / 2**20, pct(r["memory_error"]), routing,
                     "  <- planner's choice" if r["planner_choice"] else ""), flush=True)
    print("\n| model | ranks x threads | precision | layout | predicted s | measured s | error | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print("| %s | %dx%d | %s | %s%s | %.3f | %.3f | %s | %.1f | %.1f | %s |" % (
            r["model"], r["ranks"], r["threads"], r["precision"], r["layout"],
            " (planner's choice)" if r["planner_choice"] else "",
            r["predicted_s"], r["measured_s"], pct(r["time_error"]), r["predicted_memory"] / 2**20,
            r["measured_memory"] / 2**20, pct(r["memory_error"])))
    if a.json:  # first: nothing measured is lost to a summary's mistake
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    for name, rows in (("all", results), ("2 ranks x 1 thread", [r for r in results if r["ranks"] == 2])):
        if not rows:
            continue
        time_errors = [abs(r["time_error"]) for r in rows]
        memory_errors = [abs(r["memory_error"]) for r in rows]
        print("\n%s: layouts %d; step time |error| median %.1f%%, max %.1f%%, within 15%%: %d (%.0f%%); memory |error| "
              "median %.1f%%, max %.1f%%, within 5%%: %d" % (
                  name, len(rows), 100 * statistics.median(time_errors), 100 * max(time_errors),
                  sum(e <= 0.15 for e in time_errors), 100 * sum(e <= 0.15 for e in time_errors) / len(rows),
                  100 * statistics.median(memory_errors), 100 * max(memory_errors),
                  sum(e <= 0.05 for e in memory_errors)))
    for model, ranks, threads, precision in setups:
        group = [r for r in results if (r["model"], r["ranks"], r["threads"], r["precision"]) ==
                 (model, ranks, threads, precision)]
        best = min(group, key=lambda r: r["measured_s"])
        chosen = next(r for r in group if r["planner_choice"])
        print("top choice %s %dx%d %s: %s measured %.3f s; best measured %s %.3f s (%s)" % (
            model, ranks, threads, precision, chosen["layout"], chosen["measured_s"], best["layout"], best["measured_s"],
            pct(chosen["measured_s"] / best["measured_s"] - 1)))


if __name__ == "__main__":
    main()
