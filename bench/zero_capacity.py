"""The largest llama that fits a memory budget per rank under ZeRO-1 and ZeRO-3, at DP2 and DP4:
what sharding the parameters buys.

    /usr/bin/python3 bench/zero_capacity.py [--budget-gb 24] [--confirm-gb 4] [--dir bench/runs/capacity]

The model family: llama with hidden 2048, FFN 5632, 16 heads, vocabulary 32000 (Llama-1B-like layers),
the number of layers searched. Each layout is DPn, one micro-batch of 1 x 128 tokens, full
recomputation, fp32. For every (DP, ZeRO) the largest layer count whose predicted memory per rank
(the memory check, through `origami plan --json --layout ...`) is within --budget-gb is printed with
its parameter count. The budget of a real accelerator (24 GiB) cannot be run on this machine, so the
prediction is confirmed by runs at a budget that fits it: for --confirm-gb per rank at DP2, the
largest model of each ZeRO stage is trained for 2 steps and the peak RSS of its ranks (/usr/bin/time)
is compared with the budget and the prediction.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parallel"))
import harness as h  # noqa: E402

GIB = 2 ** 30
BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2}


def params_of(layers):
    C, F, V = BASE["hidden_size"], BASE["intermediate_size"], BASE["vocab_size"]
    return layers * (4 * C * C + 3 * C * F + 2 * C) + 2 * V * C + C


def predicted(d, cluster, layers, dp, zero):
    cfg = h.write_json(os.path.join(d, "llama_l%d.json" % layers), dict(BASE, num_hidden_layers=layers))
    p = subprocess.run([h.BIN, "plan", "--config", cfg, "--cluster", cluster, "--devices", str(dp), "--global-batch",
                        str(dp), "--seq-len", "128", "--json", "--layout",
                        "tp1 cp1 pp1 ep1 etp1 vpp1 zero%d mb1 nosp recompute=full" % zero],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("FAIL: origami plan: %s" % p.stderr[-500:])
    return json.loads(p.stdout)[0]["memory_bytes_per_rank"]["total"], cfg


def largest(d, cluster, dp, zero, budget):
    lo, hi = 0, 1
    while predicted(d, cluster, hi, dp, zero)[0] <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predicted(d, cluster, mid, dp, zero)[0] <= budget else (lo, mid)
    return lo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=24.0, help="GiB per rank")
    ap.add_argument("--confirm-gb", type=float, default=4.0, help="GiB per rank of the confirming DP2 runs")
    ap.add_argument("--dir", default=os.path.join(h.ROOT, "bench", "runs", "capacity"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    cluster = json.load(open(os.path.join(h.ROOT, "configs", "clusters", "cpu-2core.json")))
    cluster["device"]["memory_gb"] = 1e6  # list every layout: the budget is applied here
    cluster["nodes"] = 4  # DP4 (only the memory of a rank is read)
    cluster_path = h.write_json(os.path.join(a.dir, "cluster.json"), cluster)
    rows = []
    for dp in (2, 4):
        for zero in (1, 3):
            layers = largest(a.dir, cluster_path, dp, zero, a.budget_gb * GIB)
            total = predicted(a.dir, cluster_path, layers, dp, zero)[0]
            rows.append(["DP%d ZeRO-%d" % (dp, zero), str(layers), "%.2f" % (params_of(layers) / 1e9),
                         "%.2f" % (total / GIB)])
            print(" | ".join(rows[-1]), flush=True)
    print("\nlargest llama (hidden 2048) within %.0f GiB per rank (memory check):" % a.budget_gb)
    print(h.fmt_table(["layout", "layers", "parameters (B)", "predicted GiB per rank"], rows))

    data = h.prepare_data(a.dir, "capacity_corpus", n_docs=40)
    rows = []
    for zero in (1, 3):
        layers = largest(a.dir, cluster_path, 2, zero, a.confirm_gb * GIB)
        total, cfg = predicted(a.dir, cluster_path, layers, 2, zero)
        args = ["train", "--config", cfg, "--data", data, "--steps", "2", "--micro-batch", "1", "--global-batch", "2",
                "--seq-len", "128", "--recompute", "full", "--zero", str(zero), "--threads", "1",
                "--memory-limit-gb", str(a.confirm_gb)]
        rc, out, _, rss = h.run_wrapped(a.dir, "confirm_z%d_%d" % (zero, os.getpid()), 2, args,
                                        extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=1800)
        if rc != 0:
            sys.exit("FAIL: DP2 ZeRO-%d, %d layers: %s" % (zero, layers, out[-1500:]))
        peak = max(rss.values())
        rows.append(["DP2 ZeRO-%d" % zero, str(layers), "%.3f" % (params_of(layers) / 1e9), "%.2f" % (total / GIB),
                     "%.2f" % (peak / GIB), "%.3f" % (total / peak)])
        print(" | ".join(rows[-1]), flush=True)
    print("\nconfirmed at %.1f GiB per rank, DP2 (2 steps each):" % a.confirm_gb)
    print(h.fmt_table(["layout", "layers", "parameters (B)", "predicted GiB", "peak RSS GiB", "predicted / RSS"], rows))


if __name__ == "__main__":
    main()
