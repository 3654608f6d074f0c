"""origami dump --precision bf16 vs the reference's bf16 mode, tensor by tensor, at step 0.

For gpt2, llama, mixtral and qwen2_moe (configs/*_tiny.json, seeded weights): loss, lm_loss,
aux_loss, z_loss, logits and every parameter gradient, each as max|a - b| / max|ref| against the
reference in float64 with origami's bf16 rounding points (ref.gemm_precision("bf16")).
test_bf16_training.py's grad_norm barely sees a rounding point that only the backward misses;
the GEMM weights' gradients, dW = bf16(x)^T bf16(dy), see it directly.

bf16 rounding is chaotic. An element whose float64 value lies within float32 round-off of a
bf16 rounding boundary rounds one bf16 ulp (2^-8 relative) apart in a float32 engine; the
difference spreads through the following GEMMs, pushes further elements across boundaries, and
a layer or two later every gradient carries ulp-level noise as large as the effect of a
missing dy rounding. One micro-batch cannot tell the two apart. So each model is evaluated on
WINDOWS = 16 micro-batches (B=1, T=8; windows r * (num_windows // 16), r = 0..15; same weights),
and a tensor's error is its smallest over the windows where its reference is not exactly zero
(a routed expert no token chose has a zero gradient). A cascade must strike the same tensor in
every window to fail it; a wrong rounding point shows in all of them.

Measured over seeds 1..40 with these windows (the reference in float32, an exact float32 engine
with these rounding points, and origami, each against the float64 reference):
  one window:       some tensor > 1e-5 in 28-44% of windows (cascades), up to 2.3e-2;
  best of windows:  float32 reference <= 2.6e-7, origami <= 3.5e-7, every tensor of every model;
  the same statistic for the reference with the backward's dy left unrounded: >= 4.8e-4 on every
  dense GEMM weight (attention, dense MLP, shared expert, LM head), >= 3.2e-4 on every routed
  expert's; for the reference without rounding (fp32 mode): >= 2.2e-3 on all of them.
Tolerances: TOL = 1e-5 on a tensor's best window (30x the worst noise measured above; a
window has a cascade with probability <= 0.44, so all 16 windows about 2e-6 and all 8 of a
rarely chosen expert's about 1e-3); every single window within WINDOW_TOL = 1e-1 (4x the worst
cascade: a gross error in one window); where the reference's gradient is exactly zero, the
dump's must be too.
Teeth: the reference itself in float32 passes the TOL checks, while the reference with dy left
unrounded, and the unrounded reference, must each fail them on every GEMM weight (dense and
routed experts) by at least FLAG_MARGIN = 10x (measured >= 32x and >= 220x), and the reference
with the attention core's products unrounded on every attention weight (measured >= 170x).

Seeds (gpt2 and llama: test_forward_backward's): every MoE routing decision of every window at
least 1e-4 from a tie (ref.routing_gap; asserted >= 1e-5), every routed expert chosen in at
least 8 of the 16 windows (asserted).
"""
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402

torch.set_num_threads(2)
B, T, WINDOWS = 1, 8, 16
MIN_USED = 8          # windows in which every gradient must be non-zero
SEEDS = {"gpt2": 5, "llama": 5, "mixtral": 11, "qwen2_moe": 23}
TOL = 1e-5
WINDOW_TOL = 1e-1
FLAG_MARGIN = 10.0
MIN_ROUTING_GAP = 1e-5
SCALARS = ("loss", "lm_loss", "aux_loss", "z_loss")
# the weights that go through ref.gemm (the LM head is the embedding when tied)
GEMM_WEIGHT = re.compile(r"(c_attn|c_proj|c_fc|_proj|\.w[123]|lm_head)\.weight$")
# the attention's GEMM weights (gpt2's attn.c_attn and attn.c_proj; q, k, v and o projections)
ATTENTION_WEIGHT = re.compile(r"(attn\.c_attn|attn\.c_proj|self_attn\.[qkvo]_proj)\.weight$")


class dy_unrounded:
    """The reference's bf16 mode with the backward's output gradient left unrounded:
    dx = dy bf16(W), dW = bf16(x)^T dy (operands still rounded in the forward)."""

    def __enter__(self):
        self.saved = ref.Bf16Matmul.__dict__["backward"]   # the staticmethod itself

        def backward(ctx, dy):
            xb, wb = ctx.saved_tensors
            dx = dy @ wb.t() if ctx.needs_input_grad[0] else None
            dw = xb.reshape(-1, xb.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1]) \
                if ctx.needs_input_grad[1] else None
            return dx, dw
        ref.Bf16Matmul.backward = staticmethod(backward)

    def __exit__(self, *exc):
        ref.Bf16Matmul.backward = self.saved


class attention_unrounded:
    """The reference's bf16 mode with the attention core in the working dtype (its products
    unrounded: origami's bf16 before the core had its own rounding points)."""

    def __enter__(self):
        ref.Bf16Attention.apply = ref.softmax_attention   # a plain function: no bound class

    def __exit__(self, *exc):
        del ref.Bf16Attention.apply                       # torch's Function.apply again


def reference(cfg, params, inp, tgt, variant):
    """variant: bf16 (the reference), bf16_fp32 (same, in float32), dy_unrounded,
    attention_unrounded, unrounded."""
    if variant == "bf16_fp32":
        params = {k: v.float() for k, v in params.items()}
    for name, patch in (("dy_unrounded", dy_unrounded), ("attention_unrounded", attention_unrounded)):
        if variant == name:
            with patch(), ref.gemm_precision("bf16"):
                return ref.loss_and_grads(cfg, params, inp, tgt)
    with ref.gemm_precision("fp32" if variant == "unrounded" else "bf16"):
        return ref.loss_and_grads(cfg, params, inp, tgt)


def tensors(out):
    """{name: tensor} of a reference result or a dump: the scalars, logits, grad.<param>."""
    if "grads" not in out:
        return {k: v for k, v in out.items() if k in SCALARS or k == "logits" or k.startswith("grad.")}
    t = {k: out[k] for k in SCALARS}
    t["logits"] = out["logits"]
    t.update((f"grad.{k}", g) for k, g in out["grads"].items())
    return t


def gemm_weights(cfg, names):
    head = [] if not ref.tied(cfg) else ["grad." + ("wte.weight" if ref.model_type(cfg) == "gpt2"
                                                     else "model.embed_tokens.weight")]
    return [n for n in names if GEMM_WEIGHT.search(n)] + head


def check_model(name, report, tmp, data):
    t0 = time.time()
    cfg_path, cfg, init, params = ref.seeded_model(name, tmp, SEEDS[name])
    sampler = ref.WindowSampler(data, T)
    steps = [r * (sampler.num_windows // WINDOWS) for r in range(WINDOWS)]
    sources = ("origami", "bf16_fp32", "dy_unrounded", "attention_unrounded", "unrounded")
    errs = {s: [] for s in sources}   # per window {tensor: rel_err}
    zero = []                         # per window: tensors whose reference is exactly zero
    gaps = []
    for step in steps:
        inp, tgt = sampler.batch(step, B)
        want = reference(cfg, params, inp, tgt, "bf16")
        gaps.append(ref.routing_gap(cfg, want["router_logits"]))
        want = tensors(want)
        out = os.path.join(tmp, f"{name}_bf16_{step}.safetensors")
        got = {"origami": tensors(ref.origami_dump(cfg_path, init, data, B, T, out, step=step,
                                                   extra=["--precision", "bf16"]))}
        for v in sources[1:]:
            got[v] = tensors(reference(cfg, params, inp, tgt, v))
        if set(got["origami"]) != set(want):
            report.fail(f"{name} window {step}: dump tensors",
                        f"missing {sorted(set(want) - set(got['origami']))[:6]}, "
                        f"unexpected {sorted(set(got['origami']) - set(want))[:6]}")
        bad = [k for k, v in got["origami"].items() if v.dtype != torch.float32]
        if bad:
            report.fail(f"{name} window {step}: dtypes", f"not float32: {bad[:6]}")
        bad = [k for k, v in got["origami"].items() if k in want and
               tuple(v.shape) != tuple(want[k].shape) and not (k in SCALARS and v.numel() == 1)]
        if bad:
            report.fail(f"{name} window {step}: shapes", f"differ from the reference's: {bad[:6]}")
        zero.append({k for k, v in want.items() if float(v.abs().max()) == 0.0})
        for s in sources:
            errs[s].append({k: (ref.rel_err(got[s][k], w) if k in got[s] else float("inf"))
                            for k, w in want.items()})
    names = list(errs["bf16_fp32"][0])

    def best(s):
        """{tensor: (smallest error over the windows where its reference is non-zero, window)}"""
        b = {}
        for k in names:
            rows = [(e[k], steps[i]) for i, e in enumerate(errs[s]) if k not in zero[i]]
            if rows:
                b[k] = min(rows)
        return b

    if ref.moe_layers(cfg):
        g = min(gaps)
        report.check(f"{name}: routing gap >= {MIN_ROUTING_GAP:.0e} in every window (min {g:.1e})",
                     0.0 if g >= MIN_ROUTING_GAP else 1.0, 0.0)
    used = {k: sum(k not in z for z in zero) for k in names if k.startswith("grad.")}
    k = min(used, key=used.get)
    report.check(f"{name}: every gradient non-zero in >= {MIN_USED} of {WINDOWS} windows "
                 f"(fewest: {k}, {used[k]})", 0.0 if used[k] >= MIN_USED else 1.0, 0.0)

    # origami and the float32 reference: every tensor within TOL in its best window
    for s, label in (("origami", "origami"), ("bf16_fp32", "float32 reference")):
        b = best(s)
        for k, (e, w) in b.items():
            if e > TOL and s == "origami":
                report.check(f"{name}: {k}, best window {w} (windows: "
                             + " ".join(f"{x[k]:.1e}" for x in errs[s]) + ")", e, TOL)
        for group, keys in (("loss parts", SCALARS), ("logits", ("logits",)),
                            ("gradients", [k for k in names if k.startswith("grad.")])):
            k = max((k for k in keys if k in b), key=lambda k: b[k][0])
            report.check(f"{name}: {label}, {group}, best window, worst {k}", b[k][0], TOL)
        worst = max(((e, k, steps[i]) for i, x in enumerate(errs[s]) for k, e in x.items()
                     if k not in zero[i]))
        report.check(f"{name}: {label}, every window (worst {worst[1]} in window {worst[2]})",
                     worst[0], WINDOW_TOL)
    nonzero = [(k, steps[i]) for i, z in enumerate(zero) for k in z if errs["origami"][i][k] != 0.0]
    report.check(f"{name}: origami's tensors are exactly zero where the reference's are "
                 f"({sum(len(z) for z in zero)} tensor-windows"
                 + (f"; not {nonzero[:3]})" if nonzero else ")"), 0.0 if not nonzero else 1.0, 0.0)

    # teeth: the reference with dy unrounded, and without rounding, fail on every GEMM weight; with
    # the attention core unrounded, on every attention weight
    weights = gemm_weights(cfg, names)
    margins = {}
    for s, label in (("dy_unrounded", "the reference with dy left unrounded"),
                     ("attention_unrounded", "the reference with the attention core unrounded"),
                     ("unrounded", "the unrounded reference")):
        b = best(s)
        groups = (("attention", [k for k in weights if ATTENTION_WEIGHT.search(k)]),) \
            if s == "attention_unrounded" else \
            (("dense", [k for k in weights if "experts." not in k]),
             ("routed experts", [k for k in weights if "experts." in k]))
        for group, keys in groups:
            keys = [k for k in keys if k in b]
            if not keys:
                continue
            k = min(keys, key=lambda k: b[k][0])
            m = b[k][0] / TOL
            margins[(s, group)] = m
            report.check(f"{name}: {label} fails every {group} GEMM weight "
                         f"({len(keys)}) by >= {FLAG_MARGIN:.0f}x (weakest {k}: {m:.0f}x)",
                         0.0 if m >= FLAG_MARGIN else 1.0, 0.0)
    bo, bf = best("origami"), best("bf16_fp32")
    ko = max(bo, key=lambda k: bo[k][0])
    print(f"  {name}: seed {SEEDS[name]}, windows {steps}, min routing gap {min(gaps):.1e}; "
          f"origami worst (best window) {ko} {bo[ko][0]:.1e}, float32 reference worst "
          f"{max(v[0] for v in bf.values()):.1e}; teeth (x TOL) "
          + ", ".join(f"{s}/{g} {m:.0f}" for (s, g), m in margins.items())
          + f"; {time.time() - t0:.1f} s")


def main():
    return ref.run_model_checks(f"origami dump --precision bf16 vs the bf16 reference, per tensor "
                                f"(B={B}, T={T}, best of {WINDOWS} windows)", check_model)


if __name__ == "__main__":
    sys.exit(main())
