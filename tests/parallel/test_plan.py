"""`origami plan` (DESIGN.md, "Planner"): the layouts it lists run, and what it predicts from the
runtime's own functions is what the runtime computes.

For llama (llama_tiny) and mixtral (mixtral_8e) on this machine's cluster file (2 devices),
global batch 8, T 32:
  1. --json lists layouts best first, each with layout, step_time_s, tokens_per_s, mfu,
     memory_bytes_per_rank (by part) and comm_bytes.
  2. Every listed layout runs under `origami train` on 2 ranks (the runtime accepts it), and its
     first metrics row agrees with the prediction: the memory check's parts of its neediest rank
     (all but the measured process memory) equal the plan's for that rank's stage, and rank 0's
     bytes on every communicator equal the plan's (the MoE dispatcher's payloads excepted: they
     depend on the routing).
  3. --layout fixes the axes it names (for mixtral, "fssdp" and "fssdp-keep"; for both, "pp2 vocab":
     those layouts run and agree as in 2);
     --out writes the best layout and its prediction, and
     `origami train --plan plan.json` runs that layout (a plan for 2 devices on 1 rank is an error).
  4. Mistakes (a missing --cluster, an unknown --layout word, more devices than the cluster has,
     --layout axes that leave no layout, each naming the rule, and degrees whose product overflows;
     --explain with --json; a plan made for another model under train --plan)
     exit 1 with one error line. A bf16 mixtral layout with ZeRO over the experts' data-parallel ranks
     only (TP2, EDP2) runs and agrees as in 2.
  5. --plot FILE.png writes a PNG (gnuplot) of the listed layouts; without gnuplot (said before
     the search), with a gnuplot that fails, or with FILE in a missing directory it exits 1 with one
     error line, and leaves an existing FILE as it was and no FILE.tmp.
  6. --imbalance FILE: an EP2 mixtral run's metrics (one micro-batch a rank, one EP group) give EP2 the
     median of the run's measured expert_sync_imbalance, exactly; a one-rank run's first step gives EP2 that
     step's figure of the EP2 run (the same routing, unless a near tie went another way); the JSON
     names the figure per layout, and a layout priced from the file is priced as with that figure
     stated; a missing file and a file without routing are errors.
  7. A cluster file's threads_per_rank adds each thread's bf16 attention scratch to the memory.
"""
import json
import os
import stat
import struct

import harness as h

CLUSTER = os.path.join(h.ROOT, "configs", "clusters", "cpu-2core.json")
FIELDS = ("layout", "step_time_s", "tokens_per_s", "mfu", "memory_bytes_per_rank", "comm_bytes")
PARTS = ("weights", "gradients", "optimizer state", "activations", "workspace", "checkpoint")


def check_imbalance_from_run(tmp, data):
    """Section 6: plan --imbalance FILE against an EP2 run's measured figure."""
    failures = []
    cfg = os.path.join(h.CONFIGS, "mixtral_8e.json")
    runs = {}
    for name, ranks, layout in [("one", 1, "mb8"), ("ep2", 2, "ep2 mb4")]:
        metrics = os.path.join(tmp, "routing_%s.jsonl" % name)
        rc, text, _ = h.run(ranks, ["train", "--config", cfg, "--data", data, "--steps", "5", "--global-batch", "8",
                                    "--seq-len", "32", "--threads", "1", "--quiet", "--metrics", metrics,
                                    *h.train_flags(layout)])
        if rc != 0:
            return ["--imbalance: the %s run failed: %s" % (name, text[-300:])]
        runs[name] = h.read_metrics(metrics)
    plan = ["plan", "--config", cfg, "--cluster", CLUSTER, "--global-batch", "8", "--seq-len", "32", "--json",
            "--layout", "tp1 cp1 pp1 ep2 etp1 zero0 mb4 nosp", "--top", "1", "--imbalance"]

    def planned(rows, name):  # the plan's EP2 layout priced from these metrics rows
        path = os.path.join(tmp, "routing_%s_rows.jsonl" % name)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        rc, out, _ = h.run(0, plan + [path])
        return json.loads(out)[0] if rc == 0 else {"error": out[-300:]}

    # The EP2 run's own file: the median of its steps' measured figure, exactly.
    ep2 = runs["ep2"]
    measured = sorted(r["expert_sync_imbalance"] for r in ep2)[len(ep2) // 2]
    got = planned(ep2, "ep2")
    # The one-rank run's first step: the same routing as the EP2 run's (no update yet; a near tie, which
    # the metrics count, could send a token elsewhere on another layout, and then they may differ).
    ties = sum(runs["one"][0]["expert_near_ties"]) + sum(ep2[0]["expert_near_ties"])
    first = planned(runs["one"][:1], "one")
    rc, out, _ = h.run(0, plan + [repr(got.get("imbalance", 1.0))])
    stated = json.loads(out)[0] if rc == 0 else {}
    ok = measured > 1 and abs(got.get("imbalance", 0) - measured) <= 1e-12 * measured \
        and (ties > 0 or first.get("imbalance") == ep2[0]["expert_sync_imbalance"]) \
        and got.get("step_time_s") == stated.get("step_time_s")
    print("%-4s --imbalance FILE: EP2 %s from the EP2 run's metrics (it measured %s), %s from a one-rank run's first "
          "step (the EP2 run's: %s%s); stated alike: %s s vs %s s" % (
              "ok" if ok else "FAIL", got.get("imbalance"), measured, first.get("imbalance"),
              ep2[0]["expert_sync_imbalance"], ", near ties: not compared" if ties else "", got.get("step_time_s"),
              stated.get("step_time_s")))
    if not ok:
        failures.append("--imbalance FILE: %s / %s / %s" % (got, first, stated))
    dense = os.path.join(tmp, "dense.jsonl")
    with open(dense, "w") as f:
        f.write(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    for name, value, want in [("--imbalance, no such file", os.path.join(tmp, "missing.jsonl"),
                               "--imbalance must be a number (at least 1) or the metrics file of an MoE run"),
                              ("--imbalance, a dense run", dense, "no step has \"expert_tokens\"")]:
        _, _, failure = h.check_error(name, 0, plan + [value], lambda line, want=want: want in line)
        failures += [failure] if failure else []
    return failures


def check_threads_per_rank(tmp):
    """Section 7: a cluster file's threads_per_rank (what `origami profile` ran with) counts in the memory as
    the memory check counts its run's threads: each holds the bf16 attention core's scratch, the same
    bytes a thread, so 16 threads add 15 times what the second adds."""
    cluster = json.load(open(CLUSTER))
    memory = {}
    for threads in (1, 2, 16):
        path = os.path.join(tmp, "cluster_%d_threads.json" % threads)
        json.dump(dict(cluster, threads_per_rank=threads), open(path, "w"))
        rc, out, _ = h.run(0, ["plan", "--config", os.path.join(h.CONFIGS, "llama_tiny.json"), "--cluster", path,
                               "--global-batch", "8", "--seq-len", "64", "--precision", "bf16", "--json", "--top", "1",
                               "--layout", "tp1 cp1 pp1 zero0 mb4 nosp recompute=none"])
        if rc != 0:
            return ["threads_per_rank %d: plan exit %s: %s" % (threads, rc, out[-300:])]
        memory[threads] = json.loads(out)[0]["memory_bytes_per_rank"]["workspace"]
    one, two, many = memory[1], memory[2], memory[16]
    if not (two > one and many - one == 15 * (two - one)):
        return ["threads_per_rank: workspace %s with 1, 2 and 16 threads a rank; want a thread's scratch each" %
                memory]
    return []


def main():
    failures = []
    tmp = h.tmpdir("origami_plan_")
    data = h.prepare_data(tmp)
    for model in ("llama_tiny", "mixtral_8e"):
        cfg = os.path.join(h.CONFIGS, model + ".json")
        base = ["plan", "--config", cfg, "--cluster", CLUSTER, "--global-batch", "8", "--seq-len", "32"]
        rc, out, _ = h.run(0, base + ["--top", "6", "--json"])
        if rc != 0:
            failures.append("%s: plan exit %s: %s" % (model, rc, out[-400:]))
            continue
        plans = json.loads(out)
        steps = [p["step_time_s"] for p in plans]
        if not plans or any(f not in p for p in plans for f in FIELDS) or steps != sorted(steps):
            failures.append("%s: --json must list layouts best first with %s: %s" % (model, FIELDS, out[:300]))
        if model == "mixtral_8e":  # the best FSSDP layouts too (EP wins here); all experts reached: bytes exact
            for word in ("fssdp", "fssdp-keep"):  # (keep: what it gathers stays until the update)
                rc, out, _ = h.run(0, base + ["--layout", word, "--top", "2", "--json"])
                fssdp = json.loads(out) if rc == 0 else []
                if not fssdp or not all(" %s " % word in " %s " % p["layout"] for p in fssdp):
                    failures.append("%s: --layout %s: exit %s: %s" % (model, word, rc, out[-300:]))
                plans += fssdp
            # ZeRO where only the experts have data-parallel ranks (TP2 of the dense part, EDP2), in bf16:
            # its copy buckets are buffers of their own.
            rc, out, _ = h.run(0, base + ["--layout", "tp2 dp1 ep1 etp1 zero1 nofssdp", "--precision", "bf16", "--top",
                                          "1", "--json"])
            edp = json.loads(out) if rc == 0 else []
            if not edp:
                failures.append("%s: --layout \"tp2 dp1 ep1 etp1 zero1\": exit %s: %s" % (model, rc, out[-300:]))
            plans += [dict(p, precision="bf16") for p in edp]
        # Vocabulary parallelism's best layouts (searched where there is a pipeline): bytes exact.
        rc, out, _ = h.run(0, base + ["--layout", "pp2 vocab", "--top", "2", "--json"])
        vocab = json.loads(out) if rc == 0 else []
        if not vocab or not all(" vocab " in " %s " % p["layout"] for p in vocab):
            failures.append("%s: --layout \"pp2 vocab\": exit %s: %s" % (model, rc, out[-300:]))
        plans += vocab
        for p in plans:
            metrics = os.path.join(tmp, "m.jsonl")
            rc, text, _ = h.run(2, ["train", "--config", cfg, "--data", data, "--steps", "1", "--global-batch", "8",
                                    "--seq-len", "32", "--threads", "1", "--quiet", "--metrics", metrics,
                                    "--precision", p.get("precision", "fp32"), *h.train_flags(p["layout"])])
            if rc != 0:
                failures.append("%s %s: the runtime refused the planned layout: %s" % (model, p["layout"], text[-300:]))
                continue
            row = h.read_metrics(metrics)[0]
            bad = []
            # The memory check names its neediest rank (the measured process memory included); the
            # plan gives every stage's first rank: pp is the slowest axis of the default mesh order.
            got = row["memory_bytes"]
            want = p["memory_bytes_per_stage"][got["rank"] * len(p["memory_bytes_per_stage"]) // 2]
            if [want[k] for k in PARTS] != [got[k] for k in PARTS]:
                bad.append("memory %s vs the memory check's %s" % ({k: want[k] for k in PARTS}, {k: got[k] for k in PARTS}))
            exact = lambda d: {k: round(v) for k, v in d.items() if k not in ("ep", "etp")}
            if exact(p["comm_bytes"]) != exact(row["comm_bytes"]):
                bad.append("comm bytes %s vs measured %s" % (p["comm_bytes"], row["comm_bytes"]))
            print("%-4s %-10s %-45s runs; memory and bytes as predicted%s" % (
                "FAIL" if bad else "ok", model, p["layout"], ": " + "; ".join(bad) if bad else ""), flush=True)
            failures += ["%s %s: %s" % (model, p["layout"], b) for b in bad]
        rc, out, _ = h.run(0, base + ["--layout", "tp2 mb1", "--json", "--out", os.path.join(tmp, "plan.json")])
        fixed = json.loads(out) if rc == 0 else []
        plan = json.load(open(os.path.join(tmp, "plan.json"))) if rc == 0 else {}
        ok = rc == 0 and fixed and all(" tp2 " in " %s " % p["layout"] and " mb1 " in " %s " % p["layout"] for p in fixed) \
            and plan.get("layout", {}).get("tp") == 2 and "step_time_s" in plan.get("prediction", {})
        print("%-4s %-10s --layout \"tp2 mb1\" fixes them; --out writes the plan" % ("ok" if ok else "FAIL", model))
        if not ok:
            failures.append("%s: --layout/--out: exit %s: %s" % (model, rc, out[-300:]))
            continue
        # train --plan runs that layout (its axes, micro-batch, global batch and sequence length).
        metrics = os.path.join(tmp, "planned.jsonl")
        rc, text, _ = h.run(2, ["train", "--config", cfg, "--data", data, "--plan", os.path.join(tmp, "plan.json"),
                                "--steps", "1", "--threads", "1", "--quiet", "--metrics", metrics])
        row = h.read_metrics(metrics)[0] if rc == 0 else {}
        ok = rc == 0 and row.get("layout", "").startswith("TP2") and row.get("tokens") == 8 * 32
        print("%-4s %-10s train --plan runs %s" % ("ok" if ok else "FAIL", model, row.get("layout", text[-200:])))
        if not ok:
            failures.append("%s: train --plan: exit %s, layout %s: %s" % (model, rc, row.get("layout"), text[-300:]))
    failures += check_imbalance_from_run(tmp, data)
    failures += check_threads_per_rank(tmp)
    cfg = os.path.join(h.CONFIGS, "llama_tiny.json")
    base = ["plan", "--config", cfg, "--global-batch", "8", "--seq-len", "32"]
    for name, args, want in [("no --cluster", base, "--cluster is required"),
                             ("bad --layout", base + ["--cluster", CLUSTER, "--layout", "tp2 fast"], "'fast' is not one of"),
                             ("too many devices", base + ["--cluster", CLUSTER, "--devices", "3"], "--devices must be in [1, 2]"),
                             ("--layout tp3", base + ["--cluster", CLUSTER, "--layout", "tp3"],
                              "leaves no layout of 2 devices: tp3: TP must divide the devices (2)"),
                             ("--layout vocab pp1", base + ["--cluster", CLUSTER, "--layout", "vocab pp1"],
                              "vocabulary parallelism needs a pipeline"),
                             ("--layout fssdp on a dense model", base + ["--cluster", CLUSTER, "--layout", "fssdp"],
                              "ep, etp and fssdp need an MoE model"),
                             ("--layout dp4", base + ["--cluster", CLUSTER, "--layout", "dp4"], "dp4: DP must divide"),
                             ("--layout a2a+p2p", base + ["--cluster", CLUSTER, "--layout", "cp2 cp-comm=a2a+p2p"],
                              "which plan does not search"),
                             ("--layout pp-layers=1,1,", base + ["--cluster", CLUSTER, "--layout", "pp-layers=1,1,"],
                              "needs positive layer counts separated by commas")]:
        _, _, failure = h.check_error(name, 0, args, lambda line, want=want: want in line)
        failures += [failure] if failure else []
    # Degrees whose product overflows an int: an error, not a crash.
    moe = ["plan", "--config", os.path.join(h.CONFIGS, "mixtral_8e.json"), "--cluster", CLUSTER, "--global-batch", "8",
           "--seq-len", "32"]
    _, _, failure = h.check_error("--layout ep65536 etp65536", 0, moe + ["--layout", "ep65536 etp65536"],
                                  lambda line: "EP must divide the model's 8 experts" in line)
    failures += [failure] if failure else []
    _, _, failure = h.check_error("plan for 2 devices on 1 rank", 0, ["train", "--config", cfg, "--data", data, "--plan",
                                  os.path.join(tmp, "plan.json"), "--steps", "1"],
                                  lambda line: "lays out 2 devices, and this job has 1 rank" in line)
    failures += [failure] if failure else []
    # plan.json is mixtral_8e's (the loop's last model): a llama run refuses it, on every rank.
    _, _, failure = h.check_error("plan made for another model", 2, ["train", "--config", cfg, "--data", data, "--plan",
                                  os.path.join(tmp, "plan.json"), "--steps", "1"],
                                  lambda line: "was made for a mixtral model, and this run's is a llama" in line)
    failures += [failure] if failure else []
    # ... and one whose config differs in a field that changes the math (a llama of 3 layers).
    deeper = os.path.join(tmp, "llama_3_layers.json")
    json.dump(dict(json.load(open(cfg)), num_hidden_layers=3), open(deeper, "w"))
    stated = os.path.join(tmp, "cluster_1_threads.json")  # (check_threads_per_rank's: threads_per_rank 1)
    rc, out, _ = h.run(0, ["plan", "--config", cfg, "--cluster", stated, "--global-batch", "8", "--seq-len", "32",
                           "--devices", "1", "--layout", "tp1 mb4", "--out", os.path.join(tmp, "llama_plan.json")])
    _, _, failure = h.check_error("plan made for another config", 0, ["train", "--config", deeper, "--data", data,
                                  "--plan", os.path.join(tmp, "llama_plan.json"), "--steps", "1"],
                                  lambda line: "its config's 'num_hidden_layers' is 2, and this run's (llama) is 3" in line)
    failures += [failure] if failure else []
    # A config that differs only in fields that change values, not shapes or cost, fits the plan.
    retuned = os.path.join(tmp, "llama_retuned.json")
    json.dump(dict(json.load(open(cfg)), initializer_range=0.01, rms_norm_eps=1e-5, rope_theta=500000.0),
              open(retuned, "w"))
    rc, out, _ = h.run(0, ["train", "--config", retuned, "--data", data, "--plan", os.path.join(tmp, "llama_plan.json"),
                           "--steps", "1", "--quiet"])
    ok = rc == 0
    print("%-4s train --plan takes a config that differs in initializer_range, rms_norm_eps and rope_theta" %
          ("ok" if ok else "FAIL"))
    failures += [] if ok else ["train --plan, retuned config: exit %s: %s" % (rc, out[-300:])]
    # The plan priced the cluster file's threads a rank (1); a run with 2 is told its figures differ. A
    # plan from a file that states none (a datasheet's, or profiled before the field) warns of nothing.
    rc, out, _ = h.run(0, ["train", "--config", cfg, "--data", data, "--plan", os.path.join(tmp, "llama_plan.json"),
                           "--steps", "1", "--threads", "2", "--quiet"])
    warned = "priced 1 thread a rank (its cluster file's), and this run has 2" in out
    h.run(0, ["plan", "--config", cfg, "--cluster", CLUSTER, "--global-batch", "8", "--seq-len", "32", "--devices", "1",
              "--layout", "tp1 mb4", "--out", os.path.join(tmp, "unstated_plan.json")])
    rc2, out2, _ = h.run(0, ["train", "--config", cfg, "--data", data, "--plan", os.path.join(tmp, "unstated_plan.json"),
                             "--steps", "1", "--threads", "2", "--quiet"])
    ok = rc == 0 and warned and rc2 == 0 and "a rank (its cluster file" not in out2
    print("%-4s train --plan with other threads a rank than the plan priced warns (and not when unstated)" %
          ("ok" if ok else "FAIL"))
    failure = None if ok else "train --plan --threads 2: exit %s/%s, warned %s: %s %s" % (rc, rc2, warned, out[-200:], out2[-200:])
    failures += [failure] if failure else []
    for name, args, want in [("--explain with --json", base + ["--cluster", CLUSTER, "--explain", "--json"],
                              "its 'breakdown' field holds the same parts"),
                             ("--layout mb beyond train's bound", base + ["--cluster", CLUSTER, "--layout", "mb1073741825"],
                              "needs an integer in [1, 1073741824] after 'mb'")]:
        _, _, failure = h.check_error(name, 0, args, lambda line, want=want: want in line)
        failures += [failure] if failure else []

    png = os.path.join(tmp, "p.png")
    rc, out, _ = h.run(0, base + ["--cluster", CLUSTER, "--top", "4", "--plot", png])
    head = open(png, "rb").read(24) if os.path.exists(png) else b""
    # The signature, then the IHDR chunk: length, type, width and height (big-endian).
    width, height = struct.unpack(">II", head[16:24]) if len(head) == 24 else (0, 0)
    ok = rc == 0 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" and 600 <= width <= 4000 \
        and 200 <= height <= 4000 and not os.path.exists(png + ".tmp")
    print("%-4s --plot writes a %dx%d PNG" % ("ok" if ok else "FAIL", width, height))
    if not ok:
        failures.append("--plot: exit %s, PNG header %r: %s" % (rc, head, out[-300:]))
    fake = os.path.join(tmp, "fakebin")  # a gnuplot that fails as gnuplot does, its message last
    os.makedirs(fake)
    with open(os.path.join(fake, "gnuplot"), "w") as f:
        f.write("#!/bin/sh\necho 'set terminal pngcairo' >&2\necho '\"plot.gp\" line 3: unknown terminal' >&2\nexit 1\n")
    os.chmod(os.path.join(fake, "gnuplot"), stat.S_IRWXU)
    plot = base + ["--cluster", CLUSTER, "--top", "4", "--plot"]
    for name, args, env, want in [
            ("--plot without gnuplot", plot + [png], {"PATH": "/nonexistent"}, "--plot needs gnuplot (Debian: apt-get install gnuplot-nox"),
            ("--plot, gnuplot fails", plot + [png], {"PATH": fake}, "gnuplot failed: \"plot.gp\" line 3: unknown terminal"),
            ("--plot to a missing directory", plot + [os.path.join(tmp, "missing", "p.png")], None,
             "no directory '%s'" % os.path.join(tmp, "missing"))]:  # (found before the search)
        _, _, failure = h.check_error(name, 0, args, lambda line, want=want: want in line, extra_env=env)
        failures += [failure] if failure else []
    # Without gnuplot the command says so before it searches: nothing of a result is printed.
    rc, out, _ = h.run(0, plot + [png], extra_env={"PATH": "/nonexistent"})
    if rc != 1 or "| layout" in out or "layouts" in out:
        failures.append("--plot without gnuplot must fail before the search, got exit %s: %s" % (rc, out[-300:]))
    if os.path.exists(png + ".tmp") or open(png, "rb").read(24) != head:
        failures.append("--plot: a failed gnuplot must leave %s as it was and no .tmp beside it" % png)
    h.report(failures, "origami plan lists layouts the runtime runs, with its memory and bytes")


if __name__ == "__main__":
    main()
