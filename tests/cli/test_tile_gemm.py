"""Attention's per-thread tiles run on the library timed faster for them (src/kernels/cpu/gemm.h).

OpenBLAS's small-matrix kernels win on Zen 4, while on an Emerald Rapids host OpenBLAS 0.3.21 ran the
concurrent tiles at a quarter of oneDNN's speed, so `train` times both at start and names the choice.
Asserted, on the demo model over windows of 2 key tiles (128 positions) with document masking:
  - ORIGAMI_TILE_GEMM=openblas and =onednn are obeyed and named on the startup line, and the default
    (auto) names the measured ratio;
  - the two libraries train the same curve: every one of 4 steps' losses within 1e-5 relative in fp32
    (the same sums in two orders) and within 1e-3 in bf16, the bound of the bf16 layout tests (an fp32
    value that the order moves across a bf16 rounding boundary moves by 2^-8 after rounding);
  - any other value is one clear error and exit 1;
  - a checkpoint keeps the job's choices (trainer_state.json's "kernels") and a resume takes them, so
    that it sums as the run that saved did: resumed from step 2 without ORIGAMI_TILE_GEMM, a bf16 run
    saved under either forced library (its GEMMs pinned portable, below) names "the checkpoint's
    choice" and repeats the uninterrupted run's steps 3 and 4 bit for bit (whichever library this
    host's timing would pick, one of the two cases resumes against it); a key this version does not
    know is left alone; ORIGAMI_TILE_GEMM given on the resume wins; a kept value that is not a
    library is an error naming the field;
  - the same for the bf16 GEMM shapes' timed paths (each rank's, per shape), unpinned.
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


def train(tmp, data, library, precision, *extra, name=None, env_extra=None):
    """A 4-step run; library None leaves ORIGAMI_TILE_GEMM unset."""
    metrics = os.path.join(tmp, "m_%s.jsonl" % (name or "%s_%s" % (library, precision)))
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", **(env_extra or {})}
    env.pop("ORIGAMI_TILE_GEMM", None)
    if library is not None:
        env["ORIGAMI_TILE_GEMM"] = library
    p = subprocess.run([ORIGAMI, "train", "--config", CONFIG, "--data", data, "--steps", "4", "--micro-batch", "4",
                        "--seq-len", "128", "--threads", "2", "--lr", "5e-4", "--attention-mask", "document",
                        "--precision", precision, "--metrics", metrics, *extra],
                       capture_output=True, text=True, env=env)
    return p, metrics


def tile_line(p, what):
    if p.returncode != 0:
        fail("%s: exit %d\n%s" % (what, p.returncode, p.stdout[-2000:] + p.stderr[-2000:]))
    line = [l for l in p.stdout.splitlines() if l.startswith("attention tiles:")]
    check(len(line) == 1, "%s: one startup line naming the tile library, got %s" % (what, line))
    return line[0]


def check_resume_keeps_choice(tmp, data):
    """A resume takes the checkpoint's tile library, not its own timing. In bf16 with the GEMMs pinned
    to the portable path: on a host whose oneDNN has a bf16 matmul, each run times the layer-sized bf16
    GEMMs per shape (not kept), and its attention would multiply in oneDNN's bf16 tiles, not the fp32
    tiles' library under test."""
    names = {"openblas": "OpenBLAS", "onednn": "oneDNN"}
    portable = {"ORIGAMI_BF16_GEMM": "portable"}
    for library, name in names.items():
        save = os.path.join(tmp, "save_" + library)
        p, metrics = train(tmp, data, library, "bf16", "--save", save, "--save-every", "2", name="whole_" + library,
                           env_extra=portable)
        tile_line(p, "saving run, " + library)
        whole = [json.loads(l) for l in open(metrics)]
        state = os.path.join(save, "step-2", "trainer_state.json")
        st = json.load(open(state))
        kernels = dict(st.get("kernels") or {})
        check(kernels == {"attention_tiles": library, "bf16_tiles": "fp32"},
              "%s: trainer_state.json keeps kernels %s" % (library, kernels))
        st["kernels"]["a_later_choice"] = "anything"  # (a later version's key: not this one's to judge)
        json.dump(st, open(state, "w"))
        p, metrics = train(tmp, data, None, "bf16", "--resume", os.path.join(save, "step-2"), name="resumed_" + library,
                           env_extra=portable)
        line = tile_line(p, "resumed run, " + library)
        check(re.fullmatch(r"attention tiles: %s \(timed: OpenBLAS at [0-9.]+x oneDNN's time here; the checkpoint's "
                           r"choice\)" % name, line) is not None, "%s: resumed startup line %r" % (library, line))
        resumed = [json.loads(l) for l in open(metrics)]
        check([r["step"] for r in resumed] == [3, 4] and [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]],
              "%s: the resumed steps %s differ from the uninterrupted run's %s"
              % (library, [(r["step"], r["loss"]) for r in resumed], [(r["step"], r["loss"]) for r in whole[2:]]))
        print("ok   %s checkpoint: kernels %s; resumed without ORIGAMI_TILE_GEMM: %s; steps 3-4 bit for bit %s"
              % (library, kernels, line, " ".join(repr(r["loss"]) for r in resumed)))
    other = "onednn"
    p, _ = train(tmp, data, other, "bf16", "--resume", os.path.join(tmp, "save_openblas", "step-2"), name="forced_resume",
                 env_extra=portable)
    line = tile_line(p, "resume under ORIGAMI_TILE_GEMM=" + other)
    check(line == "attention tiles: oneDNN (forced by ORIGAMI_TILE_GEMM)", "the environment must win on a resume: %r" % line)
    print("ok   ORIGAMI_TILE_GEMM=%s on a resume of an OpenBLAS checkpoint: %s" % (other, line))
    state = os.path.join(tmp, "save_openblas", "step-2", "trainer_state.json")
    st = json.load(open(state))
    st["kernels"]["attention_tiles"] = "blas"
    json.dump(st, open(state, "w"))
    p, _ = train(tmp, data, None, "bf16", "--resume", os.path.dirname(state), name="bad_kernels", env_extra=portable)
    errors = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l]
    check(p.returncode == 1 and len(errors) == 1 and "field 'kernels.attention_tiles'" in errors[0] and '"blas"' in errors[0],
          "a kept library that is not one: exit %d, errors %s" % (p.returncode, errors))
    print("ok   a damaged kept choice: " + errors[0])


def check_resume_keeps_gemm_paths(tmp, data):
    """A bf16 checkpoint keeps each rank's timed GEMM paths ("bf16_gemms": per rank, per shape) and a resume
    takes them (tests/unit/test_bf16.cpp: a kept path replaces the timing) and repeats the uninterrupted
    steps bit for bit; a kept path that is not one is an error naming the field. Where every bf16 GEMM is
    portable (no oneDNN bf16 matmul), nothing is timed and nothing kept."""
    save = os.path.join(tmp, "save_gemm_paths")
    p, metrics = train(tmp, data, None, "bf16", "--save", save, "--save-every", "2", name="gemm_paths_whole")
    tile_line(p, "bf16 run saving its GEMM paths")
    whole = [json.loads(l) for l in open(metrics)]
    state = os.path.join(save, "step-2", "trainer_state.json")
    st = json.load(open(state))
    kept = st["kernels"].get("bf16_gemms")
    if "bf16 GEMM: portable" in p.stdout and "oneDNN has no bf16 matmul here" in p.stdout:
        check(kept is None, "every bf16 GEMM portable, yet paths kept: %s" % kept)
        print("ok   no oneDNN bf16 matmul here: no GEMM paths kept")
        return
    shapes = kept[0] if kept and len(kept) == 1 else []
    fields = {"trans", "mnk", "ld", "alpha", "beta", "path"}
    check(shapes and all(set(g) in (fields, fields | {"bias"}) and g.get("bias", True) is True for g in shapes) and
          any(g["mnk"][0] == 4 * 128 for g in shapes) and any(g.get("bias") for g in shapes),
          "kept GEMM paths: one rank's list of the model's shapes (512 rows a micro-batch; GPT-2's q|k|v and fc "
          "forward with their bias, \"bias\": true), got %s" % kept)
    p, metrics = train(tmp, data, None, "bf16", "--resume", os.path.join(save, "step-2"), name="gemm_paths_resumed")
    resumed = [json.loads(l)["loss"] for l in open(metrics)] if p.returncode == 0 else []
    check(resumed == [r["loss"] for r in whole[2:]], "resumed with the kept GEMM paths: steps 3-4 %s, uninterrupted %s"
          % (resumed, [r["loss"] for r in whole[2:]]))
    print("ok   a bf16 checkpoint keeps %d GEMM shapes' paths (%s); resumed, steps 3-4 bit for bit" % (
        len(shapes), ", ".join(sorted({g["path"] for g in shapes}))))
    shapes[0]["path"] = "fast"
    json.dump(st, open(state, "w"))
    p, _ = train(tmp, data, None, "bf16", "--resume", os.path.dirname(state), name="bad_gemm_path")
    errors = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l]
    check(p.returncode == 1 and len(errors) == 1 and "kernels.bf16_gemms" in errors[0] and '"fast"' in errors[0],
          "a kept GEMM path that is not one: exit %d, errors %s" % (p.returncode, errors))
    print("ok   a damaged kept GEMM path: " + errors[0])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        data = byte_dataset(tmp, 400)
        named = {"openblas": "attention tiles: OpenBLAS (forced by ORIGAMI_TILE_GEMM)",
                 "onednn": "attention tiles: oneDNN (forced by ORIGAMI_TILE_GEMM)"}
        for precision in ("fp32", "bf16"):
            losses = {}
            for library in ("openblas", "onednn", "auto"):
                p, metrics = train(tmp, data, library, precision)
                line = tile_line(p, "%s %s" % (library, precision))
                if library in named:
                    check(line == named[library], "%s: startup line %r, expected %r" % (library, line, named[library]))
                else:
                    check(re.fullmatch(r"attention tiles: (OpenBLAS|oneDNN) \(timed: OpenBLAS at [0-9.]+x oneDNN's "
                                       r"time here\)", line) is not None, "auto: startup line %r" % line)
                losses[library] = [json.loads(l)["loss"] for l in open(metrics)]
                print("ok   %s %s: %s | losses %s" % (precision, library, line,
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
        check_resume_keeps_choice(tmp, data)
        check_resume_keeps_gemm_paths(tmp, data)


if __name__ == "__main__":
    main()
