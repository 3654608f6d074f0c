"""origami's MoE routing options vs the float64 reference, for mixtral and qwen2_moe.

`origami dump` (B=2, T=16, step 0) with each of
  capacity 1.0 probs, capacity 1.0 position, capacity 1.25 probs + pad, capacity 0.5
  position + pad, aux seq, aux none, aux global (one micro-batch: equals micro),
  sigmoid score + aux micro, sigmoid + capacity 1.0
must match the reference's logits, loss parts and every gradient to 1e-4 relative
(max|a-b| / max|ref|); every capacity case must drop assignments in the reference.
`origami train` (10 steps, micro-batch 2, global batch 4, the cosine setting of
test_training.py) with aux global, aux seq, bias update rate 1e-3 and capacity 1.0 probs:
per-step loss parts, grad_norm and lr to 1e-4, expert_dropped and expert_tokens exactly, and
router_bias (sums of +-R) to 1e-6 absolute. Metrics rows [L] / [L][E] may hold every layer
(dense layers' rows 0) or only the MoE layers.
Init seeds are chosen so that every routing decision (top-k of p + bias, and which
candidates a full expert keeps under the probs policy) is >= 1e-4 from a tie; the test
prints the minimum gap per case.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402
import test_forward_backward as fb  # noqa: E402
import test_training as tt  # noqa: E402

torch.set_num_threads(2)
TOL = 3e-5  # (the worst measured 3.6e-6)
BIAS_TOL = 1e-6
B, T = 2, 16
MODELS = ("mixtral", "qwen2_moe")

DUMP_CASES = [
    ("capacity 1.0 probs", {"capacity_factor": 1.0, "drop_policy": "probs"}),
    ("capacity 1.0 position", {"capacity_factor": 1.0, "drop_policy": "position"}),
    ("capacity 1.25 probs + pad", {"capacity_factor": 1.25, "drop_policy": "probs", "pad_to_capacity": True}),
    ("capacity 0.5 position + pad", {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True}),
    ("aux seq", {"aux": "seq"}),
    ("aux none", {"aux": "none"}),
    ("aux global", {"aux": "global"}),
    ("sigmoid + aux micro", {"score": "sigmoid", "aux": "micro"}),
    ("sigmoid + capacity 1.0", {"score": "sigmoid", "capacity_factor": 1.0}),
]
TRAIN_CASES = [
    ("aux global", {"aux": "global"}),
    ("aux seq", {"aux": "seq"}),
    ("bias rate 1e-3", {"bias_update_rate": 1e-3}),
    ("capacity 1.0 probs", {"capacity_factor": 1.0, "drop_policy": "probs"}),
]
# init seeds, per model for the dumps and per training case, picked from 1..50 so that every
# routing decision of the reference is far from a tie (dumps >= 1e-3; trainings >= 1e-4 —
# the first seeds tried came within 6e-7, where fp32 and fp64 may route differently)
SEEDS = {"mixtral": {"dump": 27, "aux global": 16, "aux seq": 23, "bias rate 1e-3": 35,
                     "capacity 1.0 probs": 16},
         "qwen2_moe": {"dump": 35, "aux global": 36, "aux seq": 42, "bias rate 1e-3": 10,
                       "capacity 1.0 probs": 45}}


def train_seed(name, case):
    return SEEDS[name][case]


FIELDS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr")


def check_dumps(name, report, tmp, data):
    cfg_path = ref.config_path(name)
    cfg = ref.load_config(cfg_path)
    init = os.path.join(tmp, f"{name}_routing_dump.safetensors")
    ref.save_params(ref.init_params(cfg, seed=SEEDS[name]["dump"]), init)
    params = ref.load_params(cfg, init, torch.float64)
    sampler = ref.WindowSampler(data, T)
    for i, (case, routing) in enumerate(DUMP_CASES):
        tag = f"{name} dump [{case}]"
        try:
            out = os.path.join(tmp, f"{name}_routing_dump{i}.safetensors")
            dump = ref.origami_dump(cfg_path, init, data, B, T, out, step=0, routing=routing)
        except Exception as e:
            report.fail(tag, f"{type(e).__name__}: {e}")
            continue
        want = fb.compare_dump(tag, cfg, params, sampler, 0, dump, report, routing=routing)
        dropped = sum(want["expert_dropped"])
        print(f"  {tag}: ref aux {float(want['aux_loss']):.6g}, dropped {dropped}, "
              f"routing gap {want['routing_gap']:.2e}")
        if routing.get("capacity_factor") and dropped == 0:
            report.fail(f"{tag}: setup", "the reference drops nothing: the case tests nothing")


def _rows(got, want_LE, moe):
    """origami's per-layer rows ([L] or [MoE layers]) as the reference's full-L layout."""
    if not isinstance(got, list):
        return None
    if len(got) == len(want_LE):
        return got
    if len(got) == len(moe):
        full = [0 if not isinstance(want_LE[0], list) else [0] * len(want_LE[0]) for _ in want_LE]
        for l, row in zip(moe, got):
            full[l] = row
        return full
    return None


def check_train(name, variant, report, tmp, data):
    case, routing = variant
    tag = f"{name} train [{case}]"
    a = tt.RUNS["cosine"]
    cfg_path = ref.config_path(name)
    cfg = ref.load_config(cfg_path)
    moe = ref.moe_layers(cfg)
    slug = case.replace(" ", "_").replace(".", "")
    init = os.path.join(tmp, f"{name}_{slug}_init.safetensors")
    ref.save_params(ref.init_params(cfg, seed=train_seed(name, case)), init)
    got = ref.origami_train(cfg_path, init, data, os.path.join(tmp, f"{name}_{slug}_m.jsonl"),
                            a["steps"], a["micro_batch"], a["global_batch"], tt.SEQ_LEN, a["lr"],
                            a["min_lr"], a["warmup"], a["schedule"], a["weight_decay"],
                            a["grad_clip"], routing=routing)
    params = ref.load_params(cfg, init, torch.float64)
    want = ref.train(cfg, params, ref.WindowSampler(data, tt.SEQ_LEN), **a, routing=routing)
    if len(got) != len(want):
        report.fail(f"{tag}: metrics lines", f"{len(got)} lines, expected {len(want)}")
    has_bias = bool(routing.get("bias_update_rate"))
    worst = {f: 0.0 for f in FIELDS}
    bias_err, drop_bad, tok_bad = 0.0, [], []
    for s, (g, w) in enumerate(zip(got, want)):
        need = FIELDS + ("expert_tokens", "expert_dropped") + (("router_bias",) if has_bias else ())
        missing = [f for f in need if f not in g]
        if missing:
            report.fail(f"{tag}: step {s} metrics", f"missing fields {missing}")
        for f in FIELDS:
            if f in g:
                e = ref.rel_err(float(g[f]), w[f])
                worst[f] = e if not e <= worst[f] else worst[f]  # (a NaN becomes the worst)
                if not e <= TOL:
                    report.check(f"{tag}: step {s} {f} (origami {float(g[f]):.8g}, ref {w[f]:.8g})", e, TOL)
        if "expert_dropped" in g:
            d = _rows(g["expert_dropped"], w["expert_dropped"], moe)
            if d != w["expert_dropped"]:
                drop_bad.append(f"step {s}: origami {g['expert_dropped']}, ref {w['expert_dropped']}")
        if "expert_tokens" in g:
            t = _rows(g["expert_tokens"], w["expert_tokens"], moe)
            if t != w["expert_tokens"]:
                tok_bad.append(f"step {s}: origami {g['expert_tokens']}, ref {w['expert_tokens']}")
        if has_bias and "router_bias" in g:
            b = _rows(g["router_bias"], w["router_bias"], moe)
            if b is None:
                report.fail(f"{tag}: step {s} router_bias", f"layout {g['router_bias']}")
            else:
                e = float((torch.tensor(b, dtype=torch.float64)
                           - torch.tensor(w["router_bias"], dtype=torch.float64)).abs().max())
                bias_err = max(bias_err, e)
                if e > BIAS_TOL:
                    report.check(f"{tag}: step {s} router_bias (origami {b}, ref {w['router_bias']})",
                                 e, BIAS_TOL)
    for f in FIELDS:
        report.check(f"{tag}: {f}, worst of {len(got)} steps", worst[f], TOL)
    if drop_bad:
        report.fail(f"{tag}: expert_dropped", "; ".join(drop_bad[:3]))
    else:
        report.check(f"{tag}: expert_dropped equal in every step "
                     f"(ref total {sum(map(sum, (w['expert_dropped'] for w in want)))})", 0.0, 0.0)
    if tok_bad:
        report.fail(f"{tag}: expert_tokens (summed over the step's micro-batches)", "; ".join(tok_bad[:3]))
    else:
        report.check(f"{tag}: expert_tokens equal in every step", 0.0, 0.0)
    if has_bias:
        nonzero = sum(1 for w in want for row in w["router_bias"] for v in row if v != 0.0)
        report.check(f"{tag}: router_bias max abs error ({nonzero} nonzero ref entries)", bias_err, BIAS_TOL)
    gap = min(w["min_topk_gap"] for w in want)
    print(f"  {tag}: ref loss {want[0]['loss']:.5f} -> {want[-1]['loss']:.5f}, aux "
          f"{want[0]['aux_loss']:.5f} -> {want[-1]['aux_loss']:.5f}, dropped "
          f"{sum(sum(w['expert_dropped']) for w in want)}, routing gap {gap:.2e}")
    if routing.get("capacity_factor") and not any(sum(w["expert_dropped"]) for w in want):
        report.fail(f"{tag}: setup", "the reference drops nothing: the case tests nothing")


def check(name, variant, report, tmp, data):
    if variant == "dump":
        check_dumps(name, report, tmp, data)
    else:
        check_train(name, variant, report, tmp, data)


def main():
    return ref.run_model_checks("origami MoE routing options vs float64 reference", check,
                                variants=["dump"] + TRAIN_CASES, models=MODELS)


if __name__ == "__main__":
    sys.exit(main())
