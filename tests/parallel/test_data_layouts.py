"""Document masking, validation and blends under every parallel layout (DESIGN.md, "Data").

Data: byte-level documents of 2..10 words (about 10..60 tokens), so a window of T = 32 holds
several documents and many windows cut one; validation data of the same kind (another seed).

  1. Document masking + validation: `--attention-mask document --eval-data VAL --eval-every 4
     --eval-iters 1` for 8 AdamW steps (micro-batch 2, global batch 8, T 32) under TP2+SP, DP2
     ZeRO-1, PP2 (1F1B), PP2 interleaved (4 layers), --recompute full (DP2) and selective (CP2),
     CP2 (p2p and a2a: the chunks cut documents; for llama also T 256, whose 64-position chunks
     are whole tiles, so masked tiles are skipped inside blocks), CP4 a2a+p2p (A 2), TP2×PP2, and
     for mixtral EP2 and EP2 folded over CP2: every step's loss (MoE: lm/aux/z, expert_tokens
     identical) and the validation loss at steps 4 and 8 within 1e-5 relative of the one-rank run
     of the same arguments (gpt2: learned positions restart; llama with 2 KV heads: RoPE positions
     restart, a2a replicates the KV heads; mixtral); for the dense models an evaluating step's
     comm_bytes equal the step before's (the evaluation is not counted as the step's).
  2. Blends: --data "0.6 A 0.4 B" under DP2 ZeRO-1 gives the one-rank losses and per-step rows per
     dataset ("data_samples"); the one-rank run's checkpoint of step 4 resumed under DP2 continues
     the same rows and losses (steps 5..8); resuming it with other --data or --attention-mask warns.
  3. Mistakes: --eval-every or --eval-iters without --eval-data, an unknown --attention-mask, a blend
     with an odd number of fields, a blend of datasets made with different tokenizers, and more
     validation windows than the data has, and two ranks whose copies of --data differ (each rank
     opens it itself): one error line each, exit 1, on every rank.
"""
import json
import os
import subprocess

import harness as h
import test_layouts as tl

RTOL = 1e-5
COMMON = ["--steps", "8", "--micro-batch", "2", "--global-batch", "8", "--lr", "3e-3", "--warmup", "2",
          "--min-lr", "3e-4", "--weight-decay", "0.1", "--grad-clip", "1.0", "--seed", "7", "--threads", "1", "--quiet"]
DOCS = ["--attention-mask", "document", "--eval-every", "4", "--eval-iters", "1"]

# The model variants a layout runs on, each with its own one-rank run: (layers, sequence length). T 256
# under CP2 gives chunks of 64 positions, whole 64-row tiles, so masked tiles are skipped inside blocks.
VARIANTS = {"base": (None, 32), "4 layers": (4, 32), "T 256": (None, 256)}
# (name, ranks, flags, models it applies to (None: all), variant)
LAYOUTS = [
    ("TP2+SP", 2, ["--tp", "2", "--sequence-parallel"], None, "base"),
    ("DP2 z1", 2, ["--zero", "1"], None, "base"),
    ("PP2 1f1b", 2, ["--pp", "2"], None, "base"),
    ("PP2 interleaved v2", 2, ["--pp", "2", "--vpp", "2"], None, "4 layers"),
    ("DP2 recompute full", 2, ["--recompute", "full"], None, "base"),
    ("CP2 p2p recompute selective", 2, ["--cp", "2", "--recompute", "selective"], None, "base"),
    ("CP2 a2a", 2, ["--cp", "2", "--cp-comm", "a2a"], None, "base"),
    ("CP2 p2p T256", 2, ["--cp", "2"], {"llama_gqa2"}, "T 256"),
    ("CP4 a2a+p2p", 4, ["--cp", "4", "--cp-comm", "a2a+p2p", "--cp-a2a-size", "2"], None, "base"),
    ("TP2xPP2", 4, ["--tp", "2", "--pp", "2"], None, "base"),
    ("EP2", 2, ["--ep", "2"], {"mixtral_8e"}, "base"),
    ("CP2xEP2", 2, ["--cp", "2", "--ep", "2"], {"mixtral_8e"}, "base"),
]
MODELS = ["gpt2_tiny", "llama_gqa2", "mixtral_8e"]


def train(tmp, tag, ranks, cfg, data, flags, seq=32):
    metrics = os.path.join(tmp, tag.replace(" ", "_") + ".jsonl")
    rc, out, secs = h.run(ranks, ["train", "--config", cfg, "--data", data, "--seq-len", str(seq), *COMMON, *flags,
                                  "--metrics", metrics])
    if rc != 0:
        return None, h.why(rc, out, 600)
    return h.read_metrics(metrics), None


def compare(ref, got, moe):
    """Worst relative deviation of loss (and val_loss, MoE losses) and the failures. A dense model's
    steps send the same bytes, so an evaluating step's comm_bytes must equal the step before's: the
    evaluation's forwards are not counted as the step's."""
    worst, fails = 0.0, []
    if len(got) != len(ref):
        return worst, ["%d metric lines, expected %d" % (len(got), len(ref))]
    for r, g in zip(ref, got):  # the data does not depend on routing: every step
        if g.get("data_samples") != r.get("data_samples"):
            fails.append("step %d: data_samples %s vs %s" % (r["step"], g.get("data_samples"), r.get("data_samples")))
    ref, got, _ = tl.before_flip(ref, got, moe)  # MoE: the steps before a near-tie flip
    for prev, r, g in zip([None] + got[:-1], ref, got):
        if not moe and prev is not None and "val_loss" in g and g.get("comm_bytes") != prev.get("comm_bytes"):
            fails.append("step %d (evaluated): comm_bytes %s, step before %s" % (r["step"], g.get("comm_bytes"),
                                                                                 prev.get("comm_bytes")))
        keys = ["loss"] + (["lm_loss", "aux_loss", "z_loss"] if moe else []) + (["val_loss"] if "val_loss" in r else [])
        for k in keys:
            if k not in g:
                fails.append("step %d: no %s" % (r["step"], k))
                continue
            d = abs(g[k] - r[k]) / max(abs(r[k]), 1e-30)
            worst = max(worst, d)
            if d > RTOL:
                fails.append("step %d: %s %.9g vs one-rank %.9g (rel %.2e)" % (r["step"], k, g[k], r[k], d))
        if moe and g.get("expert_tokens") != r.get("expert_tokens"):
            fails.append("step %d: expert_tokens differ" % r["step"])
    return worst, fails


def blend_rows(weights, first, n):
    """Rows per dataset of samples first .. first+n−1 by the blend rule: sample i goes to the d
    maximising w_d·(i+1) − n_d, the first on ties (each product rounded, as Python computes it)."""
    total = sum(weights)
    w, given, counts = [x / total for x in weights], [0] * len(weights), [0] * len(weights)
    for i in range(first + n):
        d = max(range(len(w)), key=lambda k: (w[k] * (i + 1) - given[k], -k))
        given[d] += 1
        if i >= first:
            counts[d] += 1
    return counts


def check_resized_blend(tmp, cfg, blend, save, failures):
    """The blend's step-4 checkpoint (global batch 8) resumed under --global-batch 4: a warning names
    it, and steps 5..8 read samples 32..47, the rows per dataset the rule gives there."""
    metrics = os.path.join(tmp, "blend_resized.jsonl")
    common = [v if (k, v) != (COMMON.index("--global-batch") + 1, "8") else "4" for k, v in enumerate(COMMON)]
    rc, out, _ = h.run(0, ["train", "--config", cfg, "--data", blend, "--seq-len", "32", *common, "--resume",
                           os.path.join(save, "step-4"), "--metrics", metrics])
    got, err = (h.read_metrics(metrics), None) if rc == 0 else (None, h.why(rc, out, 600))
    if "warning: resuming with --global-batch '4'" not in out:
        failures.append("blend resumed under global batch 4: no warning naming it:\n%s" % out[-500:])
    want = [blend_rows([0.6, 0.4], 32 + 4 * k, 4) for k in range(4)]
    counts = [m.get("data_samples") for m in got] if got else err
    if counts != want:
        failures.append("blend resumed under global batch 4: rows per dataset %s, the rule gives %s" % (counts, want))
    print("  %-4s blend resumed under another global batch: rows per dataset %s (samples 32..47)" % (
        "ok" if counts == want else "FAIL", counts), flush=True)


def different_copies(tmp, cfg, data, other):
    """Each rank opens --data itself: two ranks whose working directories hold different datasets under
    the relative prefix 'corpus' (node-local copies that differ) stop at start with one error naming it."""
    ranks = []
    for r, src in enumerate((data, other)):
        d = os.path.join(tmp, "copy%d" % r)
        os.makedirs(d)
        for ext in (".bin", ".idx", ".tokenizer.json"):
            os.link(src + ext, os.path.join(d, "corpus" + ext))
        ranks += ([":"] if r else []) + ["-np", "1", "--wdir", d, h.BIN, "train", "--config", cfg, "--data", "corpus",
                                        "--steps", "1", "--seq-len", "16", "--micro-batch", "2"]
    p = subprocess.run([h.MPIRUN, "--oversubscribe", "--bind-to", "none", *ranks], capture_output=True, text=True,
                       timeout=120, env=h.env(), stdin=subprocess.DEVNULL)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if "error:" in l]
    ok = p.returncode == 1 and len(lines) == 1 and "rank 1's copy of 'corpus' holds" in lines[0] and \
        "every rank must read the same data" in lines[0]
    print("%-4s error: ranks reading different copies of --data: exit %s: %s" % ("ok" if ok else "FAIL", p.returncode,
                                                                              lines[:1] or (p.stdout + p.stderr)[-300:]))
    return [] if ok else ["ranks reading different copies of --data: exit %s, %s" % (p.returncode, lines)]


def different_eod(tmp, cfg, data):
    """--attention-mask document with a copy of --data that has no tokenizer file on rank 1 (its .bin and
    .idx alone, as a Megatron-style copy) and a config whose eos_token_id differs from the tokenizer's
    end-of-document token: rank 0 would end documents at the tokenizer's, rank 1 at the config's, and
    train masks differently on each (nothing compared them). One error naming both, exit 1."""
    with open(cfg) as f:
        c = json.load(f)
    c["eos_token_id"] = 5
    cfg5 = h.write_json(os.path.join(tmp, "eos5.json"), c)
    ranks = []
    for r, exts in enumerate(((".bin", ".idx", ".tokenizer.json"), (".bin", ".idx"))):
        d = os.path.join(tmp, "eodcopy%d" % r)
        os.makedirs(d)
        for ext in exts:
            os.link(data + ext, os.path.join(d, "corpus" + ext))
        ranks += ([":"] if r else []) + ["-np", "1", "--wdir", d, h.BIN, "train", "--config", cfg5, "--data", "corpus",
                                        "--steps", "1", "--seq-len", "16", "--micro-batch", "2", "--attention-mask",
                                        "document"]
    p = subprocess.run([h.MPIRUN, "--oversubscribe", "--bind-to", "none", *ranks], capture_output=True, text=True,
                       timeout=120, env=h.env(), stdin=subprocess.DEVNULL)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if "error:" in l]
    want = "--attention-mask document: rank 1 ends documents at token 5, rank 0 at 256"
    ok = p.returncode == 1 and len(lines) == 1 and want in lines[0]
    print("%-4s error: ranks ending documents at different tokens: exit %s: %s" % (
        "ok" if ok else "FAIL", p.returncode, lines[:1] or (p.stdout + p.stderr)[-300:]))
    return [] if ok else ["ranks ending documents at different tokens: exit %s, %s" % (p.returncode, lines)]


def main():
    failures = []
    tmp = h.tmpdir("origami_data_layouts_")
    data = h.prepare_data(tmp, "docs", n_docs=1500, seed=5, words=(2, 10))
    other = h.prepare_data(tmp, "docs_b", n_docs=800, seed=6, words=(2, 10))
    val = h.prepare_data(tmp, "val", n_docs=300, seed=9, words=(2, 10))
    eval_args = ["--eval-data", val]

    print("1. document masking and validation: layouts against one rank")
    rows = []
    for model in MODELS:
        moe = model.startswith("mixtral")
        cfgs, refs = {}, {}
        for variant in sorted({v for _, _, _, only, v in LAYOUTS if not only or model in only}):
            layers, seq = VARIANTS[variant]
            base = h.load_config(model)
            if layers:
                base["n_layer" if "n_layer" in base else "num_hidden_layers"] = layers
            base["n_positions" if "n_positions" in base else "max_position_embeddings"] = max(seq, 64)
            cfgs[variant] = h.write_json(os.path.join(tmp, "%s %s.json" % (model, variant)), base)
            refs[variant], err = train(tmp, "%s %s one rank" % (model, variant), 0, cfgs[variant], data,
                                       DOCS + eval_args, seq)
            if err:
                failures.append("%s %s one-rank run: %s" % (model, variant, err))
        if None in refs.values():
            continue
        if [m["step"] for m in refs["base"] if "val_loss" in m] != [4, 8]:
            failures.append("%s: val_loss not at steps 4 and 8" % model)
        for name, ranks, flags, only, variant in LAYOUTS:
            if only and model not in only:
                continue
            got, err = train(tmp, "%s %s" % (model, name), ranks, cfgs[variant], data, DOCS + eval_args + flags,
                             VARIANTS[variant][1])
            if err:
                failures.append("%s %s: %s" % (model, name, err))
                continue
            worst, fails = compare(refs[variant], got, moe)
            # the layout ran as asked (a degree dropped would give the one-rank losses too)
            for flag in ("--tp", "--cp", "--pp", "--ep"):
                word = "%s%s" % (flag[2:].upper(), flags[flags.index(flag) + 1]) if flag in flags else None
                if word and got and word not in got[0].get("layout", ""):
                    fails.append("layout string %r does not name %s" % (got[0].get("layout"), word))
            failures += ["%s %s: %s" % (model, name, f) for f in fails[:3]]
            rows.append((model, name, "%.1e" % worst, "ok" if not fails else "FAIL"))
            print("  %-4s %-11s %-28s worst %.1e" % ("ok" if not fails else "FAIL", model, name, worst), flush=True)

    print("2. blends under DP2 and across a resume")
    cfg = os.path.join(h.CONFIGS, "llama_tiny.json")
    blend = "0.6 %s 0.4 %s" % (data, other)  # (as --data)
    one, err1 = train(tmp, "blend one rank", 0, cfg, blend, eval_args)
    dp2, err2 = train(tmp, "blend DP2", 2, cfg, blend, eval_args + ["--zero", "1"])
    save = os.path.join(tmp, "blend_ck")
    _, err3 = train(tmp, "blend saved", 0, cfg, blend, eval_args + ["--save", save, "--save-every", "4"])
    resumed, err4 = train(tmp, "blend resumed DP2", 2, cfg, blend, eval_args + ["--resume", os.path.join(save, "step-4")])
    for err in (err1, err2, err3, err4):
        if err:
            failures.append("blend: " + err)
    if not (err1 or err2 or err3 or err4):
        counts = [m.get("data_samples") for m in one]
        first = sum(c[0] for c in counts)  # of the run's 64 rows: within one of 0.6 x 64
        if abs(first - 0.6 * 64) > 1 or sum(c[1] for c in counts) != 64 - first:
            failures.append("blend: rows per dataset %s over 64, expected about 0.6 / 0.4 of them" % counts)
        for tag, got, ref in (("DP2", dp2, one), ("resumed under DP2", resumed, one[4:])):
            worst, fails = compare(ref, got, False)
            failures += ["blend %s: %s" % (tag, f) for f in fails[:3]]
            print("  %-4s blend %-20s worst %.1e, rows per dataset %s" % (
                "ok" if not fails else "FAIL", tag, worst, [m.get("data_samples") for m in got][:4]), flush=True)

        check_resized_blend(tmp, cfg, blend, save, failures)

    # Resuming with other data or another mask is allowed, with a warning naming both.
    rc, out, _ = h.run(0, ["train", "--config", cfg, "--data", data, "--resume", os.path.join(save, "step-4"),
                           "--steps", "5", "--micro-batch", "2", "--global-batch", "8", "--seq-len", "32",
                           "--attention-mask", "document", "--threads", "1"])
    for flag in ("--data", "--attention-mask"):
        if rc != 0 or ("warning: resuming with %s" % flag) not in out:
            failures.append("resume with another %s: exit %s, no warning naming it:\n%s" % (flag, rc, out[-500:]))
    print("  %-4s resume with another --data and --attention-mask warns" % ("ok" if rc == 0 else "FAIL"))

    print("3. mistakes")
    failures += h.check_error_cases(data, [
        ("eval-every without eval-data", cfg, 2, ["--eval-every", "2"], "--eval-every needs --eval-data"),
        ("eval-iters without eval-data", cfg, 2, ["--eval-iters", "2"], "--eval-iters needs --eval-data"),
        ("unknown attention mask", cfg, 2, ["--attention-mask", "sliding"], "--attention-mask 'sliding'"),
        ("odd blend", cfg, 2, ["--data", "0.5 %s 0.5" % data], "3 fields"),
        ("eval windows", cfg, 2, ["--eval-data", val, "--eval-iters", "100000000000"], "lower --eval-iters"),
        ("eval windows of a blend", cfg, 2, ["--eval-data", "0.9 %s 0.1 %s" % (val, data), "--eval-iters", "250"],
         "which has only"),
    ])
    renamed = os.path.join(tmp, "other_tokenizer")  # the same tokens with another tokenizer file
    for ext in (".bin", ".idx"):
        os.link(other + ext, renamed + ext)
    h.write_json(renamed + ".tokenizer.json", {"type": "byte", "note": "another tokenizer"})
    failures += h.check_error_cases(data, [
        ("blend of two tokenizers", cfg, 2, ["--data", "0.5 %s 0.5 %s" % (data, renamed)], "different tokenizers"),
    ])
    failures += different_copies(tmp, cfg, data, other)
    failures += different_eod(tmp, cfg, data)
    print("\n" + h.fmt_table(["model", "layout", "worst relative deviation", ""], rows))
    h.report(failures, "document masking, validation and blends: every layout gives the one-rank run")


if __name__ == "__main__":
    main()
