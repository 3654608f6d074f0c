"""Validates the oracle itself against Hugging Face transformers (needs no origami).

For each tiny config: our seeded weights are saved as config.json + model.safetensors
with origami's HF names, loaded with transformers' from_pretrained (which also checks the
names), and compared in float64:
  - logits (all models), tolerance 1e-5
  - lm_loss and the gradient of lm_loss for every parameter (all models; for Mixtral the
    gradient of lm_loss alone, since HF's aux-loss formula differs from origami's)
  - Mixtral / Qwen2-MoE router logits per layer, and our aux/z losses recomputed from HF's
    router logits by an independent loop implementation of the spec formulas.
Then the routing options HF does not have (capacity with both drop policies, the aux
variants micro/seq/global/none, sigmoid scores, selection biases) are checked against a
second, naive per-token implementation written here (plain Python loops over scalar
tensors): one MoE block's output, aux and z losses, and the gradients of
sum(R*output) + aux + z with respect to the router weight, the block input and an expert
weight (float64, 1e-10), plus the tie rules on routing scores built to tie exactly.
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
TOL = 1e-5


def hf_model(directory, name):
    import transformers
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "mixtral": transformers.MixtralForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[name]
    model, info = cls.from_pretrained(directory, output_loading_info=True, attn_implementation="eager")
    missing = [k for k in info["missing_keys"] if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"HF load of {name}: missing {missing} unexpected "
                           f"{info['unexpected_keys']} mismatched {info['mismatched_keys']}")
    return model.double().eval()


def hf_param_name(name, cfg):
    if ref.model_type(cfg) == "gpt2":
        return "transformer." + name
    return name


def aux_z_by_loops(cfg, router_logits_list):
    """Spec formulas, written as plain loops over numpy arrays."""
    E, K = ref.num_experts(cfg), cfg["num_experts_per_tok"]
    aux_sum, z_sum = 0.0, 0.0
    for rl in router_logits_list:
        rl = rl.detach().double().numpy()
        N = rl.shape[0]
        count = [0] * E
        Psum = [0.0] * E
        z = 0.0
        for n in range(N):
            mx = rl[n].max()
            ex = np.exp(rl[n] - mx)
            p = ex / ex.sum()
            for e in sorted(range(E), key=lambda e: -p[e])[:K]:
                count[e] += 1
            for e in range(E):
                Psum[e] += p[e]
            z += (mx + math.log(ex.sum())) ** 2
        aux_sum += E * sum((count[e] / (N * K)) * (Psum[e] / N) for e in range(E))
        z_sum += z / N
    return cfg["router_aux_loss_coef"] * aux_sum, cfg["router_z_loss_coef"] * z_sum


def check_model(name, report, tmp):
    cfg = ref.load_config(ref.config_path(name))
    params32 = ref.init_params(cfg, seed=7)
    d = os.path.join(tmp, name)
    ref.write_hf_dir(cfg, params32, d)
    model = hf_model(d, name)
    params = ref.load_params(cfg, os.path.join(d, "model.safetensors"), torch.float64)

    g = torch.Generator().manual_seed(3)
    B, T = 2, 16
    tok = torch.randint(0, cfg["vocab_size"], (B, T + 1), generator=g)
    inp, tgt = tok[:, :-1], tok[:, 1:]

    # ours: lm_loss gradient only (comparable with HF for every model type)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    out = ref.losses(cfg, leaves, inp, tgt)
    ours_grad = dict(zip(leaves, torch.autograd.grad(out["lm_loss"], list(leaves.values()))))

    # HF
    moe = bool(ref.moe_layers(cfg))
    kwargs = {"output_router_logits": True} if moe else {}
    hf_out = model(input_ids=inp, **kwargs)
    hf_logits = hf_out.logits
    V = hf_logits.shape[-1]
    hf_lm = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, V), tgt.reshape(-1))
    hf_named = dict(model.named_parameters())
    hf_grads = torch.autograd.grad(hf_lm, list(hf_named.values()), allow_unused=True)
    hf_grad = dict(zip(hf_named, hf_grads))

    report.check(f"{name}: logits", ref.rel_err(out["logits"].detach(), hf_logits.detach()), TOL)
    report.check(f"{name}: lm_loss", ref.rel_err(out["lm_loss"].detach(), hf_lm.detach()), TOL)
    worst = (0.0, "")
    for k, go in ours_grad.items():
        gh = hf_grad.get(hf_param_name(k, cfg))
        if gh is None:
            report.fail(f"{name}: grad {k}", "no such HF parameter / no gradient")
            continue
        e = ref.rel_err(go, gh)
        if e > TOL:
            report.check(f"{name}: grad {k}", e, TOL)
        worst = max(worst, (e, k))
    report.check(f"{name}: all {len(ours_grad)} lm_loss grads (worst {worst[1]})", worst[0], TOL)

    if moe:
        hf_rl = hf_out.router_logits
        if len(hf_rl) != len(out["router_logits"]):
            report.fail(f"{name}: router layers", f"HF {len(hf_rl)}, reference {len(out['router_logits'])}")
        for l, (a, b) in enumerate(zip(out["router_logits"], hf_rl)):
            report.check(f"{name}: router logits layer {l}", ref.rel_err(a.detach(), b.detach()), TOL)
        aux_loop, z_loop = aux_z_by_loops(cfg, hf_rl)
        report.check(f"{name}: aux_loss vs loop formula", ref.rel_err(out["aux_loss"].detach(), aux_loop), TOL)
        report.check(f"{name}: z_loss vs loop formula", ref.rel_err(out["z_loss"].detach(), z_loop), TOL)
        gap = ref.min_topk_gap(cfg, out["router_logits"])
        report.check(f"{name}: top-k decisive (min gap {gap:.2e} > 1e-4)", 0.0 if gap > 1e-4 else 1.0, 0.0)
        # experts are exercised: every expert receives tokens in some layer
        used = torch.cat([torch.topk(r, cfg["num_experts_per_tok"], -1).indices.reshape(-1)
                          for r in out["router_logits"]]).unique().numel()
        E = ref.num_experts(cfg)
        report.check(f"{name}: experts used {used}/{E}", 0.0 if used == E else 1.0, 0.0)


# --------------------------------------------------------------------------------------
# routing options vs a naive per-token implementation
# --------------------------------------------------------------------------------------


def _cap_by_integers(F, N, K, E):
    """ceil(F*N*K/E) with F's exact binary value as a ratio of integers."""
    a, b = float(F).as_integer_ratio()
    return -(-(a * N * K) // (b * E))


def _expert_mlp_loop(W_gate, W_up, W_down, xn):
    """One token through a SwiGLU expert, one output element at a time."""
    I = W_gate.shape[0]
    hidden = []
    for i in range(I):
        g = (W_gate[i] * xn).sum()
        u = (W_up[i] * xn).sum()
        hidden.append(g / (1.0 + torch.exp(-g)) * u)
    hid = torch.stack(hidden)
    return torch.stack([(W_down[c] * hid).sum() for c in range(W_down.shape[0])])


def select_by_loops(sel_rows, p_rows, K, E, cap, policy):
    """Top-K of sel (ties: lower expert) per token, then per expert at most `cap` of its
    assignments: highest p (ties: lower token) or lowest token. Python floats only.
    Returns (chosen [N][K] experts, kept set of (n, k), counts [E])."""
    N = len(sel_rows)
    chosen = [[e for _, e in sorted((-sel_rows[n][e], e) for e in range(E))[:K]] for n in range(N)]
    counts = [sum(chosen[n].count(e) for n in range(N)) for e in range(E)]
    kept = set((n, k) for n in range(N) for k in range(K))
    if cap is not None:
        for e in range(E):
            cands = [(n, k) for n in range(N) for k in range(K) if chosen[n][k] == e]
            if policy == "probs":
                cands.sort(key=lambda nk: (-p_rows[nk[0]][e], nk[0]))
            for nk in cands[cap:]:
                kept.discard(nk)
    return chosen, kept, counts


def moe_by_loops(cfg, P, prefix, x, B, T, opts, bias, prev_counts, micro_index):
    """Naive MoE block: returns (out [N,C], aux, z, kept set, counts)."""
    mix = ref.model_type(cfg) == "mixtral"
    E, K = ref.num_experts(cfg), cfg["num_experts_per_tok"]
    N, C = x.shape
    Wg = P[prefix + "gate.weight"]
    logits, probs = [], []
    for n in range(N):
        lg = [(x[n] * Wg[e]).sum() for e in range(E)]
        if opts["score"] == "softmax":
            mx = max(float(v) for v in lg)
            ex = [torch.exp(v - mx) for v in lg]
            tot = sum(ex)
            pr = [v / tot for v in ex]
        else:
            pr = [1.0 / (1.0 + torch.exp(-v)) for v in lg]
        logits.append(lg)
        probs.append(pr)
    pf = [[float(v) for v in row] for row in probs]
    sel = [[pf[n][e] + float(bias[e]) for e in range(E)] for n in range(N)]
    cap = _cap_by_integers(opts["capacity_factor"], N, K, E) if opts["capacity_factor"] > 0 else None
    chosen, kept, counts = select_by_loops(sel, pf, K, E, cap, opts["drop_policy"])
    renorm = mix or opts["score"] == "sigmoid" or cfg.get("norm_topk_prob", False)
    rows = []
    for n in range(N):
        acc = torch.zeros(C, dtype=x.dtype)
        denom = sum(probs[n][e] for e in chosen[n]) if renorm else 1.0
        for k, e in enumerate(chosen[n]):
            if (n, k) not in kept:
                continue
            q = prefix + f"experts.{e}."
            if mix:
                y = _expert_mlp_loop(P[q + "w1.weight"], P[q + "w3.weight"], P[q + "w2.weight"], x[n])
            else:
                y = _expert_mlp_loop(P[q + "gate_proj.weight"], P[q + "up_proj.weight"],
                                     P[q + "down_proj.weight"], x[n])
            acc = acc + probs[n][e] / denom * y
        if not mix:
            q = prefix + "shared_expert."
            y = _expert_mlp_loop(P[q + "gate_proj.weight"], P[q + "up_proj.weight"],
                                 P[q + "down_proj.weight"], x[n])
            gate = (x[n] * P[prefix + "shared_expert_gate.weight"][0]).sum()
            acc = acc + y / (1.0 + torch.exp(-gate))
        rows.append(acc)
    out = torch.stack(rows)
    # aux: probabilities normalised per token for sigmoid scores
    pa = [[probs[n][e] / (1.0 if opts["score"] == "softmax" else sum(probs[n])) for e in range(E)]
          for n in range(N)]
    if opts["aux"] == "none":
        aux = 0.0
    elif opts["aux"] == "micro":
        aux = E * sum(counts[e] / (N * K) * (sum(pa[n][e] for n in range(N)) / N) for e in range(E))
    elif opts["aux"] == "seq":
        aux = 0.0
        for b in range(B):
            toks = range(b * T, (b + 1) * T)
            for e in range(E):
                c_be = sum(chosen[n].count(e) for n in toks)
                P_be = sum(pa[n][e] for n in toks) / T
                aux = aux + E * (c_be / (T * K)) * P_be / B
    else:  # global
        aux = 0.0
        for e in range(E):
            fbar = (float(prev_counts[e]) + counts[e]) / ((micro_index + 1) * N * K)
            aux = aux + E * fbar * (sum(pa[n][e] for n in range(N)) / N)
    z = 0.0
    for n in range(N):
        mx = max(float(v) for v in logits[n])
        z = z + (mx + torch.log(sum(torch.exp(v - mx) for v in logits[n]))) ** 2 / N
    return out, opts["aux_coef"] * aux, cfg["router_z_loss_coef"] * z, kept, counts


ROUTING_CASES = [
    ("dropless", {}),
    ("capacity 1.0 probs", {"capacity_factor": 1.0, "drop_policy": "probs"}),
    ("capacity 1.0 position", {"capacity_factor": 1.0, "drop_policy": "position"}),
    ("capacity 0.5 position + pad", {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True}),
    ("capacity 1.25 probs + pad", {"capacity_factor": 1.25, "pad_to_capacity": True}),
    ("aux seq", {"aux": "seq"}),
    ("aux none", {"aux": "none"}),
    ("aux global (micro-batch 2)", {"aux": "global"}),
    ("aux micro coef 0.05 + bias", {"aux": "micro", "aux_coef": 0.05}),
    ("sigmoid + aux micro", {"score": "sigmoid"}),
    ("sigmoid + capacity 1.0 + bias + aux global", {"score": "sigmoid", "capacity_factor": 1.0, "aux": "global"}),
]


def check_routing_loops(name, report):
    cfg = ref.load_config(ref.config_path(name))
    P = ref.init_params(cfg, seed=7, dtype=torch.float64)
    l = ref.moe_layers(cfg)[0]
    prefix = f"model.layers.{l}." + ref.moe_prefix(cfg)
    E, K = ref.num_experts(cfg), cfg["num_experts_per_tok"]
    g = torch.Generator().manual_seed(11)
    B, T, C = 2, 8, P[prefix + "gate.weight"].shape[1]
    # a direction shared by all tokens skews the load, so that capacity drops tokens
    x0 = torch.randn(B * T, C, generator=g, dtype=torch.float64) + \
        torch.randn(C, generator=g, dtype=torch.float64)
    R = torch.randn(B * T, C, generator=g, dtype=torch.float64)
    prev = torch.randint(0, 2 * B * T * K // E, (E,), generator=g)
    q = prefix + "experts.1." + ("w1.weight" if name == "mixtral" else "gate_proj.weight")
    names = [prefix + "gate.weight", q]
    kept_by_policy = {}
    for case, routing in ROUTING_CASES:
        opts = ref.routing_options(cfg, routing)
        with_bias = "bias" in case
        bias = (torch.randint(-3, 4, (E,), generator=g).double() * 0.01 if with_bias
                else torch.zeros(E, dtype=torch.float64))
        micro = 1 if opts["aux"] == "global" else 0
        results = []
        for impl in ("vectorised", "loops"):
            leaves = {k: v.clone().requires_grad_(True) for k, v in P.items()}
            x = x0.clone().requires_grad_(True)
            if impl == "vectorised":
                out, r = ref._moe(cfg, leaves, f"model.layers.{l}.", x.reshape(B, T, C), opts, bias)
                out = out.reshape(B * T, C)
                aux, z = ref.router_losses(cfg, [r], opts, [prev], micro)
                kept = set((n, k) for n, k in torch.nonzero(r["kept"]).tolist())
                counts = r["counts"].tolist()
                gap = ref.routing_gap(cfg, [r["logits"].detach()], opts, {l: bias})
            else:
                out, aux, z, kept, counts = moe_by_loops(cfg, leaves, prefix, x, B, T, opts, bias,
                                                         prev, micro)
            J = (out * R).sum() + aux + z
            grads = torch.autograd.grad(J, [leaves[k] for k in names] + [x])
            results.append((out.detach(), float(aux), float(z), kept, counts, grads))
        (o1, a1, z1, k1, c1, g1), (o2, a2, z2, k2, c2, g2) = results
        tag = f"{name} routing loops: {case}"
        ndrop = B * T * K - len(k2)
        same = k1 == k2 and c1 == c2
        report.check(f"{tag}: same selection and drops ({ndrop} dropped), gap {gap:.1e}",
                     0.0 if same and gap > 1e-6 else 1.0, 0.0)
        err = max(ref.rel_err(o1, o2), ref.rel_err(a1, a2), ref.rel_err(z1, z2),
                  *(ref.rel_err(a, b) for a, b in zip(g1, g2)))
        report.check(f"{tag}: output, aux {a1:.6g}, z, grads (router, expert, input)", err, 1e-10)
        kept_by_policy[case] = k1
        if "capacity" in case and ndrop == 0:
            report.fail(f"{tag}", "capacity drops nothing: the case tests nothing")
        if "aux" in case and opts["aux"] != "none" and abs(a1) < 1e-6:
            report.fail(f"{tag}", "aux loss is zero")

    differ = kept_by_policy["capacity 1.0 probs"] != kept_by_policy["capacity 1.0 position"]
    report.check(f"{name} routing loops: capacity 1.0 keeps different tokens under probs and position",
                 0.0 if differ else 1.0, 0.0)

    # tie rules, on scores that tie exactly: every token has the same logits row
    # [0, 0, 0, -1, ...]: top-K takes the lowest experts, and the probs policy keeps the
    # lowest tokens when all candidates of an expert have equal p
    N = 10
    logits = torch.tensor([[0.0] * 3 + [-1.0] * (E - 3)] * N, dtype=torch.float64)
    for policy in ("probs", "position"):
        opts = ref.routing_options(cfg, {"capacity_factor": 1.0, "drop_policy": policy})
        r = ref.route(cfg, opts, logits)
        pf = r["p"].tolist()
        chosen, kept, counts = select_by_loops(pf, pf, K, E, _cap_by_integers(1.0, N, K, E), policy)
        ok = r["top_i"].tolist() == chosen and set(map(tuple, torch.nonzero(r["kept"]).tolist())) == kept
        ok &= chosen[0] == list(range(K)) and r["dropped"] > 0
        report.check(f"{name} routing ties ({policy}): lower expert, lower token "
                     f"({r['dropped']} dropped, cap {r['cap']})", 0.0 if ok else 1.0, 0.0)


def main():
    report = ref.Report("reference vs Hugging Face transformers (float64)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ref.MODELS:
            try:
                check_model(name, report, tmp)
            except Exception as e:  # keep going so the table shows every model
                report.fail(f"{name}", f"{type(e).__name__}: {e}")
    for name in ref.MODELS:
        if ref.moe_layers(ref.load_config(ref.config_path(name))):
            try:
                check_routing_loops(name, report)
            except Exception as e:
                import traceback
                traceback.print_exc()
                report.fail(f"{name} routing loops", f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
