"""Fully sharded sparse data parallelism (--expert-sharding fssdp; DESIGN.md, "FSSDP").

  1. Layout invariance against one rank, with test_layouts' assertions (loss, aux/z/lm loss within 1e-5
     relative every step, expert_tokens identical up to a near-tie flip (test_layouts.near_tie_flip),
     step-1 grad norm, final parameters within 1e-5
     absolute, optimizer moments), 20 steps at lr 3e-3 (test_layouts.SLOW_LR; at 1e-2 mixtral's TP2xDP2
     ended 1.04e-5 from one rank on an AVX-512 host), aux and z losses on: mixtral (8 experts, top-2)
     under DP2, DP4 (2 micro-batches a rank), TP2xDP2, TP2xDP2+SP with the experts split over ETP2,
     PP2xDP2, CP2xDP2, DP2 with ZeRO-3 for the dense part, full recomputation; qwen2_moe (shared expert,
     a dense layer) under DP2, TP2xDP2, PP2xDP2 and PP2 interleaved xDP2 with ZeRO-3; a 16-expert
     mixtral whose ranks' tokens leave experts unreached; and
     --fssdp-keep (experts kept from their first gather to the step's update) under DP2, DP4 with 2
     micro-batches a rank, and PP2xDP2 with full recomputation.
  2. Traffic, every step of the layouts with one micro-batch a rank and ETP1: from every rank's routed
     counts (ORIGAMI_TEST_ROUTING), each rank's needs (the experts its rows reach, per layer) give
     exactly what rank 0 must send over EDP — per layer, forward and backward gather and the reduction
     each exchange the needs (El int32 to each peer); each gather sends every peer the pieces of rank
     0's shard its experts cover (with --fssdp-keep only the step's first: later ones find them kept);
     the reduction sends the owners the pieces of rank 0's experts it does not own — and each
     rank's gathered experts; comm_bytes.edp, expert_gathers and rank 0's gathered_bytes and
     reduced_bytes (these with the dense reduction added) must equal them. The first step's
     prediction (comm_bytes_predicted, which assumes every expert reached) equals comm_bytes where
     every rank of rank 0's group reached every expert (at least 3 layouts), and bounds it where one
     did not; the 16-expert model leaves experts unreached (an unreached expert costs nothing).
  3. Memory: a 4-layer mixtral with 16 experts of 256 x 512 (experts 96% of the parameters) at DP2:
     the neediest rank's peak RSS is within 10% of the memory check, plain and under FSSDP (fp32, bf16
     and with --fssdp-keep), and the model state (weights + gradients + optimizer state) per rank under FSSDP is below
     0.65 of plain DP2's (half the experts' state plus one layer's experts staged whole: 0.625).
  4. Checkpoints: an FSSDP DP4 checkpoint (step 10) resumes under EP2xEDP2 ZeRO-1 and on one rank, and
     an EP4 checkpoint under FSSDP DP4, each on the uninterrupted run's curve (steps 11-20 within
     1e-5 relative; constant learning rate).
  5. Errors (one message, every rank exits 1): --expert-sharding fssdp with --ep 2; on a dense model;
     an unknown sharding; --fssdp-keep without fssdp.

Usage: python3 tests/parallel/test_fssdp.py [LAYOUT,...]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
import test_expert_parallel as tep  # noqa: E402
import test_layouts as tl  # noqa: E402

MIXTRAL = os.path.join(h.CONFIGS, "mixtral_8e.json")
QWEN = os.path.join(h.CONFIGS, "qwen2_moe_8e.json")
FSSDP = ["--expert-sharding", "fssdp"]

# name, config (None: the 16-expert mixtral), ranks, flags, global batch
# (global batch 4: one micro-batch a DP rank, whose routed counts give its needs exactly)
LAYOUTS = [
    ("DP2", MIXTRAL, 2, [], 4),
    ("DP4 (2 micro)", MIXTRAL, 4, [], 16),
    ("TP2xDP2", MIXTRAL, 4, ["--tp", "2"], 4),
    ("TP2xDP2+SP ETP2", MIXTRAL, 4, ["--tp", "2", "--sequence-parallel", "--etp", "2"], 8),
    ("PP2xDP2", MIXTRAL, 4, ["--pp", "2"], 4),
    ("CP2xDP2", MIXTRAL, 4, ["--cp", "2"], 4),
    ("DP2 dense ZeRO-3", MIXTRAL, 2, ["--zero", "3"], 4),
    ("DP2 recompute full", MIXTRAL, 2, ["--recompute", "full"], 4),
    ("qwen2_moe DP2", QWEN, 2, [], 4),
    ("qwen2_moe TP2xDP2", QWEN, 4, ["--tp", "2"], 4),
    ("qwen2_moe PP2xDP2", QWEN, 4, ["--pp", "2", "--pp-layers", "2,2"], 4),
    ("qwen2_moe PP2 v2 xDP2 ZeRO-3", QWEN, 4, ["--pp", "2", "--vpp", "2", "--zero", "3"], 8),
    ("16 experts DP4", None, 4, [], 8),
    ("DP2 keep", MIXTRAL, 2, ["--fssdp-keep"], 4),
    ("DP4 (2 micro) keep", MIXTRAL, 4, ["--fssdp-keep"], 16),
    ("PP2xDP2 keep recompute full", MIXTRAL, 4, ["--fssdp-keep", "--pp", "2", "--recompute", "full"], 4),
]


def train_args(cfg_path, data, G, metrics, save, flags=()):
    """test_layouts' arguments at its gentler learning rate, then `flags`."""
    return tl.train_args(cfg_path, data, G, metrics, save, lr=tl.SLOW_LR) + list(flags)


def flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def expert_layout(cfg, edp):
    """One MoE layer's experts in the experts' buffer (one unit-aligned bucket each in these tiny
    models): E blocks of 3·F·C floats, the bucket padded to a multiple of EDP, rank j's shard its
    j-th part. Returns (block, shard bounds [(begin, end)] per EDP rank)."""
    E, C = cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"], cfg["hidden_size"]
    F = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    block = 3 * F * C
    length = -(-E * block // edp) * edp
    n = length // edp
    return E, block, [(j * n, (j + 1) * n) for j in range(edp)]


def overlap(a, b):
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def expected_traffic(routing, ranks, flags, cfg):
    """{step: (edp bytes rank 0 sends, [expert gathers per rank], of those bytes the experts' pieces
    gathered and the gradient pieces reduced)} from every rank's routed counts
    (one micro-batch a rank, ETP1: a rank's needs are the experts it routed tokens to)."""
    pp = flag(flags, "--pp")
    per_stage = ranks // pp
    edp = per_stage  # ETP1, EP1: a stage's ranks in rank order
    E, block, shards = expert_layout(cfg, edp)
    forwards = 2 if "full" in flags else 1
    moved = 1 if "--fssdp-keep" in flags else forwards + 1  # kept: the step's first gather moves them all
    out = {}
    for step in routing[0]:
        sent, gathered, reduced, gathers = 0, 0, 0, [0] * ranks
        for r in range(ranks):
            stage_layers = [l for l, row in enumerate(routing[r][step]) if any(row)]
            gathers[r] = moved * sum(1 for l in stage_layers for e in range(E) if routing[r][step][l][e])
        group = range(edp)  # rank 0's EDP group: the first stage's ranks
        for l, row in enumerate(routing[0][step]):
            if not any(row):
                continue
            need = {r: [e for e in range(E) if routing[r][step][l][e]] for r in group}
            blocks = lambda e: (e * block, (e + 1) * block)
            gather = sum(overlap(blocks(e), shards[0]) for r in group if r != 0 for e in need[r])
            reduce = sum(overlap(blocks(e), shards[j]) for e in need[0] for j in group if j != 0)
            sent += (forwards + 2) * (edp - 1) * 4 * E + moved * 4 * gather + 4 * reduce
            gathered += moved * 4 * gather
            reduced += 4 * reduce
        out[step] = (sent, gathers, gathered, reduced)
    return out


def sixteen_experts(tmp):
    return h.write_json(os.path.join(tmp, "mixtral_16e.json"), h.load_config("mixtral_8e", num_local_experts=16))


def check_traffic(got, rdir, ranks, flags, cfg_path):
    """Failures of part 2 for one layout's metrics rows, and whether step 1 checked the prediction."""
    fails = []
    cfg = json.load(open(cfg_path))
    routing = tep.read_routing(rdir, ranks)
    exp = expected_traffic(routing, ranks, flags, cfg)
    for g in got:
        e_bytes, e_gathers, e_gathered, e_reduced = exp[g["step"]]
        if g["comm_bytes"].get("edp", 0) != e_bytes or g.get("expert_gathers") != e_gathers:
            fails.append("step %d: comm_bytes.edp %s, expert_gathers %s; from the routed counts %d, %s" % (
                g["step"], g.get("comm_bytes", {}).get("edp"), g.get("expert_gathers"), e_bytes, e_gathers))
            break
        # rank 0's gathered and reduced bytes: the experts' pieces, and the dense reduction beside them
        # (dense ZeRO-3 adds its own gathers and reduce-scatters, which comm_volume checks)
        dense = g["comm_bytes"].get("dp", 0) + g["comm_bytes"].get("dp-cp", 0)
        if "--zero" not in flags and (g["gathered_bytes"][0], g["reduced_bytes"][0]) != (e_gathered, e_reduced + dense):
            fails.append("step %d: rank 0 gathered %s and reduced %s bytes; expected %d and %d (experts) + %d (dense)" % (
                g["step"], g["gathered_bytes"][0], g["reduced_bytes"][0], e_gathered, e_reduced, dense))
            break
    # Step 1's prediction assumes every rank of rank 0's EDP group reaches every expert of its layers.
    E = expert_layout(cfg, 1)[0]
    passes = 1 if "--fssdp-keep" in flags else 3 if "full" in flags else 2
    group = range(ranks // flag(flags, "--pp"))
    everything = all(n == passes * E * sum(1 for row in routing[r][1] if any(row))
                     for r, n in enumerate(exp[1][1]) if r in group)
    first = got[0]["comm_bytes"].get("edp"), got[0]["comm_bytes_predicted"].get("edp")
    if everything and first[0] != first[1]:
        fails.append("step 1, every expert reached: comm_bytes.edp %s, predicted %s" % first)
    if not everything and first[0] > first[1]:
        fails.append("step 1, some expert unreached: comm_bytes.edp %s exceeds the prediction %s" % first)
    if E == 16 and everything:
        fails.append("every rank reached every one of the 16 experts: nothing shows an unreached expert is free")
    return fails, everything


def run_layouts(tmp, data, only):
    failures, refs, predicted = [], {}, 0
    cfg16 = sixteen_experts(tmp)
    for name, cfg_path, ranks, flags, G in LAYOUTS:
        if only and name not in only:
            continue
        cfg_path = cfg_path or cfg16
        key = (cfg_path, G)
        if key not in refs:
            tag = "ref_%s_%d" % (os.path.basename(cfg_path)[:-5], G)
            mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
            rc, out, wall = h.run(0, train_args(cfg_path, data, G, mpath, ck))
            if rc != 0:
                sys.exit("FAIL: one-rank reference %s: %s" % (tag, out[-800:]))
            refs[key] = (h.read_metrics(mpath), ck)
        tag = "".join(c if c.isalnum() else "_" for c in name)
        mpath, ck, rdir = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag), os.path.join(tmp, tag + "_routing")
        os.makedirs(rdir, exist_ok=True)
        rc, out, wall = h.run(ranks, train_args(cfg_path, data, G, mpath, ck, flags + FSSDP), timeout=300,
                              extra_env={"ORIGAMI_TEST_ROUTING": rdir})
        fails = [] if rc == 0 else [h.why(rc, out, 600)]
        got = h.read_metrics(mpath) if rc == 0 else []
        ref_metrics, ref_ck = refs[key]
        w, f = tl.compare_run(ref_metrics, got, True, G)
        fails += f
        pa = {"abs": (float("nan"), "-", ())}
        traffic = "-"
        if rc == 0:
            if w["flip"] is None:
                dev, f = tl.compare_checkpoint(ref_ck, ck)
                fails += f
                pa = dev.get("params", pa)
            if "FSSDP" not in got[0].get("layout", ""):
                fails.append("layout %r does not name FSSDP" % got[0].get("layout"))
            dp = ranks // (flag(flags, "--tp") * flag(flags, "--pp") * flag(flags, "--cp"))
            if G // (tl.MICRO * dp) == 1 and flag(flags, "--etp") == 1:
                f, everything = check_traffic(got, rdir, ranks, flags, cfg_path)
                fails += f
                predicted += everything
                traffic = "exact" + (" (= prediction)" if everything else "")
            gathers = [n for g in got for n in g["expert_gathers"]]
            traffic += ", experts gathered per rank-step %d-%d" % (min(gathers), max(gathers))
        print("%-4s %-30s %d ranks: loss %.1e, aux/z/lm %.1e, experts %s, params abs %.1e, edp bytes %s, %.1f s" % (
            "ok" if not fails else "FAIL", name, ranks, w["loss"], w["aux"], w["experts"], pa["abs"][0], traffic,
            wall), flush=True)
        for x in fails[:5]:
            print("      " + x)
        failures += ["%s: %s" % (name, x) for x in fails[:3]]
        shutil.rmtree(ck, ignore_errors=True)
    if not only and predicted < 3:
        failures.append("the step-1 prediction was checked on %d layouts (every expert reached): too few" % predicted)
    return failures


def run_memory(tmp, data):
    """Part 3: the memory check against the measured peak, and FSSDP's model state against EP2's."""
    failures = []
    cfg = h.write_json(os.path.join(tmp, "mixtral_wide.json"), h.load_config(
        "mixtral_8e", hidden_size=256, intermediate_size=512, num_local_experts=16, num_hidden_layers=4))
    held = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # as test_run_safety: freed library buffers leave the RSS
    state = {}
    for label, flags in (("DP2", []), ("FSSDP", FSSDP), ("FSSDP bf16", FSSDP + ["--precision", "bf16"]),
                         ("FSSDP keep", FSSDP + ["--fssdp-keep"])):
        mpath = os.path.join(tmp, "mem_%s.jsonl" % label.replace(" ", "_"))
        args = ["train", "--config", cfg, "--data", data, "--steps", "2", "--micro-batch", "1", "--seq-len", "64",
                "--global-batch", "2", "--threads", "1", "--metrics", mpath] + flags
        rc, out, _, rss = h.run_wrapped(tmp, "mem_" + label, 2, args, extra_env=held, timeout=300)
        if rc != 0:
            failures.append("memory %s: exit %s: %s" % (label, rc, out[-400:]))
            continue
        row = h.read_metrics(mpath)[0]
        totals, parts = row["memory_bytes_per_rank"], row["memory_bytes"]
        state[label] = sum(parts[k] for k in ("weights", "gradients", "optimizer state"))
        most = max(rss.values())
        err = (max(totals) - most) / most
        ok = abs(err) <= 0.10
        print("%-4s memory %-10s DP2: check %.1f MiB, measured peak RSS %.1f MiB (%+.1f%%), model state %.1f MiB" % (
            "ok" if ok else "FAIL", label, max(totals) / 2 ** 20, most / 2 ** 20, 100 * err, state[label] / 2 ** 20),
            flush=True)
        if not ok:
            failures.append("memory %s: check %.1f MiB vs peak %.1f MiB" % (label, max(totals) / 2 ** 20, most / 2 ** 20))
    if "DP2" in state and "FSSDP" in state:
        # half of the experts' state (16 bytes a parameter), plus the staging area of one layer's experts
        # whole (values and gradients, 8 bytes, a quarter of them): 0.625 of plain DP2's, which
        # replicates everything (the dense 4% replicated either way)
        ok = state["FSSDP"] < 0.65 * state["DP2"]
        print("%-4s FSSDP model state per rank %.1f MiB: %.3f of plain DP2's %.1f MiB (at most 0.65)" % (
            "ok" if ok else "FAIL", state["FSSDP"] / 2 ** 20, state["FSSDP"] / state["DP2"], state["DP2"] / 2 ** 20),
            flush=True)
        if not ok:
            failures.append("FSSDP model state %.1f MiB, plain DP2 %.1f MiB" % (state["FSSDP"] / 2 ** 20,
                                                                               state["DP2"] / 2 ** 20))
    return failures


def run_reshard(tmp, data):
    """Part 4, with test_expert_parallel's constant-rate 20-step run as the curve."""
    failures = []
    base = lambda m, steps: ["train", "--config", MIXTRAL, "--data", data, "--steps", str(steps), "--micro-batch", "2",
                             "--global-batch", "8", "--seq-len", "16", "--lr", "3e-3", "--lr-schedule", "constant",
                             "--eps", tl.EPS, "--seed", "7", "--threads", "1", "--quiet", "--metrics", m]
    full = os.path.join(tmp, "rs_full.jsonl")
    rc, out, _ = h.run(0, base(full, 20))
    if rc:
        return ["reshard: the uninterrupted run failed: " + out[-400:]]
    ref = [r["loss"] for r in h.read_metrics(full)]
    for saved, resumed in ((FSSDP, []), (FSSDP, ["--ep", "2", "--zero", "1"]), (["--ep", "4"], FSSDP)):
        ck = os.path.join(tmp, "rs_ck_" + "_".join(saved).strip("-"))
        if not os.path.isdir(ck):
            rc, out, _ = h.run(4, base(os.path.join(tmp, "rs_10.jsonl"), 10) + saved + ["--save", ck])
            if rc:
                failures.append("reshard: saving under %s failed: %s" % (saved, out[-400:]))
                continue
        ranks = 4 if resumed else 1
        m = os.path.join(tmp, "rs_resumed_%s.jsonl" % "_".join(resumed).strip("-"))  # resumed runs append
        rc, out, _ = h.run(ranks if ranks > 1 else 0, base(m, 20) + resumed + ["--resume", ck])
        got = [r["loss"] for r in h.read_metrics(m)] if rc == 0 else []
        worst = max((abs(a - b) / abs(a) for a, b in zip(ref[10:], got)), default=float("inf"))
        ok = rc == 0 and "resuming from" in out and len(got) == 10 and worst <= tl.RTOL
        what = "%s checkpoint (step 10) resumed under %s" % (" ".join(saved), " ".join(resumed) or "one rank")
        print("%-4s %s: steps 11-20 worst relative loss difference %.2e" % ("ok" if ok else "FAIL", what, worst),
              flush=True)
        if not ok:
            failures.append("%s: %s" % (what, out[-300:] if rc else worst))
    return failures


def run_errors(tmp, data):
    dense = os.path.join(h.CONFIGS, "llama_tiny.json")
    return h.check_error_cases(data, [
        ("fssdp with --ep 2", MIXTRAL, 2, FSSDP + ["--ep", "2"], "needs --ep 1, got --ep 2"),
        ("fssdp on a dense model", dense, 2, FSSDP, "this llama model has no experts"),
        ("an unknown sharding", MIXTRAL, 2, ["--expert-sharding", "zero"], "--expert-sharding 'zero' is not one of ep, fssdp"),
        ("--fssdp-keep without fssdp", MIXTRAL, 2, ["--fssdp-keep"], "--fssdp-keep keeps what --expert-sharding fssdp"),
    ])


def main():
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    tmp = h.tmpdir()
    try:
        data = h.prepare_data(tmp)
        failures = run_errors(tmp, data) if not only else []
        failures += run_layouts(tmp, data, only)
        if not only:
            failures += run_memory(tmp, data)
            failures += run_reshard(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    h.report(failures, "FSSDP: every layout on the one-rank curve, edp bytes exact from the routed experts, "
             "memory as checked, checkpoints reshard to and from EP")


if __name__ == "__main__":
    main()
