"""Document masking, validation loss and dataset blends against the float64 reference.

Data: byte-tokenized text with one document per line (`data prepare --split line`), so a window of
32 tokens holds several documents (end-of-document id 256).
  dump:   `origami dump --attention-mask document` (B=2, T=32): logits, loss parts and every gradient
          equal the reference with a block-diagonal causal mask and restarted positions (1e-4), and
          every document wholly inside a window gets the logits of its own forward pass alone.
  train:  10 AdamW steps (micro-batch 2, global batch 4, T=32) for gpt2, llama, mixtral, qwen2_moe:
          "document": --attention-mask document with --eval-data (every 4 steps and after the 10th, 2 global
                      batches);
          "blend":    --data "0.7 A 0.3 B" (the greedy blending rule) with a blend as --eval-data at the end;
          per step loss, grad_norm, val_loss and (blend) the step's rows per dataset equal the reference.
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402
from test_forward_backward import compare_dump  # noqa: E402

torch.set_num_threads(2)
TOL = 1e-4
EOD = 256
B, T = 2, 32
TRAIN = dict(steps=10, micro_batch=2, global_batch=4, lr=3e-3, min_lr=3e-4, warmup=2, schedule="cosine",
             weight_decay=0.1, grad_clip=1.0)
SEEDS = {"gpt2": 11, "llama": 11, "mixtral": 12, "qwen2_moe": 22}


def line_data(tmp, name, offset, num_bytes=6000):
    text = ref.sample_text(os.path.join(tmp, f"{name}.txt"), num_bytes, offset)
    prefix = os.path.join(tmp, name)
    ref.run_origami(["data", "prepare", "--input", text, "--output", prefix, "--tokenizer", "byte",
                     "--split", "line"])
    return prefix


def check_dump(name, report, tmp, data):
    cfg_path, cfg, init, params = ref.seeded_model(name, tmp, seed=5)
    sampler = ref.WindowSampler(data, T)
    for step in (0, 3):
        dump = ref.origami_dump(cfg_path, init, data, B, T, os.path.join(tmp, f"{name}_doc{step}.safetensors"),
                                step=step, extra=["--attention-mask", "document"])
        want = compare_dump(f"{name} document mask, step {step}", cfg, params, sampler, step, dump, report,
                            eod=EOD)
        # Each document that starts and ends inside a row: its logits are those of its own forward pass.
        inp, _ = sampler.batch(step, B)
        docs, worst = 0, 0.0
        for b in range(B):
            row = inp[b].tolist()
            starts = [0] + [t + 1 for t in range(T - 1) if row[t] == EOD]
            for s0, s1 in zip(starts, starts[1:]):  # [s0, s1): a whole document, its end-of-document token last
                alone, _ = ref.forward(cfg, params, inp[b:b + 1, s0:s1])
                worst = max(worst, ref.rel_err(dump["logits"][b, s0:s1], alone[0]))
                docs += 1
        if docs == 0:
            report.fail(f"{name} step {step}: documents", "no whole document inside the rows: use shorter lines")
        else:
            report.check(f"{name} step {step}: {docs} whole documents' logits = their own forward pass", worst, TOL)
        report.check(f"{name} step {step}: masked logits differ from causal ones (the mask matters)",
                     0.0 if ref.rel_err(ref.forward(cfg, params, inp)[0], want["logits"]) > 1e-3 else 1.0, 0.0)


def check_train(name, variant, report, tmp, data, data_b, val):
    cfg_path, cfg, init, params = ref.seeded_model(name, tmp, seed=SEEDS[name], tag="_init")
    a = TRAIN
    if variant == "document":
        spec, sampler, eod, every = data, ref.WindowSampler(data, T), EOD, 4
        extra = ["--attention-mask", "document", "--eval-every", "4", "--eval-data", val]
        val_sampler = ref.WindowSampler(val, T)
    else:
        spec, sampler, eod, every = f"0.7 {data} 0.3 {data_b}", ref.BlendSampler([(0.7, data), (0.3, data_b)], T), None, 0
        extra = ["--eval-data", f"0.5 {val} 0.5 {data_b}"]
        val_sampler = ref.BlendSampler([(0.5, val), (0.5, data_b)], T)
    got = ref.origami_train(cfg_path, init, spec, os.path.join(tmp, f"{name}_{variant}.jsonl"), a["steps"],
                            a["micro_batch"], a["global_batch"], T, a["lr"], a["min_lr"], a["warmup"], a["schedule"],
                            a["weight_decay"], a["grad_clip"],
                            extra=extra + ["--eval-iters", "2"])
    want = ref.train(cfg, params, sampler, **a, eod=eod, eval_every=every, eval_sampler=val_sampler, eval_iters=2)
    tag = f"{name}/{variant}"
    if len(got) != len(want):
        report.fail(f"{tag}: metrics lines", f"{len(got)}, expected {len(want)}")
        return
    worst = {"loss": 0.0, "grad_norm": 0.0, "val_loss": 0.0}
    vals = 0
    for s, (g, w) in enumerate(zip(got, want)):
        for f in ("loss", "grad_norm"):
            worst[f] = max(worst[f], ref.rel_err(float(g[f]), w[f]))
        if ("val_loss" in g) != ("val_loss" in w):
            report.fail(f"{tag}: step {s + 1} val_loss", f"origami has it: {'val_loss' in g}, reference: {'val_loss' in w}")
        elif "val_loss" in w:
            worst["val_loss"] = max(worst["val_loss"], ref.rel_err(float(g["val_loss"]), w["val_loss"]))
            vals += 1
        if variant == "blend":
            rows = [0, 0]
            for r in range(a["global_batch"]):
                rows[sampler.dataset_of(s * a["global_batch"] + r)[0]] += 1
            if g.get("data_samples") != rows:
                report.fail(f"{tag}: step {s + 1} data_samples", f"{g.get('data_samples')}, expected {rows}")
    for f, e in worst.items():
        report.check(f"{tag}: {f}, worst of {vals if f == 'val_loss' else len(want)} steps", e, TOL)
    print(f"  {tag}: loss {want[0]['loss']:.4f} -> {want[-1]['loss']:.4f}, val {want[-1]['val_loss']:.4f}")


def main():
    report = ref.Report("document masking, validation and blends vs the float64 reference")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            data = line_data(tmp, "lines", 0)
            data_b = line_data(tmp, "lines_b", 8000)
            val = line_data(tmp, "lines_val", 16000)
        except Exception as e:
            report.fail("origami data prepare --split line", f"{type(e).__name__}: {e}")
            return report.finish()
        for name in ref.MODELS:
            for label, fn in (("dump", lambda: check_dump(name, report, tmp, data)),
                              ("document", lambda: check_train(name, "document", report, tmp, data, data_b, val)),
                              ("blend", lambda: check_train(name, "blend", report, tmp, data, data_b, val))):
                try:
                    fn()
                except Exception as e:
                    report.fail(f"{name}/{label}", f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
