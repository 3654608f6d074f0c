"""Validates the oracle itself against Hugging Face transformers (needs no origami).

For each tiny config: our seeded weights are saved as config.json + model.safetensors
with origami's HF names, loaded with transformers' from_pretrained (which also checks the
names), and compared in float64:
  - logits (all models), tolerance 1e-5
  - lm_loss and the gradient of lm_loss for every parameter (all models; for Mixtral the
    gradient of lm_loss alone, since HF's aux-loss formula differs from origami's)
  - Mixtral router logits per layer, and our aux/z losses recomputed from HF's router
    logits by an independent loop implementation of the spec formulas.
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
           "mixtral": transformers.MixtralForCausalLM}[name]
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
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
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
    kwargs = {"output_router_logits": True} if name == "mixtral" else {}
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

    if name == "mixtral":
        hf_rl = hf_out.router_logits
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
        report.check(f"{name}: experts used {used}/{cfg['num_local_experts']}",
                     0.0 if used == cfg["num_local_experts"] else 1.0, 0.0)


def main():
    report = ref.Report("reference vs Hugging Face transformers (float64)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ref.MODELS:
            try:
                check_model(name, report, tmp)
            except Exception as e:  # keep going so the table shows every model
                report.fail(f"{name}", f"{type(e).__name__}: {e}")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
