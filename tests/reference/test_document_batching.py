"""Document batching (`train --batching documents`) against the float64 reference.

Data: byte-tokenized lines (`data prepare --split line`, end-of-document id 256) with long-tailed
lengths: most short, some longer than L = 32 tokens (cut into pieces of 32), some of exactly 33
tokens (a last piece of one token, which predicts nothing) and one-character lines.
The reference (origami_ref.DocumentSampler / train_documents) runs every sequence through the model
alone, positions from 0, and takes the mean cross-entropy over the step's predicted tokens; origami
packs the sequences into rows of 32 (micro-batch 2 rows) and masks them from each other.
  10 AdamW steps of at most N = 96 tokens for gpt2, llama, mixtral and qwen2_moe, and the validation
  loss after the last step over 2 steps of another file: per step loss, grad_norm (<= 1e-4), tokens and
  sequences (exact); val_loss (<= 1e-4). MoE runs origami's default under document batching, the
  per-sequence aux loss, with the configs' z-loss: aux_loss and z_loss (<= 1e-4) and every layer's
  expert counts (exact: padding is not routed). mixtral once more with aux-loss-free bias balancing
  (--moe-router-bias-update-rate 0.01, aux none): the counts exact, so the biases are too. llama once
  more on a blend (0.7 / 0.3 of two files, validation on another 0.5 / 0.5 blend): also each step's tokens
  per dataset (exact), and over the run each dataset's share within one document of its weight.
"""
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402

ref.torch.set_num_threads(2)
TOL = 1e-4
L, N, STEPS = 32, 96, 10
TRAIN = dict(lr=3e-3, min_lr=3e-4, warmup=2, schedule="cosine", weight_decay=0.1, grad_clip=1.0)
SEEDS = {"gpt2": 11, "llama": 11, "mixtral": 12, "qwen2_moe": 22}


def line_lengths(rng, count):
    """Characters per line: lognormal (median ~10), 8% longer than L, 8% of exactly L (33 tokens), 6% one."""
    out = []
    for _ in range(count):
        u = rng.random()
        out.append(1 if u < 0.06 else L if u < 0.14 else rng.randint(L + 2, 3 * L) if u < 0.22
                   else max(1, min(L - 1, int(rng.lognormvariate(2.3, 0.6)))))
    return out


def documents_data(tmp, name, seed, count):
    rng = random.Random(seed)
    text = os.path.join(tmp, f"{name}.txt")
    with open(text, "w") as f:
        for n in line_lengths(rng, count):
            f.write("".join(rng.choice("abcdefghijklmnopqrstuvwxyz,.") for _ in range(n)) + "\n")
    prefix = os.path.join(tmp, name)
    ref.run_origami(["data", "prepare", "--input", text, "--output", prefix, "--tokenizer", "byte", "--split", "line"])
    return prefix


def model(name, tmp):
    """The tiny config with seeded weights."""
    cfg = ref.load_config(ref.config_path(name))
    cfg_path = os.path.join(tmp, f"{name}_documents.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    init = os.path.join(tmp, f"{name}_documents.safetensors")
    ref.save_params(ref.init_params(cfg, seed=SEEDS[name]), init)
    return cfg_path, cfg, init, ref.load_params(cfg, init, ref.torch.float64)


def spec(data):
    """origami's --data for a prefix or a blend [(weight, prefix), ...]."""
    return data if isinstance(data, str) else " ".join(f"{w} {p}" for w, p in data)


def check(name, report, tmp, data, val, routing=None, tag=""):
    """routing: None for origami's defaults (MoE: aux seq), else ref.routing_cli_args's dict. data and
    val: a prefix or a blend."""
    cfg_path, cfg, init, params = model(name, tmp)
    moe = ref.num_experts(cfg) > 0
    name = name + tag
    metrics = os.path.join(tmp, name.replace(" ", "_").replace("/", "_") + "_documents.jsonl")
    a = TRAIN
    ref.run_origami(["train", "--config", cfg_path, "--init-from", init, "--data", spec(data), "--batching", "documents",
                     "--seq-len", L, "--tokens-per-step", N, "--micro-batch", 2, "--steps", STEPS,
                     "--lr", repr(a["lr"]), "--min-lr", repr(a["min_lr"]), "--warmup", a["warmup"],
                     "--lr-schedule", a["schedule"], "--weight-decay", repr(a["weight_decay"]),
                     "--grad-clip", repr(a["grad_clip"]), "--metrics", metrics, "--threads", 2,
                     "--eval-data", spec(val), "--eval-iters", 2] + ref.routing_cli_args(routing, train=True))
    with open(metrics) as f:
        got = [json.loads(line) for line in f if line.strip()]
    sampler = ref.DocumentSampler(data, L, N)
    want = ref.train_documents(cfg, params, sampler, STEPS, **a, routing=routing,
                               eval_sampler=ref.DocumentSampler(val, L, N), eval_iters=2)
    if len(got) != len(want):
        report.fail(f"{name}: metrics lines", f"{len(got)}, expected {len(want)}")
        return
    worst = {"loss": 0.0, "grad_norm": 0.0}
    if moe:
        worst.update({"aux_loss": 0.0, "z_loss": 0.0})
    worst_bias = 0.0
    for s, (g, w) in enumerate(zip(got, want)):
        for f in worst:
            worst[f] = max(worst[f], ref.rel_err(float(g.get(f, 0.0)), w[f]))
        seen = (g["tokens"], g["documents"]["sequences"], g.get("data_tokens"))
        expected = (w["tokens"], w["sequences"], None if isinstance(data, str) else sampler.dataset_tokens[s])
        if seen != expected:
            report.fail(f"{name}: step {s + 1} tokens, sequences, tokens per dataset", f"{seen}, expected {expected}")
        if moe and g["expert_tokens"] != w["expert_tokens"]:
            report.fail(f"{name}: step {s + 1} expert counts", f"{g['expert_tokens']}, expected {w['expert_tokens']}")
        if routing and routing.get("bias_update_rate"):
            off = max(abs(a - b) for ga, wa in zip(g["router_bias"], w["router_bias"]) for a, b in zip(ga, wa))
            worst_bias = max(worst_bias, off)
    if not isinstance(data, str):
        got_tokens = [sum(g["data_tokens"][d] for g in got) for d in range(len(data))]
        total, longest = sum(got_tokens), max(sum(len(p) for p in doc) for docs in sampler.docs for doc in docs)
        off = max(abs(t - w / sum(x for x, _ in data) * total) for t, (w, _) in zip(got_tokens, data))
        report.check(f"{name}: tokens per dataset {got_tokens} within the longest document ({longest}) of the "
                     f"weights' shares", 0.0 if off <= longest else off, 0.0)
    for f, e in worst.items():
        report.check(f"{name}: {f}, worst of {len(want)} steps", e, TOL)
    if routing and routing.get("bias_update_rate"):
        moved = max(abs(b) for row in want[-1]["router_bias"] for b in row)
        report.check(f"{name}: the biases moved ({moved:.2f}), each step's within 1e-6 absolute", worst_bias, 1e-6)
    report.check(f"{name}: val_loss after the last step", ref.rel_err(float(got[-1]["val_loss"]), want[-1]["val_loss"]),
                 TOL)
    print(f"  {name}: loss {want[0]['loss']:.4f} -> {want[-1]['loss']:.4f}, val {want[-1]['val_loss']:.4f}, "
          f"{sum(w['sequences'] for w in want)} sequences" +
          (f", aux {want[-1]['aux_loss']:.3e}, z {want[-1]['z_loss']:.3e}" if moe else ""))


def main():
    report = ref.Report("document batching vs the float64 reference")
    with tempfile.TemporaryDirectory() as tmp:
        data = documents_data(tmp, "docs", 1, 160)
        val = documents_data(tmp, "docs_val", 2, 40)
        lengths = [len(q) for s in range(STEPS) for q in ref.DocumentSampler(data, L, N).step(s)]
        report.check("the data has sequences of one token, of L and of lengths in between",
                     0.0 if 1 in lengths and L in lengths and any(1 < n < L for n in lengths) else 1.0, 0.0)
        other = documents_data(tmp, "docs_other", 3, 120)
        blend, val_blend = [(0.7, data), (0.3, other)], [(0.5, val), (0.5, other)]
        cases = [(name, None, "", data, val) for name in ref.MODELS]
        cases.append(("mixtral", {"aux": "none", "bias_update_rate": 0.01}, " bias balancing", data, val))
        cases.append(("llama", None, " blend 0.7/0.3", blend, val_blend))
        for name, routing, tag, train_data, val_data in cases:
            try:
                check(name, report, tmp, train_data, val_data, routing, tag)
            except Exception as e:
                report.fail(name + tag, f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
