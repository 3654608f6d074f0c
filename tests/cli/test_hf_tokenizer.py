#!/usr/bin/python3
"""`origami data prepare --tokenizer FILE.json` on Hugging Face `tokenizers` files, against the library.

Six files are built here with `tokenizers` (nothing downloaded), one per family origami reads, each
trained on a synthetic corpus:
  gpt2    ByteLevel pre-tokenizer/decoder, <|endoftext|>; added tokens with lstrip/rstrip and single_word
  llama3  Split(Llama-3 regex, Isolated) + ByteLevel(use_regex=false), ignore_merges, merges as pairs,
          TemplateProcessing with <|begin_of_text|>, eod <|end_of_text|>
  qwen2   NFC normalizer + Split(Qwen2 regex) + ByteLevel, no BOS, a normalized added token,
          eod from a tokenizer_config.json beside the file
  deepseek3  three Isolated Splits in a row (digits, CJK, words) + ByteLevel(use_regex=false), as DeepSeek-V3
  llama2  Prepend/Replace normalizer, byte_fallback BPE with the 256 <0xNN> tokens, <unk> (fused),
          decoder Replace/ByteFallback/Fuse/Strip, TemplateProcessing with <s>, eod </s>
          (and the older layout: Metaspace pre-tokenizer and decoder instead of the normalizer)
Then, on a seeded corpus of 50,000 documents (ASCII words, CJK, emoji with ZWJ sequences, combining
marks, digit runs, runs of spaces and tabs, CRLF, Unicode spaces, the special tokens in the text):
  (a) the ids origami stores are the library's `encode(doc).ids` followed by the eod id, for every document;
  (b) `origami data decode` gives the library's `decode(ids, skip_special_tokens=False)` and, with
      --skip-special, its default `decode(ids)` (so the text comes back wherever the library's does);
  (c) PREFIX.tokenizer.json records the file verbatim and the eod choice, and re-preparing with it
      gives the same tokens;
  (d) unsupported components and a missing end-of-document token exit 1 with one message naming them;
  (e) end to end with the llama3 file (the export's tokenizer_config.json naming its eod): train (document
      masking at its eod) with --save, `generate` from
      the checkpoint, and `ckpt export --hf` writing the Hub file that the library loads;
  (f) a RobertaProcessing file, whose post-processor closes each sequence with the eod </s>: the
      documents are the library's ids (one </s> each, not a second appended), with a Split(a*,
      merged_with_next) pre-tokenizer whose empty matches right after a match the library skips;
  (g) origami's byte and gpt2 tokenizers exported by `ckpt export --hf` load in the library as the
      byte-level BPE they are and encode and decode 3000 documents as origami stored them; an
      --optimizer export resumes on the data.

Run by ctest with ORIGAMI_BIN (build/origami); exits non-zero on the first failed check.
"""
import array
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import check, fail, run  # noqa: E402

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3_REGEX = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                   r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_DOCS = 50_000


# ---- the corpus

WORDS = ("the of and to in is it that was for on are with as his they be at one have this from or had by hot "
         "word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find hello hellos Hello HELLO don't it's they'LL we've I'm she'd "
         "you're rock'n'roll naïve café résumé Straße Ærøskøbing ŁÓDŹ").split()
SCRIPTS = ["Привет", "мир", "Ёжик", "Καλημέρα", "κόσμε", "Ἀθῆναι", "مرحبا", "שלום", "नमस्ते", "ภาษาไทย",
           "日本語", "テキスト", "カタカナ", "ｶﾀｶﾅ", "中文字符", "한국어", "문장", "ＡＢＣ", "ǅ", "ª", "µ"]
EMOJI = ["😀", "👍🏽", "👩\u200d💻", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇩🇪", "🇯🇵", "✓", "→", "∑", "♥\ufe0f",
         "🤖", "🧑🏿\u200d🚀"]
COMBINING = ["e\u0301", "a\u0308", "o\u0308", "n\u0303", "cafe\u0301", "A\u030a", "u\u0308\u0301", "\u0301", "z\u0335"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", " \t ", "\u00a0", "\u3000", "\u2003", "\u202f", "\u180e", "        "]
BREAKS = ["\n", "\r\n", "\n\n", "\r\n\r\n", " \n", "\t\n", "\r"]
PUNCT = [".", ",", "!", "?", "...", "!!!", "?!", ";", ":", "-", "--", "—", "(", ")", "\"", "'", "''", "#", "$",
         "%", "&&", "@", "_", "__init__", "<", ">", "[", "]", "{", "}", "=>", "->", "/", "\\", "|", "*", "+", "~"]
SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>",
            "<unk>", "[MASK]", " [MASK] ", "hello", " hello ", "<|reserved_special_token_0|>"]


def make_doc(rng):
    parts = []
    for _ in range(rng.randint(1, 24)):
        r = rng.random()
        if r < 0.42:
            w = rng.choice(WORDS)
            parts.append(w.capitalize() if rng.random() < 0.1 else w)
        elif r < 0.50:
            parts.append(rng.choice(SCRIPTS))
        elif r < 0.54:
            parts.append("".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 6))))
        elif r < 0.58:
            parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
        elif r < 0.62:
            parts.append(rng.choice(COMBINING))
        elif r < 0.67:
            parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))))
        elif r < 0.75:
            parts.append(rng.choice(PUNCT))
        elif r < 0.79:
            parts.append(rng.choice(SPECIALS))
        elif r < 0.82:
            parts.append(rng.choice(BREAKS))
        elif r < 0.84:
            parts.append(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FF), rng.randint(0x370, 0x52F),
                                         rng.randint(0x1F300, 0x1FAFF), rng.randint(0x2000, 0x2BFF)])))
        parts.append(rng.choice(SPACES) if rng.random() < 0.25 else " " if rng.random() < 0.85 else "")
    doc = "".join(parts)
    if rng.random() < 0.1:
        doc = rng.choice(SPACES) + doc
    return doc + "\n"


def make_corpus(n, seed):
    """n documents, each ending in a line break, none blank and none holding a lone '%' line."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < n:
        d = make_doc(rng)
        if d.strip() and not any(l in ("%", "%\r") for l in d.split("\n")):
            docs.append(d)
    return docs


def write_fortune(path, docs):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("".join(d + "%\n" for d in docs))


# ---- the four tokenizer files

def train(tok, docs, vocab_size, special, **kw):
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False, **kw)
    tok.train_from_iterator(docs, trainer)
    return json.loads(tok.to_str())


def template(j, bos, tok):
    """Sets a TemplateProcessing that puts `bos` before a single sequence (inside `j`'s post-processor)."""
    bid = tok.token_to_id(bos)
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bid], "tokens": [bos]}}}


def build_gpt2(train_docs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    train(tok, train_docs, 2000, ["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=True, normalized=False, special=True)])
    tok.add_tokens([AddedToken("hello", single_word=True, normalized=True)])
    j = json.loads(tok.to_str())
    j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return j


def build_llama3(train_docs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    j = train(tok, train_docs, 2500, ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"],
              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    j["model"]["ignore_merges"] = True
    j["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in j["model"]["merges"]]  # pair form
    tok = Tokenizer.from_str(json.dumps(j))
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        template(j, "<|begin_of_text|>", tok)]}
    return j


def build_qwen2(train_docs):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    train(tok, train_docs, 2200, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.add_tokens([AddedToken("café", normalized=True)])  # matched in the NFC text: "cafe\u0301" too
    j = json.loads(tok.to_str())
    j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return j


def build_deepseek3(train_docs):
    # DeepSeek-V3's chain of three Isolated Splits (digits, CJK, then words and punctuation) before
    # ByteLevel: each Split's matches are split again by the next.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(DEEPSEEK3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return train(tok, train_docs, 2200, ["<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                                         "<\uff5cend\u2581of\u2581sentence\uff5c>"],
                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def build_llama2(train_docs):
    # SentencePiece-like training (words start with ▁), then Llama-2's tokenizer.json layout:
    # <unk> <s> </s>, the 256 byte tokens, then the learned vocabulary.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    j = train(tok, train_docs, 2000, ["<unk>", "<s>", "</s>"], limit_alphabet=150)
    learned = sorted(((i, t) for t, i in j["model"]["vocab"].items() if t not in ("<unk>", "<s>", "</s>")))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for _, t in learned:
        vocab.setdefault(t, len(vocab))
    j["model"].update({"vocab": vocab, "byte_fallback": True, "unk_token": "<unk>", "fuse_unk": True})
    j["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))]
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                          {"type": "Replace", "pattern": {"String": " "},
                                                           "content": "▁"}]}
    j["pre_tokenizer"] = None
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(j))
    j["post_processor"] = template(j, "<s>", tok)
    return j


def build_llama2_metaspace(train_docs):
    """The older Llama-2 layout: no normalizer, a Metaspace pre-tokenizer (prepend_scheme "first") and decoder."""
    j = build_llama2(train_docs)
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    j["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁",
                                                                              "prepend_scheme": "first", "split": True}]}
    return j


# ---- reading a dataset

def read_dataset(prefix):
    raw = open(prefix + ".idx", "rb").read()
    check(raw[:9] == b"MMIDIDX\x00\x00", f"{prefix}.idx: magic")
    dtype_code = raw[17]
    (seq_count,) = struct.unpack_from("<Q", raw, 18)
    lengths = array.array("i")
    lengths.frombytes(raw[34:34 + 4 * seq_count])
    tokens = array.array({8: "H", 4: "i"}[dtype_code])
    tokens.frombytes(open(prefix + ".bin", "rb").read())
    docs, pos = [], 0
    for n in lengths:
        docs.append(tokens[pos:pos + n].tolist())
        pos += n
    check(pos == len(tokens), f"{prefix}.bin holds {len(tokens)} tokens, the lengths sum to {pos}")
    return docs


def first_difference(a, b):
    return next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))


def compare_ids(name, docs, got, expected):
    check(len(got) == len(expected), f"{name}: {len(got)} documents stored, expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            k = first_difference(g, e)
            fail(f"{name}: document {i} {docs[i]!r}\n  differs at token {k}: origami {g[max(0, k - 3):k + 5]} "
                 f"vs library {e[max(0, k - 3):k + 5]}")


def compare_text(name, docs, got, expected, what):
    check(len(got) == len(expected), f"{name}: {what}: {len(got)} documents, expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            fail(f"{name}: {what} of document {i} {docs[i]!r}:\n  origami {g!r}\n  library {e!r}")


def main():
    t_start = time.time()
    tmp = tempfile.mkdtemp(prefix="origami_hf_tok_test_")
    try:
        docs = make_corpus(NUM_DOCS, seed=1234)
        train_docs = make_corpus(6000, seed=99)
        corpus = os.path.join(tmp, "corpus.txt")
        write_fortune(corpus, docs)
        print(f"corpus: {len(docs)} documents, {os.path.getsize(corpus) / 1e6:.2f} MB")
        families = [("gpt2", build_gpt2, "<|endoftext|>", None, None),
                    ("llama3", build_llama3, "<|end_of_text|>", None, None),
                    ("qwen2", build_qwen2, "<|im_end|>", "<|im_end|>", None),
                    ("deepseek3", build_deepseek3, "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     "<\uff5cend\u2581of\u2581sentence\uff5c>", None),
                    ("llama2", build_llama2, "</s>", None, None),
                    ("llama2-metaspace", build_llama2_metaspace, "</s>", None, None)]
        for name, build, eod_token, config_eos, _ in families:
            t0 = time.time()
            d = os.path.join(tmp, name)
            os.makedirs(d)
            j = build(train_docs)
            path = os.path.join(d, "tokenizer.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False)
            if config_eos:
                with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                    json.dump({"eos_token": {"content": config_eos, "__type": "AddedToken"}}, f)
            tok = Tokenizer.from_file(path)
            eod = tok.token_to_id(eod_token)
            check(eod is not None, f"{name}: no {eod_token}")

            # (a) ids, document by document
            prefix = os.path.join(tmp, name + "_ds")
            p = run("data", "prepare", "--input", corpus, "--output", prefix, "--tokenizer", path, "--split", "fortune")
            check(f"{len(docs)} documents" in p.stdout, f"{name}: summary:\n{p.stdout}")
            check(f"tokenizer: huggingface-bpe, vocab {tok.get_vocab_size()}, eod {eod};" in p.stdout,
                  f"{name}: expected eod {eod} ({eod_token}), vocab {tok.get_vocab_size()}:\n{p.stdout}")
            encode_line = [l for l in p.stdout.splitlines() if l.startswith("encode:")][0]
            encodings = tok.encode_batch(docs)
            expected = [e.ids + [eod] for e in encodings]
            got = read_dataset(prefix)
            compare_ids(name, docs, got, expected)
            if name == "llama3":
                expected_llama3 = expected

            # (b) decoding, as the library decodes
            p = run("data", "decode", "--data", prefix, "--json")
            got_text = [json.loads(l) for l in p.stdout.splitlines()]
            compare_text(name, docs, got_text, tok.decode_batch(expected, skip_special_tokens=False), "decode")
            p = run("data", "decode", "--data", prefix, "--json", "--skip-special")
            got_plain = [json.loads(l) for l in p.stdout.splitlines()]
            lib_plain = tok.decode_batch(expected)
            compare_text(name, docs, got_plain, lib_plain, "decode --skip-special")
            back = sum(g == d for g, d in zip(got_plain, docs))
            check(back > len(docs) // 3, f"{name}: only {back} documents decode back to their text")

            # (c) the saved tokenizer: the file verbatim and the eod choice; it prepares the same tokens
            saved = json.load(open(prefix + ".tokenizer.json", encoding="utf-8"))
            check(saved.get("type") == "huggingface" and saved.get("eod_token") == eod_token,
                  f"{name}: PREFIX.tokenizer.json type/eod_token: {saved.get('type')} {saved.get('eod_token')}")
            check(saved["tokenizer"] == j, f"{name}: PREFIX.tokenizer.json does not hold the file verbatim")
            small = os.path.join(tmp, name + "_small.txt")
            write_fortune(small, docs[:500])
            run("data", "prepare", "--input", small, "--output", prefix + "_again", "--tokenizer",
                prefix + ".tokenizer.json", "--split", "fortune")
            compare_ids(name + " (saved tokenizer)", docs, read_dataset(prefix + "_again"), expected[:500])
            print(f"ok   {name:16s} {len(docs)} documents equal the library's ids and decode "
                  f"({back} decode back to their text); {encode_line} [{time.time() - t0:.1f} s]", flush=True)

        # (e) end to end: a llama trained on the llama3-tokenized data carries the tokenizer into its
        # checkpoint; `generate` encodes the prompt and decodes with it; `ckpt export --hf` writes the
        # Hub file itself (what transformers loads), and document masking takes its eod.
        llama3 = json.load(open(os.path.join(tmp, "llama3", "tokenizer.json"), encoding="utf-8"))
        vocab = Tokenizer.from_file(os.path.join(tmp, "llama3", "tokenizer.json")).get_vocab_size()
        cfg = os.path.join(tmp, "llama3_model.json")
        with open(cfg, "w") as f:
            json.dump({"model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, f)
        ck = os.path.join(tmp, "llama3_ck")
        p = run("train", "--config", cfg, "--data", os.path.join(tmp, "llama3_ds"), "--steps", "3", "--seq-len", "32",
                "--micro-batch", "2", "--attention-mask", "document", "--save", ck, "--threads", "2")
        llama3_eod = Tokenizer.from_file(os.path.join(tmp, "llama3", "tokenizer.json")).token_to_id("<|end_of_text|>")
        check(f"token {llama3_eod} ends a document" in p.stdout, f"document masking's eod:\n{p.stdout}")
        p = run("generate", "--checkpoint", ck, "--prompt", "Hello wörld 你好", "--max-new-tokens", "8",
                "--temperature", "0")
        check(p.stdout.startswith("Hello wörld 你好") and len(p.stdout) > len("Hello wörld 你好\n"),
              f"generate with the llama3 tokenizer:\n{p.stdout}")
        out = os.path.join(tmp, "llama3_hf")
        run("ckpt", "export", ck, "--hf", out)
        check(json.load(open(os.path.join(out, "tokenizer.json"), encoding="utf-8")) == llama3,
              "ckpt export --hf did not write the Hub tokenizer.json itself")
        exported = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        check(exported.encode(docs[0]).ids == expected_llama3[0][:-1], "the exported tokenizer encodes differently")
        # The Hub file alone does not say which token ends a document: the export's tokenizer_config.json
        # names the run's (what generate on the export and transformers' AutoTokenizer read).
        tok_config = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
        check(tok_config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"},
              f"the export's tokenizer_config.json names the run's end of document: {tok_config}")
        print("ok   llama3 end to end: train (document masking at its eod), generate, ckpt export --hf", flush=True)

        # (g) origami's own tokenizers exported as the byte-level BPE they are: the library loads the
        # export's tokenizer.json and encodes and decodes every document as origami stored it; an
        # --optimizer export resumes on the data (the tokenizers compared in the Hub form).
        plain = Tokenizer(models.BPE())
        plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        plain.decoder = decoders.ByteLevel()
        pj = train(plain, train_docs[:2000], 600, ["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        vocab_json, merges_txt = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        json.dump(pj["model"]["vocab"], open(vocab_json, "w", encoding="utf-8"), ensure_ascii=False)
        with open(merges_txt, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join((m if isinstance(m, str) else " ".join(m)) + "\n" for m in pj["model"]["merges"]))
        # (origami's byte and gpt2 tokenizers read "<|endoftext|>" in a text as text; the library, like
        # transformers' GPT-2, as the special token: documents holding it are left out)
        some = [d for d in docs[:3000] if "<|endoftext|>" not in d]
        few = os.path.join(tmp, "few.txt")
        write_fortune(few, some)
        for name, flags in (("byte", ["--tokenizer", "byte"]),
                            ("gpt2", ["--tokenizer", "gpt2", "--vocab", vocab_json, "--merges", merges_txt])):
            prefix = os.path.join(tmp, name + "_own")
            run("data", "prepare", "--input", few, "--output", prefix, "--split", "fortune", *flags)
            stored = read_dataset(prefix)
            own_vocab = 257 if name == "byte" else len(pj["model"]["vocab"])
            cfg = os.path.join(tmp, name + "_model.json")
            with open(cfg, "w") as f:
                json.dump({"model_type": "llama", "vocab_size": own_vocab, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, f)
            ck, out = os.path.join(tmp, name + "_own_ck"), os.path.join(tmp, name + "_own_hf")
            run("train", "--config", cfg, "--data", prefix, "--steps", "1", "--seq-len", "32", "--micro-batch", "2",
                "--save", ck, "--threads", "2", "--quiet")
            run("ckpt", "export", ck, "--hf", out, "--optimizer")
            exported = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
            eod = exported.token_to_id("<|endoftext|>")
            check(eod == (256 if name == "byte" else pj["model"]["vocab"]["<|endoftext|>"]), f"{name}: eod {eod}")
            compare_ids(name + " export", some, stored, [e.ids + [eod] for e in exported.encode_batch(some)])
            compare_text(name + " export", some, [exported.decode(ids[:-1]) for ids in stored], some, "decodes")
            run("train", "--resume", out, "--data", prefix, "--steps", "2", "--seq-len", "32", "--micro-batch", "2",
                "--threads", "2", "--quiet")
        print("ok   byte and gpt2 tokenizers exported as Hub files: the library encodes and decodes as origami, "
              "and an --optimizer export resumes on the data", flush=True)

        # (f) RoBERTa's post-processor closes every sequence with </s>, the eod: a document ends with
        # one eod, not two; and a Split whose regex matches empty right after a match (MergedWithNext,
        # "a*"), where the library reports no empty match, splits as the library does.
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("a*"), behavior="merged_with_next", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        j = train(tok, train_docs[:2000], 600, ["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        ids = {t: j["model"]["vocab"][t] for t in ("<s>", "</s>")}
        j["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", ids["</s>"]], "cls": ["<s>", ids["<s>"]],
                               "trim_offsets": False, "add_prefix_space": False}
        path = os.path.join(tmp, "roberta.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        some = docs[:2000] + ["ab\n", "aab\n", "baa\n", "a\n", "b a  a\n"]
        write_fortune(os.path.join(tmp, "roberta.txt"), some)
        run("data", "prepare", "--input", os.path.join(tmp, "roberta.txt"), "--output", os.path.join(tmp, "roberta"),
            "--tokenizer", path, "--eod-token", "</s>", "--split", "fortune")
        expected = [e.ids for e in tok.encode_batch(some)]
        check(all(e[0] == ids["<s>"] and e[-1] == ids["</s>"] for e in expected),
              "the library's RoBERTa encodings are <s> ... </s>")
        compare_ids("roberta (post-processor closing with the eod; Split a* merged_with_next)", some,
                    read_dataset(os.path.join(tmp, "roberta")), expected)
        print("ok   RobertaProcessing: each document ends with one </s>; Split(a*, merged_with_next) as the library",
              flush=True)

        # (g) An added token with rstrip takes the whitespace after it, and the library looks for the next
        # added token from the end of the token's own text, so one that begins with whitespace inside
        # that run is still found (origami looked from the end of the run, and encoded it as text).
        j = json.load(open(os.path.join(tmp, "llama3", "tokenizer.json"), encoding="utf-8"))
        top = max([t["id"] for t in j["added_tokens"]] + list(j["model"]["vocab"].values()))
        for k, (content, rstrip) in enumerate((("<A>", True), (" <B>", False))):
            j["added_tokens"].append({"id": top + 1 + k, "content": content, "single_word": False, "lstrip": False,
                                      "rstrip": rstrip, "normalized": False, "special": False})
        path = os.path.join(tmp, "rstrip.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        some = ["<A>   <B>x\n", "<A> <B>\n", "a<A>\t <B> b <A>c\n", "<A>\n", "x <B><A>  y\n"]
        write_fortune(os.path.join(tmp, "rstrip.txt"), some)
        run("data", "prepare", "--input", os.path.join(tmp, "rstrip.txt"), "--output", os.path.join(tmp, "rstrip"),
            "--tokenizer", path, "--split", "fortune")
        eod = tok.token_to_id("<|end_of_text|>")  # (data prepare ends each document with it)
        expected = [e.ids + [eod] for e in tok.encode_batch(some)]
        check(top + 2 in expected[0], "the library finds ' <B>' inside <A>'s stripped run")
        compare_ids("rstrip (the next added token searched from the end of the match)", some,
                    read_dataset(os.path.join(tmp, "rstrip")), expected)
        print("ok   an rstrip added token: the next added token is found inside its stripped whitespace, as the library",
              flush=True)

        # --eod-token overrides the default; a token the file lacks is an error.
        gpt2 = os.path.join(tmp, "gpt2", "tokenizer.json")
        p = run("data", "prepare", "--input", small, "--output", os.path.join(tmp, "eod"), "--tokenizer", gpt2,
                "--eod-token", "[MASK]", "--split", "fortune")
        mask_id = Tokenizer.from_file(gpt2).token_to_id("[MASK]")
        check(f"eod {mask_id};" in p.stdout, f"--eod-token [MASK] (id {mask_id}):\n{p.stdout}")

        # (d) user mistakes: exit 1, one "error:" line naming the component
        def expect_error(what, j, needles, extra=()):
            path = os.path.join(tmp, "bad.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(j, f)
            p = run("data", "prepare", "--input", small, "--output", os.path.join(tmp, "bad"), "--tokenizer", path,
                    *extra, expect_ok=False)
            lines = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l.lower()]
            ok = p.returncode == 1 and len(lines) == 1 and all(n in lines[0] for n in needles)
            check(ok, f"{what}: exit {p.returncode}, expected 1 and one error line naming {needles}:\n"
                      f"{p.stdout}{p.stderr}")
            print(f"ok   error: {what}: {lines[0]}")
            check(not os.path.exists(os.path.join(tmp, "bad.bin")), f"{what}: a failed prepare left bad.bin")

        base = json.load(open(os.path.join(tmp, "llama3", "tokenizer.json"), encoding="utf-8"))
        j = json.loads(json.dumps(base))
        j["model"]["type"] = "WordPiece"
        expect_error("unknown model", j, ["model type 'WordPiece'", "bad.json"])
        j = json.loads(json.dumps(base))
        j["model"]["type"] = "Unigram"
        expect_error("unigram model", j, ["model type 'Unigram'"])
        j = json.loads(json.dumps(base))
        j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "BertNormalizer"}]}
        expect_error("unknown normalizer", j, ["normalizer 'BertNormalizer'"])
        j = json.loads(json.dumps(base))
        j["pre_tokenizer"] = {"type": "Whitespace"}
        expect_error("unknown pre-tokenizer", j, ["pre_tokenizer 'Whitespace'"])
        j = json.loads(json.dumps(base))
        j["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
        expect_error("unknown decoder", j, ["decoder 'WordPiece'"])
        j = json.loads(json.dumps(base))
        j["post_processor"] = {"type": "Frobnicate"}
        expect_error("unknown post-processor", j, ["post_processor 'Frobnicate'"])
        j = json.loads(json.dumps(base))
        j["model"]["continuing_subword_prefix"] = "##"
        expect_error("unsupported BPE option", j, ["continuing_subword_prefix", "##"])
        j = json.loads(json.dumps(base))
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": "(unclosed"}
        expect_error("bad regex", j, ["regex", "(unclosed"])
        j = json.loads(json.dumps(base))  # no eod candidate
        for t in j["added_tokens"]:
            t["content"] = t["content"].replace("end_of_text", "eot")
        j["model"]["vocab"] = {k.replace("end_of_text", "eot"): v for k, v in j["model"]["vocab"].items()}
        expect_error("no end-of-document token", j, ["end-of-document", "--eod-token"])
        expect_error("--eod-token not in the file", j, ["'<nope>'", "not a token"], ["--eod-token", "<nope>"])
        # An added token numbered past the id the library gives it (a gap, as a hand-edited file may have):
        # the library encodes with its own id, so the file is refused, naming that id.
        j = json.loads(json.dumps(base))
        gap = {"id": max(t["id"] for t in j["added_tokens"]) + 40, "content": "<|pad|>", "single_word": False,
               "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        j["added_tokens"].append(gap)
        path = os.path.join(tmp, "gap.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f)
        given = Tokenizer.from_file(path).token_to_id("<|pad|>")
        check(given != gap["id"], f"the library keeps the gap's id {gap['id']}")
        expect_error("an added token's id the library does not give it", j,
                     ["added token '<|pad|>' has id %d" % gap["id"], "gives it %d" % given, "renumber"])
        print(f"ok ({time.time() - t_start:.1f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
