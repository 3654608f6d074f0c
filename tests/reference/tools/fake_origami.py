#!/usr/bin/python3
"""A stand-in for the `origami` binary, built on the reference in float32.

Only for testing the reference tests themselves (the harness, the CLI contract, and that
an exact float32 engine passes the tolerances):
    ORIGAMI_BIN=tests/reference/tools/fake_origami.py /usr/bin/python3 tests/reference/test_training.py
Implements `data prepare --tokenizer byte`, `dump` and `train` as the spec describes.
Byte tokenizer: each input file is one document, its bytes followed by end-of-document 256.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import origami_ref as ref  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def inject_bug(kind):
    """FAKE_ORIGAMI_BUG=<kind> plants a plausible engine bug, to show the tests catch it."""
    import math
    if kind == "aux_no_k":            # f_e = count_e / N instead of / (N*K)
        orig = ref.router_losses
        ref.router_losses = lambda cfg, rl: (lambda a, z: (a * cfg["num_experts_per_tok"], z))(*orig(cfg, rl)) \
            if rl else orig(cfg, rl)
    elif kind == "gelu_erf":          # exact erf GELU instead of the tanh approximation
        ref.gelu_tanh = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    elif kind == "wd_all":            # weight decay on 1-D parameters too
        orig_step = ref.AdamW.step
        def step(self, params, grads, lr):
            for k, p in params.items():
                if p.ndim < 2:
                    p.mul_(1 - lr * self.wd)
            orig_step(self, params, grads, lr)
        ref.AdamW.step = step
    elif kind == "no_clip":
        orig_clip = ref.clip_grads
        ref.clip_grads = lambda g, m: orig_clip(g, 0.0)
    elif kind == "lr_shift":          # schedule evaluated at s+1
        orig_lr = ref.lr_at
        ref.lr_at = lambda s, *a: orig_lr(s + 1, *a)
    elif kind == "rope_interleaved":  # rotate pairs (2i, 2i+1) instead of (i, i+D/2)
        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([-x2, x1], -1).flatten(-2)
        ref.rotate_half = rot
    elif kind == "no_renorm":         # top-k weights not renormalised
        orig_moe = ref._moe
        def moe(cfg, P, p, h):
            y, logits = orig_moe(cfg, P, p, h)
            top = torch.topk(torch.softmax(logits, -1), cfg["num_experts_per_tok"], dim=-1).values
            return y * top.sum(-1).reshape(h.shape[0], h.shape[1], 1), logits
        ref._moe = moe
    elif kind:
        sys.exit(f"fake origami: unknown FAKE_ORIGAMI_BUG {kind!r}")


inject_bug(os.environ.get("FAKE_ORIGAMI_BUG", ""))


def data_prepare(argv):
    p = argparse.ArgumentParser(prog="origami data prepare")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--tokenizer", default="byte")
    a = p.parse_args(argv)
    if a.tokenizer != "byte":
        sys.exit(f"fake origami: tokenizer {a.tokenizer!r} not supported")
    with open(a.input, "rb") as f:
        toks = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
    ref.write_indexed_dataset(a.output, [np.append(toks, 256)], dtype_code=8)


def dump(argv):
    p = argparse.ArgumentParser(prog="origami dump")
    for k in ("--config", "--init-from", "--data", "--out"):
        p.add_argument(k, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--step", type=int, default=0)
    a = p.parse_args(argv)
    cfg = ref.load_config(a.config)
    params = ref.load_params(cfg, a.init_from, torch.float32)
    inp, tgt = ref.WindowSampler(a.data, a.seq_len).batch(a.step, a.micro_batch)
    out = ref.loss_and_grads(cfg, params, inp, tgt)
    tensors = {"logits": out["logits"].float().contiguous()}
    for k in ("loss", "lm_loss", "aux_loss", "z_loss"):
        tensors[k] = out[k].float().reshape(1)
    for k, g in out["grads"].items():
        tensors["grad." + k] = g.float().contiguous()
    from safetensors.torch import save_file
    save_file(tensors, a.out)


def train(argv):
    p = argparse.ArgumentParser(prog="origami train")
    for k in ("--config", "--init-from", "--data", "--metrics"):
        p.add_argument(k, required=True)
    for k in ("--steps", "--micro-batch", "--global-batch", "--seq-len", "--warmup", "--threads"):
        p.add_argument(k, type=int, default=None)
    for k in ("--lr", "--min-lr", "--weight-decay", "--grad-clip"):
        p.add_argument(k, type=float, default=0.0)
    p.add_argument("--lr-schedule", default="constant")
    p.add_argument("--data-order", default="sequential")
    p.add_argument("--save", default=None)
    a = p.parse_args(argv)
    if a.data_order != "sequential":
        sys.exit("fake origami: only --data-order sequential")
    cfg = ref.load_config(a.config)
    params = ref.load_params(cfg, a.init_from, torch.float32)
    metrics = ref.train(cfg, params, ref.WindowSampler(a.data, a.seq_len), a.steps, a.micro_batch,
                        a.global_batch, a.lr, a.min_lr, a.warmup or 0, a.lr_schedule,
                        a.weight_decay, a.grad_clip)
    with open(a.metrics, "w") as f:
        for m in metrics:
            m = {k: v for k, v in m.items() if k != "min_topk_gap"}
            f.write(json.dumps(m) + "\n")
    if a.save:
        ref.write_hf_dir(cfg, params, a.save)


def main():
    argv = sys.argv[1:]
    if argv[:2] == ["data", "prepare"]:
        return data_prepare(argv[2:])
    if argv[:1] == ["dump"]:
        return dump(argv[1:])
    if argv[:1] == ["train"]:
        return train(argv[1:])
    sys.exit(f"fake origami: unsupported command {argv[:2]}")


if __name__ == "__main__":
    main()
