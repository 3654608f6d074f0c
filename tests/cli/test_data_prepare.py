#!/usr/bin/python3
"""`origami data prepare` against independent oracles.

(a) token ids: a ByteLevel BPE trained with Hugging Face `tokenizers` on fortunes files (plus a file
    of non-ASCII text and odd whitespace); origami's gpt2 tokenizer, fed its vocab.json/merges.txt,
    must store exactly HF's ids for every document, each followed by <|endoftext|>. The byte
    tokenizer must store the raw bytes followed by 256 (a literal <|endoftext|> in the text is 256 too, as
    in the gpt2 tokenizer and in the Hub file `ckpt export --hf` writes for it).
(b) the .idx is parsed here, from Megatron's layout, and every field is checked.
(c) user mistakes (missing input, truncated or corrupt .idx, bad tokenizer files) fail with a
    non-zero exit and a message naming the file.
(d) data info of a dataset holding token 2000000000 runs in a 1 GiB address space; a file over 16 MiB
    that --split auto takes as one document, or as '%' records one of which is over 16 MiB, gets a
    warning; data decode of a Megatron dataset whose documents are several sequences (sentences) prints
    documents, and --first counts them; a rerun whose
    --output lies in its --input directory reads only the documents, and an --input naming one of
    --output's files is refused.

Run by ctest with ORIGAMI_BIN (build/origami); exits non-zero on the first failed assert.
"""
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from tokenizers import ByteLevelBPETokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import ORIGAMI, check, fail, run  # noqa: E402

FORTUNES = "/usr/share/games/fortunes"
EOT = "<|endoftext|>"


def byte_ids(text):
    """The byte tokenizer's ids: the UTF-8 bytes, each literal <|endoftext|> as 256."""
    ids = []
    for i, part in enumerate(text.split(EOT)):
        ids += ([256] if i else []) + list(part.encode("utf-8"))
    return ids

# Documents meant to trip a hand-written pre-tokenizer: scripts, marks, numbers of other systems,
# Unicode whitespace, contractions, runs of spaces, CRLF, control characters, a literal special token.
TRICKY_DOCS = [
    "Ça va? Déjà vu — naïve café, Ærøskøbing; Straße ŁÓDŹ ǅ ª º µ\n",
    "Καλημέρα κόσμε! Привет, мир! Ёжик в тумане. Ἀθῆναι\n",
    "日本語のテキスト、中文字符。한국어 문장. カタカナ ｶﾀｶﾅ ＡＢＣ\n",
    "numbers: ½ ² ³ Ⅻ ٣٤٥ ๑๒ 12,345.67 1e10 0x1F 007\n",
    "combining: e\u0301 a\u0308o\u0308 n\u0303 and zwj: 👩\u200d💻 👍🏽 🇩🇪 ✓ → ∑\n",
    "spaces:  two   three\t\ttabs \u00a0nbsp\u3000ideographic\u2003em\u2028ls  \n\n\n  trailing   \n",
    "it's I'm we'll they've she'd you're DON'T 'sup ''s rock'n'roll '\n",
    "crlf line one\r\ncrlf line two\r\n\x0bvtab\x0cformfeed \x01ctrl\x7fdel\n",
    "abcДЕФ123def mixed-scripts_under_score ___ --- ... !!! ?!?\n",
    "ends with spaces and a newline run   \n\n\n\n",
    "has a literal " + EOT + " inside and " + EOT + EOT + " twice\n",
    "   leading spaces\n        deep indent\n\tand tab",
]


def split_fortune(text):
    """The documented --split fortune rule: records between lines that hold only '%'."""
    docs, start, pos = [], 0, 0
    while pos < len(text):
        end = text.find("\n", pos)
        nxt = len(text) if end < 0 else end + 1
        line = text[pos:(len(text) if end < 0 else end)]
        if line in ("%", "%\r"):
            docs.append(text[start:pos])
            start = nxt
        pos = nxt
    docs.append(text[start:])
    return docs


def is_blank(doc):
    return all(c in " \t\n\x0b\x0c\r" for c in doc)


def documents_of(files):
    docs = []
    for f in files:
        text = open(f, "rb").read().decode("utf-8")
        parts = split_fortune(text) if any(l in ("%", "%\r") for l in text.split("\n")) else [text]
        docs += [d for d in parts if not is_blank(d)]
    return docs


def parse_megatron_idx(path):
    """Independent reader of Megatron's MMIDIDX index (megatron/core/datasets/indexed_dataset.py)."""
    raw = open(path, "rb").read()
    check(raw[:9] == b"MMIDIDX\x00\x00", f"{path}: magic {raw[:9]!r}")
    (version,) = struct.unpack_from("<Q", raw, 9)
    (dtype_code,) = struct.unpack_from("<B", raw, 17)
    seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = list(struct.unpack_from(f"<{seq_count}i", raw, off))
    off += 4 * seq_count
    pointers = list(struct.unpack_from(f"<{seq_count}q", raw, off))
    off += 8 * seq_count
    doc_idx = list(struct.unpack_from(f"<{doc_count}q", raw, off))
    off += 8 * doc_count
    check(off == len(raw), f"{path}: {len(raw) - off} bytes after the document indices")
    return dict(version=version, dtype_code=dtype_code, seq_count=seq_count, doc_count=doc_count,
                lengths=lengths, pointers=pointers, doc_idx=doc_idx)


def check_dataset(prefix, expected_docs, dtype_code):
    """(b): every field of the .idx, and the .bin, against the expected token lists."""
    idx = parse_megatron_idx(prefix + ".idx")
    item = {8: 2, 4: 4}[dtype_code]
    n = len(expected_docs)
    check(idx["version"] == 1, f"version {idx['version']}")
    check(idx["dtype_code"] == dtype_code, f"dtype code {idx['dtype_code']} != {dtype_code}")
    check(idx["seq_count"] == n, f"sequence count {idx['seq_count']} != {n} documents")
    check(idx["doc_count"] == n + 1, f"document count {idx['doc_count']} != documents + 1 = {n + 1}")
    raw = open(prefix + ".bin", "rb").read()
    fmt_char = "H" if item == 2 else "i"
    for i, d in enumerate(expected_docs[:idx["seq_count"]]):
        if idx["lengths"][i] == len(d):
            continue
        got = list(struct.unpack_from(f"<{idx['lengths'][i]}{fmt_char}", raw, idx["pointers"][i]))
        k = next((j for j in range(min(len(got), len(d))) if got[j] != d[j]), min(len(got), len(d)))
        fail(f"{prefix}: document {i} has {len(got)} tokens, expected {len(d)}; first difference at token {k}: "
             f"origami {got[max(0, k - 3):k + 5]} vs expected {d[max(0, k - 3):k + 5]}")
    ptrs, p = [], 0
    for d in expected_docs:
        ptrs.append(p)
        p += item * len(d)
    check(idx["pointers"] == ptrs, "sequence pointers are not the running byte offsets")
    check(idx["doc_idx"] == list(range(n + 1)), "document indices are not 0..S")
    check(len(raw) == p, f".bin has {len(raw)} bytes, expected {p}")
    fmt = "<%d%s" % (len(raw) // item, "H" if item == 2 else "i")
    stored = list(struct.unpack(fmt, raw))
    pos = 0
    for i, d in enumerate(expected_docs):
        got = stored[pos:pos + len(d)]
        if got != d:
            k = next(j for j in range(min(len(got), len(d))) if got[j] != d[j]) if got[:len(d)] != d[:len(got)] else min(len(got), len(d))
            fail(f"{prefix}: document {i} differs at token {k}: origami {got[max(0, k - 3):k + 5]} "
                 f"vs expected {d[max(0, k - 3):k + 5]}")
        pos += len(d)


def main():
    tmp = tempfile.mkdtemp(prefix="origami_data_test_")
    try:
        # ---- corpus: three fortunes files, a tricky file, plus entries a directory walk must skip
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(os.path.join(corpus, "sub"))
        for name in ["fortunes", "literature", "riddles"]:
            shutil.copy(os.path.join(FORTUNES, name), os.path.join(corpus, name))
        with open(os.path.join(corpus, "sub", "tricky"), "w", encoding="utf-8", newline="") as f:
            f.write("\n%\n".join(TRICKY_DOCS) + "\n%\n")
        with open(os.path.join(corpus, "sub", "plain.txt"), "w", encoding="utf-8", newline="") as f:
            f.write("A file without separators is one document.\n100% sure: a '%' inside a line is text.\n")
        with open(os.path.join(corpus, "riddles.dat"), "wb") as f:  # strfile companion: skipped
            f.write(b"\x00\x00\x00\x02\xff\xfe junk")
        os.symlink("fortunes", os.path.join(corpus, "fortunes.u8"))  # symlink: skipped
        with open(os.path.join(corpus, ".hidden"), "w") as f:
            f.write("skipped\n")
        files = sorted(os.path.join(corpus, n) for n in ["fortunes", "literature", "riddles", "sub/tricky", "sub/plain.txt"])
        docs = documents_of(files)
        check(len(docs) > 500, f"only {len(docs)} documents in the demo corpus")

        # ---- HF ByteLevel BPE, trained on the same files
        hf = ByteLevelBPETokenizer()
        hf.train(files, vocab_size=1500, min_frequency=2, special_tokens=[EOT], show_progress=False)
        tok_dir = os.path.join(tmp, "tok")
        os.makedirs(tok_dir)
        vocab_path, merges_path = hf.save_model(tok_dir)
        eod = hf.token_to_id(EOT)

        # ---- (a) gpt2: origami's ids == HF's ids, document by document
        prefix = os.path.join(tmp, "ds_gpt2")
        t0 = time.time()
        p = run("data", "prepare", "--input", corpus, "--output", prefix, "--tokenizer", "gpt2",
                "--vocab", vocab_path, "--merges", merges_path)
        print(p.stdout.strip(), f"[{time.time() - t0:.2f} s]")
        check(f"{len(docs)} documents" in p.stdout, f"summary does not report {len(docs)} documents:\n{p.stdout}")
        check("5 files" in p.stdout, f"summary should count 5 input files:\n{p.stdout}")
        expected = [enc.ids + [eod] for enc in hf.encode_batch(docs)]
        check(any(len(e) > 2 and eod in e[:-1] for e in expected), "the literal <|endoftext|> test document is missing")
        check_dataset(prefix, expected, dtype_code=8)

        # The tokenizer JSON written next to the dataset holds the same vocabulary and merges.
        import json
        tj = json.load(open(prefix + ".tokenizer.json", encoding="utf-8"))
        check(tj["type"] == "gpt2", f"tokenizer.json type {tj['type']}")
        check(tj["vocab"] == json.load(open(vocab_path, encoding="utf-8")), "tokenizer.json vocab != vocab.json")
        merges = [l for l in open(merges_path, encoding="utf-8").read().split("\n")[1:] if l]
        check(tj["merges"] == merges, "tokenizer.json merges != merges.txt")
        # Re-preparing with the saved JSON tokenizer gives the same tokens.
        p = run("data", "prepare", "--input", os.path.join(corpus, "sub", "tricky"), "--output",
                os.path.join(tmp, "ds_json"), "--tokenizer", prefix + ".tokenizer.json")
        tricky_docs = documents_of([os.path.join(corpus, "sub", "tricky")])
        check(len(tricky_docs) == len(TRICKY_DOCS), f"{len(tricky_docs)} tricky documents")
        check_dataset(os.path.join(tmp, "ds_json"), [enc.ids + [eod] for enc in hf.encode_batch(tricky_docs)], 8)

        # The whole Debian fortunes directory (ASCII art, odd spacing), same oracle; .dat and .u8 skipped.
        all_files = sorted(os.path.join(FORTUNES, n) for n in os.listdir(FORTUNES)
                           if not os.path.islink(os.path.join(FORTUNES, n)) and not n.endswith(".dat"))
        all_docs = documents_of(all_files)
        prefix_all = os.path.join(tmp, "ds_all")
        p = run("data", "prepare", "--input", FORTUNES, "--output", prefix_all, "--tokenizer", "gpt2",
                "--vocab", vocab_path, "--merges", merges_path)
        print(p.stdout.strip())
        check(f"{len(all_files)} files" in p.stdout, f"expected {len(all_files)} files:\n{p.stdout}")
        check_dataset(prefix_all, [enc.ids + [eod] for enc in hf.encode_batch(all_docs)], dtype_code=8)

        # ---- (a) byte tokenizer: raw bytes + 256; --split line
        prefix_b = os.path.join(tmp, "ds_byte")
        run("data", "prepare", "--input", corpus, "--output", prefix_b)
        check_dataset(prefix_b, [byte_ids(d) + [256] for d in docs], dtype_code=8)
        check(json.load(open(prefix_b + ".tokenizer.json")) == {"type": "byte"}, "byte tokenizer.json")
        prefix_l = os.path.join(tmp, "ds_line")
        run("data", "prepare", "--input", os.path.join(corpus, "sub", "plain.txt"), "--output", prefix_l,
            "--split", "line")
        check_dataset(prefix_l, [list(b"A file without separators is one document.") + [256],
                                 list(b"100% sure: a '%' inside a line is text.") + [256]], dtype_code=8)
        p = run("data", "info", "--data", prefix)
        check(f"{len(docs)} documents" in p.stdout and "gpt2" in p.stdout, f"data info output:\n{p.stdout}")

        # ---- (c) user mistakes: non-zero exit, one message naming the file and the rule
        def expect_error(args, *needles):
            p = run(*args, expect_ok=False)
            check(p.returncode != 0, f"origami {' '.join(args)} should fail, exited 0")
            for n in needles:
                check(n in p.stderr, f"origami {' '.join(args)}: stderr lacks {n!r}:\n{p.stderr}")

        missing = os.path.join(tmp, "no_such_dir")
        expect_error(["data", "prepare", "--input", missing, "--output", os.path.join(tmp, "x")], missing, "no such file")
        expect_error(["data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "x"), "--tokenizer", "gpt2"],
                     "--vocab")
        expect_error(["data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "nodir", "x")], "does not exist")
        expect_error(["data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "x"), "--split", "words"],
                     "--split", "words")
        expect_error(["data", "frobnicate"], "unknown subcommand", "frobnicate")
        # A vocabulary without <|endoftext|> cannot mark document ends.
        vocab = json.load(open(vocab_path, encoding="utf-8"))
        del vocab[EOT]
        bad_vocab = os.path.join(tmp, "bad_vocab.json")
        json.dump(vocab, open(bad_vocab, "w", encoding="utf-8"))
        expect_error(["data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "x"), "--tokenizer", "gpt2",
                      "--vocab", bad_vocab, "--merges", merges_path], bad_vocab, EOT)
        bad_merges = os.path.join(tmp, "bad_merges.txt")
        open(bad_merges, "w").write("#version: 0.2\nĠ t\nthree tokens here\n")
        expect_error(["data", "prepare", "--input", corpus, "--output", os.path.join(tmp, "x"), "--tokenizer", "gpt2",
                      "--vocab", vocab_path, "--merges", bad_merges], bad_merges + ":3")
        check(not os.path.exists(os.path.join(tmp, "x.bin")) and not os.path.exists(os.path.join(tmp, "x.bin.tmp")),
              "a failed prepare left files behind")

        # Damaged datasets, opened by `origami data info`.
        def damaged(name, mutate):
            dst = os.path.join(tmp, name)
            shutil.copy(prefix + ".bin", dst + ".bin")
            shutil.copy(prefix + ".idx", dst + ".idx")
            raw = bytearray(open(dst + ".idx", "rb").read())
            open(dst + ".idx", "wb").write(mutate(raw))
            return dst

        d = damaged("truncated", lambda raw: raw[:len(raw) - 5])
        expect_error(["data", "info", "--data", d], d + ".idx", "truncated")
        d = damaged("short_header", lambda raw: raw[:20])
        expect_error(["data", "info", "--data", d], d + ".idx", "truncated")
        d = damaged("magic", lambda raw: b"XXIDIDX\x00\x00" + raw[9:])
        expect_error(["data", "info", "--data", d], d + ".idx", "bad magic")
        d = damaged("version", lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:])
        expect_error(["data", "info", "--data", d], d + ".idx", "version 2")
        d = damaged("dtype", lambda raw: raw[:17] + bytes([7]) + raw[18:])
        expect_error(["data", "info", "--data", d], d + ".idx", "dtype code 7")
        os.remove(d + ".bin")
        expect_error(["data", "info", "--data", d], d + ".bin", "no such file")
        expect_error(["data", "info", "--data", os.path.join(tmp, "nothing")], os.path.join(tmp, "nothing") + ".idx")

        # A token id near 2^31 (a corrupt or foreign dataset) is counted without 2^31 counters: data info
        # runs in a 1 GiB address space.
        d = damaged("large_id", lambda raw: raw)
        with open(d + ".idx", "wb") as f:  # one int32 document of 5 tokens, in Megatron's layout
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([4]) + struct.pack("<QQ", 1, 2))
            f.write(struct.pack("<i", 5) + struct.pack("<q", 0) + struct.pack("<qq", 0, 1))
        open(d + ".bin", "wb").write(struct.pack("<5i", 1, 2, 3, 2000000000, 2))
        p = subprocess.run(["bash", "-c", 'ulimit -v 1048576 && exec "$0" data info --data "$1"', ORIGAMI, d],
                           capture_output=True, text=True, timeout=120)
        check(p.returncode == 0 and "5 tokens" in p.stdout and "unigram entropy: 1.3322" in p.stdout,
              f"data info of a dataset holding token 2000000000:\n{p.stdout}{p.stderr}")

        # A rerun whose --output lies in its --input directory reads the documents, not its own files.
        again = os.path.join(tmp, "again")
        os.mkdir(again)
        open(os.path.join(again, "a.txt"), "w").write("alpha beta\n")
        for k in range(2):
            if k:  # (and not the temporary index a crash while it was written would leave)
                open(os.path.join(again, "corpus.idx.tmp.tmp"), "wb").write(b"MMIDIDX\x00\x00 half an index")
            p = run("data", "prepare", "--input", again, "--output", os.path.join(again, "corpus"), "--tokenizer", "byte",
                    "--split", "file")
            check("prepared 1 file, 1 documents, 12 tokens" in p.stdout, f"a rerun in the input directory:\n{p.stdout}")
        check_dataset(os.path.join(again, "corpus"), [list(b"alpha beta\n") + [256]], dtype_code=8)
        expect_error(["data", "prepare", "--input", os.path.join(again, "corpus.bin"), "--output",
                      os.path.join(again, "corpus")], "corpus.bin is one of the files --output")
        # An --output naming a file rather than the prefix, and a dataset file's place taken by a
        # directory, are refused before the work (the dataset there stays whole).
        expect_error(["data", "prepare", "--input", again, "--output", os.path.join(again, "corpus.bin")],
                     "ends in .bin: give the prefix without it")
        os.mkdir(os.path.join(again, "other.idx"))
        expect_error(["data", "prepare", "--input", os.path.join(again, "a.txt"), "--output", os.path.join(again, "other")],
                     "other.idx' is a directory, where the dataset's file goes")
        check_dataset(os.path.join(again, "corpus"), [list(b"alpha beta\n") + [256]], dtype_code=8)

        # A file over 16 MiB without a '%' line, which --split auto takes whole, gets a warning naming
        # --split line (more often a document per line than one document); --split line none.
        lines = os.path.join(tmp, "lines.txt")
        with open(lines, "w") as f:
            f.writelines("line %d of a file of one document per line\n" % i for i in range(400000))
        p = run("data", "prepare", "--input", lines, "--output", os.path.join(tmp, "lines_auto"))
        check("prepared 1 file, 1 documents" in p.stdout and "has no '%' line, so --split auto takes it as one document"
              in p.stderr and "--split line makes each line one" in p.stderr, f"auto on a large file:\n{p.stderr}")
        p = run("data", "prepare", "--input", lines, "--output", os.path.join(tmp, "lines_line"), "--split", "line")
        check("400000 documents" in p.stdout and "warning" not in p.stderr, f"--split line:\n{p.stdout}{p.stderr}")
        # A Megatron dataset prepared with --split-sentences holds a document as several sequences: data
        # decode prints documents, and --first counts them (it printed each sentence as a document).
        sent = os.path.join(tmp, "sentences")
        parts = [b"First sentence.", b" Second one.", b"Other document."]
        tokens = [list(parts[0]), list(parts[1]) + [256], list(parts[2]) + [256]]
        with open(sent + ".bin", "wb") as f:
            f.write(b"".join(struct.pack("<%dH" % len(t), *t) for t in tokens))
        with open(sent + ".idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", 3, 3))
            f.write(struct.pack("<3i", *(len(t) for t in tokens)))
            f.write(struct.pack("<3q", 0, 2 * len(tokens[0]), 2 * (len(tokens[0]) + len(tokens[1]))))
            f.write(struct.pack("<3q", 0, 2, 3))  # documents: sequences [0, 2) and [2, 3)
        byte_prefix = os.path.join(tmp, "lines_line")  # (a byte-tokenizer dataset made above)
        shutil.copy(byte_prefix + ".tokenizer.json", sent + ".tokenizer.json")
        p = run("data", "decode", "--data", sent, "--skip-special")
        check(p.stdout == "First sentence. Second one.\nOther document.\n", f"decode by documents: {p.stdout!r}")
        p = run("data", "decode", "--data", sent, "--skip-special", "--first", "1")
        check(p.stdout == "First sentence. Second one.\n", f"decode --first 1 of sentences: {p.stdout!r}")
        # One stray '%' line makes auto take the file as two fortune records, one over 16 MiB: a warning too
        # (before, none).
        with open(lines, "a") as f:
            f.write("%\nlast line\n")
        p = run("data", "prepare", "--input", lines, "--output", os.path.join(tmp, "lines_stray"))
        check("prepared 1 file, 2 documents" in p.stdout and "has a '%' line, so --split auto takes it as records "
              "between '%' lines, and one record is 19 MB" in p.stderr, f"auto with a stray '%' line:\n{p.stderr}")
        print("ok")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
