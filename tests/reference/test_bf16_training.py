"""origami train --precision bf16 vs the reference in its bf16 mode over 10 AdamW steps, for gpt2,
llama, mixtral and qwen2_moe.

The two runs ("cosine", "constant"), micro-batch 2, global batch 4, seq 16 and the data are
test_training.py's. The reference runs in float64 with origami's bf16 rounding points
(ref.gemm_precision("bf16"): every linear-layer GEMM multiplies bf16-rounded operands and rounds
its output gradient once; everything else, master weights and AdamW included, stays unrounded).

Tolerances (relative, per step and field). bf16 rounding is discontinuous: where origami's
float32 value and the reference's float64 one lie either side of a bf16 rounding boundary they
round 2^-8 apart. At step 0 the weights are identical and only these rare flips differ; from step
1 on the weights differ too (Adam turns small gradient differences into whole steps), and in the
MoE models routing decisions flip as well. The reference's own float32 run, itself an exact
float32 engine with these rounding points, differs from its float64 run by up to
  step 0:     loss 9.8e-5, grad_norm 2.8e-4 (dense, at 2 of seeds 1..40: the step-0 tolerance holds
              at the seeds below, which the self-test checks, not at every seed)
  steps 1-9:  dense loss 8.2e-4 (median 3.1e-4), grad_norm 7.4e-3; MoE loss 3e-3, aux_loss 9e-3,
              grad_norm 3e-2
(the dense figures: seeds 1..40, both runs, on an AMX host under OpenBLAS's own kernel and under
OPENBLAS_CORETYPE=Haswell, one thread; an earlier measurement had put them at 4e-4 and 2e-3, and on
that AMX host the float32 run of gpt2/cosine at its seed below came to 6.0e-4 at 2 threads),
so a fixed 1e-3 on every step is out of reach, and the tolerances below sit above those figures
(test_reference_selftest.py checks that the reference's float32 run stays within half of them for
these seeds). The same checks applied to the reference without rounding must fail by at least
1.5x somewhere, for every model and run: an origami that ignored --precision (within 2e-6 of that
run, test_training.py) fails this test.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import origami_ref as ref  # noqa: E402
import test_training as tt  # noqa: E402

torch.set_num_threads(2)
RUNS = tt.RUNS
# test_training's seeds, but qwen2_moe's: there bf16 rounding moves the step-0 loss by 4e-5 < 1e-4
# at seed 22; 26 moves it by 5e-4, with every step-0 routing decision >= 1e-3 from a tie
SEEDS = dict(tt.SEEDS, qwen2_moe=26)
FIELDS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr")
# field: (step 0, later steps dense, later steps MoE)
TOLS = {"loss": (1e-4, 2e-3, 1e-2), "lm_loss": (1e-4, 2e-3, 1e-2),
        "aux_loss": (1e-4, 1e-3, 5e-2), "z_loss": (1e-4, 1e-3, 5e-2),
        "grad_norm": (1e-3, 2e-2, 5e-2), "lr": (1e-6, 1e-6, 1e-6)}
FLAG_MARGIN = 1.5


def tol(cfg, step, field):
    t0, dense, moe = TOLS[field]
    return t0 if step == 0 else (moe if ref.moe_layers(cfg) else dense)


def errors(cfg, got, want):
    """[(step, field, relative error, tolerance)] of metrics `got` against the reference `want`."""
    return [(s, f, ref.rel_err(float(g[f]), w[f]), tol(cfg, s, f))
            for s, (g, w) in enumerate(zip(got, want)) for f in FIELDS]


def reference(cfg, init, sampler, run, precision, dtype=torch.float64):
    params = ref.load_params(cfg, init, dtype)
    with ref.gemm_precision(precision):
        return ref.train(cfg, params, sampler, **RUNS[run])


def check_model(name, run, report, tmp, data):
    a = RUNS[run]
    tag = f"{name}/{run}"
    cfg_path, cfg, init, _ = ref.seeded_model(name, tmp, SEEDS[name])
    got = ref.origami_train(cfg_path, init, data, os.path.join(tmp, f"{name}_{run}_bf16.jsonl"),
                            a["steps"], a["micro_batch"], a["global_batch"], tt.SEQ_LEN, a["lr"],
                            a["min_lr"], a["warmup"], a["schedule"], a["weight_decay"],
                            a["grad_clip"], precision="bf16")
    sampler = ref.WindowSampler(data, tt.SEQ_LEN)
    want = reference(cfg, init, sampler, run, "bf16")

    if len(got) != len(want):
        report.fail(f"{tag}: metrics lines", f"{len(got)} lines in metrics, expected {len(want)}")
    missing = [(s, f) for s, g in enumerate(got) for f in FIELDS if f not in g]
    if missing:
        report.fail(f"{tag}: metrics fields", f"missing (step, field) {missing[:5]}")
        return
    errs = errors(cfg, got, want)
    for s, f, e, t in errs:
        if e > t:
            report.check(f"{tag}: step {s} {f} (origami {float(got[s][f]):.8g}, ref {want[s][f]:.8g})", e, t)
    for f in FIELDS:
        for label, steps in (("step 0", (0,)), ("steps 1-9", range(1, len(want)))):
            rows = [(e, t) for s, fld, e, t in errs if fld == f and s in steps]
            if rows:
                e, t = max(rows, key=lambda r: r[0] / r[1])
                report.check(f"{tag}: {f}, worst of {label}", e, t)

    # the flag matters: the unrounded reference fails these checks
    plain = reference(cfg, init, sampler, run, "fp32")
    s, f, e, t = max(errors(cfg, plain, want), key=lambda r: r[2] / r[3])
    report.check(f"{tag}: the unrounded reference fails by >= {FLAG_MARGIN}x (step {s} {f} at "
                 f"{e / t:.1f}x its tolerance)", 0.0 if e >= FLAG_MARGIN * t else 1.0, 0.0)
    print(f"  {tag}: ref loss {want[0]['loss']:.5f} -> {want[-1]['loss']:.5f}, clipping in "
          f"{sum(w['grad_norm'] > a['grad_clip'] for w in want)}/{len(want)} steps, min top-k gap "
          f"{min(w['min_topk_gap'] for w in want):.2e}")


def main():
    return ref.run_model_checks("origami train --precision bf16 vs reference (10 steps)", check_model,
                                variants=RUNS)


if __name__ == "__main__":
    sys.exit(main())
