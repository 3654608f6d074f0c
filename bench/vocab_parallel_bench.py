#!/usr/bin/env python3
"""Vocabulary parallelism benchmark: step time, per-stage busy time and peak memory with and without
--vocab-parallel, at PP2 and PP4, on a model whose vocabulary dominates.

Model (configs/models/llama-4l-vocab128k.json): llama, 4 layers, d = 512, 8 heads, FFN 1408,
vocabulary 128256 (Llama 3's), untied: the
embedding and the LM head hold 131M of its 144M parameters (91%). T = 256, micro-batch 1, 8
micro-batches per step, 1F1B, 1 thread per rank; without the flag the first stage holds the embedding
and the last the LM head and its loss.

Reported per layout (medians over the measured steps of one mpirun job):
  - step time and tokens/s, and the speed-up of --vocab-parallel over the same pipeline without it;
  - per stage: busy time (`pp_busy_ms` + `pp_vocab_ms`: forwards, backwards and the vocabulary
    passes), and the peak resident memory of the stage's process (`pp_rss_peak_bytes`), with the
    largest over the smallest of each;
  - the memory check's total per stage (`memory_bytes_per_rank`: one rank per stage here);
  - the pipeline bytes stage 0 sent (`pp_bytes`) against the planner's prediction (`comm_bytes_predicted`).

Runs are pinned to --cores with taskset. PP4 runs 4 ranks on a 2-core host: ranks share cores, so a
stage's busy time includes time descheduled while another computes; the speed-up is then bounded by
the cores (the pipeline without the flag keeps one core busy with the head while the others wait).

Usage: /usr/bin/python3 bench/vocab_parallel_bench.py [--steps 3] [--warmup 1] [--pp 2,4]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
import harness as h  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "models", "llama-4l-vocab128k.json")


def run(a, cfg, data, pp, vocab, tmp):
    mpath = os.path.join(tmp, "pp%d%s.jsonl" % (pp, "_vocab" if vocab else ""))
    args = ["train", "--config", cfg, "--data", data, "--steps", str(a.warmup + a.steps), "--micro-batch", "1",
            "--global-batch", str(a.micro), "--seq-len", str(a.seq_len), "--lr", "3e-4", "--threads", "1",
            "--metrics", mpath, "--quiet", "--pp", str(pp)] + (["--vocab-parallel"] if vocab else [])
    cmd = ["taskset", "-c", a.cores] + h.command(pp, args, a.origami)
    p = subprocess.run(cmd, capture_output=True, text=True, env=h.env(), timeout=a.timeout, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit("FAIL: %s\n%s%s" % (" ".join(cmd), p.stdout[-2000:], p.stderr[-2000:]))
    every = [json.loads(line) for line in open(mpath)]
    rows = every[a.warmup:]
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    busy = [statistics.median(r["pp_busy_ms"][s] + r.get("pp_vocab_ms", [0] * pp)[s] for r in rows) for s in range(pp)]
    return {"ms": med(lambda r: r["ms"]), "tps": med(lambda r: r["tokens_per_s"]), "busy": busy,
            "rss": rows[-1]["pp_rss_peak_bytes"], "pp_bytes": rows[-1]["pp_bytes"],
            "checked": every[0].get("memory_bytes_per_rank", []),
            "predicted": every[0].get("comm_bytes_predicted", {}).get("pp"), "layout": rows[-1]["layout"]}


def spread(xs):
    return max(xs) / min(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--cores", default="0-%d" % (os.cpu_count() - 1))
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--origami", default=os.environ.get("ORIGAMI_BIN", os.path.join(ROOT, "build", "origami")))
    a = ap.parse_args()
    tmp = h.tmpdir("origami_vpb_")
    try:
        data = h.prepare_data(tmp, n_docs=400)
        cfg = CONFIG
        host = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                              text=True).stdout.strip()
        print("host: %s, %d cores; llama 4 layers d=512 V=128256, T=%d, %d micro-batches of 1 row" % (
            host, os.cpu_count(), a.seq_len, a.micro), flush=True)
        print("| layout | step | tokens/s | speed-up | busy per stage (ms) | max/min | peak RSS per stage (MiB) "
              "| max/min | memory check per stage (MiB) | pp bytes = predicted |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for pp in [int(x) for x in a.pp.split(",")]:
            base = None
            for vocab in (False, True):
                r = run(a, cfg, data, pp, vocab, tmp)
                base = base or r
                speed = "%.2fx" % (base["ms"] / r["ms"]) if vocab else "-"
                pred = "yes" if r["predicted"] is not None and abs(r["pp_bytes"][0] - r["predicted"]) < 1 else \
                    "%s vs %s" % (r["pp_bytes"][0], r["predicted"])
                print("| PP%d%s | %.0f ms | %.0f | %s | %s | %.2f | %s | %.2f | %s | %s |" % (
                    pp, " vocab-parallel" if vocab else "", r["ms"], r["tps"], speed,
                    " / ".join("%.0f" % b for b in r["busy"]), spread(r["busy"]),
                    " / ".join("%.0f" % (b / 2**20) for b in r["rss"]), spread(r["rss"]),
                    " / ".join("%.0f" % (b / 2**20) for b in r["checked"]), pred), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
