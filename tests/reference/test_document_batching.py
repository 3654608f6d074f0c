"""Document batching (`train --batching documents`) against the float64 reference.

Data: byte-tokenized lines (`data prepare --split line`, end-of-document id 256) with long-tailed
lengths: most short, some longer than L = 32 tokens (cut into pieces of 32), some of exactly 33
tokens (a last piece of one token, which predicts nothing) and one-character lines.
The reference (origami_ref.DocumentSampler / train_documents) runs every sequence through the model
alone, positions from 0, and takes the mean cross-entropy over the step's predicted tokens; origami
packs the sequences into rows of 32 (micro-batch 2 rows) and masks them from each other.
  10 AdamW steps of at most N = 96 tokens for gpt2, llama, mixtral and qwen2_moe (MoE: aux none, no
  z-loss), and the validation loss after the last step over 2 steps of another file: per step loss,
  grad_norm (<= 1e-4), tokens and sequences (exact); val_loss (<= 1e-4).
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
    """The tiny config (MoE: router_z_loss_coef 0, since the z-loss would count the rows' padding)
    with seeded weights."""
    cfg = ref.load_config(ref.config_path(name))
    cfg["router_z_loss_coef"] = 0.0 if "router_z_loss_coef" in cfg else cfg.get("router_z_loss_coef")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    cfg_path = os.path.join(tmp, f"{name}_documents.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    init = os.path.join(tmp, f"{name}_documents.safetensors")
    ref.save_params(ref.init_params(cfg, seed=SEEDS[name]), init)
    return cfg_path, cfg, init, ref.load_params(cfg, init, ref.torch.float64)


def check(name, report, tmp, data, val):
    cfg_path, cfg, init, params = model(name, tmp)
    moe = ref.num_experts(cfg) > 0
    routing = {"aux": "none"} if moe else None
    metrics = os.path.join(tmp, f"{name}_documents.jsonl")
    a = TRAIN
    ref.run_origami(["train", "--config", cfg_path, "--init-from", init, "--data", data, "--batching", "documents",
                     "--seq-len", L, "--tokens-per-step", N, "--micro-batch", 2, "--steps", STEPS,
                     "--lr", repr(a["lr"]), "--min-lr", repr(a["min_lr"]), "--warmup", a["warmup"],
                     "--lr-schedule", a["schedule"], "--weight-decay", repr(a["weight_decay"]),
                     "--grad-clip", repr(a["grad_clip"]), "--metrics", metrics, "--threads", 2,
                     "--eval-data", val, "--eval-iters", 2] + ref.routing_cli_args(routing, train=True))
    with open(metrics) as f:
        got = [json.loads(line) for line in f if line.strip()]
    want = ref.train_documents(cfg, params, ref.DocumentSampler(data, L, N), STEPS, **a, routing=routing,
                               eval_sampler=ref.DocumentSampler(val, L, N), eval_iters=2)
    if len(got) != len(want):
        report.fail(f"{name}: metrics lines", f"{len(got)}, expected {len(want)}")
        return
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for s, (g, w) in enumerate(zip(got, want)):
        for f in worst:
            worst[f] = max(worst[f], ref.rel_err(float(g[f]), w[f]))
        seen = (g["tokens"], g["documents"]["sequences"])
        if seen != (w["tokens"], w["sequences"]):
            report.fail(f"{name}: step {s + 1} tokens, sequences", f"{seen}, expected {(w['tokens'], w['sequences'])}")
    for f, e in worst.items():
        report.check(f"{name}: {f}, worst of {len(want)} steps", e, TOL)
    report.check(f"{name}: val_loss after the last step", ref.rel_err(float(got[-1]["val_loss"]), want[-1]["val_loss"]),
                 TOL)
    print(f"  {name}: loss {want[0]['loss']:.4f} -> {want[-1]['loss']:.4f}, val {want[-1]['val_loss']:.4f}, "
          f"{sum(w['sequences'] for w in want)} sequences")


def main():
    report = ref.Report("document batching vs the float64 reference")
    with tempfile.TemporaryDirectory() as tmp:
        data = documents_data(tmp, "docs", 1, 160)
        val = documents_data(tmp, "docs_val", 2, 40)
        lengths = [len(q) for s in range(STEPS) for q in ref.DocumentSampler(data, L, N).step(s)]
        report.check("the data has sequences of one token, of L and of lengths in between",
                     0.0 if 1 in lengths and L in lengths and any(1 < n < L for n in lengths) else 1.0, 0.0)
        for name in ref.MODELS:
            try:
                check(name, report, tmp, data, val)
            except Exception as e:
                report.fail(name, f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
