"""Layout invariance (DESIGN.md, "Correctness: three oracles", across layouts): the same run —
same seed, global batch, data order, micro-batch size — under any parallel layout gives the same
loss curve and the same final checkpoint as one rank.

For the gpt2, llama and mixtral test models (tests/parallel/configs/*_tiny.json: the reference
tiny models with vocab 260 and heads / kv heads / hidden / FFN divisible by 4, so TP4 divides),
20 AdamW steps with lr 1e-2 (3 warmup steps, cosine to 1e-3), weight decay 0.1 and gradient
clipping at 1.0 (the one-rank runs clip in 6-10 of the 20 steps; the test checks that at least
one step is clipped) on a byte-level dataset are run once on one rank (the binary without
mpirun) and then under every layout of LAYOUTS, with mpirun --oversubscribe, 1 thread per rank
and OMP_WAIT_POLICY=passive. Two more cases: DP2×TP2 with the mesh order dp-tp-cp-ep-pp (dp
fastest), and TP4 on the byte tokenizer's vocabulary of 257, which the engine pads to 260 inside
the shards (compared with a one-rank run of that vocab-257 config; the checkpoint keeps 257 rows). ZeRO-3 (every
parameter sharded, each layer gathered when used) under DP2, DP4 with two micro-batches a rank,
TP2×DP2+SP and full recomputation.

Asserted for every (model, layout), against the one-rank run with the same --global-batch and
--micro-batch:
  - loss: every step within 1e-5 relative, |loss − loss_ref| ≤ 1e-5·|loss_ref|, all 20 steps;
    MoE: lm_loss, aux_loss and z_loss too, and expert_tokens (tokens per expert per layer over
    the whole step) identical — up to a near-tie flip: where the counts first differ by no more than
    the one-rank run's nearly tied top-k decisions of that step explain (expert_near_ties), the
    steps before it are compared and the final checkpoint is not (near_tie_flip);
  - grad_norm of step 1 within 1e-5 relative (step 1 starts from identical parameters, so only
    the summation order differs; Adam is invariant to the scale of a tensor's gradient, so this —
    and the optimizer moments below — is what catches a gradient reduced over too few or too many
    ranks). Later steps' grad_norm is reported, not asserted (see "float noise" below);
  - tokens == global batch · seq-len; the metrics' "layout" string names the degrees (TP2, DP2) and
    the options that would give the same losses if dropped (+SP, the ZeRO stage, recompute);
  - the --save checkpoint (every rank writes its own shards under DIR/step-20; read through
    `origami ckpt export --optimizer`, which assembles the global tensors): the same tensor names
    and global shapes as the one-rank checkpoint's export in model.safetensors and
    optimizer.safetensors, config.json equal, and
      parameters: elementwise |x − x_ref| ≤ 1e-5 (absolute; the parameters are O(0.01–1));
      optimizer moments (exp_avg, exp_avg_sq): per tensor max|x − x_ref| ≤ 1e-3·max|x_ref|.
The table also shows, per tensor, max|x − x_ref| / max|x_ref| for the parameters.

Float noise, and why Adam's eps is 1e-6 here. Float32 sums in a different order (which is all a
correct layout changes) differ by ~1e-7 relative; what 20 steps of AdamW at lr 1e-2 make of that
was measured with a control that involves no parallelism at all, one rank with --threads 2 against
--threads 1 (the "control" rows of the table):
  - With the default eps 1e-8, an element whose gradient happens to be ~eps (e.g. llama layer-0
    down_proj[17, 67]: step-1 gradient −6.635e-9 on one rank, −6.570e-9 under TP2 — the result of
    cancellation, 1% apart) gets an update lr·g/(|g|+eps) that differs by ~1e-5 after one step, and
    gpt2's attention key bias, whose gradient is zero in exact arithmetic (softmax is invariant to
    a per-query shift), is moved by Adam-normalised rounding noise: the control itself deviates by
    2.7e-5 absolute there, and a mixtral TP4 run flips one token's top-2 routing at step 18 after
    such drift. These are properties of the optimizer, not of any layout.
  - eps 1e-6 bounds Adam's amplification of a gradient perturbation δ by lr·δ/eps, and removes
    those cases; everything else (lr, warmup, clipping, weight decay, 20 steps) is as specified.
  Run with LAYOUT_TEST_EPS=1e-8 to see the eps 1e-8 numbers. Tolerances here are fixed; they are
  not loosened to make a failure pass.

Usage: python3 tests/parallel/test_layouts.py [gpt2,llama,mixtral] [LAYOUT,...]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

RTOL = 1e-5        # loss, aux/z/lm loss, step-1 grad_norm: relative
PARAM_ATOL = 1e-5  # parameters: elementwise absolute
MOMENT_RTOL = 1e-3  # optimizer moments: per tensor, relative to the tensor's max
STEPS = 20
SEQ = 16
MICRO = 2
EPS = os.environ.get("LAYOUT_TEST_EPS", "1e-6")

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
    # ZeRO-3: every parameter sharded, each layer gathered when used (and again for backward)
    ("DP2 z3", 2, ["--zero", "3"], 8),
    ("DP4 z3 (2 micro)", 4, ["--zero", "3"], 16),
    ("DP2xTP2+SP z3", 4, ["--tp", "2", "--sequence-parallel", "--zero", "3"], 8),
    ("DP2 z3 recompute full", 2, ["--zero", "3", "--recompute", "full"], 8),
    # buckets smaller than a layer whose sizes DP5 does not divide: a bucket's padding must not part
    # q|k|v, gate|up or a layer's experts, which the model reads as one block
    ("DP5 z1 buckets inside layers", 5, ["--zero", "1", "--bucket-mb", "0.001"], 10),
    ("DP5 z3 buckets inside layers", 5, ["--zero", "3", "--bucket-mb", "0.001"], 10),
    # the mesh order only renumbers ranks: dp varies fastest here
    ("DP2xTP2 dp-first order", 4, ["--tp", "2", "--mesh-order", "dp-tp-cp-ep-pp"], 8),
    # vocabulary 257 (the byte tokenizer's) is padded to a multiple of TP inside the shards; the
    # checkpoint keeps 257 rows. Compared with a one-rank run of the same vocab-257 config.
    ("TP4 vocab 257 (padded)", 4, ["--tp", "4"], 8, {"vocab_size": 257}),
]
MODELS = ["gpt2", "llama", "mixtral"]
CONTROL = "control: 1 rank, 2 threads"


def degrees(flags, ranks):
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    return tp, ranks // tp


# The gentler learning rate (peak, final) of the tests whose float noise lr 1e-2 amplifies past 1e-5:
# at 1e-2 the 20 steps are chaotic for some models, seeds and hosts, and MoE routing is discontinuous —
# a ~1e-8 difference from another order of float sums flips a nearly tied top-k choice, after which
# the curves part for a reason that is not a bug. Measured: seed 7's 4-layer mixtral_tiny under
# PP2 --vocab-parallel stays within 1e-7 of one rank for 12 steps and then flips one layer-0 token at
# step 13, and the 4-layer gpt2_tiny ends 1.2e-5 from one rank on h.0.mlp.c_fc.weight[18, 3] (where
# the one-rank --threads 2 control ends 2.6e-6), on an AVX-512 host (oneDNN's AVX-512 sgemm kernels;
# under ONEDNN_MAX_CPU_ISA=AVX2 both stay below 1e-5); at 3e-3 the same runs end 7e-7 from one rank,
# and the control 1.2e-7. test_context_parallel.py and test_routing_layouts.py give their own cases.
SLOW_LR = ("3e-3", "3e-4")


def train_args(cfg_path, data, G, metrics, save, threads=1, lr=("1e-2", "1e-3")):
    """The run every layout test compares: lr = (peak, final) of the cosine schedule."""
    return ["train", "--config", cfg_path, "--data", data, "--steps", str(STEPS), "--micro-batch", str(MICRO),
            "--global-batch", str(G), "--seq-len", str(SEQ), "--lr", lr[0], "--warmup", "3", "--min-lr", lr[1],
            "--lr-schedule", "cosine", "--weight-decay", "0.1", "--grad-clip", "1.0", "--eps", EPS, "--seed", "7",
            "--data-order", "sequential", "--threads", str(threads), "--quiet", "--metrics", metrics, "--save", save]


def rel(a, b):
    return abs(a - b) / abs(b) if b != 0 else (0.0 if a == 0 else float("inf"))


def near_tie_flip(ref, got):
    """The first step whose expert_tokens differ from the one-rank run's, where the near ties of that
    step explain the difference, else None. A near tie (expert_near_ties per layer: a token whose K-th
    choice led the best expert left out by less than kNearTie, layers/moe.h) is a decision that
    another layout's float rounding may take the other way; each such flip moves one assignment
    between two experts of its layer, and both runs count the token as a near tie (on the other run
    its own choice leads by as little). So each layer may differ by at most twice the near ties of
    either run at that step. Step 1 starts from the same weights and must agree. From the flip the
    curves part for a reason that is not a bug, so the routing-dependent comparisons stop there. A
    difference the near ties do not explain returns None, and compare_run fails on it. (A flip in one
    layer can move a later layer's choices by more than its near ties explain: that fails too, to be
    looked at.)"""
    for r, g in zip(ref, got):
        if g.get("expert_tokens") == r.get("expert_tokens"):
            continue
        moved = [sum(abs(a - b) for a, b in zip(gl, rl)) for gl, rl in zip(g.get("expert_tokens") or [], r["expert_tokens"])]
        ties = [r.get("expert_near_ties") or [], g.get("expert_near_ties") or []]
        explained = r["step"] > 1 and all(len(t) == len(moved) and all(m <= 2 * n for m, n in zip(moved, t)) for t in ties)
        return r["step"] if explained else None
    return None


def before_flip(ref, got, moe):
    """(ref, got, flip step or None): the steps before a near-tie flip (near_tie_flip), all of them
    without one: what the comparisons that depend on routing read."""
    flip = near_tie_flip(ref, got) if moe else None
    if flip is None:
        return ref, got, None
    return [r for r in ref if r["step"] < flip], [g for g in got if g["step"] < flip], flip


def check_near_tie_flip():
    """near_tie_flip on made-up rows (2 layers, 3 experts): what the near ties explain and what not."""
    def rows(counts, ties=None):
        return [{"step": s + 1, "expert_tokens": c, "expert_near_ties": t}
                for s, (c, t) in enumerate(zip(counts, ties or [[0, 0]] * len(counts)))]
    same, moved = [[4, 4, 4], [6, 3, 3]], [[5, 3, 4], [6, 3, 3]]  # one assignment of layer 0 moved
    tie = [[0, 0], [1, 0], [0, 0]]  # a near tie in layer 0 at step 2
    ref = rows([same, same, same], tie)
    cases = [("a flip the near tie explains", rows([same, moved, moved], tie), 2),
             ("no difference", rows([same, same, same]), None),
             ("two flips, one near tie", rows([same, [[6, 2, 4], [6, 3, 3]], same], tie), None),
             ("a flip in a layer without near ties", rows([same, [[4, 4, 4], [5, 4, 3]], same], tie), None),
             ("a difference before the near tie", rows([moved, moved, moved], tie), None),
             ("a flip where the layout saw no near tie", rows([same, moved, moved]), None),
             ("a flip at step 1", rows([moved, moved, moved], [[1, 0]] * 3), None)]
    ref1 = rows([same, same, same], [[1, 0]] * 3)
    refs = {"a flip at step 1": ref1}
    bad = ["%s: %s, expected %s" % (name, near_tie_flip(refs.get(name, ref), got), want) for name, got, want in cases
           if near_tie_flip(refs.get(name, ref), got) != want]
    if bad:
        sys.exit("FAIL: near_tie_flip: " + "; ".join(bad))


def compare_run(ref, got, moe, G):
    """Per-step comparison of metrics. Returns (dict of worst deviations, list of failures). MoE: the
    steps before a near-tie flip (before_flip), whose step is w["flip"]; the caller then skips what
    depends on the later steps (the final checkpoint)."""
    fails = []
    w = {"loss": 0.0, "loss_step": 0, "gn1": 0.0, "grad_norm": 0.0, "aux": 0.0, "experts": "-", "flip": None}
    if len(got) != len(ref):
        return w, ["%d metric lines, expected %d" % (len(got), len(ref))]
    for r, g in zip(ref, got):  # what does not depend on routing, every step
        if g.get("step") != r["step"]:
            fails.append("step %s where %s expected" % (g.get("step"), r["step"]))
        if g.get("tokens") != G * SEQ:
            fails.append("step %d: tokens %s, expected %d" % (r["step"], g.get("tokens"), G * SEQ))
    ref, got, w["flip"] = before_flip(ref, got, moe)
    for r, g in zip(ref, got):
        s = r["step"]
        d = rel(g["loss"], r["loss"])
        if d > w["loss"]:
            w["loss"], w["loss_step"] = d, s
        if d > RTOL:
            fails.append("step %d: loss %.9g vs one-rank %.9g (rel %.2e)" % (s, g["loss"], r["loss"], d))
        d = rel(g["grad_norm"], r["grad_norm"])
        w["grad_norm"] = max(w["grad_norm"], d)
        if s == 1:
            w["gn1"] = d
            if d > RTOL:
                fails.append("step %d: grad_norm %.9g vs %.9g (rel %.2e)" % (s, g["grad_norm"], r["grad_norm"], d))
        if moe:
            for k in ("aux_loss", "z_loss", "lm_loss"):
                d = rel(g[k], r[k])
                w["aux"] = max(w["aux"], d)
                if d > RTOL:
                    fails.append("step %d: %s %.9g vs %.9g (rel %.2e)" % (s, k, g[k], r[k], d))
            if g.get("expert_tokens") != r.get("expert_tokens"):
                if w["experts"] != "DIFF":
                    fails.append("step %d: expert_tokens %s vs one-rank %s" % (s, g.get("expert_tokens"),
                                                                               r.get("expert_tokens")))
                w["experts"] = "DIFF"
            elif w["experts"] == "-":
                w["experts"] = "same"
    if w["flip"] is not None:
        w["experts"] = "same to a near tie at step %d" % w["flip"]
        print("      a near-tie routing flip at step %d: steps 1-%d compared, the final checkpoint not" % (
            w["flip"], w["flip"] - 1), flush=True)
    return w, fails


_REF_EXPORTS = {}  # (reference checkpoint, its `latest` mtime) -> its export, made once


def exported(ck, cache=False):
    """h.export_checkpoint(ck) with the optimizer state; cache: reuse an earlier export of the same
    committed checkpoint (the one-rank references are compared with many layouts)."""
    key = None
    if cache:
        latest = os.path.join(ck, "latest")
        key = (os.path.abspath(ck), os.stat(latest).st_mtime_ns if os.path.exists(latest) else None)
        if key in _REF_EXPORTS and os.path.isdir(_REF_EXPORTS[key]):
            return _REF_EXPORTS[key]
    out = h.export_checkpoint(ck, optimizer=True)
    if key is not None:
        _REF_EXPORTS[key] = out
    return out


def compare_checkpoint(ref_dir, got_dir):
    """({'params': compare_tensors dict, 'moments': ...}, failures). Both --save directories are
    read through `origami ckpt export --optimizer` (global tensors, Hugging Face names)."""
    fails, out = [], {}
    try:
        ref_x = exported(ref_dir, cache=True)
    except RuntimeError as e:
        return out, ["one-rank checkpoint: %s" % e]
    try:
        got_x = exported(got_dir)
    except RuntimeError as e:
        return out, [str(e)]
    try:
        for key, f in (("params", "model.safetensors"), ("moments", "optimizer.safetensors")):
            p = os.path.join(got_x, f)
            if not os.path.exists(p):
                fails.append("checkpoint export lacks " + f)
                continue
            c = h.compare_tensors(h.read_safetensors(os.path.join(ref_x, f)), h.read_safetensors(p))
            out[key] = c
            fails += ["%s: %s" % (f, x) for x in c["problems"]]
            if key == "params" and c["abs"][0] > PARAM_ATOL:
                d, name, idx, a, b = c["abs"]
                fails.append("parameter %s%s = %.9g, one rank %.9g: |diff| %.2e > %.0e" % (name, list(idx), b, a, d,
                                                                                           PARAM_ATOL))
            if key == "moments" and c["rel"][0] > MOMENT_RTOL:
                fails.append("optimizer %s: max|diff|/max|ref| %.2e > %.0e" % (c["rel"][1], c["rel"][0], MOMENT_RTOL))
        cfg_a = json.load(open(os.path.join(ref_x, "config.json")))
        p = os.path.join(got_x, "config.json")
        if not os.path.exists(p) or json.load(open(p)) != cfg_a:
            fails.append("config.json differs from the one-rank checkpoint's")
    finally:
        shutil.rmtree(got_x, ignore_errors=True)
    return out, fails


def short(name):
    return name.replace("model.layers.", "L").replace("block_sparse_moe.", "").replace("exp_avg", "m").replace(
        ".weight", ".w").replace(".bias", ".b")


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else MODELS
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    layouts = [tuple(l) + (None,) * (5 - len(l)) for l in LAYOUTS if only is None or l[0] in only]
    check_near_tie_flip()
    tmp = h.tmpdir()
    rows, failures = [], []
    print("AdamW eps %s; tolerances: loss %.0e relative, parameters %.0e absolute, moments %.0e of max"
          % (EPS, RTOL, PARAM_ATOL, MOMENT_RTOL), flush=True)
    try:
        data = h.prepare_data(tmp)
        for model in models:
            moe = model == "mixtral"
            cfg_paths, refs = {}, {}
            for _, _, _, G, changes in layouts + [(CONTROL, 0, [], 8, None)]:
                key = (G, json.dumps(changes, sort_keys=True))
                if key in refs:
                    continue
                if changes:
                    cfg_paths[key[1]] = h.write_json(os.path.join(tmp, "%s_%d.json" % (model, len(cfg_paths))),
                                                     h.load_config(model + "_tiny", **changes))
                else:
                    cfg_paths[key[1]] = os.path.join(h.CONFIGS, model + "_tiny.json")
                tag = "%s_ref%d_%d" % (model, G, len(refs))
                mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
                rc, out, wall = h.run(0, train_args(cfg_paths[key[1]], data, G, mpath, ck))
                if rc != 0:
                    print(out)
                    sys.exit("FAIL: one-rank reference run of %s (G=%d, %s) exited %s" % (model, G, changes, rc))
                refs[key] = (h.read_metrics(mpath), ck)
                clipped = sum(1 for r in refs[key][0] if r["grad_norm"] > 1.0)
                print("%s one-rank G=%d%s: loss %.4f -> %.4f, %d of %d steps clipped, %.1f s" % (
                    model, G, " " + json.dumps(changes) if changes else "", refs[key][0][0]["loss"],
                    refs[key][0][-1]["loss"], clipped, STEPS, wall), flush=True)
                if clipped == 0:
                    failures.append("%s G=%d: no step was clipped; the test would not exercise clipping" % (model, G))
            for name, ranks, flags, G, changes in [(CONTROL, 0, [], 8, None)] + layouts:
                key = (G, json.dumps(changes, sort_keys=True))
                cfg_path = cfg_paths[key[1]]
                control = name == CONTROL
                tag = "%s_%s" % (model, "".join(c if c.isalnum() else "_" for c in name))
                mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
                rc, out, wall = h.run(ranks, train_args(cfg_path, data, G, mpath, ck, threads=2 if control else 1) + flags,
                                      timeout=240)
                ref_metrics, ref_ck = refs[key]
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
                # ...and the options that give the same losses when dropped: SP, the ZeRO stage, recomputation
                words = (["+SP"] if "--sequence-parallel" in flags else []) + \
                        (["ZeRO-" + flags[flags.index("--zero") + 1]] if "--zero" in flags and dp > 1 else []) + \
                        (["recompute " + flags[flags.index("--recompute") + 1]] if "--recompute" in flags else [])
                for word in words:
                    if rc == 0 and got and word not in lay:
                        fails.append("layout string %r does not name %s" % (lay, word))
                ck_dev = {}
                if rc == 0 and w["flip"] is None:
                    ck_dev, f = compare_checkpoint(ref_ck, ck)
                    fails += f
                pa = ck_dev.get("params", {"abs": (float("nan"), "-", (), 0, 0), "rel": (float("nan"), "-")})
                mo = ck_dev.get("moments", {"rel": (float("nan"), "-")})
                status = ("ok" if not fails else "FAIL") if not control else ("(within)" if not fails else "(outside)")
                rows.append((model, name, ranks or 1, G, "%.1e (step %d)" % (w["loss"], w["loss_step"]),
                             "%.1e / %.1e" % (w["gn1"], w["grad_norm"]),
                             "%.1e / %s" % (w["aux"], w["experts"]) if moe else "-",
                             "%.1e %s%s" % (pa["abs"][0], short(pa["abs"][1]), list(pa["abs"][2])),
                             "%.1e %s" % (pa["rel"][0], short(pa["rel"][1])),
                             "%.1e %s" % (mo["rel"][0], short(mo["rel"][1])), "%.1f" % wall, status, lay or "-"))
                print("%-9s %-8s %-26s %d ranks: loss %.1e, params abs %.1e (rel %.1e), moments %.1e, %.1f s  %s" % (
                    status, model, name, ranks or 1, w["loss"], pa["abs"][0], pa["rel"][0], mo["rel"][0], wall, lay),
                    flush=True)
                for x in fails[:8]:
                    print("      " + x)
                if len(fails) > 8:
                    print("      ... %d more" % (len(fails) - 8))
                if not control:
                    failures += ["%s %s: %s" % (model, name, x) for x in fails[:3]]
                shutil.rmtree(ck, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("Worst deviations from the one-rank run (AdamW eps %s). loss, grad_norm (step 1 / any step), aux: relative;"
          % EPS)
    print("params: max |x - x_ref| (element), and max over tensors of max|x - x_ref|/max|x_ref|; moments: the latter.")
    print("The control rows (one rank, 2 threads vs 1) show the float noise of the same run with no parallelism.")
    print(h.fmt_table(("model", "layout", "ranks", "G", "loss (worst step)", "grad_norm 1 / all", "aux,z,lm / experts",
                       "params abs (element)", "params rel (tensor)", "moments rel (tensor)", "wall s", "status",
                       "layout string"), rows))
    if failures:
        print("\nFAILED (loss %.0e relative, parameters %.0e absolute, moments %.0e of max):"
              % (RTOL, PARAM_ATOL, MOMENT_RTOL))
        for x in failures:
            print("  " + x)
        sys.exit(1)
    print("\nall layouts agree with one rank: loss within %.0e relative, parameters within %.0e absolute"
          % (RTOL, PARAM_ATOL))


if __name__ == "__main__":
    main()
