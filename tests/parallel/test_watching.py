"""Watching a run (issue 36): `origami train --tensorboard DIR` and `origami plot`.

TensorBoard, read by TensorBoard's own EventAccumulator (PyPI tensorboard):
  - a MoE run with validation every 2 steps, 6 steps, saving at 4 and 6, then resumed from step 4 to 8
    with the same --tensorboard DIR after the event file's last record and the metrics file's last row
    were cut short (as a kill mid-write leaves them): the cut row is dropped, and so are the metrics
    rows of steps 5-6 the first run wrote past the checkpoint (the resumed run writes its own), so
    the file holds steps 1-8 once each; every tag holds exactly the scalars of the metrics file, step
    by step (TensorBoard's SessionLog START purges the first run's 5-6); one event file (the resume
    appended to it);
    `origami plot` of that metrics file draws 8 steps, each once; then the run again from step 0 for 2
    steps, a second event file beside the first: TensorBoard shows only its 2 steps (the START at
    step 1 hides the earlier file's), as the metrics file holds only them;
  - a copy of an event file cut inside its last record reads up to that record;
  - the tags are those of src/train/tensorboard.h, the MoE ones included.
`origami plot`: two layouts of one model (one rank and DP2, its metrics written by mpirun) drawn into
one PNG (a PNG of 1400x900 of more than 20 KB), with --x step, tokens and time; errors: a missing
file, a file with no rows, a bad --x, a missing --out, no gnuplot on the PATH — one message each.
"""
import json
import os
import shutil
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

# (metrics key, tag) as src/train/tensorboard.cpp writes them.
TAGS = [("loss", "train/loss"), ("lm_loss", "train/lm_loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
        ("val_loss", "val/loss"), ("tokens_per_s", "perf/tokens_per_s"), ("ms", "perf/step_ms"),
        ("gflops", "perf/gflops"), ("save_blocked_s", "perf/save_blocked_s"),
        ("rss_peak_bytes", "memory/rss_peak_bytes"), ("expert_imbalance", "moe/expert_imbalance"),
        ("expert_sync_imbalance", "moe/expert_sync_imbalance"), ("aux_loss", "train/aux_loss"), ("z_loss", "train/z_loss")]
FAILS = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILS.append(what)
    return ok


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected_scalars(rows):
    """tag -> [(step, float32 value)] from metrics rows; a later row of a step replaces an earlier one."""
    by_step = {}
    for r in rows:
        by_step[r["step"]] = r
    out = {}
    for step in sorted(by_step):
        r = by_step[step]
        for key, tag in TAGS:
            if key in r and (key not in ("aux_loss", "z_loss") or "expert_imbalance" in r):
                out.setdefault(tag, []).append((step, f32(r[key])))
        out.setdefault("train/update_skipped", []).append((step, 1.0 if "skipped" in r else 0.0))
        if "memory_bytes" in r:
            out.setdefault("memory/predicted_bytes", []).append((step, f32(r["memory_bytes"]["total"])))
    return out


def read_events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(path)
    ea.Reload()
    events = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    return {tag: e for tag, e in events.items() if e}  # (a tag whose events were all purged stays listed, empty)


def compare(got, want, what):
    bad = [t for t in sorted(set(got) | set(want)) if got.get(t) != want.get(t)]
    for t in bad[:3]:
        print("  %s: event file %s\n  %s  metrics    %s" % (t, got.get(t), " " * len(t), want.get(t)))
    return check(not bad, "%s: %d tags, every scalar equal to the metrics file's (differing: %s)"
                 % (what, len(want), ", ".join(bad) or "none"))


def tensorboard_part(tmp, data):
    cfg = os.path.join(h.CONFIGS, "mixtral_8e.json")
    tb, ck, metrics = (os.path.join(tmp, n) for n in ("tb", "ck", "m.jsonl"))
    common = ["train", "--config", cfg, "--data", data, "--seq-len", "32", "--micro-batch", "2", "--threads", "1",
              "--quiet", "--metrics", metrics, "--tensorboard", tb, "--eval-data", data, "--eval-every", "2",
              "--eval-iters", "1", "--save", ck, "--save-every", "4"]
    rc, out, _ = h.run(0, common + ["--steps", "6"])
    if not check(rc == 0, "train --tensorboard, 6 steps (exit %s) %s" % (rc, out[-300:] if rc else "")):
        return
    files = os.listdir(tb)
    check(len(files) == 1 and files[0].startswith("events.out.tfevents."), "one event file: %s" % files)
    event_file = os.path.join(tb, files[0])
    first = h.read_metrics(metrics)
    compare(read_events(tb), expected_scalars(first), "6 steps")
    tags = set(read_events(tb))
    check({"train/loss", "val/loss", "moe/expert_imbalance", "moe/expert_sync_imbalance", "train/aux_loss",
           "memory/predicted_bytes"} <= tags,
          "the MoE, validation and memory tags are written: %s" % sorted(tags))

    # A reader of a file cut inside its last record gets every record before it.
    size = os.path.getsize(event_file)
    cut = os.path.join(tmp, "cut")
    os.makedirs(cut)
    with open(event_file, "rb") as src, open(os.path.join(cut, files[0]), "wb") as dst:
        dst.write(src.read(size - 7))
    compare(read_events(cut), expected_scalars(first[:-1]), "a copy cut inside its last record")

    # Killed after step 6 mid-write, resumed from the step-4 checkpoint: the cut record is dropped and
    # TensorBoard shows steps 1-4 of the first run and 5-8 of the resumed one.
    with open(event_file, "r+b") as f:
        f.truncate(size - 7)
    with open(metrics, "a") as f:  # and the metrics row it was writing, without its newline
        f.write('{"step": 7, "loss": 1.')
    rc, out, _ = h.run(0, common + ["--steps", "8", "--resume", os.path.join(ck, "step-4")])
    if not check(rc == 0, "resumed from step 4 to 8 (exit %s) %s" % (rc, out[-300:] if rc else "")):
        return
    check(os.listdir(tb) == files, "the resume appended to the one event file: %s" % os.listdir(tb))
    rows = h.read_metrics(metrics)
    check([r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8],
          "metrics steps %s: the cut row and the first run's steps past the checkpoint dropped, the resumed "
          "run's rows after step 4" % [r["step"] for r in rows])
    compare(read_events(tb), expected_scalars(rows), "after the resume")
    # plot draws the run's steps: the resumed rows of steps 5 and 6 replace the first attempt's
    png = os.path.join(tmp, "resumed.png")
    rc, out, _ = h.run(0, ["plot", metrics, "--out", png])
    check(rc == 0 and "1 run, 8 steps" in out, "plot of the resumed run: its 8 steps, each once: %s" % out.strip()[-200:])

    # Run again from step 0 (as a launch restarts an attempt that failed before its first save): the
    # metrics file starts over, and so does what TensorBoard shows, though the old file stays beside it.
    time.sleep(1.1)  # (a new event file's name holds the second it was made in)
    rc, out, _ = h.run(0, common[:-4] + ["--steps", "2"])
    rows = h.read_metrics(metrics)
    if check(rc == 0 and [r["step"] for r in rows] == [1, 2], "rerun from step 0: metrics steps %s (exit %s)"
             % ([r["step"] for r in rows], rc)):
        check(len(os.listdir(tb)) == 2, "the rerun wrote a second event file: %s" % os.listdir(tb))
        compare(read_events(tb), expected_scalars(rows), "after a rerun from step 0")


def plot_part(tmp, data):
    cfg = os.path.join(h.CONFIGS, "gpt2_tiny.json")
    runs = []
    for name, ranks in (("one_rank", 0), ("dp2", 2)):
        m = os.path.join(tmp, name + ".jsonl")
        rc, out, _ = h.run(ranks, ["train", "--config", cfg, "--data", data, "--steps", "12", "--seq-len", "32",
                                   "--micro-batch", "2", "--global-batch", "4", "--threads", "1", "--quiet",
                                   "--metrics", m, "--eval-data", data, "--eval-every", "4", "--eval-iters", "1"])
        check(rc == 0, "%s run for the plot (exit %s)" % (name, rc))
        runs.append(m)
    for x in ("step", "tokens", "time"):
        png = os.path.join(tmp, "curves_%s.png" % x)
        rc, out, _ = h.run(0, ["plot", *runs, "--out", png, "--x", x])
        ok = rc == 0 and os.path.exists(png)
        if ok:
            with open(png, "rb") as f:
                head = f.read(24)
            w, hgt = struct.unpack(">II", head[16:24])
            ok = head[:8] == b"\x89PNG\r\n\x1a\n" and (w, hgt) == (1400, 900) and os.path.getsize(png) > 20000
        check(ok, "plot --x %s of two layouts: exit %s, %s" % (x, rc, out.strip()[-200:]))

    empty = os.path.join(tmp, "empty.jsonl")
    open(empty, "w").close()
    png = os.path.join(tmp, "bad.png")
    errors = [
        (["plot", os.path.join(tmp, "missing.jsonl"), "--out", png], "missing.jsonl"),
        (["plot", empty, "--out", png], "has no metrics rows"),
        (["plot", runs[0], "--out", png, "--x", "epoch"], "--x 'epoch' is not one of step, tokens, time"),
        (["plot", runs[0]], "--out FILE.png"),
        (["plot", "--out", png], "give one or more metrics files"),
    ]
    for args, words in errors:
        ok, line, _ = h.check_error("plot: " + words, 0, args, lambda l, w=words: w in l)
        check(ok and not os.path.exists(png), "plot error names %r" % words)
    ok, line, _ = h.check_error("plot without gnuplot", 0, ["plot", runs[0], "--out", png],
                                lambda l: "plot needs gnuplot" in l, extra_env={"PATH": "/nonexistent"})
    check(ok, "plot without gnuplot on the PATH: one message")


def main():
    tmp = h.tmpdir("origami_watching_")
    try:
        data = h.prepare_data(tmp)
        tensorboard_part(tmp, data)
        plot_part(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    h.report(FAILS, "TensorBoard events equal the metrics; plot draws runs and names every mistake")


if __name__ == "__main__":
    main()
