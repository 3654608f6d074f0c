"""Expert parallelism with MoE parallel folding (DESIGN.md, "Expert parallelism").

mixtral test models with 8 experts (tests/parallel/configs/mixtral_8e.json, top-2) and 6 experts
top-3 (mixtral_6e_top3.json), aux-loss coefficient 0.02 and z-loss 0.001, the settings of
test_layouts.py (20 AdamW steps, lr 1e-2 with warmup and cosine decay, clipping, eps 1e-6):

  1. Layout invariance against one rank, with test_layouts' assertions (loss, aux/z/lm loss within
     1e-5 relative every step, expert_tokens identical up to a near-tie flip
     (test_layouts.near_tie_flip), step-1 grad norm, final parameters within
     1e-5 absolute, optimizer moments), for the attention mesh and the MoE mesh folded every way the
     issue names: EP2, EP4, EP8, EP2xETP2, TP2 attention with EP2 ETP1 (EP spans TP), TP2xDP2
     attention with EP4 (EP spans TP and DP), EP2xPP2, EP2 x TP2+SP x PP2 (8 ranks), EP4 with
     ZeRO-1 and ZeRO-2, EP2 with full recomputation; 6 experts top-3 under EP2, EP3 and EP2xETP2, and
     TP2 on a model whose FFN (57) TP2 does not divide, which has MoE layers only (it stopped on an
     internal assert).
  2. comm_bytes.ep and .etp of rank 0, every step, equal the count derived here from every rank's
     routed counts (ORIGAMI_TEST_ROUTING makes each rank log them): per call (layer, micro-batch)
     forward and backward each send the rows routed to other EP ranks and return the rows other EP
     ranks sent (all-to-all-v), all-gather this rank's received rows to the ETP peers and
     reduce-scatter the peers' rows (pairwise accounting, comm.h); plus the count exchanges
     (El int64 to each other EP rank, EP·El int64 gathered over ETP) once per forward (full
     recomputation runs each forward, exchanges included, twice), and the metrics' all-reduce (max)
     over EP of each forward call's rows (8 bytes a call). `expert_sync_imbalance`, every
     step: with one micro-batch per rank, equal to the busiest EP rank's expert-side rows over the
     mean, summed layer by layer, from the same counts (the most over the EP groups); with several
     (the logs sum them) at least that.
  3. A checkpoint saved under EP4xPP2 (8 ranks, step 10; each rank writes its own shards) resumes
     (--resume) under EP1 (one rank) and EP2xETP2 and continues on the one-rank curve (steps 11-20
     within 1e-5); its `origami ckpt export` loads in transformers (no missing or unexpected
     weights) and gives the same logits as the one-rank checkpoint's export.
  4. Errors (one message, every rank exits 1): experts not divisible by EP; EP x ETP not dividing
     the ranks of a stage; ETP not dividing the expert FFN; --ep on a dense model.

Usage: python3 tests/parallel/test_expert_parallel.py [LAYOUT,...]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
import test_layouts as tl  # noqa: E402

CFG8 = os.path.join(h.CONFIGS, "mixtral_8e.json")
CFG6 = os.path.join(h.CONFIGS, "mixtral_6e_top3.json")
CFG_FFN57 = os.path.join(h.CONFIGS, "mixtral_ffn57.json")  # FFN 57, which TP2 does not divide: MoE layers only

# name, config, ranks, flags, global batch
LAYOUTS = [
    ("EP2", CFG8, 2, ["--ep", "2"], 8),
    ("EP4", CFG8, 4, ["--ep", "4"], 8),
    ("EP8", CFG8, 8, ["--ep", "8"], 16),
    ("EP2xETP2", CFG8, 4, ["--ep", "2", "--etp", "2"], 8),
    ("TP2 attn | EP2 ETP1 (folded)", CFG8, 2, ["--tp", "2", "--ep", "2"], 8),
    ("TP2xDP2 attn | EP4 (spans TP, DP)", CFG8, 4, ["--tp", "2", "--ep", "4"], 8),
    ("EP2xPP2", CFG8, 4, ["--ep", "2", "--pp", "2"], 8),
    ("EP2 x TP2+SP x PP2", CFG8, 8, ["--ep", "2", "--tp", "2", "--sequence-parallel", "--pp", "2"], 8),
    ("EP4 z1", CFG8, 4, ["--ep", "4", "--zero", "1"], 8),
    ("EP4 z2 (2 micro)", CFG8, 4, ["--ep", "4", "--zero", "2"], 16),
    ("EP2xEDP2 z3 (2 micro)", CFG8, 4, ["--ep", "2", "--zero", "3"], 16),
    ("EP2 recompute full", CFG8, 2, ["--ep", "2", "--recompute", "full"], 8),
    ("6e top-3 EP2", CFG6, 2, ["--ep", "2"], 8),
    ("6e top-3 EP3", CFG6, 3, ["--ep", "3"], 12),
    ("6e top-3 EP2xETP2", CFG6, 4, ["--ep", "2", "--etp", "2"], 8),
    ("TP2 attn with FFN 57 (MoE layers only)", CFG_FFN57, 2, ["--tp", "2"], 8),
]


def flag(flags, name, default=1):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def coords(rank, etp, ep, world_per_stage):
    """(etp, ep, edp, pp) coordinates of a rank in the MoE mesh (default order: etp fastest)."""
    edp = world_per_stage // (etp * ep)
    return rank % etp, rank // etp % ep, rank // (etp * ep) % edp, rank // (etp * ep * edp)


def expected_dispatch_bytes(routing, ranks, flags, cfg, micro):
    """{step: (ep bytes, etp bytes)} rank 0 sends, from every rank's logged routed counts ([L][E]
    summed over its `micro` micro-batches; zero rows for layers of other stages)."""
    etp, ep, pp = flag(flags, "--etp"), flag(flags, "--ep"), flag(flags, "--pp")
    C, E = cfg["hidden_size"], cfg["num_local_experts"]
    El, per_stage = E // ep, ranks // pp
    rank_at = {coords(r, etp, ep, per_stage): r for r in range(ranks)}
    b0, a0, d0, s0 = coords(0, etp, ep, per_stage)
    mine = range(a0 * El, (a0 + 1) * El)
    out = {}
    for step in routing[0]:
        counts = {r: routing[r][step] for r in range(ranks)}  # [L][E] summed over micro-batches
        layers = [l for l, row in enumerate(counts[0]) if any(row)]  # rank 0's stage routes every token
        rows = lambda r, l, experts: sum(counts[r][l][e] for e in experts)
        # full recomputation reruns each forward (and its exchanges) before the layer's backward
        passes = 3 if "full" in flags else 2
        ep_rows = etp_rows = 0
        for l in layers:
            sent = rows(0, l, [e for e in range(E) if e not in mine])
            back = sum(rows(rank_at[(b0, a, d0, s0)], l, mine) for a in range(ep) if a != a0)
            peer = [sum(rows(rank_at[(b, a, d0, s0)], l, mine) for a in range(ep)) for b in range(etp)]
            ep_rows += passes * (sent + back)
            etp_rows += passes * ((etp - 1) * peer[b0] + sum(peer) - peer[b0])
        calls = len(layers) * micro * (passes - 1)  # plan() once per forward of a layer
        busiest = 2 * (ep - 1) / ep * 8 * len(layers) * micro  # the metrics' max over EP, per forward call
        out[step] = (4 * C * ep_rows + 8 * (ep - 1) * El * calls + busiest,
                     4 * C * etp_rows + 8 * (etp - 1) * ep * El * calls)
    return out


def expected_sync_imbalance(routing, ranks, flags, cfg, step):
    """Σ over layers of the busiest EP rank's expert-side rows / Σ of the mean, the most over the EP
    groups, from every rank's routed counts ([L][E], summed over its micro-batches). A rank's
    expert-side rows are what its EP peers routed to its experts, gathered over its ETP peers."""
    etp, ep, pp = flag(flags, "--etp"), flag(flags, "--ep"), flag(flags, "--pp")
    El, per_stage = cfg["num_local_experts"] // ep, ranks // pp
    rank_at = {coords(r, etp, ep, per_stage): r for r in range(ranks)}
    worst = 1.0
    for d in range(per_stage // (etp * ep)):
        for s in range(pp):
            sources = [rank_at[(b, a, d, s)] for b in range(etp) for a in range(ep)]
            busiest = mean = 0
            for l in range(len(routing[sources[0]][step])):
                rows = [sum(routing[r][step][l][e] for r in sources for e in range(a * El, (a + 1) * El))
                        for a in range(ep)]
                busiest, mean = busiest + max(rows), mean + sum(rows) / ep  # (zeros: another stage's layer)
            if mean:
                worst = max(worst, busiest / mean)
    return worst


def read_routing(d, ranks):
    out = {}
    for r in range(ranks):
        out[r] = {}
        for line in open(os.path.join(d, "routing.%d.jsonl" % r)):
            rec = json.loads(line)
            out[r][rec["step"]] = rec["expert_counts"]
    return out


def run_layouts(tmp, data, only):
    failures, rows = [], []
    refs = {}
    for name, cfg_path, ranks, flags, G in LAYOUTS:
        if only and name not in only:
            continue
        key = (cfg_path, G)
        if key not in refs:
            tag = "ref_%s_%d" % (os.path.basename(cfg_path)[:-5], G)
            mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
            rc, out, wall = h.run(0, tl.train_args(cfg_path, data, G, mpath, ck))
            if rc != 0:
                sys.exit("FAIL: one-rank reference %s G=%d: %s" % (cfg_path, G, out[-800:]))
            refs[key] = (h.read_metrics(mpath), ck)
            print("one-rank %s G=%d: loss %.4f -> %.4f, aux %.4f, %.1f s" % (os.path.basename(cfg_path), G,
                  refs[key][0][0]["loss"], refs[key][0][-1]["loss"], refs[key][0][-1]["aux_loss"], wall), flush=True)
        tag = "".join(c if c.isalnum() else "_" for c in name)
        mpath, ck, rdir = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag), os.path.join(tmp, tag + "_routing")
        os.makedirs(rdir, exist_ok=True)
        os.environ["ORIGAMI_TEST_ROUTING"] = rdir
        rc, out, wall = h.run(ranks, tl.train_args(cfg_path, data, G, mpath, ck) + flags, timeout=300)
        del os.environ["ORIGAMI_TEST_ROUTING"]
        fails = []
        if rc != 0:
            fails.append(h.why(rc, out, 600))
            got = []
        else:
            got = h.read_metrics(mpath)
        ref_metrics, ref_ck = refs[key]
        w, f = tl.compare_run(ref_metrics, got, True, G)
        fails += f
        pa = {"abs": (float("nan"), "-", ())}
        if rc == 0:
            if w["flip"] is None:
                dev, f = tl.compare_checkpoint(ref_ck, ck)
                fails += f
                pa = dev.get("params", pa)
            # the startup line names both meshes
            lay = got[0].get("layout", "")
            if "experts ETP%d x EP%d" % (flag(flags, "--etp"), flag(flags, "--ep")) not in lay:
                fails.append("layout %r does not name the MoE mesh" % lay)
            # dispatcher bytes against the routed counts
            cfg = json.load(open(cfg_path))
            tp, pp = flag(flags, "--tp"), flag(flags, "--pp")
            micro = G // (tl.MICRO * (ranks // (tp * pp)))
            routing = read_routing(rdir, ranks)
            exp = expected_dispatch_bytes(routing, ranks, flags, cfg, micro)
            for g in got:
                e_ep, e_etp = exp[g["step"]]
                cb = g.get("comm_bytes", {})
                if round(e_ep) != cb.get("ep", 0) or round(e_etp) != cb.get("etp", 0):
                    fails.append("step %d: comm_bytes ep %s etp %s, from the routed counts %d and %d" % (
                        g["step"], cb.get("ep", 0), cb.get("etp", 0), e_ep, e_etp))
                    break
            for g in got:
                want, have = expected_sync_imbalance(routing, ranks, flags, cfg, g["step"]), g["expert_sync_imbalance"]
                if not (abs(have - want) <= 1e-9 * want if micro == 1 else have >= want - 1e-9):
                    fails.append("step %d: expert_sync_imbalance %.6f, from the routed counts %s%.6f" % (
                        g["step"], have, "" if micro == 1 else "at least ", want))
                    break
        imb = max(g.get("expert_imbalance", 0) for g in got) if got else float("nan")
        sync = max(g.get("expert_sync_imbalance", 0) for g in got) if got else float("nan")
        status = "ok" if not fails else "FAIL"
        print("%-4s %-36s %d ranks: loss %.1e, aux/z/lm %.1e, experts %s, params abs %.1e, comm ep/etp "
              "checked %d steps, imbalance up to %.2f (call by call %.2f), %.1f s" % (
                  status, name, ranks, w["loss"], w["aux"], w["experts"], pa["abs"][0], len(got), imb, sync, wall),
              flush=True)
        for x in fails[:5]:
            print("      " + x)
        failures += ["%s: %s" % (name, x) for x in fails[:3]]
        shutil.rmtree(ck, ignore_errors=True)
    return failures


def run_reshard(tmp, data):
    """EP4xPP2 checkpoint at step 10 → EP1 and EP2xETP2 to step 20; transformers loads its export. A constant
    learning rate, so a 10-step run is the first half of the 20-step one."""
    failures = []
    base = lambda m, steps: ["train", "--config", CFG8, "--data", data, "--steps", str(steps), "--micro-batch", "2",
                             "--global-batch", "8", "--seq-len", "16", "--lr", "3e-3", "--lr-schedule", "constant",
                             "--eps", tl.EPS, "--seed", "7", "--threads", "1", "--quiet", "--metrics", m]
    full, ck1, ck10 = os.path.join(tmp, "full.jsonl"), os.path.join(tmp, "ck_1rank_10"), os.path.join(tmp, "ck_ep4pp2_10")
    runs = [h.run(0, base(full, 20)), h.run(0, base(os.path.join(tmp, "r10.jsonl"), 10) + ["--save", ck1]),
            h.run(8, base(os.path.join(tmp, "p10.jsonl"), 10) + ["--ep", "4", "--pp", "2", "--save", ck10])]
    for rc, out, _ in runs:
        if rc:
            return ["reshard: a setup run failed: " + out[-400:]]
    ref = [r["loss"] for r in h.read_metrics(full)]
    for ranks, layout in ((1, []), (4, ["--ep", "2", "--etp", "2"])):
        m = os.path.join(tmp, "resumed%d.jsonl" % ranks)
        rc, out, _ = h.run(ranks, base(m, 20) + layout + ["--resume", ck10])
        got = [r["loss"] for r in h.read_metrics(m)] if rc == 0 else []
        worst = max((abs(a - b) / abs(a) for a, b in zip(ref[10:], got)), default=float("inf"))
        ok = rc == 0 and "resuming from" in out and len(got) == 10 and worst <= tl.RTOL
        print("%-4s EP4xPP2 checkpoint (step 10) resumed on %d rank(s) %s: steps 11-20 worst relative loss "
              "difference %.2e" % ("ok" if ok else "FAIL", ranks, " ".join(layout) or "(one rank)", worst), flush=True)
        if not ok:
            failures.append("EP4xPP2 checkpoint resumed as %s: %s" % (layout or "one rank", out[-300:] if rc else worst))
    # transformers: the EP-written checkpoint's export loads completely and gives the one-rank
    # checkpoint's logits
    try:
        exports = [h.export_checkpoint(d, optimizer=False) for d in (ck10, ck1)]
    except RuntimeError as e:
        return failures + ["export for transformers: %s" % e]
    try:
        import torch
        from transformers import AutoModelForCausalLM
        tokens = torch.tensor([[(i * 37 + 11) % 256 for i in range(16)]])
        logits = []
        for d in exports:
            model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, torch_dtype=torch.float64)
            bad = info["missing_keys"] + info["unexpected_keys"] + info["mismatched_keys"]
            if bad:
                failures.append("transformers: %s loads with missing/unexpected weights %s" % (d, bad[:5]))
            with torch.no_grad():
                logits.append(model(tokens).logits)
        rel = float((logits[0] - logits[1]).abs().max() / logits[1].abs().max())
        ok = rel <= 1e-4
        print("%-4s transformers loads the EP4xPP2 checkpoint's export: logits vs the one-rank checkpoint's, "
              "max rel %.2e" % ("ok" if ok else "FAIL", rel), flush=True)
        if not ok:
            failures.append("transformers logits of the EP4xPP2 checkpoint differ: %.2e" % rel)
    except ImportError as e:
        failures.append("transformers is not importable: %s" % e)
    return failures


def run_errors(tmp, data):
    dense = os.path.join(h.CONFIGS, "llama_tiny.json")
    return h.check_error_cases(data, [
        ("experts not divisible by EP", CFG6, 4, ["--ep", "4"], "--ep 4 must divide the number of experts (6)"),
        ("EP x ETP not dividing a stage", CFG8, 4, ["--ep", "4", "--pp", "2"], "must divide the ranks of a pipeline stage"),
        ("ETP not dividing the expert FFN", CFG8, 3, ["--etp", "3"], "--etp 3 must divide the expert FFN features (56)"),
        ("--ep on a dense model", dense, 2, ["--ep", "2"], "this llama model has no experts"),
    ])


def main():
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    tmp = h.tmpdir()
    try:
        data = h.prepare_data(tmp)
        failures = run_errors(tmp, data) if not only else []
        failures += run_layouts(tmp, data, only)
        if not only:
            failures += run_reshard(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    h.report(failures, "expert parallelism: every layout on the one-rank curve, dispatcher bytes exact, checkpoints reshard")


if __name__ == "__main__":
    main()
