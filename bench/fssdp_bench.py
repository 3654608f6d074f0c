"""FSSDP against EP: Mixtral-style models with 16 and 64 experts on 2 and 4 ranks, under the router's own
balance and under skew (a router bias that sends half of the assignments to experts 0 and 1).

    /usr/bin/python3 bench/fssdp_bench.py [--experts 16,64] [--ranks 2,4] [--steps 6] [--repeats 3]
        [--hidden 256] [--ffn 512] [--kv-heads 8] [--seq-len 128] [--micro-batch 8] [--accumulate 1]
        [--precision fp32] [--routing balanced,skewed] [--single-copy cma] [--dir bench/runs/fssdp]

The model: 4 layers of hidden --hidden (256), 8 heads (--kv-heads of them for keys and values), experts
of FFN --ffn (512), top-2, the byte vocabulary; per rank a step --accumulate micro-batches (1) of
--micro-batch x --seq-len tokens, one thread per rank. What FSSDP moves is the experts' weights and
gradients (under --fssdp-keep the values once a step, the gradients every micro-batch), what EP moves
is token rows, so their ratio is set by the rows each expert gets on a rank (tokens x top-k / experts) and by how
much of a step the experts are (Mixtral's proportions, FFN 3.5 x hidden and 4 query heads per
key-value head, put 0.86 of the weight GEMMs' FLOPs of the README's shape in the experts, about 0.8
counting attention's scores). Each layout is EP over
all ranks (--ep R), FSSDP (--expert-sharding fssdp) on R ranks of data parallelism (the dense part
all-reduced either way), or FSSDP with --fssdp-keep (each expert gathered once a step). Skew:
ORIGAMI_TEST_ROUTER_SKEW=B adds B to experts 0 and 1's selection scores; B is calibrated first (one rank, 1 step, bisection) so that about half of the routed assignments go to
them. Per layout: the median over --repeats runs of the median step time of steps 3 onward (ms), the
busiest rank's expert rows over the mean (expert_imbalance: under EP the rows an EP rank's experts
compute, under FSSDP a rank's own), and the bytes rank 0 sends per step (all groups). The table ends
with FSSDP's throughput over EP's (step time of EP over FSSDP's), then a lone rank's step time (one
process with one rank's work, all experts local, no communication; as fast as FSSDP could be, or a
little faster: it has the machine's caches and memory to itself; its runs come first for each
expert count, not alternated with the others) and EP's over it, the most FSSDP
could gain (where the ranks have a core each; when no --ranks entry has, the lone rank is not run).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))
import harness as h  # noqa: E402

SINGLE_COPY = ["cma"]  # --single-copy


def model(d, a, experts):
    return h.write_json(os.path.join(d, "mixtral_%de.json" % experts), h.load_config(
        "mixtral_8e", hidden_size=a.hidden, intermediate_size=a.ffn, num_local_experts=experts, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq_len))


def train(d, a, cfg, data, ranks, flags, steps, skew, tag):
    m = os.path.join(d, tag + ".jsonl")
    if os.path.exists(m):
        os.remove(m)
    args = ["train", "--config", cfg, "--data", data, "--steps", str(steps), "--micro-batch", str(a.micro_batch),
            "--global-batch", str(a.micro_batch * max(ranks, 1) * a.accumulate), "--seq-len", str(a.seq_len),
            "--threads", "1", "--quiet", "--metrics", m, "--precision", a.precision]
    env = {"OMP_NUM_THREADS": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": SINGLE_COPY[0]}
    if skew:
        env["ORIGAMI_TEST_ROUTER_SKEW"] = repr(skew)
    rc, out, _ = h.run(ranks, args + flags, timeout=900, extra_env=env)
    if rc != 0:
        sys.exit("FAIL: %s: %s" % (tag, out[-800:]))
    return h.read_metrics(m)


def skewed_share(rows):
    """Share of the routed assignments that went to experts 0 and 1, over the run."""
    tot = [sum(map(sum, r["expert_tokens"])) for r in rows]
    hot = [sum(layer[0] + layer[1] for layer in r["expert_tokens"]) for r in rows]
    return sum(hot) / sum(tot)


def calibrate(d, a, cfg, data):
    lo, hi = 0.0, 1.0
    for _ in range(10):
        mid = (lo + hi) / 2
        share = skewed_share(train(d, a, cfg, data, 0, [], 1, mid, "calibrate"))
        lo, hi = (mid, hi) if share < 0.5 else (lo, mid)
    return (lo + hi) / 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="16,64")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per rank a step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="each expert's FFN width")
    ap.add_argument("--kv-heads", type=int, default=8, help="of 8 heads")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--routing", default="balanced,skewed", help="which routings to run (skewed calibrates a bias)")
    ap.add_argument("--single-copy", default="cma", help="Open MPI shared-memory single-copy mechanism for large "
                    "messages (cma: the receiver copies straight from the sender; none: through shared buffers)")
    ap.add_argument("--dir", default=os.path.join(h.ROOT, "bench", "runs", "fssdp"))
    a = ap.parse_args()
    if a.accumulate < 1:
        ap.error("--accumulate must be at least 1, got %d" % a.accumulate)
    routings = a.routing.split(",")
    if any(r not in ("balanced", "skewed") for r in routings):
        ap.error("--routing takes balanced, skewed or both (comma-separated), got %r" % a.routing)
    SINGLE_COPY[0] = a.single_copy
    os.makedirs(a.dir, exist_ok=True)
    data = h.prepare_data(a.dir, n_docs=2000)
    rows = []
    cores = os.cpu_count() or 1
    # The lone rank bounds FSSDP only where every rank has a core; with none such, it is not run.
    bounded = any(int(R) <= cores for R in a.ranks.split(","))
    for E in map(int, a.experts.split(",")):
        cfg = model(a.dir, a, E)
        bias = calibrate(a.dir, a, cfg, data) if "skewed" in routings else 0.0
        routes = [(r, bias if r == "skewed" else 0.0) for r in routings]
        lone = {routing: statistics.median(
                    statistics.median(r["ms"] for r in train(a.dir, a, cfg, data, 0, [], a.steps, skew, "run")[2:])
                    for _ in range(a.repeats)) if bounded else None
                for routing, skew in routes}
        if bounded:
            print("%d experts: a lone rank (one process, no communication) %s" %
                  (E, ", ".join("%s %.0f ms" % kv for kv in lone.items())), flush=True)
        for R in map(int, a.ranks.split(",")):
            for routing, skew in routes:
                layouts = (("EP%d" % R, ["--ep", str(R)]), ("FSSDP DP%d" % R, ["--expert-sharding", "fssdp"]),
                           ("FSSDP keep DP%d" % R, ["--expert-sharding", "fssdp", "--fssdp-keep"]))
                runs = {name: [] for name, _ in layouts}
                for rep in range(a.repeats):  # EP and FSSDP alternate, so drifts of the machine hit both
                    for name, flags in layouts:
                        got = train(a.dir, a, cfg, data, R, flags, a.steps, skew, "run")
                        runs[name].append((statistics.median(r["ms"] for r in got[2:]),
                                           statistics.median(r["expert_imbalance"] for r in got[2:]),
                                           statistics.median(sum(r["comm_bytes"].values()) for r in got[2:]),
                                           skewed_share(got)))
                result = {}
                for name, _ in layouts:
                    ms = [x[0] for x in runs[name]]
                    result[name] = tuple(statistics.median(x[i] for x in runs[name]) for i in range(4))
                    print("%d experts, %d ranks, %s, %s: %.0f ms (runs %s), busiest/mean rows %.2f, %.1f MB sent, "
                          "experts 0-1 take %.2f" % (E, R, routing, name, result[name][0], [round(x) for x in ms],
                                                     result[name][1], result[name][2] / 1e6, result[name][3]), flush=True)
                ep, fs, fk = result["EP%d" % R], result["FSSDP DP%d" % R], result["FSSDP keep DP%d" % R]
                rows.append([E, R, routing + (" (B %.3f)" % skew if skew else ""), "%.0f" % ep[0], "%.0f" % fs[0],
                             "%.0f" % fk[0], "%.2f" % ep[1], "%.2f" % fs[1], "%.1f" % (ep[2] / 1e6),
                             "%.1f" % (fs[2] / 1e6), "%.1f" % (fk[2] / 1e6), "%.2f" % (ep[0] / fs[0]),
                             "%.2f" % (ep[0] / fk[0]), "%.0f" % lone[routing] if bounded else "-",
                             "%.2f" % (ep[0] / lone[routing]) if R <= cores else "-"])
    print()
    print(h.fmt_table(["experts", "ranks", "routing", "EP ms", "FSSDP ms", "keep ms", "EP busiest/mean",
                       "FSSDP busiest/mean", "EP MB/step", "FSSDP MB/step", "keep MB/step", "FSSDP / EP",
                       "keep / EP", "lone rank ms", "EP / lone"], rows))


if __name__ == "__main__":
    main()
