#!/usr/bin/env python3
"""Mixed-length training benchmark: step time of fixed windows against document batching.

Data: byte-level documents whose lengths follow a long-tailed lognormal (--median tokens, 1% above
--tail), L = --seq-len, steps of N = --tokens-per-step tokens; a llama-style model (d = 256, 4 layers,
4 heads). On R ranks (1 thread each) it times
  (i)   fixed windows with document masking (today's batching): N / L windows of L a step, DP R;
  (ii)  document batching, sequences dealt round-robin (--balance none), DP R;
  (iii) document batching, balanced (--balance lpt), DP R;
  (iv)  balanced with a CP degree per sequence: --cp C (CP C x DP R/C); a sequence runs at the least of
        1, 2, 4 ... C ranks whose rows of degree·L/C tokens hold it (at CP2: one rank up to L/2 tokens);
  (iv') the same with --balance flex: a sequence's degree raised above the least where that balances
        the ranks or saves a micro-batch (train/balance.h);
  (v)   balanced with static CP over every sequence: --cp C --static-cp.
C is 2, and on 4 ranks or more also 4 (the degrees 1, 2 and 4). With --balance-costs SOURCE also
  (iii) with the balancer's costs in seconds (train --balance-costs): timed at start (measure) or at a
  cluster.json's rates; its row adds the mean busy ms per rank the balancer estimated and measured.
--only LABELS (comma-separated prefixes such as "(ii),(iii)") times those configurations alone.
Per configuration: tokens/s (the step's tokens over its time; median of the measured steps, then of
--rounds rounds in rotated order), the rows each DP rank ran per step, and for document batching the
balancer's estimated max/mean busy time per rank, a lower bound of that estimate for any placement in as
many micro-batches (the bound: the mean, or the heaviest sequence's share alone) and the measured max/mean
(`documents` in the metrics).

Usage: /usr/bin/python3 bench/documents_bench.py [--ranks 2,4] [--seq-len 4096] [--tokens-per-step 16384]
           [--median 150] [--tail 2048] [--steps 6] [--warmup 2] [--rounds 3] [--balance-costs measure|FILE]
           [--only LABELS]
"""
import argparse
import json
import math
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "parallel"))
import harness as h  # noqa: E402


def make_data(tmp, args, count):
    """Documents of lognormal lengths (tokens, the end-of-document included)."""
    rng = random.Random(args.seed)
    sigma = math.log(args.tail / args.median) / 2.326  # P(n > tail) = 1%
    text = os.path.join(tmp, "docs.txt")
    lengths = []
    with open(text, "w") as f:
        for _ in range(count):
            n = max(2, int(rng.lognormvariate(math.log(args.median), sigma)))
            lengths.append(n)
            f.write("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n - 1)) + "\n")
    prefix = os.path.join(tmp, "docs")
    rc, out, _ = h.run(0, ["data", "prepare", "--input", text, "--output", prefix, "--tokenizer", "byte",
                           "--split", "line"])
    if rc != 0:
        sys.exit("data prepare failed:\n" + out)
    return prefix, lengths


def model_config(tmp, seq_len):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 257, "hidden_size": 256,
           "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
           "max_position_embeddings": seq_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu"}
    return h.write_json(os.path.join(tmp, "llama_d256.json"), cfg)


def configurations(args, ranks):
    L, N = args.seq_len, args.tokens_per_step
    docs = ["--batching", "documents", "--tokens-per-step", str(N), "--micro-batch", "1"]
    return [
        ("(i) windows, document mask", ["--attention-mask", "document", "--micro-batch", "1",
                                        "--global-batch", str(N // L)]),
        ("(ii) documents, round-robin", docs + ["--balance", "none"]),
        ("(iii) documents, balanced", docs + ["--balance", "lpt"]),
    ] + ([("(iii) balanced, costs %s" % os.path.basename(args.balance_costs),
           docs + ["--balance", "lpt", "--balance-costs", args.balance_costs])] if args.balance_costs else []) + [
        conf for c in ([2, 4] if ranks >= 4 else [2]) for conf in (
        ("(iv) balanced, CP%d per sequence" % c, docs + ["--balance", "lpt", "--cp", str(c)]),
        ("(iv') flex, CP%d per sequence" % c, docs + ["--balance", "flex", "--cp", str(c)]),
        ("(v) balanced, static CP%d" % c, docs + ["--balance", "lpt", "--cp", str(c), "--static-cp"]))]


def run_once(tmp, args, cfg, data, ranks, label, flags):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    steps = args.warmup + args.steps
    rc, out, _ = h.run(ranks, ["train", "--config", cfg, "--data", data, "--seq-len", str(args.seq_len),
                               "--steps", str(steps), "--threads", "1", "--quiet", "--lr", "1e-3",
                               "--metrics", metrics, *flags], timeout=3600)
    if rc != 0:
        sys.exit("%s on %d ranks failed:\n%s" % (label, ranks, out[-2000:]))
    rows = h.read_metrics(metrics)[args.warmup:]
    docs = [r.get("documents") for r in rows]
    return {"tok_s": statistics.median(r["tokens_per_s"] for r in rows),
            "rows": statistics.median(d["micro_batches"] for d in docs) if docs[0] else None,
            "est": statistics.median(d["busy_estimated_max_over_mean"] for d in docs) if docs[0] else None,
            "bound": statistics.median(d["busy_estimated_bound"] for d in docs) if docs[0] else None,
            "measured": statistics.median(d["busy_max_over_mean"] for d in docs) if docs[0] else None,
            "ms": tuple(statistics.median(statistics.mean(d[k]) for d in docs) for k in (
                "busy_estimated_ms", "busy_ms")) if docs[0] and "busy_estimated_ms" in docs[0] else None}


def busy_ms(rounds):
    """The estimated and measured busy ms per rank, each the median over the rounds ("" without costs in ms)."""
    if rounds[0]["ms"] is None:
        return ""
    return "%.0f / %.0f" % tuple(statistics.median(r["ms"][i] for r in rounds) for i in (0, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--median", type=float, default=150)
    p.add_argument("--tail", type=float, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--balance-costs", default="")
    p.add_argument("--only", default="")
    args = p.parse_args()
    tmp = h.tmpdir("origami_documents_bench_")
    need = (args.warmup + args.steps) * args.tokens_per_step * 2
    data, lengths = make_data(tmp, args, count=int(need / (args.median * 1.5)) + 100)
    cfg = model_config(tmp, args.seq_len)
    print("data: %d documents, median %d tokens, %.1f%% above %d, longest %d; L %d, N %d" % (
        len(lengths), statistics.median(lengths), 100.0 * sum(n > args.tail for n in lengths) / len(lengths),
        args.tail, max(lengths), args.seq_len, args.tokens_per_step))
    table = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        confs = [c for c in configurations(args, ranks) if not args.only or c[0].startswith(tuple(args.only.split(",")))]
        results = {label: [] for label, _ in confs}
        for k in range(args.rounds):
            for label, flags in confs[k % len(confs):] + confs[:k % len(confs)]:
                results[label].append(run_once(tmp, args, cfg, data, ranks, label, flags))
        # (the ratios are to round-robin (ii): --only must keep it)
        if "(ii) documents, round-robin" not in results:
            sys.exit("documents_bench: --only %s leaves out (ii), which every ratio is to" % args.only)
        base = statistics.median(r["tok_s"] for r in results["(ii) documents, round-robin"])
        for label, flags in confs:
            rs = results[label]
            tok_s = statistics.median(r["tok_s"] for r in rs)
            fmt = lambda key: "%.3f" % statistics.median(r[key] for r in rs) if rs[0][key] is not None else ""
            table.append((ranks, label, "%.0f" % tok_s, "%.2fx" % (tok_s / base), fmt("rows"), fmt("est"),
                          fmt("bound"), fmt("measured"), busy_ms(rs)))
        wanted = ("(iv) balanced, CP%d per sequence", "(iv') flex, CP%d per sequence", "(v) balanced, static CP%d")
        for c in [c for c in ([2, 4] if ranks >= 4 else [2]) if all(k % c in results for k in wanted)]:
            iv, flex, v = (statistics.median(r["tok_s"] for r in results[k % c]) for k in wanted)
            print("%d ranks, CP%d: (iv) is %.2fx (ii) (target >= 1.3) and %.2fx (v) (target >= 1.2); (iv') %.2fx "
                  "and %.2fx" % (ranks, c, iv / base, iv / v, flex / base, flex / v))
        print(h.fmt_table(["ranks", "configuration", "tokens/s", "vs (ii)", "micro-batches", "est. max/mean",
                           "bound", "measured max/mean", "busy ms est. / measured"], [t for t in table if t[0] == ranks]), flush=True)
    print(json.dumps({"table": table}))


if __name__ == "__main__":
    main()
