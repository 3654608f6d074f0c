"""`origami profile` (DESIGN.md, "Planner"): measures this machine and writes a cluster.json.

  1. Under mpirun on 2 ranks with a model config: exit 0; the file is one node of 2 devices; one
     GEMM rate per distinct size of the model's layer GEMMs (forward, input and weight gradients of
     QKV, attention output, MLP and LM head) at one row and at --micro-batch rows, ascending in size,
     each positive and at most the peak; the operands' streaming rate, where the cold calls were
     slower (and into weight gradients), and the first-touch rate positive; every collective's bandwidth by message size
     (ascending sizes, positive rates); the attention rate, the memory and the link's
     bandwidth and latency positive; the table
     printed names every collective, and the file keeps the other four collectives' own rates;
     the bf16 rates (the same GEMM sizes, each at most the bf16 peak; attention's own, positive); the
     planner reads the file and plans bf16 with it.
  2. On one rank (no mpirun), a MoE model with fewer routed rows than experts (2 tokens, top-2,
     8 experts): one device, no link or collectives measured, none written, every GEMM point positive;
     the file edited to two devices a node is refused by the planner (no link to price them with).
  3. On one rank without --config: the fixed squares and slabs, one fp32 and one bf16 rate per
     distinct size, each in (0, peak]; the planner plans a model with the file.
  4. Mistakes (no --out, a non-positive --seconds, a missing config): exit 1, one error line.
"""
import json
import os

import harness as h

QUICK = ["--seconds", "0.05", "--max-mb", "1", "--seq-len", "64", "--micro-batch", "2", "--threads", "1"]


def gemm_sizes(cfg, rows):
    """FLOPs of each layer GEMM of `cfg` on `rows` rows (forward, dx and dW of a linear share them)."""
    c, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = c // heads
    linears = [(c, (heads + 2 * kv) * d), (heads * d, c), (c, 2 * cfg["intermediate_size"]),
               (cfg["intermediate_size"], c), (c, cfg["vocab_size"])]
    return {2 * rows * i * o for i, o in linears}


def same_sizes(gflops, flops):
    """Whether the file's GEMM sizes (GFLOP, ascending) are the distinct sizes `flops` (FLOP), in order."""
    want = sorted(flops)
    return len(gflops) == len(want) and all(abs(a - b * 1e-9) < 1e-9 * b * 1e-9 for a, b in zip(gflops, want))


def plans(cfg, cluster, *extra):
    """(whether the planner plans cfg with the cluster file, the end of its output)."""
    rc, planned, _ = h.run(0, ["plan", "--config", cfg, "--cluster", cluster, "--global-batch", "4", "--seq-len", "32",
                               *extra, "--top", "1", "--json"])
    return rc == 0 and json.loads(planned)[0]["step_time_s"] > 0, planned[-300:]


def record(checks, case, failures):
    for ok, what in checks:
        print("%-4s %s: %s" % ("ok" if ok else "FAIL", case, what[:160]))
        if not ok:
            failures.append("profile %s: %s" % (case, what))


def two_ranks(tmp, cfg, failures):
    out = os.path.join(tmp, "two.json")
    rc, text, secs = h.run(2, ["profile", "--out", out, "--config", cfg, *QUICK], timeout=300)
    if rc != 0:
        failures.append("profile on 2 ranks: exit %s: %s" % (rc, text[-800:]))
    else:
        c = json.load(open(out))
        d = c["device"]
        gemm = d.get("gemm", [])
        sizes = [g[0] for g in gemm]
        model = json.load(open(cfg))
        want = gemm_sizes(model, 64) | gemm_sizes(model, 2 * 64)
        checks = [
            (c["nodes"] == 1 and c["devices_per_node"] == 2, "one node of 2 devices: %s x %s" % (c["nodes"], c["devices_per_node"])),
            (same_sizes(sizes, want), "GEMM rates by distinct size, ascending, at 1 and 2 rows of 64: %s (want %s)" % (
                sizes, [w * 1e-9 for w in sorted(want)])),
            (all(x.get(k, 1) > 0 for x in (d, d.get("bf16", {}))
                 for k in ("gemm_streaming_gb_s", "gemm_streaming_accumulating_gb_s")),
             "operands' streaming rates (and into weight gradients) positive where measured: %s, %s" % (
                 d.get("gemm_streaming_gb_s"), d.get("gemm_streaming_accumulating_gb_s"))),
            (d.get("first_touch_gb_s", 0) > 0, "first-touch rate positive: %s" % d.get("first_touch_gb_s")),
            (all(len(x.get("bandwidth_by_size", [])) >= 4 and
                 [p[0] for p in x["bandwidth_by_size"]] == sorted(p[0] for p in x["bandwidth_by_size"]) and
                 all(p[1] > 0 for p in x["bandwidth_by_size"])
                 for x in [c["intra_node"], *c.get("collectives", {}).values()]),
             "every collective's bandwidth by message size, ascending and positive: %s" %
             c["intra_node"].get("bandwidth_by_size")),
            (all(0 < g[1] <= d["peak_tflops"] * (1 + 1e-9) for g in gemm), "rates in (0, peak]: %s" % gemm),
            (d["attention_tflops"] > 0 and d["memory_gb"] > 0, "attention and memory positive: %s" % d),
            (c["intra_node"]["bandwidth_gb_s"] > 0 and c["intra_node"]["latency_us"] > 0, "link: %s" % c["intra_node"]),
            (all(k in text for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")),
             "the printed table names every collective"),
            (sorted(c.get("collectives", {})) == ["all_gather", "all_to_all", "reduce_scatter", "send_recv"] and
             all(x["bandwidth_gb_s"] > 0 and x["latency_us"] > 0 for x in c["collectives"].values()),
             "each collective's own rate: %s" % c.get("collectives")),
            ([g[0] for g in d.get("bf16", {}).get("gemm", [])] == sizes and
             all(0 < g[1] <= d["bf16"]["peak_tflops"] * (1 + 1e-9) for g in d["bf16"]["gemm"]) and
             d["bf16"]["attention_tflops"] > 0, "bf16 rates: %s" % d.get("bf16")),
        ]
        ok, planned = plans(cfg, out, "--precision", "bf16")
        checks.append((ok, "the planner reads it (bf16): %s" % planned))
        record(checks, "on 2 ranks", failures)
        print("     (%.1f s; peak %.1f GFLOP/s per rank, all-reduce %.2f GB/s)" % (
            secs, d["peak_tflops"] * 1e3, c["intra_node"]["bandwidth_gb_s"]))


def one_rank_moe(tmp, cfg, failures):
    """Returns the file written, for the mistakes' --out."""
    # On one rank (no mpirun), with a MoE model whose micro-batch routes fewer rows than it has experts
    # (2 tokens x top-2 < 8 experts): one device and no link; each expert's GEMMs are timed on one row
    # (zero rows stopped the job on an internal assert).
    one = os.path.join(tmp, "one.json")
    rc, text, _ = h.run(0, ["profile", "--out", one, "--config", os.path.join(h.CONFIGS, "mixtral_8e.json"),
                            "--seconds", "0.01", "--seq-len", "2", "--micro-batch", "1", "--threads", "1"], timeout=300)
    c = json.load(open(one)) if rc == 0 else {}
    ok = rc == 0 and c["devices_per_node"] == 1 and "intra_node" not in c and not c["collectives"]
    print("%-4s 1 rank: one device, no link or collectives" % ("ok" if ok else "FAIL"))
    if not ok:
        failures.append("profile on 1 rank: exit %s: %s" % (rc, text[-500:]))
    else:
        dev = c["device"]
        ok = all(f > 0 and r > 0 for f, r in dev["gemm"] + dev["bf16"]["gemm"])
        print("%-4s 1 rank: mixtral with 2 tokens a micro-batch (fewer expert rows than experts)" % ("ok" if ok else "FAIL"))
        if not ok:
            failures.append("profile of mixtral_8e at --seq-len 2: GEMM points %s" % dev["gemm"])
        # a node of several devices made of it has no link to price their collectives with: refused
        edited = os.path.join(tmp, "one_edited.json")
        json.dump(dict(c, devices_per_node=2), open(edited, "w"))
        _, _, failure = h.check_error("one-rank profile as 2 devices", 0,
                                      ["plan", "--config", cfg, "--cluster", edited, "--global-batch", "4", "--seq-len", "32"],
                                      lambda line: "'intra_node': missing (a node of 2 devices" in line)
        failures += [failure] if failure else []
    return one


def without_config(tmp, cfg, failures):
    # On one rank without --config: the fixed shapes, squares from 128 to 2048 and slabs of a 1024 x 4096
    # weight (both ways round) at 256 to 4096 rows, one rate per distinct size (a 1024 square and the
    # 256-row slab share one), in fp32 and bf16; and the planner prices a model with the file.
    generic = os.path.join(tmp, "generic.json")
    rc, text, secs = h.run(0, ["profile", "--out", generic, "--seconds", "0.01", "--seq-len", "64", "--threads", "2"],
                           timeout=600)
    if rc != 0:
        failures.append("profile without --config: exit %s: %s" % (rc, text[-500:]))
    else:
        dev = json.load(open(generic))["device"]
        want = {2 * n ** 3 for n in (128, 256, 512, 1024, 2048)} | {2 * n * 1024 * 4096 for n in (256, 1024, 4096)}
        sizes = [g[0] for g in dev["gemm"]]
        checks = [(same_sizes(sizes, want), "GEMM rates at the fixed shapes' %d distinct sizes: %s" % (len(want), sizes)),
                  ([g[0] for g in dev["bf16"]["gemm"]] == sizes and
                   all(0 < g[1] <= x["peak_tflops"] * (1 + 1e-9) for x in (dev, dev["bf16"]) for g in x["gemm"]),
                   "fp32 and bf16 rates in (0, peak] at the same sizes: %s, %s" % (dev["gemm"], dev["bf16"]["gemm"]))]
        ok, planned = plans(cfg, generic)
        checks.append((ok, "the planner reads it: %s" % planned))
        record(checks, "without --config", failures)
        print("     (%.1f s)" % secs)


def main():
    failures = []
    tmp = h.tmpdir("origami_profile_")
    cfg = os.path.join(h.CONFIGS, "llama_tiny.json")
    two_ranks(tmp, cfg, failures)
    one = one_rank_moe(tmp, cfg, failures)
    without_config(tmp, cfg, failures)
    for name, args, want in [("no --out", [], "--out FILE is required"),
                             ("--seconds 0", ["--out", one, "--seconds", "0"], "--seconds must be positive"),
                             ("missing config", ["--out", one, "--config", os.path.join(tmp, "none.json")], "none.json")]:
        _, _, failure = h.check_error(name, 2, ["profile", *args], lambda line, want=want: want in line)
        failures += [failure] if failure else []
    h.report(failures, "origami profile writes a cluster.json the planner reads")


if __name__ == "__main__":
    main()
