"""Attention's per-thread tiles run on the library timed faster for them (src/kernels/cpu/gemm.h).

OpenBLAS's small-matrix kernels win on Zen 4, while on an Emerald Rapids host OpenBLAS 0.3.21 ran the
concurrent tiles at a quarter of oneDNN's speed, so `train` times both at start and names the choice.
Asserted, on the demo model over windows of 2 key tiles (128 positions) with document masking:
  - ORIGAMI_TILE_GEMM=openblas and =onednn are obeyed and named on the startup line, and the default
    (auto) names the measured ratio;
  - the two libraries train the same curve: every one of 4 steps' losses within 1e-5 relative in fp32
    (the same sums in two orders) and within 1e-3 in bf16, the bound of the bf16 layout tests (an fp32
    value that the order moves across a bf16 rounding boundary moves by 2^-8 after rounding);
  - any other value is one clear error and exit 1.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cli_util import ORIGAMI, byte_dataset, check, fail  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(ROOT, "configs", "demo_gpt2.json")


def train(tmp, data, library, precision):
    metrics = os.path.join(tmp, "m_%s_%s.jsonl" % (library, precision))
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", "ORIGAMI_TILE_GEMM": library}
    p = subprocess.run([ORIGAMI, "train", "--config", CONFIG, "--data", data, "--steps", "4", "--micro-batch", "4",
                        "--seq-len", "128", "--threads", "2", "--lr", "5e-4", "--attention-mask", "document",
                        "--precision", precision, "--metrics", metrics],
                       capture_output=True, text=True, env=env)
    return p, metrics


def main():
    with tempfile.TemporaryDirectory() as tmp:
        data = byte_dataset(tmp, 400)
        named = {"openblas": "attention tiles: OpenBLAS (forced by ORIGAMI_TILE_GEMM)",
                 "onednn": "attention tiles: oneDNN (forced by ORIGAMI_TILE_GEMM)"}
        for precision in ("fp32", "bf16"):
            losses = {}
            for library in ("openblas", "onednn", "auto"):
                p, metrics = train(tmp, data, library, precision)
                if p.returncode != 0:
                    fail("%s %s: exit %d\n%s" % (library, precision, p.returncode, p.stdout[-2000:] + p.stderr[-2000:]))
                line = [l for l in p.stdout.splitlines() if l.startswith("attention tiles:")]
                check(len(line) == 1, "%s: one startup line naming the tile library, got %s" % (library, line))
                if library in named:
                    check(line[0] == named[library], "%s: startup line %r, expected %r" % (library, line[0], named[library]))
                else:
                    check(re.fullmatch(r"attention tiles: (OpenBLAS|oneDNN) \(timed: OpenBLAS at [0-9.]+x oneDNN's "
                                       r"time here\)", line[0]) is not None, "auto: startup line %r" % line[0])
                losses[library] = [json.loads(l)["loss"] for l in open(metrics)]
                print("ok   %s %s: %s | losses %s" % (precision, library, line[0],
                                                        " ".join("%.6f" % x for x in losses[library])))
            rtol = 1e-5 if precision == "fp32" else 1e-3
            check(len(losses["openblas"]) == len(losses["onednn"]) == 4,
                  "%s: 4 steps each, got %s" % (precision, {k: len(v) for k, v in losses.items()}))
            for a, b in zip(losses["openblas"], losses["onednn"]):
                check(abs(a - b) <= rtol * abs(a), "%s: OpenBLAS and oneDNN tiles disagree: %s against %s"
                      % (precision, losses["openblas"], losses["onednn"]))
            print("ok   %s: OpenBLAS and oneDNN tiles train the same curve (4 steps within %g)" % (precision, rtol))
        p, _ = train(tmp, data, "blas", "fp32")
        want = "origami train: error: ORIGAMI_TILE_GEMM='blas': expected auto, openblas or onednn"
        errors = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l]
        check(p.returncode == 1 and errors == [want], "ORIGAMI_TILE_GEMM=blas: exit %d, errors %s, expected %r"
              % (p.returncode, errors, want))
        print("ok   ORIGAMI_TILE_GEMM=blas: " + want)


if __name__ == "__main__":
    main()
