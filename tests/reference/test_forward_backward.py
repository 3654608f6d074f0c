"""origami dump vs the float64 reference: logits, loss parts and every parameter gradient.

For gpt2, llama, mixtral and qwen2_moe (tests/reference/configs/*_tiny.json): seeded weights are
saved with safetensors, a byte-tokenized text is prepared with `origami data prepare`,
and `origami dump` evaluates micro-batch 0 (B=2, T=16) and a later micro-batch (B=3..7) whose
rows wrap around the end of the dataset. Every tensor must agree to 1e-4 relative
(max|a-b| / max|ref|), and the dump must hold exactly one `grad.<name>` per parameter.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402

torch.set_num_threads(2)
TOL = 3e-5  # (fp32 against float64: the worst measured 3.6e-6 over these and the routing tests)
B, T = 2, 16
SCALARS = ("loss", "lm_loss", "aux_loss", "z_loss")


def compare_dump(tag, cfg, params, sampler, step, dump, report, grads=True, rows=B, routing=None, eod=None):
    """Checks one `origami dump` against the reference (eod: with document masking); returns the
    reference's outputs."""
    inp, tgt = sampler.batch(step, rows)
    want = ref.loss_and_grads(cfg, params, inp, tgt, routing=routing, eod=eod)
    gap = ref.routing_gap(cfg, want["router_logits"], routing)
    want["routing_gap"] = gap
    if gap < 1e-5:
        print(f"  WARNING {tag}: routing gap {gap:.1e}: fp32 may route differently")

    def cmp(what, got, ref_t, shape):
        if got is None:
            report.fail(f"{tag}: {what}", "missing from dump")
            return None
        if got.dtype != torch.float32:
            report.fail(f"{tag}: {what}", f"dtype {got.dtype}, expected float32")
        if tuple(got.shape) != tuple(shape):
            report.fail(f"{tag}: {what}", f"shape {tuple(got.shape)}, expected {tuple(shape)}")
            return None
        return ref.rel_err(got, ref_t)

    e = cmp("logits", dump.get("logits"), want["logits"], want["logits"].shape)
    if e is not None:
        report.check(f"{tag}: logits", e, TOL)
    for k in SCALARS:
        e = cmp(k, dump.get(k), want[k], (1,))
        if e is not None:
            report.check(f"{tag}: {k} (origami {float(dump[k]):.8g}, ref {float(want[k]):.8g})", e, TOL)
    if not grads:
        return want
    names = set(f"grad.{n}" for n in params)
    got_names = set(k for k in dump if k.startswith("grad."))
    if got_names != names:
        report.fail(f"{tag}: gradient names",
                    f"missing {sorted(names - got_names)[:6]}, unexpected {sorted(got_names - names)[:6]}")
    if "tokens" in dump:   # optional extra: the [B, T+1] windows origami read
        window = torch.cat([inp, tgt[:, -1:]], dim=1)
        ok = tuple(dump["tokens"].shape) == tuple(window.shape) and \
            torch.equal(dump["tokens"].long(), window.long())
        report.check(f"{tag}: tokens (optional) equal the reference's windows", 0.0 if ok else 1.0, 0.0)
    others = set(dump) - got_names - set(SCALARS) - {"logits", "tokens"}
    if others:
        print(f"  note {tag}: dump also holds {sorted(others)[:6]}")
    worst, worst_name, n = 0.0, "-", 0
    for name, g in want["grads"].items():
        e = cmp(f"grad {name}", dump.get(f"grad.{name}"), g, g.shape)
        if e is None:
            continue
        n += 1
        if not e <= TOL:  # (a NaN error fails too)
            report.check(f"{tag}: grad {name}", e, TOL)
        if not e < worst:  # (so does the worst: a NaN takes its place)
            worst, worst_name = e, name
    report.check(f"{tag}: {n}/{len(params)} gradients, worst {worst_name}", worst, TOL)
    return want


def check_model(name, report, tmp, data):
    cfg_path, cfg, init, params = ref.seeded_model(name, tmp, seed=5)
    sampler = ref.WindowSampler(data, T)

    out = os.path.join(tmp, f"{name}_dump0.safetensors")
    dump = ref.origami_dump(cfg_path, init, data, B, T, out, step=0)
    compare_dump(f"{name} step 0", cfg, params, sampler, 0, dump, report)

    # a micro-batch whose rows straddle the end of the data (window index wraps modulo
    # num_windows inside the batch): needs a micro-batch size that does not divide it
    nw = sampler.num_windows
    bw = next(b for b in (3, 4, 5, 6, 7) if nw % b)
    step = nw // bw
    out = os.path.join(tmp, f"{name}_dumpw.safetensors")
    dump = ref.origami_dump(cfg_path, init, data, bw, T, out, step=step)
    rows = [(step * bw + r) % nw for r in range(bw)]
    compare_dump(f"{name} B={bw} step {step} (windows {rows} of {nw})", cfg, params, sampler,
                 step, dump, report, grads=bool(ref.moe_layers(cfg)), rows=bw)


def main():
    return ref.run_model_checks("origami dump vs float64 reference (B=2, T=16)", check_model)


if __name__ == "__main__":
    sys.exit(main())
