"""Mixed precision trains as well as fp32: the loss curves of `--precision bf16` and fp32 (issue 28).

Two runs each, the same seed, data order and settings, on the demo corpus (Debian's fortunes, byte
tokenizer), side by side with one thread each (on 2 cores that takes 0.83x the time of one run after the
other with 2 threads each):
  - the demo model (configs/demo_gpt2.json, the README's demo settings): 600 steps;
  - a Mixtral test model (tests/parallel/configs/mixtral_8e.json: 8 experts, top-2, with the aux and
    z losses): 300 steps of micro-batch 32 x 64 tokens (its 64 positions), lr 2e-3 cosine.
Asserted: at every 50th step s, the mean bf16 loss of the 10 steps s-4 .. s+5 (the last 10 at the end)
within 1% of fp32's, and the final step's losses within 0.5% for the demo model (each step trains on
the same windows in both runs). The startup line names the precision and the bf16 GEMM path; the
metrics' layout says bf16.

The MoE's final step is held to 1%, not 0.5%: its top-2 routing makes each run's trajectory depend on
last bits, and a single step's loss is one batch's. Measured on this model (300 steps, 10-step means at
the end / final step): fp32 with 1 thread against 2 threads 0.02% / 0.15%; bf16 with 1 thread against 2
threads 0.6% / 0.6%; bf16 against fp32 -0.04% / +0.05% with 1 thread and +0.5% / +0.8% with 2. (A
wider test Mixtral, d = 128, ends with bf16 0.8% *below* fp32 at both thread counts; not explained yet.)
(bf16 training on 2 threads runs in tests/cli/test_bf16_export.py and tests/parallel/test_run_safety.py.)
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cli_util import ORIGAMI, check, fail  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = "/usr/share/games/fortunes"
# (name, config, steps, flags, final-step bound)
RUNS = [("demo gpt2", os.path.join(ROOT, "configs", "demo_gpt2.json"), 600,
         ["--micro-batch", "16", "--seq-len", "128", "--lr", "2e-3", "--min-lr", "2e-4", "--warmup", "100"], 0.005),
        ("mixtral_8e", os.path.join(ROOT, "tests", "parallel", "configs", "mixtral_8e.json"), 300,
         ["--micro-batch", "32", "--seq-len", "64", "--lr", "2e-3", "--min-lr", "2e-4", "--warmup", "30"], 0.01)]
CURVE_RTOL = 0.01


def start(tmp, tag, config, steps, flags, precision):
    """Starts one training run on one thread; returns (process, metrics path)."""
    metrics = os.path.join(tmp, "%s_%s.jsonl" % (tag, precision))
    p = subprocess.Popen([ORIGAMI, "train", "--config", config, "--data", os.path.join(tmp, "fortunes"), "--steps",
                          str(steps), "--lr-schedule", "cosine",
                          "--weight-decay", "0.1", "--grad-clip", "1.0", "--data-order", "shuffled", "--threads", "1",
                          "--quiet", "--precision", precision, "--metrics", metrics] + flags,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_WAIT_POLICY": "passive"})
    return p, metrics


def finish(run, tag, steps, precision):
    """Waits for a run; returns (losses, the metrics' layout, its output)."""
    p, metrics = run
    out = p.communicate()[0]
    if p.returncode != 0:
        fail("%s %s: exit %d\n%s" % (tag, precision, p.returncode, out[-4000:]))
    rows = [json.loads(l) for l in open(metrics)]
    check(len(rows) == steps, "%s %s: %d metrics rows, expected %d" % (tag, precision, len(rows), steps))
    return [r["loss"] for r in rows], rows[0]["layout"], out


def window_mean(losses, s):
    lo = min(max(s - 5, 0), len(losses) - 10)
    return sum(losses[lo:lo + 10]) / 10


def main():
    check(os.path.isdir(CORPUS) or os.path.exists(CORPUS), "no %s: scripts/setup.sh installs Debian's fortunes" % CORPUS)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([ORIGAMI, "data", "prepare", "--input", CORPUS, "--output", os.path.join(tmp, "fortunes"),
                        "--tokenizer", "byte"], check=True, capture_output=True)
        for tag, config, steps, flags, final_rtol in RUNS:
            runs = {precision: start(tmp, tag, config, steps, flags, precision) for precision in ("fp32", "bf16")}
            try:
                fp32, _, _ = finish(runs["fp32"], tag, steps, "fp32")
                bf16, layout, out = finish(runs["bf16"], tag, steps, "bf16")
            finally:  # (a failed run leaves no other running)
                for process, _ in runs.values():
                    process.kill()
                    process.wait()
            check("bf16" in layout, "%s: metrics layout %r does not name bf16" % (tag, layout))
            check("precision: bf16 GEMMs" in out and "bf16 GEMM: " in out,
                  "%s: the startup line does not name the precision and the GEMM path:\n%s" % (tag, out[:1500]))
            worst = 0.0
            for s in list(range(50, steps + 1, 50)):
                a, b = window_mean(fp32, s), window_mean(bf16, s)
                d = abs(b - a) / a
                worst = max(worst, d)
                print("%-10s step %3d: loss fp32 %.4f bf16 %.4f (10-step means), %.2e" % (tag, s, a, b, d))
                check(d <= CURVE_RTOL, "%s step %d: bf16 mean loss %.5f vs fp32 %.5f: %.2e > %.0e"
                      % (tag, s, b, a, d, CURVE_RTOL))
            final = abs(bf16[-1] - fp32[-1]) / fp32[-1]
            print("%-10s final: fp32 %.5f bf16 %.5f (%.2e); curves within %.2e" % (tag, fp32[-1], bf16[-1], final, worst))
            check(final <= final_rtol, "%s: final loss bf16 %.5f vs fp32 %.5f: %.2e > %.0e"
                  % (tag, bf16[-1], fp32[-1], final, final_rtol))
    print("bf16 trains within %.0e of fp32's curve" % CURVE_RTOL)


if __name__ == "__main__":
    main()
