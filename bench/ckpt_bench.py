"""Checkpoint save and load on a ~470M-parameter llama (hidden 1024, 24 layers, FFN 4096, vocabulary
32000) on 1, 2, 4 and 8 ranks: save time (synchronous), the step loop's stall with --async-save,
load time (--resume under the same layout), bytes per rank, and the aggregate write bandwidth
against what `dd` (conv=fsync) achieves on the same disk.

    /usr/bin/python3 bench/ckpt_bench.py [--ranks 1,2,4,8] [--dir bench/runs/ckpt]

Layouts shard the state over the ranks (1: one rank; 2: PP2; 4: TP2 x PP2; 8: TP2 x PP4), so each
rank writes 1/n of the ~5.6 GB of weights and AdamW moments. One measured save per run (the
first-step save would include page-cache warm-up of a fresh file system: both runs save after
step 2). Needs ~12 GB of memory for one rank with --async-save and ~12 GB free disk.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))
import harness as h  # noqa: E402

LAYOUT = {1: [], 2: ["--pp", "2"], 4: ["--tp", "2", "--pp", "2"], 8: ["--tp", "2", "--pp", "4"]}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
          "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
          "vocab_size": 32000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def dd_bandwidth(d, gb=4):
    path = os.path.join(d, "dd.bin")
    t0 = time.time()
    subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=16M", "count=%d" % (gb * 64), "conv=fsync"],
                   capture_output=True, check=True)
    dt = time.time() - t0
    os.remove(path)
    return gb * 64 * 16 * 2**20 / dt


def train(n, args):
    rc, out, wall = h.run(n if n > 1 else 0, args, timeout=1800)
    if rc != 0:
        sys.exit("FAIL: %s\n%s" % (" ".join(args), out[-2000:]))
    return out, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--dir", default=os.path.join(h.ROOT, "bench", "runs", "ckpt"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    cfg = h.write_json(os.path.join(a.dir, "llama_470m.json"), CONFIG)
    data = h.prepare_data(a.dir, "ckpt_corpus", n_docs=400)
    dd = dd_bandwidth(a.dir)
    print("dd (16 MiB blocks, conv=fsync): %.0f MB/s" % (dd / 1e6), flush=True)
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        common = ["train", "--config", cfg, "--data", data, "--micro-batch", "1", "--seq-len", "32", "--lr", "1e-4",
                  "--threads", str(max(1, 2 // n)), "--quiet"] + LAYOUT[n]
        row = {"ranks": n, "layout": " ".join(LAYOUT[n]) or "one rank"}
        for mode in ("sync", "async"):
            ck, m = os.path.join(a.dir, "ck_%d_%s" % (n, mode)), os.path.join(a.dir, "m_%d_%s.jsonl" % (n, mode))
            shutil.rmtree(ck, ignore_errors=True)
            if os.path.exists(m):
                os.remove(m)
            extra = ["--steps", "3", "--save-every", "2", "--save", ck] + (["--async-save"] if mode == "async" else [])
            out, _ = train(n, common + ["--metrics", m] + extra)
            step2 = [r for r in h.read_metrics(m) if r["step"] == 2][0]
            row[mode + "_blocked_s"] = step2["save_blocked_s"]
            # The step-2 save's own duration (from the start of the save to its commit).
            row[mode + "_save_s"] = float(re.search(r"saved checkpoint \S+step-2 \(.*?, ([0-9.]+) s\)", out).group(1))
            if mode == "sync":
                meta = json.load(open(os.path.join(ck, "step-2", "metadata.json")))
                sizes = [f["bytes"] for f in meta["files"]]
                row["bytes_total"], row["bytes_per_rank_max"] = sum(sizes), max(sizes)
                out, _ = train(n, common + ["--steps", "3", "--resume", os.path.join(ck, "step-2")])
                row["load_s"] = float(re.search(r"resuming from .* \(read in ([0-9.]+) s\)", out).group(1))
                shutil.rmtree(os.path.join(ck, "step-3"), ignore_errors=True)
            shutil.rmtree(ck, ignore_errors=True)
        row["write_MBps"] = row["bytes_total"] / row["sync_save_s"] / 1e6
        row["vs_dd"] = row["bytes_total"] / row["sync_save_s"] / dd
        row["stall_vs_sync"] = row["async_blocked_s"] / row["sync_save_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| ranks | layout | bytes per rank (max) | sync save | write MB/s (vs dd) | async stall (vs sync save) | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %d | %s | %.2f GB | %.2f s | %.0f (%.0f%%) | %.3f s (%.1f%%) | %.2f s |" % (
            r["ranks"], r["layout"], r["bytes_per_rank_max"] / 1e9, r["sync_save_s"], r["write_MBps"],
            100 * r["vs_dd"], r["async_blocked_s"], 100 * r["stall_vs_sync"], r["load_s"]))
    print("dd: %.0f MB/s" % (dd / 1e6))
    json.dump({"dd_Bps": dd, "rows": rows}, open(os.path.join(a.dir, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
