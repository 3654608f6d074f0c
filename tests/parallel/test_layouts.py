"""Layout invariance (DESIGN.md, "Correctness: three oracles", across layouts): the same run —
same seed, global batch, data order, micro-batch size — under any parallel layout gives the same
loss curve and the same final checkpoint as one rank.

For the gpt2, llama and mixtral test models (tests/parallel/configs/*_tiny.json: the reference
tiny models with vocab 260 and heads / kv heads / hidden / FFN divisible by 4, so TP4 divides),
20 AdamW steps with lr 1e-2 (3 warmup steps, cosine to 1e-3), weight decay 0.1 and gradient
clipping at 1.0 (the reference runs clip in several steps; the test checks that at least one
step is clipped) on a byte-level dataset, are run once on one rank (the binary without mpirun)
and then under every layout of LAYOUTS below, with mpirun --oversubscribe, 1 thread per rank and
OMP_WAIT_POLICY=passive.

Asserted for every (model, layout), against the one-rank run with the same --global-batch and
--micro-batch:
  - every step's loss within 1e-5 relative: |loss − loss_ref| ≤ 1e-5·|loss_ref|, all 20 steps;
    the same for grad_norm (the pre-clip global norm: it decides the clipping);
  - MoE: aux_loss and z_loss within 1e-5 relative (absolute 1e-9 when the reference is 0), and
    expert_tokens (tokens per expert per layer, of the whole step) identical;
  - tokens == global batch · seq-len; the "layout" string names the degrees (e.g. TP2, DP2);
  - the checkpoint of --save: the same tensor names and global shapes in model.safetensors and
    optimizer.safetensors, and for every tensor max|x − x_ref| ≤ 1e-5 · max|x_ref| (max abs
    difference relative to the tensor's max abs value; absolute 1e-5 if the reference tensor is
    all zero); config.json equal.
A compact table of worst deviations per (model, layout) is printed. Tolerances are fixed here and
must not be loosened to make a failure pass.

Usage: python3 tests/parallel/test_layouts.py [gpt2,llama,mixtral] [LAYOUT,...]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

RTOL = 1e-5
STEPS = 20
SEQ = 16
MICRO = 2

# name, ranks, flags, global batch. G=8 with micro-batch 2 is 4 micro-batches on one rank, 2 per
# rank under DP2, 1 under DP4; G=16 gives DP4 two micro-batches per rank (so ZeRO-2's per-micro-batch
# reduce-scatter accumulates) and DP2 four.
LAYOUTS = [
    ("DP2", 2, [], 8),
    ("DP4", 4, [], 8),
    ("TP2", 2, ["--tp", "2"], 8),
    ("TP4", 4, ["--tp", "4"], 8),
    ("TP2+SP", 2, ["--tp", "2", "--sequence-parallel"], 8),
    ("DP2xTP2", 4, ["--tp", "2", "--dp", "2"], 8),
    ("DP2xTP2+SP z1", 4, ["--tp", "2", "--sequence-parallel", "--zero", "1"], 8),
    ("DP4 z2 (2 micro)", 4, ["--zero", "2"], 16),
    ("DP2 (4 micro)", 2, [], 16),
    ("DP2xTP4+SP z2", 8, ["--tp", "4", "--sequence-parallel", "--zero", "2"], 16),
]
MODELS = ["gpt2", "llama", "mixtral"]


def degrees(flags, ranks):
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    return tp, ranks // tp


def train_args(cfg_path, data, G, metrics, save):
    return ["train", "--config", cfg_path, "--data", data, "--steps", str(STEPS), "--micro-batch", str(MICRO),
            "--global-batch", str(G), "--seq-len", str(SEQ), "--lr", "1e-2", "--warmup", "3", "--min-lr", "1e-3",
            "--lr-schedule", "cosine", "--weight-decay", "0.1", "--grad-clip", "1.0", "--seed", "7",
            "--data-order", "sequential", "--threads", "1", "--quiet", "--metrics", metrics, "--save", save]


def rel(a, b, floor=0.0):
    d = abs(a - b)
    s = abs(b)
    return d / s if s > floor else d


def compare_run(ref, got, moe, G):
    """Per-step comparison of metrics. Returns (dict of worst deviations, list of failures)."""
    fails = []
    w = {"loss": 0.0, "loss_step": 0, "grad_norm": 0.0, "aux": 0.0, "experts": "-"}
    if len(got) != len(ref):
        return w, ["%d metric lines, expected %d" % (len(got), len(ref))]
    for r, g in zip(ref, got):
        s = r["step"]
        if g.get("step") != s:
            fails.append("step %s where %s expected" % (g.get("step"), s))
        d = rel(g["loss"], r["loss"])
        if d > w["loss"]:
            w["loss"], w["loss_step"] = d, s
        if d > RTOL:
            fails.append("step %d: loss %.9g vs one-rank %.9g (rel %.2e)" % (s, g["loss"], r["loss"], d))
        d = rel(g["grad_norm"], r["grad_norm"])
        w["grad_norm"] = max(w["grad_norm"], d)
        if d > RTOL:
            fails.append("step %d: grad_norm %.9g vs %.9g (rel %.2e)" % (s, g["grad_norm"], r["grad_norm"], d))
        if g.get("tokens") != G * SEQ:
            fails.append("step %d: tokens %s, expected %d" % (s, g.get("tokens"), G * SEQ))
        if moe:
            for k in ("aux_loss", "z_loss", "lm_loss"):
                d = abs(g[k] - r[k]) / abs(r[k]) if r[k] != 0 else (0.0 if abs(g[k]) <= 1e-9 else float("inf"))
                w["aux"] = max(w["aux"], d)
                if d > RTOL:
                    fails.append("step %d: %s %.9g vs %.9g" % (s, k, g[k], r[k]))
            if g.get("expert_tokens") != r.get("expert_tokens"):
                w["experts"] = "DIFF"
                fails.append("step %d: expert_tokens %s vs one-rank %s" % (s, g.get("expert_tokens"),
                                                                           r.get("expert_tokens")))
            elif w["experts"] == "-":
                w["experts"] = "same"
    return w, fails


def compare_checkpoint(ref_dir, got_dir):
    """(worst param dev, tensor, worst optimizer dev, tensor, failures)."""
    fails = []
    out = []
    for f in ("model.safetensors", "optimizer.safetensors"):
        p = os.path.join(got_dir, f)
        if not os.path.exists(p):
            fails.append("checkpoint lacks " + f)
            out += [float("inf"), "-"]
            continue
        worst, where, problems = h.compare_tensors(h.read_safetensors(os.path.join(ref_dir, f)), h.read_safetensors(p))
        fails += ["%s: %s" % (f, x) for x in problems]
        if worst > RTOL:
            fails.append("%s: tensor %s differs by %.2e (max abs diff / max abs value)" % (f, where, worst))
        out += [worst, where]
    cfg_a = json.load(open(os.path.join(ref_dir, "config.json")))
    p = os.path.join(got_dir, "config.json")
    if not os.path.exists(p) or json.load(open(p)) != cfg_a:
        fails.append("config.json differs from the one-rank checkpoint's")
    return (*out, fails)


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else MODELS
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    layouts = [l for l in LAYOUTS if only is None or l[0] in only]
    tmp = h.tmpdir()
    rows, failures = [], []
    try:
        data = h.prepare_data(tmp)
        for model in models:
            cfg_path = os.path.join(h.CONFIGS, model + "_tiny.json")
            moe = model == "mixtral"
            refs = {}
            for G in sorted({l[3] for l in layouts}):
                mpath, ck = os.path.join(tmp, "%s_ref%d.jsonl" % (model, G)), os.path.join(tmp, "%s_ref%d" % (model, G))
                rc, out, wall = h.run(0, train_args(cfg_path, data, G, mpath, ck))
                if rc != 0:
                    print(out)
                    sys.exit("FAIL: one-rank reference run of %s (G=%d) exited %s" % (model, G, rc))
                refs[G] = (h.read_metrics(mpath), ck)
                clipped = sum(1 for r in refs[G][0] if r["grad_norm"] > 1.0)
                print("%s one-rank G=%d: loss %.4f -> %.4f, %d of %d steps clipped, %.1f s" % (
                    model, G, refs[G][0][0]["loss"], refs[G][0][-1]["loss"], clipped, STEPS, wall), flush=True)
                if clipped == 0:
                    failures.append("%s G=%d: no step was clipped; the test would not exercise clipping" % (model, G))
            for name, ranks, flags, G in layouts:
                tag = "%s_%s" % (model, "".join(c if c.isalnum() else "_" for c in name))
                mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
                rc, out, wall = h.run(ranks, train_args(cfg_path, data, G, mpath, ck) + flags, timeout=240)
                ref_metrics, ref_ck = refs[G]
                fails = []
                if rc != 0:
                    fails.append("exit %s: %s" % (rc, " | ".join(l for l in out.splitlines() if "error" in l.lower())[:400]
                                                  or out[-400:]))
                try:
                    got = h.read_metrics(mpath)
                except ValueError as e:
                    got = []
                    fails.append(str(e))
                w, f = compare_run(ref_metrics, got, moe, G)
                fails += f if rc == 0 else []
                tp, dp = degrees(flags, ranks)
                lay = got[0].get("layout", "") if got else ""
                for deg, lab in ((tp, "TP"), (dp, "DP")):
                    if rc == 0 and got and deg > 1 and ("%s%d" % (lab, deg)) not in lay:
                        fails.append("layout string %r does not name %s%d" % (lay, lab, deg))
                if rc == 0:
                    pw, pwhere, ow, owhere, f = compare_checkpoint(ref_ck, ck)
                    fails += f
                else:
                    pw, pwhere, ow, owhere = float("nan"), "-", float("nan"), "-"
                status = "ok" if not fails else "FAIL"
                rows.append((model, name, ranks, G, "%.1e (step %d)" % (w["loss"], w["loss_step"]), "%.1e" % w["grad_norm"],
                             "%.1e / %s" % (w["aux"], w["experts"]) if moe else "-",
                             "%.1e %s" % (pw, pwhere), "%.1e %s" % (ow, owhere), "%.1f" % wall, status, lay or "-"))
                print("%-5s %-8s %-18s %d ranks: loss %.1e, params %.1e, optimizer %.1e, %.1f s  %s" % (
                    status, model, name, ranks, w["loss"], pw, ow, wall, lay), flush=True)
                for x in fails[:8]:
                    print("      " + x)
                if len(fails) > 8:
                    print("      ... %d more" % (len(fails) - 8))
                failures += ["%s %s: %s" % (model, name, x) for x in fails[:3]]
                shutil.rmtree(ck, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("Worst deviations from the one-rank run (relative; params/optimizer: max|x-x_ref|/max|x_ref| per tensor, worst tensor):")
    print(h.fmt_table(("model", "layout", "ranks", "G", "loss (worst step)", "grad_norm", "aux,z,lm / expert_tokens",
                       "params (tensor)", "optimizer (tensor)", "wall s", "status", "layout string"), rows))
    if failures:
        print("\nFAILED (tolerance %.0e):" % RTOL)
        for x in failures:
            print("  " + x)
        sys.exit(1)
    print("\nall layouts agree with one rank within %.0e" % RTOL)


if __name__ == "__main__":
    main()
