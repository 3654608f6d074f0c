#!/usr/bin/python3
"""Seed corpora and dictionaries of the libFuzzer targets (tests/fuzz/fuzz_*.cpp), from the seeds the
mutation fuzzer made (mutate.py --seeds-only --out DIR: DIR/seeds) plus small synthetic files.

  /usr/bin/python3 tests/fuzz/libfuzzer_corpus.py SEEDS_DIR CORPUS_ROOT

writes CORPUS_ROOT/<target>/ (one file per seed input, in the target's input format) and
CORPUS_ROOT/<target>.dict (libFuzzer -dict: JSON punctuation, the field names and string values of the seeds).
"""
import glob
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mutators  # noqa: E402
from seeds import ROOT  # noqa: E402

TEXTS = ["Hello world", "naïve café 日本語 😀 <|endoftext|> </s> <s>", "  \t\r\n", "don't 12345 3.14",
         "\u0301\u0301 e\u0301", ""]


def safetensors_file(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)]; the reference layout (header padded to 8 bytes)."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def idx_file(lengths, dtype=8):
    S = len(lengths)
    size = 2 if dtype == 8 else 4
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * size
    body = struct.pack("<%di" % S, *lengths) + struct.pack("<%dq" % S, *pointers) + \
        struct.pack("<%dq" % (S + 1), *range(S + 1))
    return b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype, S, S + 1) + body, at


EDGES = [2**31, 2**61, 2**63 - 1, -1, 0, 1e300]


def boundary_variants(j):
    """(name, copy of j) with one number of its first two levels replaced by each edge value."""
    for k, v in j.items():
        places = [((k,), v)] + ([((k, k2), v2) for k2, v2 in v.items()] if isinstance(v, dict) else [])
        for keys, x in places:
            if not isinstance(x, (int, float)) or isinstance(x, bool):
                continue
            for i, e in enumerate(EDGES):
                c = json.loads(json.dumps(j))
                target = c
                for key in keys[:-1]:
                    target = target[key]
                target[keys[-1]] = e
                yield "%s-%d" % (".".join(keys), i), c


def dictionary(texts, extra=()):
    keys, strings = mutators.json_vocabulary(texts)
    words = ["{", "}", "[", "]", ":", ",", "\"", "true", "false", "null", "-", "e+", "1e999", "NaN", "0x",
             # the numbers that break size arithmetic (int32 and int64 edges, 2^61, huge doubles)
             "0", "-1", "2147483647", "2147483648", "4294967296", "2305843009213693952", "9223372036854775807",
             "9223372036854775808", "18446744073709551615", "1e300", "1e19", "1000000000000"] + \
        list(extra) + ["\"%s\"" % k for k in keys] + ["\"%s\"" % s for s in strings if len(s) < 40]
    out = []
    for w in dict.fromkeys(words):
        b = w.encode("utf-8")
        out.append("kw%d=\"%s\"" % (len(out), "".join("\\x%02x" % c if c < 32 or c > 126 or c in (34, 92)
                                                       else chr(c) for c in b)))
    return "\n".join(out) + "\n"


def main():
    seeds, root = sys.argv[1], sys.argv[2]
    corpora = {}

    def add(target, name, data):
        d = os.path.join(root, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        corpora.setdefault(target, []).append((name, data if isinstance(data, bytes) else data.encode()))

    def read(p):
        with open(p, "rb") as f:
            return f.read()

    # safetensors: small synthetic files of each dtype, with and without metadata
    f32 = struct.pack("<6f", *range(6))
    add("safetensors", "f32", safetensors_file([("a", "F32", [2, 3], f32), ("b", "F32", [], f32[:4])]))
    add("safetensors", "mixed", safetensors_file([("h", "F16", [2], b"\x00\x3c\x00\x40"), ("bf", "BF16", [2], b"\x80\x3f\x00\x40"),
                                                  ("i", "I64", [1], struct.pack("<q", 7)), ("j", "I32", [2], struct.pack("<2i", 1, -1)),
                                                  ("z", "F32", [0, 4], b"")], {"format": "pt"}))
    add("safetensors", "f64", safetensors_file([("d", "F64", [1, 1], struct.pack("<d", 1.5))]))
    # tokenizer files: the Hub files and the datasets' own, each with a text after a NUL byte
    tok_files = sorted(glob.glob(os.path.join(seeds, "tok", "*.json"))) + \
        sorted(glob.glob(os.path.join(seeds, "d", "*.tokenizer.json")))
    for k, p in enumerate(tok_files):
        if os.path.basename(p).startswith("alias") or os.path.basename(p) == "vocab.json":
            continue
        add("tokenizer_json", "%d-%s" % (k, os.path.basename(p)), read(p) + b"\0" + TEXTS[k % len(TEXTS)].encode())
    # .idx (2 bytes: the .bin's size in 2-byte units)
    for name, lengths, dtype in (("u16", [3, 1, 5], 8), ("i32", [2, 2], 4), ("empty", [], 8), ("one", [40], 8)):
        data, bin_bytes = idx_file(lengths, dtype)
        add("idx", name, struct.pack("<H", bin_bytes // 2) + data)
    # JSON readers
    for p in sorted(glob.glob(os.path.join(ROOT, "tests", "parallel", "configs", "*.json")) +
                    glob.glob(os.path.join(ROOT, "configs", "*.json")) + glob.glob(os.path.join(ROOT, "configs", "models", "*.json"))):
        add("model_config", os.path.basename(p), read(p))
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "clusters", "*.json"))):
        add("cluster", os.path.basename(p), read(p))
    # Boundary variants of the model configs and clusters: each number of the top two levels set to an
    # edge value (libFuzzer's byte mutations rarely turn "80" into a valid 2305843009213693952).
    for target in ("model_config", "cluster"):
        for name, data in list(corpora[target]):
            for path, edge in boundary_variants(json.loads(data)):
                add(target, "%s-%s" % (name, path), json.dumps(edge))
    for p in sorted(glob.glob(os.path.join(seeds, "ck", "*", "step-*", "metadata.json"))):
        add("ckpt_metadata", p.split(os.sep)[-3], read(p))
    # strings
    for k, s in enumerate(["tp2 pp2", "tp1 cp2 ep2 etp1 zero1 mb1", "recompute=selective sp cp-comm=a2a", "vpp2 pp2 mb2",
                           "nosp zero2 cp-comm=a2a+p2p cp4", ""]):
        add("layout", str(k), s)
    for k, s in enumerate(["data/a", "0.5 a 0.5 b", "1 x 2 y 3 z", "1e-3 a\t7 b", "0.3 a 0.3 b 0.4 c"]):
        add("blend", str(k), s)

    dict_extra = {"layout": ["tp", "cp", "ep", "etp", "pp", "vpp", "zero", "mb", "sp", "nosp", "recompute=", "cp-comm=",
                             "selective", "full", "none", "p2p", "a2a", "a2a+p2p", "2147483648"],
                  "blend": ["1e308", "nan", "inf", "0x1p3", "1e-320", " "]}
    for target, files in corpora.items():
        texts = []
        for _, b in files:
            t = b.split(b"\0")[0]
            if target == "safetensors" and len(b) >= 8:
                t = b[8:8 + struct.unpack_from("<Q", b)[0]]
            texts.append(t.decode("utf-8", "replace"))
        with open(os.path.join(root, target + ".dict"), "w") as f:
            f.write(dictionary(texts if target not in ("layout", "blend", "idx") else [], dict_extra.get(target, [])))
    print("corpora: " + ", ".join("%s %d" % (t, len(f)) for t, f in sorted(corpora.items())))


if __name__ == "__main__":
    main()
