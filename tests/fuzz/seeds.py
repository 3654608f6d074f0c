"""The seed inputs of the mutation fuzzer, made at the start of a run with the binary under test:
datasets (`data prepare`), sharded checkpoints (a 1-rank and a 2-rank `train --save`, and the
single-directory form of `ckpt export --optimizer`), plan files (`plan --out`), small Hugging Face
tokenizer.json files built with the `tokenizers` package (as tests/cli/test_hf_tokenizer.py does;
skipped when it is missing), plus the model configs and cluster files of the repository."""
import glob
import json
import os
import random
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "tests", "parallel", "configs")

WORDS = ("the of and to in is it that was for on are with as his they be at one have this from or had by hot "
         "word but what some we can out other were all there when up use your how said an each she which do "
         "don't it's we've naïve café Straße Привет мир 日本語 😀 👩\u200d💻 e\u0301 \t 12345 3.14 <|endoftext|> </s> "
         "<s> [MASK] __init__ -> => {} () ").split(" ")


def corpus(seed, docs):
    """Fortune-style text ('%' lines between documents): words, scripts, emoji, digits, odd spaces."""
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        n = rng.randrange(3, 60)
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(text.replace(" .", ".\n") + "\n%\n")
    return "".join(out)


class SeedError(RuntimeError):
    pass


class Seeds:
    def __init__(self, out, runner):
        self.dir = os.path.join(out, "seeds")
        self.run = runner  # runner(argv, cwd, mpi=False) -> (rc, stdout, stderr)
        self.configs = {}   # name -> path
        self.clusters = {}
        self.tokenizers = {}  # name -> tokenizer.json path
        self.checkpoints = {}  # name -> --save directory (or export directory)
        self.plans = {}
        self.datasets = {}  # name -> prefix
        self.aliases = []   # prefixes holding the same dataset under other names (blends)

    def path(self, *p):
        return os.path.join(self.dir, *p)

    def must(self, what, argv, mpi=False):
        rc, out, err = self.run(argv, self.dir, mpi=mpi)
        if rc != 0:
            raise SeedError("seed '%s' failed (exit %s): %s\n%s" % (what, rc, " ".join(argv), (out + err)[-3000:]))
        return out

    def make(self, bin_, mpi_ok, log):
        if os.path.exists(self.dir):
            shutil.rmtree(self.dir)
        os.makedirs(self.path("d"))
        for p in sorted(glob.glob(os.path.join(TINY, "*.json"))) + [os.path.join(ROOT, "configs", "demo_gpt2.json")] + \
                sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.json"))):
            self.configs[os.path.splitext(os.path.basename(p))[0]] = p
        for p in sorted(glob.glob(os.path.join(ROOT, "configs", "clusters", "*.json"))):
            self.clusters[os.path.splitext(os.path.basename(p))[0]] = p

        with open(self.path("corpus.txt"), "w", encoding="utf-8") as f:
            f.write(corpus(1, 300))
        with open(self.path("corpus2.txt"), "w", encoding="utf-8") as f:
            f.write(corpus(2, 120))
        with open(self.path("small.txt"), "w", encoding="utf-8") as f:
            f.write(corpus(3, 12))
        for name, text in (("byte", "corpus.txt"), ("byte2", "corpus2.txt")):
            self.must("data " + name, [bin_, "data", "prepare", "--input", text, "--output", "d/" + name,
                                       "--tokenizer", "byte", "--threads", "1"])
            self.datasets[name] = self.path("d", name)
        for k in range(6):  # the same dataset under other prefixes, for blends of many parts
            for ext in (".bin", ".idx", ".tokenizer.json"):
                os.link(self.path("d", "byte" + ext), self.path("d", "alias%d%s" % (k, ext)))
            self.aliases.append(self.path("d", "alias%d" % k))

        self.make_tokenizers(log)
        if "gpt2" in self.tokenizers:
            self.must("data hf", [bin_, "data", "prepare", "--input", "corpus2.txt", "--output", "d/hf",
                                  "--tokenizer", self.tokenizers["gpt2"], "--threads", "1"])
            self.datasets["hf"] = self.path("d", "hf")

        common = ["--data", "d/byte", "--steps", "2", "--micro-batch", "2", "--seq-len", "16", "--threads", "1",
                  "--quiet", "--lr", "1e-3"]
        self.must("checkpoint one", [bin_, "train", "--config", self.configs["llama_tiny"], "--save", "ck/one"] + common)
        self.checkpoints["one"] = self.path("ck", "one")
        self.must("checkpoint gpt2", [bin_, "train", "--config", self.configs["gpt2_tiny"], "--save", "ck/gpt2"] + common)
        self.checkpoints["gpt2"] = self.path("ck", "gpt2")
        if mpi_ok:
            self.must("checkpoint two", [bin_, "train", "--config", self.configs["mixtral_tiny"], "--save", "ck/two",
                                         "--tp", "2"] + common, mpi=True)
            self.checkpoints["two"] = self.path("ck", "two")
        self.must("export", [bin_, "ckpt", "export", "ck/one", "--hf", "ck/export", "--optimizer"])
        self.checkpoints["export"] = self.path("ck", "export")

        os.makedirs(self.path("plans"))
        self.must("plan tiny", [bin_, "plan", "--config", self.configs["llama_tiny"], "--cluster",
                                self.clusters["cpu-2core"], "--devices", "1", "--global-batch", "4", "--seq-len", "16",
                                "--top", "1", "--out", "plans/tiny.json"])
        self.plans["tiny"] = self.path("plans", "tiny.json")
        self.must("plan mixtral", [bin_, "plan", "--config", self.configs["mixtral_tiny"], "--cluster",
                                   self.clusters["dgx-h100"], "--devices", "8", "--global-batch", "16", "--seq-len", "64",
                                   "--top", "1", "--out", "plans/mixtral.json"])
        self.plans["mixtral"] = self.path("plans", "mixtral.json")
        with open(self.path("run_config.json"), "w") as f:
            json.dump({"steps": 1, "micro-batch": 2, "global-batch": 4, "seq-len": 16, "lr": 0.001, "warmup": 1,
                       "lr-schedule": "cosine", "weight-decay": 0.1, "grad-clip": 1.0, "data-order": "shuffled",
                       "threads": 1, "quiet": True, "attention-mask": "document", "seed": 7}, f, indent=1)

    def make_tokenizers(self, log):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # (it forks origami afterwards)
        try:
            from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
        except ImportError:
            log("seeds: the 'tokenizers' package is missing (scripts/setup.sh installs it): no tokenizer.json seeds")
            return
        os.makedirs(self.path("tok"))
        docs = corpus(1, 300).split("%\n")

        def train(tok, size, special, **kw):
            tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=size, special_tokens=special,
                                                              show_progress=False, **kw))
            return json.loads(tok.to_str())

        def template(j, bos, bid):
            return {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {bos: {"id": bos, "ids": [bid], "tokens": [bos]}}}

        # GPT-2: ByteLevel, <|endoftext|>, added tokens with flags.
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        train(tok, 400, ["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=True, normalized=False, special=True)])
        tok.add_tokens([AddedToken("hello", single_word=True, normalized=True)])
        gpt2 = json.loads(tok.to_str())
        # Llama-3: regex Split + ByteLevel, merges as pairs, ignore_merges, template with BOS, NFC.
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                                       r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated",
                                 invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        llama3 = train(tok, 420, ["<|begin_of_text|>", "<|end_of_text|>"],
                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        llama3["model"]["ignore_merges"] = True
        llama3["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in llama3["model"]["merges"]]
        llama3["post_processor"] = template(llama3, "<|begin_of_text|>", llama3["model"]["vocab"]["<|begin_of_text|>"])
        # Llama-2: SentencePiece-style BPE with byte_fallback, Prepend/Replace normalizer, decoder sequence.
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        llama2 = train(tok, 300, ["<unk>", "<s>", "</s>"], limit_alphabet=80)
        learned = sorted((i, t) for t, i in llama2["model"]["vocab"].items() if t not in ("<unk>", "<s>", "</s>"))
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for b in range(256):
            vocab["<0x%02X>" % b] = 3 + b
        for _, t in learned:
            vocab.setdefault(t, len(vocab))
        llama2["model"].update({"vocab": vocab, "byte_fallback": True, "unk_token": "<unk>", "fuse_unk": True})
        llama2["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True} for t, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))]
        llama2["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        llama2["pre_tokenizer"] = None
        llama2["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        llama2["post_processor"] = template(llama2, "<s>", 1)
        for name, j in (("gpt2", gpt2), ("llama3", llama3), ("llama2", llama2)):
            p = self.path("tok", name + ".json")
            with open(p, "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False, indent=1)
            self.tokenizers[name] = p
        # GPT-2's two-file form (vocab.json + merges.txt) from the same model
        with open(self.path("tok", "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(gpt2["model"]["vocab"], f, ensure_ascii=False)
        with open(self.path("tok", "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join((m if isinstance(m, str) else " ".join(m)) + "\n"
                                                for m in gpt2["model"]["merges"]))


def read(path):
    with open(path, "rb") as f:
        return f.read()
