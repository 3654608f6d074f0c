#!/usr/bin/python3
"""A stand-in for the `origami` binary, built on the reference in float32.

Only for testing the reference tests themselves (the harness, the CLI contract, and that
an exact float32 engine passes the tolerances):
    ORIGAMI_BIN=tests/reference/tools/fake_origami.py /usr/bin/python3 tests/reference/test_training.py
Implements `data prepare --tokenizer byte`, `dump`, `train` and `ckpt export` as the spec
describes, with the --moe-* routing flags and train's and dump's --precision (bf16: the reference's bf16 mode). `train --save DIR` commits DIR/step-N and DIR/latest as
origami does, but the step directory holds the weights as config.json + model.safetensors (no
per-rank shards, no optimizer state); `ckpt export` (without --optimizer) copies them out.
Byte tokenizer, --split auto (ref.byte_documents): a fortune file's records, else the whole
file, are the documents, each followed by end-of-document 256.
"""
import argparse
import json
import os
import shutil
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
        def router_losses(cfg, routes, *a):
            aux, z = orig(cfg, routes, *a)
            return (aux if aux is None else aux * cfg["num_experts_per_tok"]), z
        ref.router_losses = router_losses
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
        ref.renormalise_topk = lambda cfg, score="softmax": False
    elif kind == "cap_floor":         # capacity floor(F*N*K/E) instead of ceil
        ref.expert_capacity = lambda opts, N, K, E: \
            int(opts["capacity_factor"] * N * K // E) if opts["capacity_factor"] > 0 else None
    elif kind == "drop_renorm":       # weights renormalised again over the kept experts
        orig_route = ref.route
        def route(cfg, opts, logits, bias=None):
            r = orig_route(cfg, opts, logits, bias)
            wk = r["w"] * r["kept"]
            s = wk.sum(-1, keepdim=True)
            r["w"] = torch.where(s > 0, r["w"] / torch.where(s > 0, s, torch.ones_like(s))
                                 * r["w"].sum(-1, keepdim=True), r["w"])
            return r
        ref.route = route
    elif kind == "drop_by_weight":    # probs policy ranks candidates by routing weight, not p
        orig_route = ref.route
        def route(cfg, opts, logits, bias=None):
            r = orig_route(cfg, dict(opts, capacity_factor=0.0), logits, bias)
            cap = ref.expert_capacity(opts, *logits.shape[:1], cfg["num_experts_per_tok"], logits.shape[1])
            if cap is not None:
                for e in range(logits.shape[1]):
                    n, k = torch.nonzero(r["top_i"] == e, as_tuple=True)
                    if len(n) > cap:
                        order = (torch.sort(r["w"].detach()[n, k], descending=True, stable=True).indices
                                 if opts["drop_policy"] == "probs" else torch.arange(len(n)))
                        r["kept"][n[order[cap:]], k[order[cap:]]] = False
                r["dropped"] = int((~r["kept"]).sum())
            r["cap"] = cap
            return r
        ref.route = route
    elif kind == "drop_keep_high_n":  # position policy keeps the last tokens
        orig_route = ref.route
        def route(cfg, opts, logits, bias=None):
            if opts["drop_policy"] != "position":
                return orig_route(cfg, opts, logits, bias)
            r = orig_route(cfg, opts, logits.flip(0), bias)
            for k in ("logits", "p", "top_i", "w", "kept"):
                r[k] = r[k].flip(0)
            return r
        ref.route = route
    elif kind == "aux_seq_as_micro":  # seq aux computed over the whole micro-batch
        orig = ref.router_losses
        def router_losses(cfg, routes, routing=None, *a):
            o = ref.routing_options(cfg, routing)
            if o["aux"] == "seq":
                o = dict(o, aux="micro")
            return orig(cfg, routes, o, *a)
        ref.router_losses = router_losses
    elif kind == "global_no_accum":   # global aux from the current micro-batch's counts only
        orig = ref.router_losses
        ref.router_losses = lambda cfg, routes, routing=None, prev=None, m=0: orig(cfg, routes, routing, None, 0)
    elif kind == "bias_sign":         # balancing bias moves the wrong way
        orig_update = ref.router_bias_update
        ref.router_bias_update = lambda load, rate: -orig_update(load, rate)
    elif kind == "sigmoid_aux_raw":   # sigmoid scores enter the aux loss unnormalised
        ref._aux_probs = lambda p, score: p
    elif kind == "bias_in_weights":   # selection bias added to the routing weights too
        orig_route = ref.route
        def route(cfg, opts, logits, bias=None):
            r = orig_route(cfg, opts, logits, bias)
            if bias is not None:
                b = torch.as_tensor(bias, dtype=r["w"].dtype)
                r["w"] = r["w"] + b[r["top_i"]]
            return r
        ref.route = route
    elif kind == "bf16_ignored":      # --precision bf16 accepted, GEMMs left in fp32
        ref.gemm_precision.__init__ = lambda self, p: setattr(self, "precision", "fp32")
    elif kind == "bf16_w_unrounded":  # bf16 GEMMs round activations and gradients, not weights
        def forward(ctx, x, w):
            xb = ref.bf16_round(x)
            ctx.save_for_backward(xb, w)
            return xb @ w
        ref.Bf16Matmul.forward = staticmethod(forward)
    elif kind == "bf16_dy_unrounded":  # bf16 GEMMs' backward uses the unrounded output gradient
        def backward(ctx, dy):
            xb, wb = ctx.saved_tensors
            dw = xb.reshape(-1, xb.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
            return dy @ wb.t(), dw
        ref.Bf16Matmul.backward = staticmethod(backward)
    elif kind:
        sys.exit(f"fake origami: unknown FAKE_ORIGAMI_BUG {kind!r}")


inject_bug(os.environ.get("FAKE_ORIGAMI_BUG", ""))


def data_prepare(argv):
    p = argparse.ArgumentParser(prog="origami data prepare")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--split", default="auto")
    a = p.parse_args(argv)
    if a.tokenizer != "byte" or a.split not in ("auto", "line") or os.path.isdir(a.input):
        sys.exit("fake origami: only one file, --tokenizer byte, --split auto or line")
    if a.split == "auto":
        return ref.prepare_byte_dataset(a.input, a.output)
    with open(a.input, "rb") as f:  # each line without its line break, blank ones skipped
        lines = [l.rstrip(b"\r") for l in f.read().split(b"\n") if l.strip()]
    ref.write_indexed_dataset(a.output, [ref.np.append(ref.np.frombuffer(l, dtype=ref.np.uint8).astype(ref.np.int64), 256)
                                         for l in lines], dtype_code=8)


def add_moe_flags(p, train=False):
    p.add_argument("--moe-capacity-factor", type=float, default=0.0)
    p.add_argument("--moe-drop-policy", choices=("probs", "position"), default="probs")
    p.add_argument("--moe-pad-to-capacity", action="store_true")
    p.add_argument("--moe-aux-loss", choices=("none", "micro", "seq", "global"), default=None)
    p.add_argument("--moe-aux-loss-coef", type=float, default=None)
    p.add_argument("--moe-router-score", choices=("softmax", "sigmoid"), default="softmax")
    if train:
        p.add_argument("--moe-router-bias-update-rate", type=float, default=0.0)


def moe_routing(a):
    default = "seq" if getattr(a, "batching", "windows") == "documents" else "micro"
    r = {"capacity_factor": a.moe_capacity_factor, "drop_policy": a.moe_drop_policy,
         "pad_to_capacity": a.moe_pad_to_capacity, "aux": a.moe_aux_loss or default,
         "aux_coef": a.moe_aux_loss_coef, "score": a.moe_router_score}
    if hasattr(a, "moe_router_bias_update_rate"):
        r["bias_update_rate"] = a.moe_router_bias_update_rate
    return r


def dump(argv):
    p = argparse.ArgumentParser(prog="origami dump")
    add_moe_flags(p)
    for k in ("--config", "--init-from", "--data", "--out"):
        p.add_argument(k, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args(argv)
    cfg = ref.load_config(a.config)
    params = ref.load_params(cfg, a.init_from, torch.float32)
    inp, tgt = ref.WindowSampler(a.data, a.seq_len).batch(a.step, a.micro_batch)
    with ref.gemm_precision(a.precision):
        out = ref.loss_and_grads(cfg, params, inp, tgt, routing=moe_routing(a))
    tensors = {"logits": out["logits"].float().contiguous()}
    for k in ("loss", "lm_loss", "aux_loss", "z_loss"):
        tensors[k] = out[k].float().reshape(1)
    for k, g in out["grads"].items():
        tensors["grad." + k] = g.float().contiguous()
    from safetensors.torch import save_file
    save_file(tensors, a.out)


def train(argv):
    p = argparse.ArgumentParser(prog="origami train")
    add_moe_flags(p, train=True)
    for k in ("--config", "--init-from", "--data", "--metrics"):
        p.add_argument(k, required=True)
    for k in ("--steps", "--micro-batch", "--global-batch", "--seq-len", "--warmup", "--threads", "--tokens-per-step",
              "--eval-iters"):
        p.add_argument(k, type=int, default=None)
    p.add_argument("--batching", choices=("windows", "documents"), default="windows")
    p.add_argument("--eval-data", default=None)
    for k in ("--lr", "--min-lr", "--weight-decay", "--grad-clip"):
        p.add_argument(k, type=float, default=0.0)
    p.add_argument("--lr-schedule", default="constant")
    p.add_argument("--data-order", default="sequential")
    p.add_argument("--save", default=None)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args(argv)
    if a.data_order != "sequential":
        sys.exit("fake origami: only --data-order sequential")
    cfg = ref.load_config(a.config)
    params = ref.load_params(cfg, a.init_from, torch.float32)
    with ref.gemm_precision(a.precision):
        if a.batching == "documents":  # rows and micro-batches do not change the reference's sums
            val = ref.DocumentSampler(a.eval_data, a.seq_len, a.tokens_per_step) if a.eval_data else None
            metrics = ref.train_documents(cfg, params, ref.DocumentSampler(a.data, a.seq_len, a.tokens_per_step),
                                          a.steps, a.lr, a.min_lr, a.warmup or 0, a.lr_schedule, a.weight_decay,
                                          a.grad_clip, routing=moe_routing(a), eval_sampler=val,
                                          eval_iters=a.eval_iters or 1)
            for m in metrics:
                m["documents"] = {"sequences": m.pop("sequences")}
        else:
            metrics = ref.train(cfg, params, ref.WindowSampler(a.data, a.seq_len), a.steps, a.micro_batch,
                                a.global_batch, a.lr, a.min_lr, a.warmup or 0, a.lr_schedule,
                                a.weight_decay, a.grad_clip, routing=moe_routing(a))
    with open(a.metrics, "w") as f:
        for m in metrics:
            m = {k: v for k, v in m.items() if k != "min_topk_gap"}
            if not ref.moe_layers(cfg):
                m = {k: v for k, v in m.items() if not k.startswith(("expert_", "router_"))}
            elif not a.moe_router_bias_update_rate:
                m.pop("router_bias", None)
            f.write(json.dumps(m) + "\n")
    if a.save:
        step = f"step-{a.steps}"
        ref.write_hf_dir(cfg, params, os.path.join(a.save, step))
        with open(os.path.join(a.save, "latest"), "w") as f:
            f.write(step + "\n")


def ckpt(argv):
    if argv[:1] != ["export"]:
        sys.exit(f"fake origami: unsupported ckpt subcommand {argv[:1]}")
    p = argparse.ArgumentParser(prog="origami ckpt export")
    p.add_argument("checkpoint")
    p.add_argument("--hf", required=True)
    p.add_argument("--optimizer", action="store_true")
    a = p.parse_args(argv[1:])
    if a.optimizer:
        sys.exit("fake origami: checkpoints hold no optimizer state")
    src = a.checkpoint
    latest = os.path.join(src, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            src = os.path.join(src, f.read().strip())
    os.makedirs(a.hf, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(src, name), os.path.join(a.hf, name))


def main():
    argv = sys.argv[1:]
    if argv[:2] == ["data", "prepare"]:
        return data_prepare(argv[2:])
    if argv[:1] == ["dump"]:
        return dump(argv[1:])
    if argv[:1] == ["train"]:
        return train(argv[1:])
    if argv[:1] == ["ckpt"]:
        return ckpt(argv[1:])
    sys.exit(f"fake origami: unsupported command {argv[:2]}")


if __name__ == "__main__":
    main()
