#!/usr/bin/python3
"""Tokenization speed: `origami data prepare` against Hugging Face `tokenizers`' `encode_batch`.

Builds (as tests/cli/test_hf_tokenizer.py does, nothing downloaded) a GPT-2 byte-level, a Llama-3
style (regex Split + ByteLevel) and a Llama-2 style (SentencePiece-like, byte_fallback) tokenizer.json,
generates a seeded multilingual corpus of --mb MB (documents of ~20 lines: English words, Cyrillic,
Greek, Arabic, CJK, emoji, digits, code-like punctuation, odd whitespace), and times:
  origami  `data prepare --tokenizer FILE.json --threads T`; MB/s of its "encode:" line (the
           encoding, on T threads) and of the whole command (reading, splitting, writing included)
  library  `Tokenizer.encode_batch(documents)` with RAYON_NUM_THREADS=T, best of --repeat runs
Both produce the same ids (checked on the first 2000 documents). Prints a markdown table.

  /usr/bin/python3 bench/tokenize_bench.py [--mb 30] [--threads 2] [--repeat 2]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("ORIGAMI_ROOT", os.path.dirname(HERE))
BIN = os.environ.get("ORIGAMI_BIN", os.path.join(ROOT, "build", "origami"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers starts its pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    sys.path.insert(0, os.path.join(ROOT, "tests", "cli"))
    import test_hf_tokenizer as t  # the tokenizer builders and the corpus generator
    from tokenizers import Tokenizer

    rng = random.Random(7)
    docs, size = [], 0
    while size < args.mb * 1e6:
        lines = [t.make_doc(rng) for _ in range(rng.randint(5, 40))]
        d = "".join(lines)
        if any(l in ("%", "%\r") for l in d.split("\n")) or not d.strip():
            continue
        docs.append(d)
        size += len(d.encode("utf-8"))
    train_docs = t.make_corpus(6000, seed=99)
    rows = []
    with tempfile.TemporaryDirectory(prefix="origami_tok_bench_") as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        t.write_fortune(corpus, docs)
        mb = os.path.getsize(corpus) / 1e6
        for name, build in [("GPT-2 byte-level", t.build_gpt2), ("Llama-3 style (regex Split + ByteLevel)", t.build_llama3),
                            ("Llama-2 style (SentencePiece BPE, byte_fallback)", t.build_llama2)]:
            path = os.path.join(tmp, "tokenizer.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(build(train_docs), f, ensure_ascii=False)
            tok = Tokenizer.from_file(path)
            lib_s = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                enc = tok.encode_batch(docs)
                lib_s = min(lib_s, time.perf_counter() - t0)
            best_enc, best_wall = float("inf"), float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                p = subprocess.run([BIN, "data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "ds"),
                                    "--tokenizer", path, "--split", "fortune", "--threads", str(args.threads)],
                                   capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if p.returncode != 0:
                    sys.exit(f"origami failed:\n{p.stdout}\n{p.stderr}")
                line = [l for l in p.stdout.splitlines() if l.startswith("encode:")][0]
                best_enc = min(best_enc, float(line.split(" in ")[1].split(" s")[0]))
                best_wall = min(best_wall, wall)
            # Same ids (the first documents), so the speeds compare like with like.
            import array, struct
            raw = open(os.path.join(tmp, "ds.idx"), "rb").read()
            (n,) = struct.unpack_from("<Q", raw, 18)
            lengths = array.array("i")
            lengths.frombytes(raw[34:34 + 4 * n])
            ids = array.array({8: "H", 4: "i"}[raw[17]])
            ids.frombytes(open(os.path.join(tmp, "ds.bin"), "rb").read())
            pos = 0
            for i in range(min(2000, len(docs))):
                if ids[pos:pos + lengths[i] - 1].tolist() != enc[i].ids:
                    sys.exit(f"{name}: document {i}: origami's ids differ from the library's")
                pos += lengths[i]
            rows.append((name, mb, mb / best_enc, mb / best_wall, mb / lib_s))
            print(f"{name}: origami encode {mb / best_enc:.1f} MB/s (whole command {mb / best_wall:.1f}), "
                  f"library {mb / lib_s:.1f} MB/s", file=sys.stderr, flush=True)
    print(f"\n{len(docs)} documents, {args.threads} threads (RAYON_NUM_THREADS={args.threads} for the library), "
          f"best of {args.repeat}\n")
    print("| tokenizer.json | corpus MB | origami MB/s (encode) | origami MB/s (whole prepare) | library encode_batch MB/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, mb, enc, wall, lib in rows:
        print(f"| {name} | {mb:.1f} | {enc:.1f} | {wall:.1f} | {lib:.1f} | {enc / lib:.1f}x |")


if __name__ == "__main__":
    main()
