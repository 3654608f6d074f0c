"""A checkpoint saved by one layout resumes under another, exactly: 3 steps of mixtral as TP2 x DP2
with sequence parallelism and ZeRO-1 (4 ranks), saved, then resumed (--resume) to step 6 as DP2 with
ZeRO-2 (2 ranks), as one rank, as PP2, as PP2 x DP2 with ZeRO-1 and full recomputation and as TP2 x
DP2 with ZeRO-3; and 3 steps as DP4 with ZeRO-3 (every parameter sharded), resumed as one rank, as
TP2 x DP2 + SP with ZeRO-1 and as PP2 with ZeRO-3: every resumed run equals the uninterrupted one-rank
run's losses within 1e-6 relative; without --global-batch a resume keeps the checkpoint's (not the
new layout's micro-batch x DP). In bf16 (bf16_zero): a DP2 ZeRO-1 or ZeRO-3 checkpoint resumed
the same way equals the uninterrupted run exactly, and a one-rank one resumed so stays within 1e-3 of it.
Nothing is gathered to one rank when saving: each rank writes its own pieces (its TP shards, its
ZeRO shard of the moments) to DIR/step-3/rank-RRRRR.safetensors, metadata.json records every
tensor's global shape and how it was split, and every layout reads the pieces that overlap its
own shard (and pipeline stage)."""
import json
import os
import subprocess
import sys
import tempfile

import harness as h  # noqa: E402  (the MPI settings every parallel test runs with)

BIN = os.environ["ORIGAMI_BIN"]
ROOT = os.environ["ORIGAMI_ROOT"]


def train(ranks, *args, env=None):
    cmd = h.command(ranks if ranks > 1 else 0, ["train", *args])
    p = subprocess.run(cmd, env={**h.env(), **(env or {})}, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def main():
    tmp = tempfile.mkdtemp()
    text = os.path.join(tmp, "corpus.txt")
    with open(text, "w") as f:
        for i in range(200):
            f.write(f"fortune {i}: a stitch in time saves {i % 9} more, said the {i * 7 % 13}th tailor.\n%\n")
    data = os.path.join(tmp, "d")
    subprocess.run([BIN, "data", "prepare", "--input", text, "--output", data, "--tokenizer", "byte"],
                   check=True, capture_output=True)
    common = ["--config", os.path.join(ROOT, "tests/reference/configs/mixtral_tiny.json"), "--data", data,
              "--micro-batch", "2", "--global-batch", "8", "--seq-len", "16", "--lr", "1e-3",
              "--lr-schedule", "constant", "--threads", "1"]
    full = os.path.join(tmp, "full.jsonl")
    train(1, *common, "--steps", "6", "--metrics", full)
    failures = []
    # (name, ranks, layout) saved at step 3, then each resumed layout to step 6.
    saves = [("TP2xDP2+SP ZeRO-1", 4, ["--tp", "2", "--sequence-parallel", "--zero", "1"],
              [(2, ["--dp", "2", "--zero", "2"]), (1, []), (2, ["--pp", "2"]),
               (4, ["--pp", "2", "--dp", "2", "--zero", "1", "--recompute", "full"]),
               (4, ["--tp", "2", "--dp", "2", "--zero", "3"])]),
             ("DP4 ZeRO-3", 4, ["--zero", "3"],
              [(1, []), (4, ["--tp", "2", "--sequence-parallel", "--zero", "1"]), (2, ["--pp", "2", "--zero", "3"])])]
    for s, (name, save_ranks, save_layout, resumes) in enumerate(saves):
        ck = os.path.join(tmp, f"ck{s}")
        part = os.path.join(tmp, f"part{s}.jsonl")
        train(save_ranks, *common, "--steps", "3", *save_layout, "--save", ck, "--metrics", part)
        for i, (ranks, layout) in enumerate(resumes):
            resumed = os.path.join(tmp, f"resumed{s}_{i}.jsonl")
            out = train(ranks, *common, "--steps", "6", *layout, "--resume", ck, "--metrics", resumed)
            a, b = losses(full), losses(part)[:3] + losses(resumed)
            worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
            ok = "resuming from" in out and len(a) == len(b) == 6 and worst <= 1e-6
            print(f"{'ok  ' if ok else 'FAIL'} {name} checkpoint resumed on {ranks} rank(s) {' '.join(layout)}: "
                  f"worst relative loss difference {worst:.2e} over 6 steps")
            if not ok:
                failures.append((name, ranks))
    for zero in (1, 3):
        failures += bf16_zero(tmp, common, zero)
    failures += default_global_batch(tmp, common)
    sys.exit(1 if failures else 0)


def default_global_batch(tmp, common):
    """Without --global-batch the global batch is micro-batch x DP, so another layout would step through
    the data by another stride: a resume keeps the checkpoint's (and says so). Saved at step 3 by one
    rank with micro-batch 4 (global batch 4), resumed as DP2 with micro-batch 1 (its own default: 2),
    the run equals the uninterrupted one-rank run within 1e-6. (A llama: an MoE's aux loss depends on how
    the rows are grouped into micro-batches.)"""
    base = [a for k, a in enumerate(common) if a != "--global-batch" and common[k - 1] != "--global-batch"]
    base = [a.replace("mixtral_tiny", "llama_tiny") for a in base]
    base = [a if k == 0 or base[k - 1] != "--micro-batch" else "4" for k, a in enumerate(base)]
    full, part = os.path.join(tmp, "full_default_g.jsonl"), os.path.join(tmp, "part_default_g.jsonl")
    resumed, ck = os.path.join(tmp, "resumed_default_g.jsonl"), os.path.join(tmp, "ck_default_g")
    train(1, *base, "--steps", "6", "--metrics", full)
    train(1, *base, "--steps", "3", "--save", ck, "--metrics", part)
    one_row = [a for k, a in enumerate(base) if a != "--micro-batch" and base[k - 1] != "--micro-batch"]
    out = train(2, *one_row, "--micro-batch", "1", "--steps", "6", "--resume", ck, "--metrics", resumed)
    a, b = losses(full), losses(part)[:3] + losses(resumed)
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    ok = "resuming with the checkpoint's global batch 4" in out and len(a) == len(b) == 6 and worst <= 1e-6
    print(f"{'ok  ' if ok else 'FAIL'} no --global-batch: a one-rank checkpoint (global batch 4) resumed as DP2 "
          f"with micro-batch 1 keeps it: worst relative loss difference {worst:.2e} over 6 steps")
    return [] if ok else [("default global batch", 2)]


def bf16_zero(tmp, common, zero):
    """ZeRO under bf16 gathers a GEMM weight as the bf16 copy of each rank's shard (ZeRO-1/2 after the
    update, ZeRO-3 before each use), which a resume must round from the loaded values. Saved at step
    3 under DP2 with that ZeRO stage in bf16 and resumed the same way, the run equals the uninterrupted
    one exactly; saved by one rank (bf16) and resumed so, it stays within the bf16 layouts' bound
    (1e-3, test_bf16_layouts.py) of it. The GEMMs' path is pinned: each job times oneDNN's against the
    portable one afresh, and two jobs that chose differently sum in different orders."""
    bf16, layout, pin = ["--precision", "bf16"], ["--zero", str(zero)], {"ORIGAMI_BF16_GEMM": "portable"}
    full = os.path.join(tmp, "full_bf16_z%d.jsonl" % zero)
    train(2, *common, "--steps", "6", *layout, *bf16, "--metrics", full, env=pin)
    failures = []
    for name, ranks, saved_as, bound in (("DP2 ZeRO-%d bf16" % zero, 2, layout, 0.0), ("one rank bf16", 1, [], 1e-3)):
        tag = "bf16_z%d_%d" % (zero, ranks)
        ck, part = os.path.join(tmp, "ck_" + tag), os.path.join(tmp, "part_%s.jsonl" % tag)
        resumed = os.path.join(tmp, "resumed_%s.jsonl" % tag)
        train(ranks, *common, "--steps", "3", *saved_as, *bf16, "--save", ck, "--metrics", part, env=pin)
        out = train(2, *common, "--steps", "6", *layout, *bf16, "--resume", ck, "--metrics", resumed, env=pin)
        a, b = losses(full), losses(part)[:3] + losses(resumed)
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        ok = "resuming from" in out and len(a) == len(b) == 6 and worst <= bound
        print(f"{'ok  ' if ok else 'FAIL'} {name} checkpoint resumed as DP2 ZeRO-{zero} bf16: worst relative loss "
              f"difference {worst:.2e} from the uninterrupted DP2 ZeRO-{zero} bf16 run (bound {bound:.0e})")
        if not ok:
            failures.append((name, 2))
    return failures


if __name__ == "__main__":
    main()
