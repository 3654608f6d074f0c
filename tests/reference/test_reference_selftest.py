"""Self-checks of the oracle's non-model parts (needs no origami):
  - AdamW (wd on ndim>=2 only) vs torch.optim.AdamW with two parameter groups
  - global-norm clipping vs torch.nn.utils.clip_grad_norm_
  - LR schedule values at hand-computed points
  - Megatron .bin/.idx reader round trip (uint16 and int32) and the window sampler
  - gradient accumulation: mean of 2 micro-batch gradients of loss == gradient of the mean
  - tolerance headroom: the reference trained 10 steps in float32 vs float64 agrees to
    well under the 1e-4 that origami (float32) is held to, also for the MoE routing runs of
    test_moe_routing.py (there with the same expert_dropped / router_bias in both precisions).
  - bf16 mode: round to nearest even; its GEMM and gradients vs their definition; with the
    rounding made the identity it equals the unrounded reference bit for bit; its float32 run
    stays within half of test_bf16_training.py's tolerances of its float64 run.
"""
import math
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402

torch.set_num_threads(2)


def check_adamw(report):
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 3), "b": (3,), "emb": (7, 2)}
    p0 = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
             for _ in range(4)]
    lrs = [1e-3, 3e-3, 2e-3, 5e-4]
    ours = {k: v.clone() for k, v in p0.items()}
    opt = ref.AdamW(ours, weight_decay=0.1)
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    topt = torch.optim.AdamW([
        {"params": [theirs["w"], theirs["emb"]], "weight_decay": 0.1},
        {"params": [theirs["b"]], "weight_decay": 0.0}], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    for gr, lr in zip(grads, lrs):
        opt.step(ours, gr, lr)
        for grp in topt.param_groups:
            grp["lr"] = lr
        for k in theirs:
            theirs[k].grad = gr[k].clone()
        topt.step()
    err = max(ref.rel_err(ours[k], theirs[k].detach()) for k in shapes)
    report.check("AdamW vs torch.optim.AdamW (4 steps, wd on ndim>=2)", err, 1e-12)


def check_clip(report):
    g = torch.Generator().manual_seed(1)
    for scale, label in ((10.0, "clipping"), (0.01, "no clipping")):
        grads = {k: scale * torch.randn(4, 3, generator=g, dtype=torch.float64) for k in "abc"}
        ps = [torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)) for _ in "abc"]
        for p, k in zip(ps, "abc"):
            p.grad = grads[k].clone()
        tn = torch.nn.utils.clip_grad_norm_(ps, 1.0)
        n = ref.clip_grads(grads, 1.0)
        report.check(f"clip ({label}): norm", ref.rel_err(n, tn), 1e-12)
        err = max(ref.rel_err(grads[k], p.grad) for p, k in zip(ps, "abc"))
        report.check(f"clip ({label}): grads", err, 1e-12)


def check_lr(report):
    lr, mn, W, S = 1e-2, 1e-3, 2, 10
    expect = {0: lr * 1 / 2, 1: lr, 2: lr,
              6: mn + 0.5 * (lr - mn) * (1 + math.cos(math.pi * 4 / 8)),
              9: mn + 0.5 * (lr - mn) * (1 + math.cos(math.pi * 7 / 8))}
    err = max(abs(ref.lr_at(s, lr, mn, W, S, "cosine") - v) / v for s, v in expect.items())
    report.check("cosine LR schedule", err, 1e-15)
    err = max(abs(ref.lr_at(s, lr, mn, W, S, "constant") - (lr if s >= W else lr * (s + 1) / W))
              for s in range(S))
    report.check("constant LR schedule", err, 1e-15)


def check_data(report, tmp):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 257, n) for n in (5, 17, 1, 30)]
    flat = np.concatenate(seqs)
    for code in (8, 4):
        prefix = os.path.join(tmp, f"d{code}")
        ref.write_indexed_dataset(prefix, seqs, dtype_code=code)
        back, docs = ref.read_indexed_dataset(prefix)
        ok = all(np.array_equal(a, b) for a, b in zip(back, seqs)) and len(back) == len(seqs)
        report.check(f"indexed dataset round trip (dtype code {code})", 0.0 if ok else 1.0, 0.0)
    T = 8
    s = ref.WindowSampler(os.path.join(tmp, "d8"), T)
    nw = (len(flat) - 1) // T
    ok = s.num_windows == nw
    inp, tgt = s.batch(3, 2)   # windows 6, 7 -> mod nw
    for r in range(2):
        i = (3 * 2 + r) % nw
        ok &= np.array_equal(inp[r].numpy(), flat[i * T:i * T + T])
        ok &= np.array_equal(tgt[r].numpy(), flat[i * T + 1:i * T + T + 1])
    report.check(f"window sampler ({nw} windows, wrap-around)", 0.0 if ok else 1.0, 0.0)


def check_accumulation(report):
    cfg = ref.load_config(ref.config_path("mixtral"))
    P = ref.init_params(cfg, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    tok = torch.randint(0, 257, (4, 9), generator=g)
    a = ref.loss_and_grads(cfg, P, tok[:2, :-1], tok[:2, 1:])
    b = ref.loss_and_grads(cfg, P, tok[2:, :-1], tok[2:, 1:])
    # finite-difference check of one router weight against the autograd gradient of `loss`
    k = "model.layers.0.block_sparse_moe.gate.weight"
    h = 1e-6
    Pp = dict(P); Pp[k] = P[k].clone(); Pp[k][1, 3] += h
    Pm = dict(P); Pm[k] = P[k].clone(); Pm[k][1, 3] -= h
    fd = (ref.losses(cfg, Pp, tok[:2, :-1], tok[:2, 1:])["loss"]
          - ref.losses(cfg, Pm, tok[:2, :-1], tok[:2, 1:])["loss"]) / (2 * h)
    err = abs(float(a["grads"][k][1, 3]) - float(fd)) / float(a["grads"][k].abs().max())
    report.check("mixtral d loss / d router weight: autograd vs finite difference", err, 1e-6)
    report.check("mixtral micro-batches differ (accumulation is not trivial)",
                 0.0 if ref.rel_err(a["grads"][k], b["grads"][k]) > 1e-3 else 1.0, 0.0)


def check_fp32_headroom(report, tmp):
    """The reference in float32 vs float64 over the training test's setting: the
    differences are what an exact float32 engine may legitimately show."""
    text = ref.sample_text(os.path.join(tmp, "t.txt"), 4000)
    # the same tokens as `origami data prepare` gives the engine tests
    sampler = ref.WindowSampler(ref.prepare_byte_dataset(text, os.path.join(tmp, "t")), 16)
    import test_training as tt
    for name in ref.MODELS:
        cfg = ref.load_config(ref.config_path(name))
        clipped = unclipped = 0
        for run, args in tt.RUNS.items():
            p32 = ref.init_params(cfg, seed=tt.SEEDS[name])
            p64 = {k: v.double() for k, v in p32.items()}
            m32 = ref.train(cfg, p32, sampler, **args)
            m64 = ref.train(cfg, p64, sampler, **args)
            for f in ("loss", "grad_norm"):
                e = max(ref.rel_err(a[f], b[f]) for a, b in zip(m32, m64))
                report.check(f"{name}/{run}: fp32 vs fp64 reference, 10-step {f}", e, 1e-5)
            gap = min(m["min_topk_gap"] for m in m64)
            if gap != float("inf"):
                report.check(f"{name}/{run}: routing decisive, min top-k gap {gap:.1e} > 1e-5",
                             0.0 if gap > 1e-5 else 1.0, 0.0)
            clipped += sum(m["grad_norm"] > args["grad_clip"] for m in m64)
            unclipped += sum(m["grad_norm"] <= args["grad_clip"] for m in m64)
        report.check(f"{name}: training runs clip in {clipped} steps, not in {unclipped}",
                     0.0 if clipped and unclipped else 1.0, 0.0)
    import test_moe_routing as tm
    for name in tm.MODELS:
        cfg = ref.load_config(ref.config_path(name))
        for case, routing in tm.TRAIN_CASES:
            p32 = ref.init_params(cfg, seed=tm.train_seed(name, case))
            p64 = {k: v.double() for k, v in p32.items()}
            m32 = ref.train(cfg, p32, sampler, **tt.RUNS["cosine"], routing=routing)
            m64 = ref.train(cfg, p64, sampler, **tt.RUNS["cosine"], routing=routing)
            e = max(ref.rel_err(a[f], b[f]) for a, b in zip(m32, m64)
                    for f in ("loss", "aux_loss", "grad_norm"))
            same = all(a["expert_dropped"] == b["expert_dropped"] and a["router_bias"] == b["router_bias"]
                       for a, b in zip(m32, m64))
            gap = min(m["min_topk_gap"] for m in m64)
            report.check(f"{name}/routing {case}: fp32 vs fp64 reference, 10-step loss/aux/grad_norm "
                         f"(routing gap {gap:.1e}, same drops and biases: {same})",
                         e if same and gap > 1e-5 else 1.0, 1e-5)


def check_bf16_gemm(report):
    """bf16 mode's GEMM against its definition, on a GEMM with a bias and upstream gradient r:
    y = bf16(x) bf16(W)^T + b, dx = bf16(r) bf16(W), dW = bf16(r)^T bf16(x), db = sum r."""
    R = ref.bf16_round
    # (1 + 2^-8 + 2^-30 would round to 1: torch goes through float32, which drops the 2^-30)
    ties = R(torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20], dtype=torch.float64))
    want = torch.tensor([1.0, 1 + 2 ** -6, 1 + 2 ** -7], dtype=torch.float64)
    report.check("bf16 rounding: nearest, ties to even", 0.0 if torch.equal(ties, want) else 1.0, 0.0)
    g = torch.Generator().manual_seed(3)
    x, W, b, r = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 5, 7), (4, 7), (4,), (2, 5, 4)))
    x.requires_grad_(True), W.requires_grad_(True), b.requires_grad_(True)
    with ref.gemm_precision("bf16"):
        y = ref.gemm(x, W.t()) + b
    dx, dW, db = torch.autograd.grad(y, (x, W, b), r)
    x, W = x.detach(), W.detach()
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    err = max(ref.rel_err(y, R(x) @ R(W).t() + b), ref.rel_err(dx, R(r) @ R(W)),
              ref.rel_err(dW, flat(R(r)).t() @ flat(R(x))), ref.rel_err(db, r.sum((0, 1))))
    report.check("bf16 GEMM: y, dx, dW, unrounded bias gradient vs definition", err, 1e-14)
    report.check("bf16 GEMM rounds (differs from the exact product by > 1e-4)",
                 0.0 if ref.rel_err(y, x @ W.t() + b) > 1e-4 else 1.0, 0.0)


def check_bf16_off_is_exact(report):
    """bf16 mode with its rounding replaced by the identity gives the unrounded loss and every
    gradient bit for bit: the mode changes nothing but the rounding. The attention core's bf16 form
    is its own algorithm (an online-softmax reference, an explicit backward), so here it is the plain
    softmax attention, and check_bf16_attention_off compares the two."""
    g = torch.Generator().manual_seed(4)
    tok = torch.randint(0, 257, (2, 17), generator=g)
    rounding = ref.bf16_round
    for name in ref.MODELS:
        cfg = ref.load_config(ref.config_path(name))
        P = ref.init_params(cfg, seed=11, dtype=torch.float64)
        a = ref.loss_and_grads(cfg, P, tok[:, :-1], tok[:, 1:])
        ref.bf16_round = lambda t: t
        ref.Bf16Attention.apply = ref.softmax_attention
        try:
            with ref.gemm_precision("bf16"):
                b = ref.loss_and_grads(cfg, P, tok[:, :-1], tok[:, 1:])
        finally:
            ref.bf16_round = rounding
            del ref.Bf16Attention.apply
        same = torch.equal(a["loss"], b["loss"]) and all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
        report.check(f"{name}: bf16 mode without rounding = unrounded (loss, every gradient)",
                     0.0 if same else 1.0, 0.0)


def check_bf16_attention_off(report):
    """The attention core's bf16 form (Bf16Attention) with its rounding replaced by the identity is
    softmax attention: output and the gradients of q, k and v within float64 round-off, causal and
    with documents (GQA is the callers' repeat of k, v)."""
    g = torch.Generator().manual_seed(6)
    q, k, v, r = (torch.randn(2, 3, 17, 8, generator=g, dtype=torch.float64) * 2 for _ in range(4))
    doc = torch.tensor([[0] * 5 + [1] * 12, [0] * 9 + [1] * 3 + [2] * 5])
    rounding = ref.bf16_round
    for what, mask in (("causal", ref.attention_mask(17)), ("documents", ref.attention_mask(17, doc))):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        y = ref.softmax_attention(*x, mask)
        want = [y] + list(torch.autograd.grad(y, x, r))
        ref.bf16_round = lambda t: t
        try:
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            y = ref.Bf16Attention.apply(*x, mask)
            got = [y] + list(torch.autograd.grad(y, x, r))
        finally:
            ref.bf16_round = rounding
        report.check(f"bf16 attention without rounding = softmax attention ({what}: out, dq, dk, dv)",
                     max(ref.rel_err(a, b) for a, b in zip(got, want)), 1e-13)


def check_bf16_headroom(report, tmp):
    """test_bf16_training.py's runs with the reference in float32 vs float64, both in bf16 mode:
    what an exact float32 engine with origami's rounding points may show. Within half of that
    test's tolerances, per step and field."""
    text = ref.sample_text(os.path.join(tmp, "t.txt"), 4000)
    sampler = ref.WindowSampler(ref.prepare_byte_dataset(text, os.path.join(tmp, "t")), 16)
    import test_bf16_training as tb
    for name in ref.MODELS:
        cfg = ref.load_config(ref.config_path(name))
        p32 = ref.init_params(cfg, seed=tb.SEEDS[name])
        for run, args in tb.RUNS.items():
            with ref.gemm_precision("bf16"):
                m32 = ref.train(cfg, {k: v.clone() for k, v in p32.items()}, sampler, **args)
                m64 = ref.train(cfg, {k: v.double() for k, v in p32.items()}, sampler, **args)
            s, f, e, t = max(tb.errors(cfg, m32, m64), key=lambda r: r[2] / r[3])
            report.check(f"{name}/{run}: bf16 fp32 vs fp64 reference, worst step {s} {f} "
                         f"{e:.1e} of tolerance {t:.0e}", e / t, 0.5)


def main():
    report = ref.Report("reference self-test")
    with tempfile.TemporaryDirectory() as tmp:
        for fn in (check_adamw, check_clip, check_lr, lambda r: check_data(r, tmp),
                   check_accumulation, lambda r: check_fp32_headroom(r, tmp), check_bf16_gemm,
                   check_bf16_off_is_exact, check_bf16_attention_off, lambda r: check_bf16_headroom(r, tmp)):
            try:
                fn(report)
            except Exception as e:
                import traceback
                traceback.print_exc()
                report.fail(getattr(fn, "__name__", "check"), f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
