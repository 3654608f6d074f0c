#!/usr/bin/env python3
"""How fast `origami plan` searches: the layouts it counts, evaluates in full, accepts and fits, and
its wall time, for Mixtral 8x7B (32 layers) and Mixtral 8x22B (56 layers) on 8, 64, 1024 and 8192
H100s (configs/clusters/dgx-h100.json, extended to 1024 nodes for 8192 devices), at 4096 tokens and
a global batch of 1024 rows (4096 for 8192 devices). Each search runs --rounds times; the median
wall time is reported (the machine's other load adds to it).

Usage: /usr/bin/python3 bench/plan_search_bench.py [--rounds 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.environ.get("ORIGAMI_BIN", os.path.join(ROOT, "build", "origami"))
MODELS = [("Mixtral 8x7B", "configs/models/mixtral-8x7b.json"), ("Mixtral 8x22B", "configs/models/mixtral-8x22b.json")]
COUNTS = re.compile(r"(\d+) layouts, (\d+) evaluated .*?, (\d+) of them the runtime accepts, (\d+) fit")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with open(os.path.join(ROOT, "configs", "clusters", "dgx-h100.json")) as f:
        cluster = json.load(f)
    cluster["nodes"] = 1024
    big = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(cluster, big)
    big.close()
    print("| model | devices | global batch | layouts | evaluated in full | accepted | fit | best layout | predicted step s | MFU | search s (median of %d) |" % a.rounds)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, config in MODELS:
        for devices in (8, 64, 1024, 8192):
            G = 4096 if devices == 8192 else 1024
            clus = big.name if devices > 1024 else os.path.join(ROOT, "configs", "clusters", "dgx-h100.json")
            cmd = [BIN, "plan", "--config", os.path.join(ROOT, config), "--cluster", clus, "--devices", str(devices),
                   "--global-batch", str(G), "--seq-len", "4096", "--top", "1"]
            times, out = [], ""
            for _ in range(a.rounds):
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True)
                times.append(time.time() - t0)
                out = p.stdout + p.stderr
            counts = COUNTS.search(out)
            # nothing fits: the error names the layouts the runtime accepts (exit 1, that message alone)
            none_fit = re.search(r"none of the (\d+) layouts the runtime accepts", out)
            if p.returncode == 0 and counts:
                row = [l for l in out.splitlines() if l.startswith("| tp")][0].split("|")
                best, step, mfu = row[1].strip(), row[2].strip(), row[4].strip()
                figures = counts.groups()
            elif p.returncode == 1 and none_fit:
                best, step, mfu = "none fits in 80 GB", "-", "-"
                figures = ("-", "-", none_fit.group(1), "0")
            else:  # any other failure is the benchmark's, not a row
                sys.exit("plan_search_bench: %s failed (exit %s): %s" % (" ".join(cmd), p.returncode, out[-600:]))
            print("| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %.2f |" % (
                name, devices, G, *figures, best, step, mfu, statistics.median(times)), flush=True)
    os.unlink(big.name)


if __name__ == "__main__":
    sys.exit(main())
