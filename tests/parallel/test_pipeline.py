"""Pipeline parallelism: layout invariance, activation memory and pipeline traffic.

The run of test_layouts.py (20 AdamW steps, lr 1e-2 with warmup and cosine decay, weight decay,
clipping, AdamW eps 1e-6 for the reason given there; micro-batch 2, global batch 8, seq-len 16) on
the gpt2 and mixtral test models (llama for a few layouts) with 4 layers (2 where TP is involved:
see LAYOUTS), once on one rank and under each pipeline layout below, with each activation
recomputation mode (none, selective, full).

Asserted for every (model, layout, recompute), against the one-rank run:
  - loss every step within 1e-5 relative (MoE: lm/aux/z losses too, expert_tokens identical up to a
  near-tie flip (test_layouts.near_tie_flip)),
    step-1 grad norm within 1e-5, final parameters elementwise within 1e-5, Adam moments within 1e-3
    of their max (test_layouts.compare_run / compare_checkpoint);
  - the metrics' layout string names PP<p> (and a --pp-schedule given), and a --pp-layers split shows
    in the startup line of the stages (dropped, either would give the same losses and bytes);
  - activation memory: every step, every stage, the measured peak ("act_bytes_peak": the bytes of
    the model's activation slots alive at once plus its recomputation buffer) equals the computed
    one ("act_bytes_computed": model.h slot_bytes() × the schedule replayed by
    schedule_activation_peak(), plus recompute_bytes());
  - pipeline traffic: every step, stage s sent exactly
        M · Nl · C · 4 · (#chunks not the last virtual stage + #chunks not the first)
    bytes over the pipeline group ("pp_bytes"), M micro-batches per DP rank, Nl = B·T (/TP under
    sequence parallelism: only the sequence shard crosses stages);
  - recomputation saves memory: for each model and layout, stage 0's computed peak is strictly
    smaller with selective than with none, and with full than with selective.

Usage: python3 tests/parallel/test_pipeline.py [gpt2,mixtral,llama] [LAYOUT,...]
"""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
import test_layouts as tl  # noqa: E402

G = 8
RECOMPUTE = ["none", "selective", "full"]

# name, ranks, flags (pp, vpp, tp, sp derived from them), recompute modes, models, layers.
# Layouts with TP run the 2-layer test models (one layer per stage): on the 4-layer gpt2, TP2 alone
# — no pipeline — already ends 1.16e-5 from one rank at h.0.mlp.c_fc.weight[18, 3], an element whose
# gradient RMS (1.4e-5) is 1/8 of the median and whose Adam mean (-2.8e-7) is the residue of
# cancellation: float noise that AdamW turns into ~1e-5 (the one-rank 2-thread control: 8.3e-7).
# PP2xTP2 on that model ends 1.05e-5 there, no further than TP2 alone.
LAYOUTS = [
    ("PP2", 2, ["--pp", "2"], RECOMPUTE, ["gpt2", "mixtral", "llama"], 4),
    ("PP4", 4, ["--pp", "4"], RECOMPUTE, ["gpt2", "mixtral"], 4),
    ("PP2 v2 interleaved", 2, ["--pp", "2", "--vpp", "2"], RECOMPUTE, ["gpt2", "mixtral", "llama"], 4),
    ("PP2xTP2", 4, ["--pp", "2", "--tp", "2"], RECOMPUTE, ["gpt2", "mixtral"], 2),
    ("PP2xDP2 z1", 4, ["--pp", "2", "--dp", "2", "--zero", "1"], RECOMPUTE, ["gpt2", "mixtral"], 4),
    ("PP2xTP2xDP2+SP", 8, ["--pp", "2", "--tp", "2", "--dp", "2", "--sequence-parallel"], RECOMPUTE,
     ["gpt2", "mixtral"], 2),
    ("PP2 gpipe", 2, ["--pp", "2", "--pp-schedule", "gpipe"], ["none"], ["gpt2", "mixtral"], 4),
    ("PP2 layers 1,3", 2, ["--pp", "2", "--pp-layers", "1,3"], ["none"], ["gpt2", "mixtral"], 4),
    ("PP2xDP2 z2", 4, ["--pp", "2", "--dp", "2", "--zero", "2"], ["none"], ["gpt2", "mixtral"], 4),
    ("PP2xDP2 z3", 4, ["--pp", "2", "--dp", "2", "--zero", "3"], ["none", "full"], ["gpt2", "mixtral"], 4),
    ("PP2 v2xDP2 z3", 4, ["--pp", "2", "--vpp", "2", "--dp", "2", "--zero", "3"], ["none"], ["gpt2", "mixtral"], 4),
    # Interleaving over more than two stages: the previous and the next stage are other ranks (under PP2
    # both are the one peer, so a mix-up of the wrap-around's sender and receiver would pass there).
    ("PP4 v2 interleaved", 4, ["--pp", "4", "--vpp", "2"], ["none"], ["gpt2"], 8),
]


def flag(flags, name, default):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def expected_pp_bytes(flags, ranks, C):
    pp, v, tp, cp = flag(flags, "--pp", 1), flag(flags, "--vpp", 1), flag(flags, "--tp", 1), flag(flags, "--cp", 1)
    dp = ranks // (pp * tp * cp)
    micro = G // (tl.MICRO * dp)
    nl = tl.MICRO * tl.SEQ // cp // (tp if "--sequence-parallel" in flags else 1)
    out = []
    for s in range(pp):
        virt = [c * pp + s for c in range(v)]
        msgs = sum(u != pp * v - 1 for u in virt) + sum(u != 0 for u in virt)
        out.append(micro * nl * C * 4 * msgs)
    return out


def check_steps(got, word, want_bytes):
    """Every step's metrics: the layout string names `word`, the measured activation peaks equal the
    computed ones, and pp_bytes equal `want_bytes`. Returns the failures (at most a few)."""
    fails = []
    for g in got:
        if word not in g.get("layout", ""):
            fails.append("layout string %r does not name %s" % (g.get("layout"), word))
        if g.get("act_bytes_peak") != g.get("act_bytes_computed"):
            fails.append("step %d: act_bytes_peak %s != act_bytes_computed %s" % (
                g["step"], g.get("act_bytes_peak"), g.get("act_bytes_computed")))
        if g.get("pp_bytes") != want_bytes:
            fails.append("step %d: pp_bytes %s, analytic %s" % (g["step"], g.get("pp_bytes"), want_bytes))
        if len(fails) > 6:
            break
    return fails


# Micro-batches of 4 windows of 64: messages of [256, 48] floats, 48 KiB, above MPI's eager limit, so
# that a send completes only once its receive is posted.


def check_message_buffers(tmp, data):
    """The memory check counts a stage's backward sends in flight (Pipeline::buffer_bytes). With
    stage 0's backward slowed (ORIGAMI_TEST_SLOW_BACKWARD), stage 1 runs ahead of it and its sends
    wait for stage 0's receives: each step's allocated buffers ("pp_message_buffers") must stay within
    the count (the trainer warns otherwise), and GPipe's stage 1 must pile up more than the 3
    buffers counted before (its count is all 8 sends)."""
    cfg_path = h.write_json(os.path.join(tmp, "gpt2_l4_buffers.json"), h.load_config("gpt2_tiny", n_layer=4))
    failures = []
    for name, flags in (("gpipe", ["--pp-schedule", "gpipe"]), ("1f1b", []), ("interleaved", ["--vpp", "2"])):
        mpath = os.path.join(tmp, "buffers_%s.jsonl" % name)
        args = ["train", "--config", cfg_path, "--data", data, "--steps", "2", "--micro-batch", "4", "--global-batch",
                "32", "--seq-len", "64", "--threads", "1", "--quiet", "--metrics", mpath, "--pp", "2", *flags]
        rc, out, _ = h.run(2, args, extra_env={"ORIGAMI_TEST_SLOW_BACKWARD": "0:30"})
        rows = h.read_metrics(mpath) if rc == 0 else []
        got = [r["pp_message_buffers"] for r in rows]
        warned = "more than the" in out
        piled = name != "gpipe" or (got and max(r[1] for r in got) > 3)
        ok = rc == 0 and got and not warned and piled
        print("%-4s message buffers with a slow stage 0, %s: per step and stage %s%s" % (
            "ok" if ok else "FAIL", name, got, " (warned: more than counted)" if warned else ""), flush=True)
        if not ok:
            failures.append("message buffers, %s: exit %s, %s, warned %s: %s" % (name, rc, got, warned, out[-300:]))
    return failures


def main():
    models = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else ["gpt2", "mixtral", "llama"]
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    tmp = h.tmpdir("origami_pp_")
    rows, failures = [], []
    try:
        data = h.prepare_data(tmp)
        if not only or "buffers" in only:
            failures += check_message_buffers(tmp, data)
        for model in models:
            moe = model == "mixtral"
            layer_key = "n_layer" if model == "gpt2" else "num_hidden_layers"
            refs = {}
            for name, ranks, flags, modes, for_models, layers in LAYOUTS:
                if model not in for_models or (only and name not in only):
                    continue
                if layers not in refs:  # the one-rank run of this model with this many layers
                    cfg = h.load_config(model + "_tiny", **{layer_key: layers})
                    C = cfg.get("n_embd", cfg.get("hidden_size"))
                    cfg_path = h.write_json(os.path.join(tmp, "%s_l%d.json" % (model, layers)), cfg)
                    ref_m, ref_ck = os.path.join(tmp, "%s_l%d_ref.jsonl" % (model, layers)), os.path.join(
                        tmp, "%s_l%d_ref" % (model, layers))
                    rc, out, wall = h.run(0, tl.train_args(cfg_path, data, G, ref_m, ref_ck))
                    if rc != 0:
                        print(out)
                        sys.exit("FAIL: one-rank reference run of %s exited %s" % (model, rc))
                    refs[layers] = (cfg_path, C, h.read_metrics(ref_m), ref_ck)
                    ref = refs[layers][2]
                    print("%s %d layers, one rank: loss %.4f -> %.4f, %.1f s" % (model, layers, ref[0]["loss"],
                                                                              ref[-1]["loss"], wall), flush=True)
                cfg_path, C, ref, ref_ck = refs[layers]
                peaks = {}
                for mode in modes:
                    tag = "%s_%s_%s" % (model, "".join(c if c.isalnum() else "_" for c in name), mode)
                    mpath, ck = os.path.join(tmp, tag + ".jsonl"), os.path.join(tmp, tag)
                    args = tl.train_args(cfg_path, data, G, mpath, ck) + flags + ["--recompute", mode]
                    rc, out, wall = h.run(ranks, args, timeout=240)
                    fails = []
                    got = []
                    if rc != 0:
                        fails.append("exit %s: %s" % (rc, " | ".join(l for l in out.splitlines()
                                                                    if "error" in l.lower())[:400] or out[-400:]))
                    else:
                        try:
                            got = h.read_metrics(mpath)
                        except ValueError as e:
                            fails.append(str(e))
                    w, f = tl.compare_run(ref, got, moe, G)
                    fails += f if rc == 0 else []
                    pa = {"abs": (float("nan"),)}
                    if rc == 0 and w["flip"] is None:
                        dev, f = tl.compare_checkpoint(ref_ck, ck)
                        fails += f
                        pa = dev.get("params", pa)
                    pp = flag(flags, "--pp", 1)
                    want_bytes = expected_pp_bytes(flags, ranks, C)
                    act = "-"
                    fails += check_steps(got, "PP%d" % pp, want_bytes)
                    # The schedule and the split asked for, not the defaults (1F1B, even layers) that
                    # would give the same losses and bytes.
                    if "--pp-schedule" in flags and got and flags[flags.index("--pp-schedule") + 1] not in got[0]["layout"]:
                        fails.append("layout string %r does not name the schedule" % got[0]["layout"])
                    if "--pp-layers" in flags and rc == 0 and "pipeline stages (layers per chunk): 0: [0,1) 1: [1,4)" not in out:
                        fails.append("the startup lines do not give stages [0,1) and [1,4)")
                    if got:
                        act = "/".join("%.0fk" % (b / 1024) for b in got[-1]["act_bytes_peak"])
                        peaks[mode] = got[-1]["act_bytes_computed"][0]
                    status = "ok" if not fails else "FAIL"
                    rows.append((model, name, mode, ranks, layers, "%.1e" % w["loss"], "%.1e" % w["gn1"], "%.1e" % pa["abs"][0],
                                 act, "/".join(str(b) for b in want_bytes), "%.1f" % wall, status))
                    print("%-4s %-8s %-20s %-9s %d ranks: loss %.1e, params abs %.1e, act peak %s, %.1f s" % (
                        status, model, name, mode, ranks, w["loss"], pa["abs"][0], act, wall), flush=True)
                    for x in fails[:6]:
                        print("      " + x)
                    failures += ["%s %s %s: %s" % (model, name, mode, x) for x in fails[:3]]
                    shutil.rmtree(ck, ignore_errors=True)
                if len(peaks) == 3 and not (peaks["full"] < peaks["selective"] < peaks["none"]):
                    failures.append("%s %s: stage-0 activation peaks not full < selective < none: %s" % (model, name, peaks))
        if not only or "errors" in only:  # (the interleaved schedule with one chunk a stage ran as a longer 1f1b)
            failures += h.check_error_cases(data, [
                ("interleaved with one chunk a stage", os.path.join(h.CONFIGS, "gpt2_tiny.json"), 2,
                 ["--pp", "2", "--pp-schedule", "interleaved"], "--pp-schedule interleaved needs --vpp >= 2")])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(h.fmt_table(("model", "layout", "recompute", "ranks", "layers", "loss rel (worst)", "grad norm 1 rel",
                       "params abs", "act peak per stage", "pp bytes per stage", "wall s", "status"), rows))
    h.report(failures, "all pipeline layouts agree with one rank (loss 1e-5 relative, parameters 1e-5 absolute); "
             "measured activation peaks equal the computed ones; pipeline bytes equal the analytic count")


if __name__ == "__main__":
    main()
