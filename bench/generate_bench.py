#!/usr/bin/python3
"""`origami generate` with its KV cache against `--no-kv-cache` (the whole window through the model for
every token), alternated round by round in one run.

For each case a checkpoint is made by one training step (the speed does not depend on the weights)
from a byte-level corpus (the fortunes, /usr/share/games/fortunes), then `generate` samples
--new-tokens tokens after a short prompt, greedily, in each mode. The cases:
  demo     the demo model (configs/demo_gpt2.json: gpt2, 4 layers, hidden 192, 128 positions): the
           window fills after ~128 tokens, and from then on each token recomputes the window in
           both modes (the cache pays only before that);
  gpt2-124m  GPT-2 124M's shape (12 layers, hidden 768, 12 heads, byte vocabulary) trained at 1024
           positions: every new token fits the window.
  gpt2-124m-slide  the same with GPT-2's 50257-row LM head (the byte tokenizer uses 257 of them) trained
           at 256 positions: the window fills after ~250 tokens, and from then on each token recomputes
           the window; the cache's path computes the LM head for the last position only, the
           whole-window path for every position.
Prints each mode's median seconds and new tokens/s, their ratio, and whether the texts agree.

  /usr/bin/python3 bench/generate_bench.py [--rounds 3] [--new-tokens 400] [--threads 2] [--cases demo,gpt2-124m,gpt2-124m-slide]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("ORIGAMI_ROOT", os.path.dirname(HERE))
BIN = os.environ.get("ORIGAMI_BIN", os.path.join(ROOT, "build", "origami"))

GPT2_124M = {"model_type": "gpt2", "vocab_size": 257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 256, "eos_token_id": 256}


def run(args, **kw):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit("generate_bench: origami %s failed (exit %d): %s" % (" ".join(args[:2]), p.returncode, p.stderr[-600:]))
    return p


def checkpoint(tmp, name, config, seq_len, data, threads):
    save = os.path.join(tmp, name)
    run(["train", "--config", config, "--data", data, "--steps", "1", "--seq-len", str(seq_len), "--micro-batch", "1",
         "--threads", str(threads), "--quiet", "--save", save])
    return save


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="demo,gpt2-124m")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="origami_generate_bench_")
    data = os.path.join(tmp, "fortunes")
    run(["data", "prepare", "--input", "/usr/share/games/fortunes", "--output", data, "--tokenizer", "byte"])
    big = os.path.join(tmp, "gpt2_124m.json")
    json.dump(GPT2_124M, open(big, "w"))
    big_vocab = os.path.join(tmp, "gpt2_124m_50k.json")
    json.dump(dict(GPT2_124M, vocab_size=50257), open(big_vocab, "w"))
    cases = {"demo": (os.path.join(ROOT, "configs", "demo_gpt2.json"), 128), "gpt2-124m": (big, 1024),
             "gpt2-124m-slide": (big_vocab, 256)}
    print("| case | positions | new tokens | KV cache s | whole window s | speed-up | same text |")
    print("|---|---|---|---|---|---|---|")
    for name in a.cases.split(","):
        config, seq_len = cases[name]
        ck = checkpoint(tmp, name, config, seq_len, data, a.threads)
        args = ["generate", "--checkpoint", ck, "--prompt", "The computer", "--max-new-tokens", str(a.new_tokens),
                "--temperature", "0", "--threads", str(a.threads)]
        times, texts = {"cache": [], "whole": []}, {}
        for r in range(a.rounds):
            for mode in (("cache", "whole") if r % 2 == 0 else ("whole", "cache")):  # alternated
                t0 = time.time()
                p = run(args + (["--no-kv-cache"] if mode == "whole" else []))
                times[mode].append(time.time() - t0)
                texts[mode] = p.stdout
        cache, whole = statistics.median(times["cache"]), statistics.median(times["whole"])
        print("| %s | %d | %d | %.2f (%.0f tok/s) | %.2f (%.0f tok/s) | %.2fx | %s |" % (
            name, seq_len, a.new_tokens, cache, a.new_tokens / cache, whole, a.new_tokens / whole, whole / cache,
            "yes" if texts["cache"] == texts["whole"] else "no"), flush=True)


if __name__ == "__main__":
    main()
