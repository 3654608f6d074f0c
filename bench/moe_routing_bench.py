#!/usr/bin/env python3
"""MoE routing benchmark on case (c) (side_by_side.py: Mixtral L4 d256, 8 experts top-2, F 512,
vocabulary 257: the byte tokenizer's) on 2 ranks as EP2 (attention DP2, experts EP2 over the same ranks).

Speed (micro-batch 8, T 256, global batch 16: one micro-batch per rank and step): per routing setting —
dropless, capacity factor 1.0 and 1.25, each with the probs and the position policy, padded and not —
rank 0's tokens/s (median over the measured steps, then over rounds), the receive imbalance (the most
expert-side rows a rank computed over the mean: `expert_imbalance`) and the fraction of assignments
dropped (`expert_dropped` over tokens·K·layers).

Quality (--quality-steps, default 300; micro-batch 4, T 64, global batch 8, lr 3e-3 cosine with 20
warmup steps, on the demo corpus — /usr/share/games/fortunes, byte tokenizer): the LM loss (mean of the
last 10 steps) with the `micro` and `global` load-balancing losses and with aux-loss-free bias balancing
(rate 1e-3, no aux loss), and the expert-load spread they reach: max/mean tokens per expert over the
last 50 steps, averaged over the layers (1.0: perfectly even).

Usage: /usr/bin/python3 bench/moe_routing_bench.py [--rounds 2] [--steps 3] [--quality-steps 300]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
import side_by_side as sbs  # noqa: E402
import harness as h  # noqa: E402

SPEED = [("dropless", [])]
for f in ("1.0", "1.25"):
    for policy in ("probs", "position"):
        for pad in (False, True):
            SPEED.append(("cf %s %s%s" % (f, policy, " padded" if pad else ""),
                          ["--moe-capacity-factor", f, "--moe-drop-policy", policy] + (["--moe-pad-to-capacity"] if pad else [])))
QUALITY = [("micro", []), ("global", ["--moe-aux-loss", "global"]),
           ("bias 1e-3", ["--moe-router-bias-update-rate", "1e-3", "--moe-aux-loss", "none"])]


def train(a, cfg_path, data, flags, steps, B, G, T, mpath, extra=()):
    if os.path.exists(mpath):
        os.remove(mpath)
    args = ["train", "--config", cfg_path, "--data", data, "--steps", str(steps), "--micro-batch", str(B),
            "--global-batch", str(G), "--seq-len", str(T), "--threads", "1", "--metrics", mpath, "--quiet",
            "--ep", "2", *extra, *flags]
    cmd = ["taskset", "-c", a.cores] + h.command(2, args, a.origami)
    p = subprocess.run(cmd, capture_output=True, text=True, env=h.env("cma"), timeout=a.timeout, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError("exit %d: %s\n%s" % (p.returncode, " ".join(cmd), (p.stdout + p.stderr)[-3000:]))
    return h.read_metrics(mpath)


def spread(recs):
    """max/mean tokens per expert, summed over the records, averaged over the MoE layers."""
    L = len(recs[0]["expert_tokens"])
    vals = []
    for l in range(L):
        tot = [sum(r["expert_tokens"][l][e] for r in recs) for e in range(len(recs[0]["expert_tokens"][l]))]
        if sum(tot):
            vals.append(max(tot) / (sum(tot) / len(tot)))
    return statistics.mean(vals)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per speed run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quality-steps", type=int, default=300)
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--origami", default=os.path.join(ROOT, "build", "origami"))
    ap.add_argument("--workdir", default=os.path.join(HERE, "runs", "moe_routing"))
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    case = sbs.CASES["c"]
    cfg_path = os.path.join(a.workdir, "mixtral_c.json")
    cfg = dict(case["config"], vocab_size=257)  # the byte tokenizer's 256 bytes + end-of-document
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    data = os.path.join(a.workdir, "fortunes")
    if not os.path.exists(data + ".bin"):
        subprocess.run([a.origami, "data", "prepare", "--input", "/usr/share/games/fortunes", "--output", data,
                        "--tokenizer", "byte"], check=True, capture_output=True)
    B, T, G = case["B"], case["T"], 2 * case["B"]
    K, L = cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    results = {}
    for r in range(a.rounds):
        # each round in another order (rotated), so that a load that grows over the run falls on each setting alike
        for name, flags in SPEED[r % len(SPEED):] + SPEED[:r % len(SPEED)]:
            recs = train(a, cfg_path, data, flags, a.warmup + a.steps, B, G, T, os.path.join(a.workdir, "speed.jsonl"))
            recs = recs[a.warmup:]
            res = results.setdefault(name, {"tok": [], "imb": [], "drop": []})
            res["tok"].append(statistics.median(x["tokens_per_s"] for x in recs))
            res["imb"].append(statistics.median(x["expert_imbalance"] for x in recs))
            res["drop"].append(statistics.median(sum(x["expert_dropped"]) / (G * T * K * L) for x in recs))
            print("round %d %-24s %7.0f tok/s  imbalance %.2f  dropped %.1f%%" % (
                r + 1, name, res["tok"][-1], res["imb"][-1], 100 * res["drop"][-1]), flush=True)
    base = statistics.median(results["dropless"]["tok"])
    print("\n| routing (EP2, 2 ranks) | tok/s | vs dropless | receive imbalance | dropped |")
    print("|---|---|---|---|---|")
    for name, _ in SPEED:
        res = results[name]
        tok = statistics.median(res["tok"])
        print("| %s | %.0f | %.2f× | %.2f | %.1f%% |" % (name, tok, tok / base, statistics.median(res["imb"]),
                                                    100 * statistics.median(res["drop"])))
    if a.quality_steps > 0:
        print("\n| balancing (EP2, %d steps) | LM loss (last 10 steps) | aux loss | expert-load spread (max/mean, last 50 steps) |"
              % a.quality_steps)
        print("|---|---|---|---|")
        for name, flags in QUALITY:
            recs = train(a, cfg_path, data, flags, a.quality_steps, 4, 8, 64, os.path.join(a.workdir, "quality.jsonl"),
                         ["--lr", "3e-3", "--warmup", "20", "--lr-schedule", "cosine", "--min-lr", "3e-4"])
            lm = statistics.mean(x["lm_loss"] for x in recs[-10:])
            print("| %s | %.4f | %.4f | %.3f |" % (name, lm, recs[-1]["aux_loss"], spread(recs[-50:])), flush=True)


if __name__ == "__main__":
    main()
