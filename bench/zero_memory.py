"""ZeRO 0, 1, 2 and 3 side by side: what a rank holds (the memory check's model state and total) and what
it measured (peak RSS of the neediest rank, /usr/bin/time), on the 16-layer llama
(hidden 256, 48.8 MiB of fp32 weights) of the sharding issue, at DP2 and DP4 with two micro-batches
per rank.

    /usr/bin/python3 bench/zero_memory.py [--ranks 2,4] [--steps 6] [--bucket-mb 16] [--dir bench/runs/zero]

ZeRO-1 reduce-scatters in place; ZeRO-2 keeps its gradient shard plus at most two buckets (one
reducing, one being written), so its gradients part is shard + the non-shard part of the two largest
buckets: --bucket-mb moves it. ZeRO-3 keeps its shard of the weights plus two units gathered (a
layer in use and the next, prefetched). glibc's mmap threshold is fixed at 64 KiB (as in the run-safety test)
so that freed library buffers leave the RSS. (Speed: bench/parallel_bench.py --layouts zero.)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))
import harness as h  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 8,
          "vocab_size": 260, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 256}
MIB = 2 ** 20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--bucket-mb", default="16")
    ap.add_argument("--dir", default=os.path.join(h.ROOT, "bench", "runs", "zero"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    cfg = h.write_json(os.path.join(a.dir, "llama16.json"), CONFIG)
    data = h.prepare_data(a.dir, "zero_corpus", n_docs=200)
    header = ["layout", "weights MiB", "gradients MiB", "optimizer MiB", "model state MiB", "check total MiB",
              "peak RSS MiB", "check / RSS"]
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        for zero in (0, 1, 2, 3):
            label = "DP%d ZeRO-%d" % (n, zero)
            mpath = os.path.join(a.dir, "dp%d_z%d.jsonl" % (n, zero))
            if os.path.exists(mpath):
                os.remove(mpath)
            args = ["train", "--config", cfg, "--data", data, "--steps", str(a.steps), "--micro-batch", "4",
                    "--global-batch", str(8 * n), "--seq-len", "128", "--threads", "1", "--zero", str(zero),
                    "--bucket-mb", a.bucket_mb, "--metrics", mpath]
            rc, out, _, rss = h.run_wrapped(a.dir, "%s_%d" % (label, os.getpid()), n, args,
                                            extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=1200)
            if rc != 0:
                sys.exit("FAIL: %s\n%s" % (label, out[-2000:]))
            recs = h.read_metrics(mpath)
            parts, totals = recs[0]["memory_bytes"], recs[0]["memory_bytes_per_rank"]
            state = [parts[k] for k in ("weights", "gradients", "optimizer state")]
            peak = max(rss.values())
            rows.append([label] + ["%.1f" % (x / MIB) for x in state + [sum(state), max(totals), peak]] +
                        ["%.3f" % (max(totals) / peak)])
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(h.fmt_table(header, rows))


if __name__ == "__main__":
    main()
